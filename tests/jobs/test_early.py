"""Searching the first user batches while the items are read (recall/jobs/early.py), on the CPU with
``JobOptions(early="on")``.

Items are decoded in batches of a few rows here and each batch's arrival is slowed, so that parts close and user
batches are taken before the last item row: the answers must still be exactly the oracle's, ties included.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from parquet_data import int_data, oracle_topk, write_embeddings
from recall import Engine, EngineOptions, InputError, ResourceError
from recall.backends.numpy import NumpyBackend
from recall.io import embeddings as embeddings_io
from recall.jobs import JobOptions, early, score_files

ON = JobOptions(early="on")


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embeddings_io, "READ_BATCH_ROWS", 7)
    on_rows = early.EarlyStart.on_rows

    def slow(self, matrix, rows):  # give the searching thread time between two item batches
        on_rows(self, matrix, rows)
        time.sleep(0.03)

    monkeypatch.setattr(early.EarlyStart, "on_rows", slow)


def _files(tmp_path: Path, n_users: int = 61, n_items: int = 90, dim: int = 5, seed: int = 0,
           layout: str = "fixed32"):
    users, items = int_data(n_users, n_items, dim, seed)
    user_ids = 10_000 + np.random.default_rng(seed).permutation(n_users)
    item_ids = 500 + 3 * np.arange(n_items)[::-1]
    up = write_embeddings(tmp_path / "users.parquet", user_ids, users, layout, row_group_size=8)
    ip = write_embeddings(tmp_path / "items.parquet", item_ids, items, layout, row_group_size=30)
    return up, ip, users, items, user_ids, item_ids


def _check(out: Path, users, items, user_ids, item_ids, k, metric="ip") -> None:
    table = pq.read_table(out)
    assert table.column("user_id").to_pylist() == list(user_ids)
    rows, scores = oracle_topk(users, items, k, metric)
    got_items, got_scores = table.column("item_ids").to_pylist(), table.column("scores").to_pylist()
    for u in range(len(users)):
        assert got_items[u] == [item_ids[r] for r in rows[u]], f"user row {u}"
        np.testing.assert_array_equal(np.asarray(got_scores[u], np.float64), scores[u])


def _exclusions(path: Path, pairs: list[tuple[int, int]], user_ids, item_ids) -> tuple[Path, np.ndarray]:
    """An exclusion file of (user row, item row) pairs by their ids, and the (users, items) mask it bans."""
    pq.write_table(pa.table({"user_id": pa.array([int(user_ids[u]) for u, _ in pairs], pa.int64()),
                             "item_id": pa.array([int(item_ids[r]) for _, r in pairs], pa.int64())}), path)
    banned = np.zeros((len(user_ids), len(item_ids)), bool)
    for u, r in pairs:
        banned[u, r] = True
    return path, banned


def _no_threads_left() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("recall-")]


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("k", [1, 4, 30, 200])
def test_matches_oracle_exactly(forced, tmp_path: Path, metric: str, k: int) -> None:
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    summary = score_files(up, ip, tmp_path / "out.parquet", k, metric=metric, device="cpu", batch_size=5,
                          options=ON)
    assert summary.early_users > 0 and "searched meanwhile" in summary.stages_line()
    _check(tmp_path / "out.parquet", users, items, user_ids, item_ids, k, metric)
    assert _no_threads_left()


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_parts_hold_views_of_the_jobs_matrix(forced, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             metric: str) -> None:
    # Each part's engine is built over rows of the job's matrix that are not written again (``copy=False``): under ip
    # it holds them rather than a copy of them; the answers are the oracle's.
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    built = []

    class Recording(Engine):
        def __init__(self, vectors, *args, **kwargs):
            super().__init__(vectors, *args, **kwargs)
            built.append((vectors, kwargs.get("copy"), self))

    monkeypatch.setattr(early, "Engine", Recording)
    score_files(up, ip, tmp_path / "out.parquet", 4, metric=metric, device="cpu", batch_size=5, options=ON)
    assert len(built) >= (2 if metric == "ip" else 1)  # l2's first part holds the rows of its centre: all 90 here
    for vectors, copy, engine in built:
        assert copy is False
        assert np.shares_memory(engine.prepared_items, vectors) == (metric == "ip")
    _check(tmp_path / "out.parquet", users, items, user_ids, item_ids, 4, metric)


def test_list_columns_declare_no_dimension_and_still_search_early(forced, tmp_path: Path) -> None:
    # list<float> columns (as Spark and DuckDB write them): the dimension comes with the first decoded item rows.
    up, ip, users, items, user_ids, item_ids = _files(tmp_path, layout="list32")
    summary = score_files(up, ip, tmp_path / "out.parquet", 4, device="cpu", batch_size=5, options=ON)
    assert summary.early_users > 0
    _check(tmp_path / "out.parquet", users, items, user_ids, item_ids, 4)
    other = write_embeddings(tmp_path / "users6.parquet", user_ids, np.ones((61, 6), np.float32), "list32")
    with pytest.raises(InputError, match=r"users6\.parquet: row 0 \(id \d+\) has dimension 6, expected 5"):
        score_files(other, ip, tmp_path / "out2.parquet", 4, device="cpu", batch_size=5, options=ON)
    assert _no_threads_left()


def test_every_user_taken_early(forced, tmp_path: Path) -> None:
    # Few users: the searching thread takes the reader's end marker too; nothing is read twice or lost.
    up, ip, users, items, user_ids, item_ids = _files(tmp_path, n_users=6)
    summary = score_files(up, ip, tmp_path / "out.parquet", 3, device="cpu", batch_size=2, options=ON)
    assert summary.early_users == 6 and summary.users == 6
    _check(tmp_path / "out.parquet", users, items, user_ids, item_ids, 3)


def test_exclusions_searched_early(forced, tmp_path: Path) -> None:
    # Each part searches a batch with the exclusions in its rows; the answer is the oracle's with the exclusions.
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    rng = np.random.default_rng(3)
    pairs = [(u, int(r)) for u in range(0, 61, 2) for r in rng.choice(90, size=int(rng.integers(0, 40)), replace=False)]
    pairs += [(1, r) for r in range(90)]  # user row 1: every item excluded
    excl, banned = _exclusions(tmp_path / "excl.parquet", pairs, user_ids, item_ids)
    for k in (3, 60):
        summary = score_files(up, ip, tmp_path / "a.parquet", k, device="cpu", batch_size=5, exclude_path=excl,
                              options=ON)
        assert summary.early_users > 0
        table = pq.read_table(tmp_path / "a.parquet")
        rows, scores = oracle_topk(users, items, k, banned=banned)
        got = table.column("item_ids").to_pylist()
        for u in range(len(users)):
            assert got[u] == [item_ids[r] for r in rows[u] if r >= 0], f"user row {u}"
        assert got[1] == []
    assert _no_threads_left()


@pytest.mark.parametrize("device, metric", [("cpu", "ip"), ("cpu", "l2"),
                                            pytest.param("gpu", "ip", marks=pytest.mark.gpu)])
def test_exclusions_mapped_late_are_applied_to_the_batches_searched_before(forced, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          device: str, metric: str) -> None:
    # The exclusions arrive after every early batch was taken: those batches keep k + slack items per user without
    # them, drop the excluded ones afterwards, and search again the users left with fewer than k (user row 1
    # excludes every item, user row 3 its 80 best; others up to 60 of the 90 items). On the GPU those searches run
    # on the writer's thread while the job queues the next batches' (the pipeline takes them one after the other).
    from recall.backends import cuda_status
    from recall.jobs import files

    if device == "gpu" and not cuda_status()[0]:
        pytest.skip(f"no usable GPU: {cuda_status()[1]}")

    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    rng = np.random.default_rng(5)
    pairs = [(u, int(r)) for u in range(0, 61, 2) for r in rng.choice(90, size=int(rng.integers(0, 61)), replace=False)]
    # User row 3 excludes its 80 best items: its list of k + slack holds none it may have, its answer lies beyond.
    best_of_3 = oracle_topk(users[3:4], items, 80, metric)[0][0]
    pairs += [(1, r) for r in range(90)] + [(3, int(r)) for r in best_of_3]
    pairs += pairs[:40]  # repeated pairs count once
    excl, banned = _exclusions(tmp_path / "excl.parquet", pairs, user_ids, item_ids)
    read_side = files._read_side

    def late(*args):
        time.sleep(0.6)
        return read_side(*args)

    applied = []
    drop = early._drop_excluded

    def spy(vals, rows, indptr, items_, k):
        out = drop(vals, rows, indptr, items_, k)
        applied.append((rows.shape[1], int(out[2].sum())))
        return out

    monkeypatch.setattr(files, "_read_side", late)
    monkeypatch.setattr(early, "_drop_excluded", spy)
    for k in (3, 20, 60):
        applied.clear()
        summary = score_files(up, ip, tmp_path / "a.parquet", k, metric=metric, device=device, batch_size=5,
                              exclude_path=excl, options=ON)
        assert summary.early_users > 0 and applied, "the early batches did not defer their exclusions"
        assert all(width == k + early.slack(k) for width, _ in applied), applied
        if k + early.slack(k) < 90:  # user rows 1 and 3 at least are searched again (beyond: padded lists hold all)
            assert sum(again for _, again in applied) >= 2
        table = pq.read_table(tmp_path / "a.parquet")
        rows, scores = oracle_topk(users, items, k, metric, banned=banned)
        got, got_scores = table.column("item_ids").to_pylist(), table.column("scores").to_pylist()
        for u in range(len(users)):
            assert got[u] == [item_ids[r] for r in rows[u] if r >= 0], f"user row {u}, k={k}"
            np.testing.assert_array_equal(np.asarray(got_scores[u], np.float64), scores[u][rows[u] >= 0])
        assert got[1] == []
    assert _no_threads_left()


def test_drop_excluded_keeps_the_first_k_allowed_and_flags_full_lists() -> None:
    vals = np.array([[9, 8, 7, 6], [5, 4, -np.inf, -np.inf], [3, 2, 1, 0]], np.float32)
    rows = np.array([[4, 1, 7, 2], [3, 0, -1, -1], [5, 6, 8, 9]], np.int64)
    indptr = np.array([0, 2, 3, 7], np.int64)
    excl = np.array([1, 4, 0, 5, 6, 8, 9], np.int64)
    out_vals, out_rows, short = early._drop_excluded(vals, rows, indptr, excl, 2)
    assert out_rows.tolist() == [[7, 2], [3, -1], [-1, -1]]
    assert out_vals[0].tolist() == [7, 6] and out_vals[1, 1] == -np.inf
    # Row 1 ran out of items (its list is padded): complete. Row 2 lost its whole full list: search it again.
    assert short.tolist() == [False, False, True]


def test_bad_exclusion_file_with_early_searches(forced, tmp_path: Path) -> None:
    up, ip, *_ = _files(tmp_path)
    bad = tmp_path / "excl.parquet"
    pq.write_table(pa.table({"user_id": pa.array([1.5]), "item_id": pa.array([2.5])}), bad)
    with pytest.raises(InputError):
        score_files(up, ip, tmp_path / "a.parquet", 3, device="cpu", batch_size=5, exclude_path=bad, options=ON)
    assert not (tmp_path / "a.parquet").exists()
    assert _no_threads_left()


def test_off_and_auto_not_early(forced, tmp_path: Path) -> None:
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    for mode in ("off", "auto"):  # "auto": not on a backend whose searches run on the spot (the CPU)
        assert score_files(up, ip, tmp_path / "b.parquet", 3, device="cpu", batch_size=5,
                           options=JobOptions(early=mode)).early_users == 0
        _check(tmp_path / "b.parquet", users, items, user_ids, item_ids, 3)
    with pytest.raises(InputError, match="unknown early-search mode 'sometimes'"):
        JobOptions(early="sometimes")
    for bad in (0, "many"):
        with pytest.raises(InputError, match="early_parts must be an integer >= 1"):
            JobOptions(early_parts=bad)
    assert _no_threads_left()


@pytest.mark.parametrize("which,row,value,rows_per_group", [("items", 80, np.nan, 30), ("users", 12, np.inf, 8)])
def test_bad_row_with_early_searches(forced, tmp_path: Path, which: str, row: int, value: float,
                                     rows_per_group: int) -> None:
    # A bad item row after parts were searched, or a bad user row read early: the error names the file and row,
    # nothing is written, no thread is left.
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    vecs, ids = (items, item_ids) if which == "items" else (users, user_ids)
    vecs = vecs.copy()
    vecs[row, 1] = value
    write_embeddings(tmp_path / f"{which}.parquet", ids, vecs, "fixed32", row_group_size=rows_per_group)
    out = tmp_path / "out.parquet"
    with pytest.raises(InputError, match=rf"{which}\.parquet: row {row} \(id {ids[row]}\) has a NaN"):
        score_files(up, ip, out, 3, device="cpu", batch_size=5, options=ON)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["items.parquet", "users.parquet"]
    assert _no_threads_left()


@pytest.mark.parametrize("error", [InputError("item_vecs: refused"), ResourceError("GPU out of memory"),
                                   MemoryError("out of memory")])
def test_part_failing_falls_back(forced, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error) -> None:
    # A part engine's input error, or no room for it, abandons the early searches: the batches taken are searched by
    # the full engine, and the job's answer is the same.
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    calls = []

    def refusing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise error
        return Engine(*args, **kwargs)

    monkeypatch.setattr(early, "Engine", refusing)
    summary = score_files(up, ip, tmp_path / "out.parquet", 4, device="cpu", batch_size=5, options=ON)
    assert len(calls) == 2 and summary.early_users > 0
    _check(tmp_path / "out.parquet", users, items, user_ids, item_ids, 4)


def test_merge_ties_and_padding() -> None:
    # Two parts (rows 0-2 and 3-5) with equal scores across them: the lower row first; padding stays last.
    backend = NumpyBackend()
    a = (np.array([[5.0, 2.0, -np.inf]], np.float32), np.array([[1, 0, -1]]), 0)
    b = (np.array([[5.0, 2.0, 1.0]], np.float32), np.array([[0, 2, 1]]), 3)
    best = backend.merge([a], 4)
    np.testing.assert_array_equal(best[1], [[1, 0, -1, -1]])
    vals, rows = backend.merge([(*best, 0), b], 4)
    np.testing.assert_array_equal(rows, [[1, 3, 0, 5]])
    np.testing.assert_array_equal(vals, [[5.0, 5.0, 2.0, 2.0]])
    vals, rows = backend.merge([(*backend.merge([a], 7), 0), b], 7)
    np.testing.assert_array_equal(rows, [[1, 3, 0, 5, 4, -1, -1]])
    assert (vals[0, -2:] == -np.inf).all()


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["ip", "cosine"])
def test_gpu_matches_oracle(forced, tmp_path: Path, metric: str) -> None:
    # On the device (the default there, early="auto"): parts are device views of the rows uploaded so far.
    from recall.backends import cuda_status

    usable, reason = cuda_status()
    if not usable:
        pytest.skip(f"no usable GPU: {reason}")
    options = JobOptions(engine=EngineOptions(tiles=(16, 8, 2)))  # several blocks per batch
    up, ip, users, items, user_ids, item_ids = _files(tmp_path, n_users=301, n_items=200, dim=6)
    summary = score_files(up, ip, tmp_path / "out.parquet", 9, metric=metric, device="gpu", batch_size=37,
                          options=options)
    assert summary.device == "gpu" and summary.early_users > 0 and summary.device_busy_s > 0
    if metric == "ip":
        _check(tmp_path / "out.parquet", users, items, user_ids, item_ids, 9)
    else:
        table = pq.read_table(tmp_path / "out.parquet")
        rows, scores = oracle_topk(users, items, 9, metric)
        got = table.column("scores").to_pylist()
        for u in range(len(users)):
            np.testing.assert_allclose(got[u], scores[u], rtol=1e-5, atol=1e-5)
    assert _no_threads_left()


@pytest.mark.gpu
def test_gpu_job_sized_early_searches_write_what_one_search_writes(tmp_path: Path) -> None:
    # A job big enough that the items are still loading (and the full engine being built, allocating on the
    # uploading thread's stream) while merges of the early parts are queued: the file with early searches equals
    # the file without them, byte for byte in every column (the device's scores do not depend on the part).
    from recall.backends import cuda_status
    from recall.bench import layouts
    from recall.bench.workloads import generate

    usable, reason = cuda_status()
    if not usable:
        pytest.skip(f"no usable GPU: {reason}")
    users, items = generate("clustered", 200_000, 600_000, 32, seed=3, device="cpu")
    up, ip = tmp_path / "users.parquet", tmp_path / "items.parquet"
    layouts.write(users, up)
    layouts.write(items, ip)
    rng = np.random.default_rng(3)
    excl = tmp_path / "excl.parquet"
    layouts.write_exclusions(np.arange(200_001, dtype=np.int64) * 20,
                             rng.integers(0, 600_000, size=4_000_000).astype(np.int64), excl)
    for exclude in (None, excl):
        tables = {}
        for mode in ("on", "off"):
            summary = score_files(up, ip, tmp_path / f"{mode}.parquet", 100, device="gpu", exclude_path=exclude,
                                  options=JobOptions(early=mode))
            assert (summary.early_users > 0) == (mode == "on")
            tables[mode] = pq.read_table(tmp_path / f"{mode}.parquet")
        ids = np.asarray(tables["on"].column("item_ids").combine_chunks().flatten())
        assert ids.min() >= 0 and ids.max() < items.shape[0]
        assert tables["on"].equals(tables["off"])


@pytest.mark.parametrize("centre_rows", [16, 4096])
def test_l2_far_from_the_origin_parts_share_the_centre(forced, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       centre_rows: int) -> None:
    # Integer vectors around (3000, ...): every part's engine is moved by the centre the full engine takes (from the
    # first rows, which the first part waits for), so the parts' lists merge into the exact distances. With 16
    # centre rows the first part closes at 16 of the 90 items and the others follow; with 4,096 it holds them all.
    from recall.core import metrics

    monkeypatch.setattr(metrics, "CENTRE_ROWS", centre_rows)
    users, items = int_data(61, 90, 5, seed=4)
    users, items = users + np.float32(3000), items + np.float32(3000)
    user_ids, item_ids = 10_000 + np.arange(61), 500 + 3 * np.arange(90)[::-1]
    up = write_embeddings(tmp_path / "users.parquet", user_ids, users, "fixed32", row_group_size=8)
    ip = write_embeddings(tmp_path / "items.parquet", item_ids, items, "fixed32", row_group_size=30)
    made = []
    monkeypatch.setattr(early, "Engine", lambda *a, **kw: made.append(kw.get("l2_centre")) or Engine(*a, **kw))
    summary = score_files(up, ip, tmp_path / "out.parquet", 7, metric="l2", device="cpu", batch_size=5, options=ON)
    assert summary.early_users > 0 and made
    want = metrics.far_centre(items)
    assert want is not None and all(np.array_equal(c, want) for c in made)
    assert (len(made) > 1) == (centre_rows < 90)
    _check(tmp_path / "out.parquet", users, items, user_ids, item_ids, 7, "l2")
