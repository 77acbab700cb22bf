"""recall.pipeline.score_files: Parquet to Parquet against a float64 oracle, in order, atomically, errors first."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from parquet_data import int_data, oracle_topk, write_embeddings
from recall import InputError
from recall.io import CandidateWriter
from recall import EngineOptions
from recall.jobs import JobOptions, JobSummary, auto_batch_size, score_files


def _files(tmp_path: Path, n_users: int = 37, n_items: int = 23, dim: int = 5, seed: int = 0,
           user_layout: str = "list32", item_layout: str = "fixed32", string_ids: bool = False):
    users, items = int_data(n_users, n_items, dim, seed)
    if string_ids:
        user_ids = np.array([f"u{i:03d}" for i in np.random.default_rng(seed).permutation(n_users)], object)
        item_ids = np.array([f"item-{i}" for i in range(n_items)][::-1], object)
    else:
        user_ids = 10_000 + np.random.default_rng(seed).permutation(n_users)
        item_ids = 500 + 3 * np.arange(n_items)[::-1]
    up = write_embeddings(tmp_path / "users.parquet", user_ids, users, user_layout, row_group_size=8)
    ip = write_embeddings(tmp_path / "items.parquet", item_ids, items, item_layout, row_group_size=6)
    return up, ip, users, items, user_ids, item_ids


def _check_against_oracle(out: Path, users, items, user_ids, item_ids, k, metric="ip", banned=None, exact=True):
    table = pq.read_table(out)
    assert table.column_names == ["user_id", "item_ids", "scores"]
    assert table.column("user_id").to_pylist() == list(user_ids)  # input order
    rows, scores = oracle_topk(users, items, k, metric, banned)
    got_items, got_scores = table.column("item_ids").to_pylist(), table.column("scores").to_pylist()
    for u in range(len(users)):
        if exact:
            assert got_items[u] == [item_ids[r] for r in rows[u]], f"user row {u}"
            np.testing.assert_array_equal(np.asarray(got_scores[u], np.float64), scores[u])
        else:
            np.testing.assert_allclose(got_scores[u], scores[u], rtol=1e-5, atol=1e-5)
    return table


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("batch_size", [1, 5, 8, 64])
def test_matches_oracle_exactly(tmp_path: Path, metric: str, batch_size: int) -> None:
    """Integer vectors: exact scores, many ties (lower item row first), batches across row groups."""
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    summary = score_files(up, ip, tmp_path / "out.parquet", 4, metric=metric, device="cpu", batch_size=batch_size)
    _check_against_oracle(tmp_path / "out.parquet", users, items, user_ids, item_ids, 4, metric)
    assert isinstance(summary, JobSummary)
    assert (summary.users, summary.items, summary.dim, summary.k, summary.device) == (37, 23, 5, 4, "cpu")
    assert summary.batch_size == batch_size and summary.seconds > 0 and summary.users_per_s > 0
    assert 0 < summary.start_s < summary.seconds and "start-up " in summary.stages_line()


def test_cosine_close_to_oracle(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    users, items = rng.standard_normal((20, 6)).astype(np.float32), rng.standard_normal((30, 6)).astype(np.float32)
    up = write_embeddings(tmp_path / "u.parquet", np.arange(20), users, "list64")
    ip = write_embeddings(tmp_path / "i.parquet", np.arange(30), items)
    score_files(up, ip, tmp_path / "out.parquet", 5, metric="cosine", device="cpu", batch_size=7)
    _check_against_oracle(tmp_path / "out.parquet", users, items, np.arange(20), np.arange(30), 5, "cosine",
                          exact=False)


def test_string_ids(tmp_path: Path) -> None:
    up, ip, users, items, user_ids, item_ids = _files(tmp_path, string_ids=True)
    score_files(up, ip, tmp_path / "out.parquet", 3, device="cpu", batch_size=10)
    table = _check_against_oracle(tmp_path / "out.parquet", users, items, user_ids, item_ids, 3)
    assert table.schema.field("user_id").type == pa.string()
    assert table.schema.field("item_ids").type.value_type == pa.string()
    assert table.schema.field("scores").type.value_type == pa.float32()


def test_int_id_output_types(tmp_path: Path) -> None:
    up, ip, *_ = _files(tmp_path)
    score_files(up, ip, tmp_path / "out.parquet", 3, device="cpu")
    schema = pq.read_schema(tmp_path / "out.parquet")
    assert schema.field("user_id").type == pa.int64() and schema.field("item_ids").type.value_type == pa.int64()


@pytest.mark.parametrize("k", [1, 23, 40])
def test_k_edges(tmp_path: Path, k: int) -> None:
    """k = 1, k = n_items, k > n_items (lists hold every item, no padding)."""
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    score_files(up, ip, tmp_path / "out.parquet", k, device="cpu", batch_size=9)
    table = _check_against_oracle(tmp_path / "out.parquet", users, items, user_ids, item_ids, k)
    assert {len(x) for x in table.column("item_ids").to_pylist()} == {min(k, 23)}


def test_exclusions(tmp_path: Path) -> None:
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    rng = np.random.default_rng(9)
    pair_users = rng.integers(0, 37, 120)
    pair_items = rng.integers(0, 23, 120)
    banned = np.zeros((37, 23), bool)
    banned[pair_users, pair_items] = True
    banned[5, :] = True  # every item excluded for user row 5
    ex_users = np.concatenate([user_ids[pair_users], np.full(23, user_ids[5]), [1], [user_ids[0]]])
    ex_items = np.concatenate([item_ids[pair_items], item_ids, [item_ids[0]], [123456]])
    pq.write_table(pa.table({"user_id": ex_users, "item_id": ex_items}), tmp_path / "x.parquet")
    summary = score_files(up, ip, tmp_path / "out.parquet", 6, exclude_path=tmp_path / "x.parquet", device="cpu",
                          batch_size=4)
    table = _check_against_oracle(tmp_path / "out.parquet", users, items, user_ids, item_ids, 6, banned=banned)
    assert table.column("item_ids").to_pylist()[5] == []
    assert summary.unknown_pairs == 2 and summary.pairs == 120 + 23 + 2


def test_exclusions_list_form(tmp_path: Path) -> None:
    up, ip, users, items, user_ids, item_ids = _files(tmp_path, string_ids=True)
    banned = np.zeros((37, 23), bool)
    banned[3, [0, 4, 9]] = True
    banned[30, [1]] = True
    pq.write_table(pa.table({"user_id": [user_ids[3], user_ids[30]],
                             "item_ids": [[item_ids[0], item_ids[4], item_ids[9]], [item_ids[1], "nope"]]}),
                   tmp_path / "x.parquet")
    summary = score_files(up, ip, tmp_path / "out.parquet", 5, exclude_path=tmp_path / "x.parquet", device="cpu",
                          batch_size=16)
    _check_against_oracle(tmp_path / "out.parquet", users, items, user_ids, item_ids, 5, banned=banned)
    assert summary.unknown_pairs == 1


def test_tiny_memory_budget_same_answer(tmp_path: Path) -> None:
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    score_files(up, ip, tmp_path / "out.parquet", 4, device="cpu", memory_budget=4096)
    _check_against_oracle(tmp_path / "out.parquet", users, items, user_ids, item_ids, 4)


def test_empty_users_file_is_refused_unless_allowed(tmp_path: Path) -> None:
    """An empty users file (an upstream job that failed quietly) must not replace yesterday's candidates."""
    full, ip, *_ = _files(tmp_path)
    out = tmp_path / "out.parquet"
    score_files(full, ip, out, 3, device="cpu")
    before = out.read_bytes()
    up = write_embeddings(tmp_path / "none.parquet", pa.array([], pa.int64()), np.zeros((0, 5), np.float32))
    with pytest.raises(InputError, match=rf"{up}: the users file has no rows, so this would replace {out} "
                                         rf"\({len(before):,} bytes\) with an empty candidates file; pass "
                                         rf"--allow-empty"):
        score_files(up, ip, out, 3, device="cpu")
    assert out.read_bytes() == before
    summary = score_files(up, ip, out, 3, device="cpu", allow_empty=True)
    assert summary.users == 0 and pq.read_table(out).num_rows == 0


def test_progress_reports_every_user(tmp_path: Path) -> None:
    up, ip, *_ = _files(tmp_path)
    seen: list[tuple[int, int]] = []
    score_files(up, ip, tmp_path / "out.parquet", 2, device="cpu", batch_size=10,
                progress=lambda done, total: seen.append((done, total)))
    assert seen[0] == (0, 37) and seen[-1] == (37, 37)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_compression(tmp_path: Path, compression: str) -> None:
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    score_files(up, ip, tmp_path / "out.parquet", 4, device="cpu", batch_size=6, compression=compression)
    _check_against_oracle(tmp_path / "out.parquet", users, items, user_ids, item_ids, 4)
    meta = pq.ParquetFile(tmp_path / "out.parquet").metadata
    assert meta.num_row_groups == 7  # one per batch
    assert meta.row_group(0).column(1).compression == {"none": "UNCOMPRESSED", "zstd": "ZSTD"}[compression]


def test_auto_batch_size_shrinks_with_k() -> None:
    assert auto_batch_size(10, 64) == 65_536
    assert auto_batch_size(1000, 64) < auto_batch_size(100, 64) <= 65_536
    assert auto_batch_size(10**6, 64) == 16
    # The batches in flight (5 of them, 4 dim + 32 k bytes a user) stay within INFLIGHT_BYTES up to k = 200,000.
    from recall.jobs.files import INFLIGHT_BYTES
    for k in (1000, 13_000, 50_000, 200_000):
        assert 5 * auto_batch_size(k, 64) * (4 * 64 + 32 * k) <= INFLIGHT_BYTES


# ---- errors: raised before anything is published -----------------------------------------------------------------

def _assert_nothing_written(directory: Path, out: Path, keep: set[str]) -> None:
    assert not out.exists()
    assert {p.name for p in directory.iterdir()} == keep, "a temporary file was left behind"


@pytest.mark.parametrize("kwargs,pattern", [
    ({"k": 0}, r"k must be an integer >= 1, got 0"),
    ({"k": -2}, r"k must be an integer >= 1"),
    ({"k": 2.0}, r"k must be an integer >= 1"),
    ({"metric": "dot"}, r"unknown metric 'dot'"),
    ({"device": "tpu"}, r"unknown device 'tpu'"),
    ({"batch_size": 0}, r"batch_size must be an integer >= 1"),
    ({"compression": "gzip"}, r"unknown compression 'gzip': expected one of none, snappy, lz4, zstd"),
    ({"id_col": "uid"}, r"users\.parquet: no id column 'uid'; the columns are 'id', 'embedding'"),
])
def test_bad_arguments(tmp_path: Path, kwargs: dict, pattern: str) -> None:
    up, ip, *_ = _files(tmp_path)
    args = {"k": 3, **kwargs}
    with pytest.raises(InputError, match=pattern):
        score_files(up, ip, tmp_path / "out.parquet", args.pop("k"), **args)
    _assert_nothing_written(tmp_path, tmp_path / "out.parquet", {"users.parquet", "items.parquet"})


def test_bad_row_in_a_late_batch(tmp_path: Path) -> None:
    """The error comes from the reader thread after batches were already written: nothing is published."""
    _, ip, users, _, user_ids, _ = _files(tmp_path)
    users = users.copy()
    users[33, 2] = np.nan
    write_embeddings(tmp_path / "users.parquet", user_ids, users, "list32", row_group_size=8)
    out = tmp_path / "out.parquet"
    with pytest.raises(InputError, match=rf"users\.parquet: row 33 \(id {user_ids[33]}\) has a NaN"):
        score_files(tmp_path / "users.parquet", ip, out, 3, device="cpu", batch_size=4)
    _assert_nothing_written(tmp_path, out, {"users.parquet", "items.parquet"})


def test_previous_output_survives_an_error(tmp_path: Path) -> None:
    up, ip, *_ = _files(tmp_path)
    out = tmp_path / "out.parquet"
    out.write_bytes(b"yesterday")
    with pytest.raises(InputError):
        score_files(up, ip, out, 3, metric="nope")
    assert out.read_bytes() == b"yesterday"


def test_dimension_mismatch(tmp_path: Path) -> None:
    up, ip, *_ = _files(tmp_path, user_layout="fixed32")
    rng = np.random.default_rng(0)
    write_embeddings(tmp_path / "items7.parquet", np.arange(4), rng.standard_normal((4, 7)))
    write_embeddings(tmp_path / "items7l.parquet", np.arange(4), rng.standard_normal((4, 7)), "list32")
    with pytest.raises(InputError, match=r"users\.parquet: vectors have dimension 5, but the items .* dimension 7"):
        score_files(up, tmp_path / "items7.parquet", tmp_path / "out.parquet", 3, device="cpu")
    with pytest.raises(InputError, match=r"users\.parquet: vectors have dimension 5, expected 7 "
                                         r"\(the items' dimension, .*items7l\.parquet\)"):
        score_files(up, tmp_path / "items7l.parquet", tmp_path / "out.parquet", 3, device="cpu")
    # A variable-size list column has no declared dimension: its first row is checked against the items.
    ul = write_embeddings(tmp_path / "users_l.parquet", np.arange(3) + 40, rng.standard_normal((3, 5)), "list32")
    with pytest.raises(InputError, match=r"users_l\.parquet: row 0 \(id 40\) has dimension 5, expected 7 "
                                         r"\(the items' dimension, .*items7\.parquet\)"):
        score_files(ul, tmp_path / "items7.parquet", tmp_path / "out.parquet", 3, device="cpu")
    assert not (tmp_path / "out.parquet").exists()


def test_empty_items(tmp_path: Path) -> None:
    up, *_ = _files(tmp_path)
    ip = write_embeddings(tmp_path / "empty.parquet", pa.array([], pa.int64()), np.zeros((0, 5), np.float32))
    with pytest.raises(InputError, match=r"empty\.parquet: the file has no rows"):
        score_files(up, ip, tmp_path / "out.parquet", 3, device="cpu")


def test_duplicate_user_ids(tmp_path: Path) -> None:
    _, ip, users, _, user_ids, _ = _files(tmp_path)
    user_ids = user_ids.copy()
    user_ids[30] = user_ids[2]
    write_embeddings(tmp_path / "users.parquet", user_ids, users, row_group_size=8)
    with pytest.raises(InputError, match=rf"duplicate id {user_ids[2]} at rows 2 and 30"):
        score_files(tmp_path / "users.parquet", ip, tmp_path / "out.parquet", 3, device="cpu")
    assert not (tmp_path / "out.parquet").exists()


def test_cosine_zero_vector_named(tmp_path: Path) -> None:
    up, ip, users, _, user_ids, _ = _files(tmp_path)
    users = users.copy()
    users[11] = 0
    write_embeddings(up, user_ids, users, "list32")
    with pytest.raises(InputError, match=rf"users\.parquet: row 11 \(id {user_ids[11]}\) is a zero vector"):
        score_files(up, ip, tmp_path / "out.parquet", 3, metric="cosine", device="cpu", batch_size=5)


def test_output_must_not_be_an_input(tmp_path: Path) -> None:
    up, ip, *_ = _files(tmp_path)
    with pytest.raises(InputError, match="is also an input file"):
        score_files(up, ip, up, 3, device="cpu")
    with pytest.raises(InputError, match="does not exist"):
        score_files(up, ip, tmp_path / "missing-dir" / "out.parquet", 3, device="cpu")


def test_writer_failure_propagates_and_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    up, ip, *_ = _files(tmp_path)
    calls = []
    original = CandidateWriter.write

    def failing_write(self, table):
        calls.append(table.num_rows)
        if len(calls) == 3:
            raise OSError("disk full")
        original(self, table)

    monkeypatch.setattr(CandidateWriter, "write", failing_write)
    with pytest.raises(OSError, match="disk full"):
        score_files(up, ip, tmp_path / "out.parquet", 3, device="cpu", batch_size=2)
    _assert_nothing_written(tmp_path, tmp_path / "out.parquet", {"users.parquet", "items.parquet"})
    assert len(calls) == 3  # the writer stopped at the failure
    assert not [t for t in threading.enumerate() if t.name.startswith("recall-")]


def test_search_failure_propagates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from recall import Engine

    up, ip, *_ = _files(tmp_path)
    seen = []
    original = Engine.search_async

    def failing_search(self, *args, **kwargs):
        seen.append(1)
        if len(seen) == 2:
            raise MemoryError("out of memory")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "search_async", failing_search)
    with pytest.raises(MemoryError, match="out of memory"):
        score_files(up, ip, tmp_path / "out.parquet", 3, device="cpu", batch_size=3)
    _assert_nothing_written(tmp_path, tmp_path / "out.parquet", {"users.parquet", "items.parquet"})
    assert not [t for t in threading.enumerate() if t.name.startswith("recall-")]


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_gpu_matches_oracle_exactly_with_queued_batches(tmp_path: Path, metric: str) -> None:
    """On a GPU the batches are queued on the device while earlier results are written (Engine.search_async)."""
    options = JobOptions(engine=EngineOptions(tiles=(16, 8, 2)))  # several blocks per batch
    up, ip, users, items, user_ids, item_ids = _files(tmp_path, n_users=301, n_items=90, dim=6)
    excl = tmp_path / "excl.parquet"
    pq.write_table(pa.table({"user_id": pa.array(user_ids[:50], pa.int64()),
                             "item_id": pa.array(item_ids[:50], pa.int64())}), excl)
    summary = score_files(up, ip, tmp_path / "out.parquet", 9, metric=metric, device="gpu", batch_size=37,
                          exclude_path=excl, options=options)
    banned = np.zeros((301, 90), bool)
    banned[np.arange(50), np.arange(50)] = True
    _check_against_oracle(tmp_path / "out.parquet", users, items, user_ids, item_ids, 9, metric, banned)
    assert summary.device == "gpu" and summary.device_busy_s > 0


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_gpu_route_results_fetched_by_the_writer_are_exact(tmp_path: Path, metric: str, precision: str) -> None:
    """The certified route (and fast mode) leave each batch's results on the device; the writer thread fetches them
    while the next batch is searched: every batch's file rows are still the oracle's."""
    route = EngineOptions(certified_exact="on", fused="force", tiles=(128, 8, 2), float16_min_scores=0)
    up, ip, users, items, user_ids, item_ids = _files(tmp_path, n_users=701, n_items=300, dim=6)
    excl = tmp_path / "excl.parquet"
    pq.write_table(pa.table({"user_id": pa.array(user_ids[:50], pa.int64()),
                             "item_id": pa.array(item_ids[:50], pa.int64())}), excl)
    out = tmp_path / "out.parquet"
    score_files(up, ip, out, 9, metric=metric, device="gpu", batch_size=97, exclude_path=excl,
                precision=precision, options=JobOptions(early="off", engine=route))
    banned = np.zeros((701, 300), bool)
    banned[np.arange(50), np.arange(50)] = True
    _check_against_oracle(out, users, items, user_ids, item_ids, 9, metric, banned)


def test_an_l2_item_whose_norm_overflows_is_named_by_file_row_and_id(tmp_path: Path) -> None:
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    items = items.copy()
    items[13] = 3e19  # |v|^2 / 2 beyond float32
    write_embeddings(ip, item_ids, items)
    with pytest.raises(InputError, match=rf"items\.parquet: row 13 \(id {item_ids[13]}\) has norm .* metric 'l2'"):
        score_files(up, ip, tmp_path / "out.parquet", 3, metric="l2", device="cpu")
    assert not (tmp_path / "out.parquet").exists()


def test_the_job_engine_holds_the_files_ip_vectors_once(tmp_path) -> None:
    """A job's ip engine on the CPU keeps the file's own array (``Engine(copy=False)``): the catalogue is held once
    while the engine is built, not twice; cosine keeps its normalised copy."""
    from parquet_data import write_embeddings

    from recall.backends import resolve
    from recall.jobs.items import load_engine

    rng = np.random.default_rng(0)
    path = tmp_path / "items.parquet"
    write_embeddings(path, np.arange(50), rng.standard_normal((50, 8)).astype(np.float32))
    for metric, shared in (("ip", True), ("cosine", False)):
        _, vectors, engine, _ = load_engine(str(path), "id", "embedding", metric, resolve("cpu"), None,
                                            keep_vectors=True)
        assert np.shares_memory(vectors, engine.prepared_items) == shared
