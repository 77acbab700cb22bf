"""Multi-interest users (``Engine.search`` with 3-d or ragged users, ``aggregate="max"|"sum"``) against a float64
oracle, and their Parquet reader and file job.

Every Engine test takes ``device``: the same bodies run on the CPU backend here and on the GPU backend on a GPU machine
(``-m gpu``). Integer-valued data makes float32 scores exact (l2 included: every term is a half-integer), so ip and l2
results, tie order included, must equal the oracle's.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from oracle import as_numpy
from parquet_data import vector_array, write_embeddings
from recall import Engine, InputError, ResourceError, EngineOptions
from recall.engine.interests import is_multi
from recall.io import read_interest_users
from recall.jobs import score_files

METRICS = ["ip", "cosine", "l2"]


def _ints(rng: np.random.Generator, shape: tuple, lo: int = -2, hi: int = 2) -> np.ndarray:
    vecs = rng.integers(lo, hi + 1, shape).astype(np.float32)
    flat = vecs.reshape(-1, shape[-1])
    flat[~flat.any(axis=1), 0] = 1.0  # no zero vectors: cosine needs a direction
    return vecs


def _ragged(rng: np.random.Generator, n_users: int, dim: int, most: int = 4) -> list[np.ndarray]:
    return [_ints(rng, (int(rng.integers(1, most + 1)), dim)) for _ in range(n_users)]


def _want(users, items, k, metric, aggregate, exclude=None):
    """float64 oracle: aggregate each user's per-interest scores, then the exact top-k with exclusions."""
    per_user = [oracle.score_matrix(u, items, metric) for u in users]
    agg = np.stack([s.max(axis=0) if aggregate == "max" else s.sum(axis=0) for s in per_user]) if per_user else \
        np.zeros((0, len(items)))
    return oracle.topk_from_scores(agg, min(k, len(items)), exclude)


def _check(res, users, items, k, metric, aggregate, exclude=None):
    idx, val = as_numpy(res.indices), as_numpy(res.scores)
    want_idx, want_val = _want(users, items, k, metric, aggregate, exclude)
    assert idx.shape == (len(users), min(k, len(items))) and idx.dtype == np.int64 and val.dtype == np.float32
    if metric == "cosine":
        np.testing.assert_array_equal(idx < 0, want_idx < 0)
        real = want_idx >= 0
        np.testing.assert_allclose(val[real], want_val[real], rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_array_equal(idx, want_idx)
        np.testing.assert_array_equal(val, want_val.astype(np.float32))


@pytest.mark.parametrize("aggregate", ["max", "sum"])
@pytest.mark.parametrize("metric", METRICS)
def test_regular_and_ragged_match_oracle(device, metric, aggregate):
    rng = np.random.default_rng(1)
    items = _ints(rng, (700, 12))
    regular = _ints(rng, (40, 3, 12))
    ragged = _ragged(rng, 40, 12)
    excl = {0: [1, 2, 3], 7: list(range(0, 700, 3)), 39: list(range(690))}
    engine = Engine(items, metric=metric, device=device)
    for users in (regular, ragged):
        for k in (1, 10, 25):
            _check(engine.search(users, k, exclude=excl, aggregate=aggregate), users, items, k, metric, aggregate,
                   excl)


def test_max_is_the_default_and_3d_lists_agree(device):
    rng = np.random.default_rng(2)
    items, users = _ints(rng, (300, 8)), _ints(rng, (9, 4, 8))
    engine = Engine(items, device=device)
    a = engine.search(users, 7)
    b = engine.search(list(users), 7, aggregate="max")
    c = engine.search([u.tolist() for u in users], 7)
    for other in (b, c):
        np.testing.assert_array_equal(as_numpy(a.indices), as_numpy(other.indices))
        np.testing.assert_array_equal(as_numpy(a.scores), as_numpy(other.scores))
    _check(a, users, items, 7, "ip", "max")


def test_k_beyond_items_pads(device):
    rng = np.random.default_rng(3)
    items, users = _ints(rng, (9, 5)), _ragged(rng, 6, 5)
    res = Engine(items, metric="l2", device=device).search(users, 15, exclude={2: [0, 1]}, aggregate="sum")
    _check(res, users, items, 15, "l2", "sum", {2: [0, 1]})  # k > n_items: as wide as the catalogue
    assert as_numpy(res.indices).shape == (6, 9) and (as_numpy(res.indices)[2, 7:] == -1).all()


def test_ties_go_to_the_lower_item_row(device):
    items = np.zeros((50, 3), np.float32)
    items[:, 0] = 1.0  # interest 0 scores every item 1; interest 1 prefers items 40 and 45
    items[40] = [1, 5, 0]
    items[45] = [1, 5, 0]
    users = np.array([[[1, 0, 0], [0, 1, 0]]], np.float32)
    res = Engine(items, device=device).search(users, 5, aggregate="max")
    np.testing.assert_array_equal(as_numpy(res.indices), [[40, 45, 0, 1, 2]])
    res = Engine(items, device=device).search(users, 3, aggregate="sum")
    np.testing.assert_array_equal(as_numpy(res.scores), [[6, 6, 1]])


@pytest.mark.parametrize("aggregate", ["max", "sum"])
def test_tiny_budget_and_many_blocks_agree(device, aggregate):
    rng = np.random.default_rng(4)
    items, users = _ints(rng, (1500, 16)), _ragged(rng, 70, 16, most=5)
    engine = Engine(items, metric="l2", device=device)
    want = engine.search(users, 30, aggregate=aggregate)
    _check(want, users, items, 30, "l2", aggregate)
    budget = 60_000 + 4 * engine.backend.state_bytes(30)  # small tiles, whatever top-k state a backend keeps
    tiny = Engine(items, metric="l2", device=device, memory_budget=budget).search(users, 30, aggregate=aggregate)
    np.testing.assert_array_equal(as_numpy(tiny.indices), as_numpy(want.indices))
    np.testing.assert_array_equal(as_numpy(tiny.scores), as_numpy(want.scores))


@pytest.mark.parametrize("metric, aggregate", [("ip", "max"), ("l2", "max"), ("l2", "sum")])
@pytest.mark.parametrize("tiles", [(1, 1, 1), (3, 5, 2), (16, 7, 1)])
def test_tiles_asked_for_count_items_whatever_the_interests(device, metric, aggregate, tiles):
    # EngineOptions.tiles counts items a tile: a tile of fewer items than a user has interest rows is a tiling like
    # any (it raised ResourceError: the plan counts score rows, several an item), and no tiling changes an answer.
    rng = np.random.default_rng(7)
    items, users = _ints(rng, (300, 8)), _ragged(rng, 40, 8, most=6)
    want = Engine(items, metric=metric, device=device).search(users, 12, aggregate=aggregate)
    engine = Engine(items, metric=metric, device=device, options=EngineOptions(tiles=tiles))
    got = engine.search(users, 12, aggregate=aggregate)
    np.testing.assert_array_equal(as_numpy(got.indices), as_numpy(want.indices))
    np.testing.assert_array_equal(as_numpy(got.scores), as_numpy(want.scores))
    assert engine.stats["item_tile"] == tiles[1], engine.stats  # as asked: the memory budget is ample


def test_one_interest_per_user_is_the_plain_search(device):
    rng = np.random.default_rng(5)
    items, users = _ints(rng, (200, 6)), _ints(rng, (8, 6))
    engine = Engine(items, device=device)
    plain = engine.search(users, 5)
    for multi in (users[:, None, :], [u[None, :] for u in users]):
        for aggregate in ("max", "sum"):
            got = engine.search(multi, 5, aggregate=aggregate)
            np.testing.assert_array_equal(as_numpy(got.indices), as_numpy(plain.indices))
    got = engine.search(users, 5, aggregate="sum")  # 2-d users: one vector each, aggregate has nothing to do
    np.testing.assert_array_equal(as_numpy(got.indices), as_numpy(plain.indices))


def test_clustered_data_close_to_oracle(device, make_clustered):
    users, items = make_clustered(90, 2000, 24, seed=6)
    users = users.reshape(30, 3, 24)
    for metric in METRICS:
        for aggregate in ("max", "sum"):
            res = Engine(items, metric=metric, device=device).search(users, 12, aggregate=aggregate)
            want_idx, want_val = _want(users, items, 12, metric, aggregate)
            scale = np.abs(want_val).max(axis=1, keepdims=True)
            np.testing.assert_allclose(as_numpy(res.scores), want_val, atol=1e-4 * scale.max() + 1e-5)
            agree = (as_numpy(res.indices) == want_idx).mean()
            assert agree > 0.95  # swaps only among near-ties


@settings(max_examples=25)
@given(data=st.data())
def test_property_equals_oracle(device, data):
    seed = data.draw(st.integers(0, 10_000))
    rng = np.random.default_rng(seed)
    n_items, dim = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 6))
    items = _ints(rng, (n_items, dim), -1, 1)
    users = _ragged(rng, data.draw(st.integers(1, 6)), dim, most=data.draw(st.integers(1, 4)))
    metric, aggregate = data.draw(st.sampled_from(["ip", "l2"])), data.draw(st.sampled_from(["max", "sum"]))
    k = data.draw(st.integers(1, 12))
    _check(Engine(items, metric=metric, device=device).search(users, k, aggregate=aggregate), users, items, k,
           metric, aggregate)


# ---- bad input -------------------------------------------------------------------------------------------------

def test_bad_input_names_user_and_interest(device):
    rng = np.random.default_rng(7)
    items = _ints(rng, (20, 4))
    engine = Engine(items, device=device)
    users = _ragged(rng, 4, 4)
    with pytest.raises(InputError, match="unknown aggregate 'mean'"):
        engine.search(users, 3, aggregate="mean")
    with pytest.raises(InputError, match="unknown aggregate"):
        engine.search(users[0], 3, aggregate="min")
    with pytest.raises(InputError, match="user 2 has no interest vectors"):
        engine.search([users[0], users[1], np.zeros((0, 4), np.float32)], 3)
    with pytest.raises(InputError, match="user 1 has dimension 5"):
        engine.search([users[0], np.ones((2, 5), np.float32)], 3)
    with pytest.raises(InputError, match="dimension 3 does not match"):
        engine.search(np.ones((2, 2, 3), np.float32), 3)
    bad = [u.copy() for u in users]
    bad[3] = np.vstack([bad[3], [[0, np.inf, 0, 0]]]).astype(np.float32)
    with pytest.raises(InputError, match=f"user 3, interest {len(bad[3]) - 1} has a NaN or infinite value"):
        engine.search(bad, 3)
    with pytest.raises(InputError, match="k must be an integer"):
        engine.search(users, 0)
    with pytest.raises(InputError, match="expected real numbers"):
        engine.search(np.array([[["a"]]]), 3)
    cosine = Engine(items, metric="cosine", device=device)
    with pytest.raises(InputError, match="user 1, interest 0 is a zero vector"):
        cosine.search([users[0], np.zeros((1, 4), np.float32)], 3)
    with pytest.raises(InputError, match="item row 20 .* out of range"):
        engine.search(users, 3, exclude={0: [20]})
    huge = np.full((1, 2, 4), 1e37, np.float32)
    with pytest.raises(InputError, match="user 0, interest 0 has norm .* could overflow float32"):
        engine.search(huge, 3)


@pytest.mark.parametrize("flt", [{"allow": []}, {"deny": np.arange(20)}])
def test_bad_input_is_refused_where_the_filter_passes_nothing(device, flt):
    # Nothing to score, the same errors as a search that scores: no padding answer for bad users.
    rng = np.random.default_rng(7)
    engine = Engine(_ints(rng, (20, 4)), device=device)
    users = _ragged(rng, 4, 4)
    bad = [u.copy() for u in users]
    bad[1][0, 2] = np.nan
    with pytest.raises(InputError, match="user 1, interest 0 has a NaN"):
        engine.search(bad, 3, **flt)
    with pytest.raises(InputError, match="dimension 3 does not match"):
        engine.search(np.ones((2, 2, 3), np.float32), 3, **flt)
    with pytest.raises(InputError, match="user 2 has no interest vectors"):
        engine.search([users[0], users[1], np.zeros((0, 4), np.float32)], 3, **flt)
    res = engine.search(users, 3, **flt)
    assert (as_numpy(res.indices) == -1).all() and res.indices.shape == (4, 3)


def test_budget_too_small_for_the_interest_rows():
    items = np.eye(4, dtype=np.float32)
    engine = Engine(items, device="cpu", memory_budget=64)
    with pytest.raises(ResourceError):
        engine.search(np.ones((1, 3, 4), np.float32), 2)


def test_is_multi():
    assert is_multi(np.zeros((2, 3, 4))) and is_multi([np.zeros((1, 4))]) and is_multi([[[1.0, 2.0]]])
    assert not is_multi(np.zeros((2, 4))) and not is_multi([[1.0, 2.0]]) and not is_multi([])


# ---- Parquet -------------------------------------------------------------------------------------------------------

def _repeated(path: Path, ids, vecs) -> Path:
    return write_embeddings(path, ids, vecs, "list32", row_group_size=3)


def _nested(path: Path, ids, per_user: list[np.ndarray], dim: int) -> Path:
    inner = vector_array(np.concatenate(per_user), "fixed32")
    offsets = pa.array(np.r_[0, np.cumsum([len(u) for u in per_user])].astype(np.int32))
    pq.write_table(pa.table({"id": pa.array(ids), "embedding": pa.ListArray.from_arrays(offsets, inner)}), path,
                   row_group_size=2)
    return path


def test_read_both_layouts(tmp_path):
    rng = np.random.default_rng(8)
    per_user = _ragged(rng, 5, 3)
    ids = np.array([30, 10, 20, 50, 40])
    # repeated ids, rows of a user not adjacent: user order is first appearance
    flat_ids = np.concatenate([[i] * len(u) for i, u in zip(ids, per_user)])
    flat = np.concatenate(per_user)
    perm = rng.permutation(flat_ids.size)
    got = read_interest_users(_repeated(tmp_path / "r.parquet", flat_ids[perm], flat[perm]))
    first = list(dict.fromkeys(flat_ids[perm].tolist()))
    assert got.ids.tolist() == first and got.ids.dtype == np.int64
    for i, uid in enumerate(first):
        u = int(np.flatnonzero(ids == uid)[0])
        rows = perm[flat_ids[perm] == uid]  # file order within a user
        np.testing.assert_array_equal(got.vectors[got.indptr[i]:got.indptr[i + 1]], flat[rows])
        assert len(rows) == len(per_user[u])
    nested = read_interest_users(_nested(tmp_path / "n.parquet", ids.tolist(), per_user, 3))
    assert nested.ids.tolist() == ids.tolist()
    np.testing.assert_array_equal(nested.vectors, flat)
    assert nested.indptr.tolist() == np.r_[0, np.cumsum([len(u) for u in per_user])].tolist()
    batch = nested.batch(1, 4)
    assert isinstance(batch, list) or batch.ndim == 3


def test_read_errors_name_file_row_and_id(tmp_path):
    p = tmp_path / "n.parquet"
    _nested(p, ["a", "b", "a"], [np.ones((1, 2)), np.ones((2, 2)), np.ones((1, 2))], 2)
    with pytest.raises(InputError, match="duplicate user id 'a' at rows 0 and 2"):
        read_interest_users(p)
    vecs = [np.ones((1, 2)), np.array([[1, 2], [np.nan, 0]]), np.ones((1, 2))]
    _nested(p, ["a", "b", "c"], vecs, 2)
    with pytest.raises(InputError, match=r"n.parquet: row 1 \(id 'b'\): vector 1 of its list has a NaN"):
        read_interest_users(p)
    offsets = pa.array(np.array([0, 1, 1], np.int32))
    pq.write_table(pa.table({"id": ["a", "b"], "embedding": pa.ListArray.from_arrays(
        offsets, vector_array(np.ones((1, 2)), "fixed32"))}), p)
    with pytest.raises(InputError, match=r"row 1 \(id 'b'\) has no interest vectors"):
        read_interest_users(p)
    _nested(p, ["a", "b"], [np.ones((1, 2)), np.ones((1, 2))], 2)
    with pytest.raises(InputError, match="has dimension 2, expected 3"):
        read_interest_users(p, dim=3)
    pq.write_table(pa.table({"id": [1], "embedding": [["x"]]}), p)
    with pytest.raises(InputError, match=r"expected fixed_size_list<float>\[dim\]"):
        read_interest_users(p)
    with pytest.raises(InputError, match="no vector column 'vec'"):
        read_interest_users(p, vec_col="vec")


@pytest.mark.parametrize("layout", ["repeated", "nested"])
@pytest.mark.parametrize("aggregate", ["max", "sum"])
def test_score_files(tmp_path, layout, aggregate):
    rng = np.random.default_rng(9)
    per_user = _ragged(rng, 23, 4)
    items = _ints(rng, (60, 4))
    ids = np.arange(100, 123)
    if layout == "nested":
        users_path = _nested(tmp_path / "u.parquet", ids.tolist(), per_user, 4)
    else:
        flat_ids = np.concatenate([[i] * len(u) for i, u in zip(ids, per_user)])
        users_path = _repeated(tmp_path / "u.parquet", flat_ids, np.concatenate(per_user))
    items_path = write_embeddings(tmp_path / "i.parquet", 5000 + np.arange(60), items)
    pq.write_table(pa.table({"user_id": [101, 101, 999], "item_id": [5000, 5001, 5002]}), tmp_path / "x.parquet")
    summary = score_files(users_path, items_path, tmp_path / "o.parquet", 6, aggregate=aggregate, metric="l2",
                          exclude_path=tmp_path / "x.parquet", device="cpu", batch_size=5)
    assert summary.users == 23 and summary.vectors == sum(len(u) for u in per_user)
    assert summary.unknown_pairs == 1 and f"interest vectors, {aggregate}) x 60 items" in summary.line()
    table = pq.read_table(tmp_path / "o.parquet")
    assert table.column("user_id").to_pylist() == ids.tolist()
    want_idx, want_val = _want(per_user, items, 6, "l2", aggregate, {1: [0, 1]})
    assert table.column("item_ids").to_pylist() == (5000 + want_idx).tolist()
    np.testing.assert_array_equal(np.array(table.column("scores").to_pylist()), want_val.astype(np.float32))


def test_score_files_compression(tmp_path):
    rng = np.random.default_rng(11)
    per_user = _ragged(rng, 9, 3)
    users_path = _nested(tmp_path / "u.parquet", list(range(9)), per_user, 3)
    items_path = write_embeddings(tmp_path / "i.parquet", np.arange(20), _ints(rng, (20, 3)))
    score_files(users_path, items_path, tmp_path / "o.parquet", 3, device="cpu", compression="zstd", aggregate="max")
    assert pq.ParquetFile(tmp_path / "o.parquet").metadata.row_group(0).column(1).compression == "ZSTD"
    with pytest.raises(InputError, match="unknown compression 'gzip'"):
        score_files(users_path, items_path, tmp_path / "o2.parquet", 3, device="cpu", compression="gzip",
                    aggregate="max")


def test_cli_score_interests(tmp_path):
    from typer.testing import CliRunner

    from recall.cli.app import app

    rng = np.random.default_rng(10)
    per_user = _ragged(rng, 7, 3)
    items = _ints(rng, (40, 3))
    users_path = _nested(tmp_path / "u.parquet", [f"u{i}" for i in range(7)], per_user, 3)
    items_path = write_embeddings(tmp_path / "i.parquet", np.arange(40), items)
    args = ["score", "--users", str(users_path), "--items", str(items_path), "--k", "4", "--out",
            str(tmp_path / "o.parquet"), "--device", "cpu", "--interests", "sum", "-v"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "scored 7 users (" in result.stdout and "interest vectors, sum) x 40 items" in result.stdout
    assert "stages (overlapping)" in result.stdout
    want_idx, _ = _want(per_user, items, 4, "ip", "sum")
    assert pq.read_table(tmp_path / "o.parquet").column("item_ids").to_pylist() == want_idx.tolist()
    result = CliRunner().invoke(app, args[:-3] + ["--interests", "mean"])
    assert result.exit_code == 2 and "mean" in result.output
    # A users file that is not multi-interest-shaped: one line, exit 2, no output.
    pq.write_table(pa.table({"id": [1], "embedding": [["x"]]}), tmp_path / "bad.parquet")
    args[2] = str(tmp_path / "bad.parquet")
    (tmp_path / "o.parquet").unlink()
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "o.parquet").exists()


# ---- the S7 bench workload -------------------------------------------------------------------------------------

@pytest.mark.parametrize("aggregate", ["max", "sum"])
def test_bench_interest_workload_truth_and_check(aggregate):
    import dataclasses

    from recall.bench import contenders, oracle as bench_oracle, workloads

    w = dataclasses.replace(workloads.get("S7-small"), n_users=120, n_items=1500, k=10, aggregate=aggregate)
    users, items = w.generate(seed=3)
    assert isinstance(users, workloads.MultiInterestUsers) and users.vecs.shape == (120, 4, 32)
    assert w.flops == 2.0 * 120 * 4 * 1500 * 32
    sample = bench_oracle.sample_rows(120, 50, 0)
    for metric in METRICS:
        truth = w.truth(users, items, sample, metric)
        want_idx, want_val = _want(list(users.vecs[sample]), items, 10, metric, aggregate)
        np.testing.assert_allclose(truth.top_scores, want_val, rtol=1e-12, atol=1e-9)
        c = contenders.RecallContender("cpu", metric)
        c.prepare(items)
        idx, sc = c.search(users, w.k)
        check = w.check(truth, users, items, idx, sc, rtol=1e-4)
        assert check.exact and check.invalid == 0 and check.max_score_error < 1e-4
        bad = np.array(idx, copy=True)
        bad[sample[1], :] = bad[sample[1], ::-1]  # same items, another order: still every one a hit
        assert w.check(truth, users, items, bad, None, rtol=1e-4).exact
        # The user's worst item (by the aggregated score) in place of its 10th: exactly one user falls short.
        worst, _ = _want([users.vecs[sample[1]]], items, 1500, metric, aggregate)
        bad[sample[1]] = np.r_[truth.top_items[1][:9], worst[0, -1]]
        assert w.check(truth, users, items, bad, None, rtol=1e-4).users_short == 1
    assert contenders.FaissContender("cpu").unsupported_workload(w)


# ---- GPU only: device arrays in place, many blocks with graph replay, equal to the CPU bit for bit -------------

@pytest.mark.gpu
@pytest.mark.parametrize("aggregate", ["max", "sum"])
def test_gpu_blocks_and_graphs_equal_cpu(aggregate):
    import cupy

    options = EngineOptions(tiles=(64, 600, 3))  # many blocks and segments: both slots, capture, replay
    rng = np.random.default_rng(12)
    items = _ints(rng, (2500, 12), -3, 3)
    users = _ragged(rng, 500, 12, most=5)
    excl = {u: rng.choice(2500, 30, replace=False).tolist() for u in range(0, 500, 4)}
    for metric in ("ip", "l2"):
        want = Engine(items, metric=metric, device="cpu").search(users, 33, exclude=excl, aggregate=aggregate)
        gpu = Engine(items, metric=metric, device="gpu", options=options)
        got = gpu.search(users, 33, exclude=excl, aggregate=aggregate)
        np.testing.assert_array_equal(as_numpy(got.indices), want.indices)
        np.testing.assert_array_equal(as_numpy(got.scores), want.scores)
        assert gpu.stats["blocks"] == 8 and gpu.stats["graph_blocks"] >= 6  # the reduce step was captured
        dev = gpu.search(cupy.asarray(_ints(rng, (40, 3, 12))), 5, aggregate=aggregate)
        assert isinstance(dev.indices, cupy.ndarray)


@pytest.mark.parametrize("nested", [False, True])
def test_an_empty_users_file_keeps_its_string_ids(tmp_path, nested):
    # --allow-empty: the output's user_id has the users file's type (string), as for one vector per user.
    from recall.jobs import score_files

    items = tmp_path / "items.parquet"
    pq.write_table(pa.table({"id": pa.array(["a", "b", "c"]),
                             "embedding": pa.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], pa.list_(pa.float32(), 2))}),
                   items)
    vec = pa.list_(pa.list_(pa.float32(), 2)) if nested else pa.list_(pa.float32(), 2)
    users = tmp_path / "users.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "embedding": pa.array([], vec)}), users)
    score_files(users, items, tmp_path / "o.parquet", 2, device="cpu", aggregate="max", allow_empty=True)
    assert pq.read_schema(tmp_path / "o.parquet").field("user_id").type == pa.string()
