"""The public Engine API against the float64 oracle. Every test takes ``device``: the same bodies run on the CPU
backend here and on the GPU backend on a GPU machine (``-m gpu``)."""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from oracle import as_numpy
from recall import BackendUnavailable, Engine, InputError, ResourceError, SearchResult

METRICS = ["ip", "cosine", "l2"]


def _search(engine: Engine, users, k, exclude=None):
    res = engine.search(users, k, exclude=exclude)
    assert isinstance(res, SearchResult)
    return as_numpy(res.indices), as_numpy(res.scores), res


def _assert_exact(idx, val, users, items, k, metric="ip", exclude=None):
    """Integer-valued data: indices (tie order included) and scores must equal the oracle exactly."""
    want_idx, want_val = oracle.topk(users, items, k, metric, exclude)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(val, want_val.astype(np.float32))


def _tiny_budget(items, device, k: int, floor: int, metric: str = "ip") -> int:
    """``floor`` bytes (a few KB: many small tiles on the CPU), raised to a few times the smallest workspace where a
    backend keeps more top-k state per user than that allows."""
    engine = Engine(items, metric=metric, device=device)
    smallest = 4 + 4 * (engine.dim + 4) + engine.backend.state_bytes(min(k, engine.n_items))
    return max(floor, 8 * smallest)


def _nonzero_rows(vecs: np.ndarray) -> np.ndarray:
    """Replace all-zero rows (no direction under cosine) by a unit vector, keeping the rows integer-valued."""
    vecs = vecs.copy()
    vecs[~vecs.any(axis=1), 0] = 1.0
    return vecs


# ---- correctness against the oracle ------------------------------------------------------------------------------

@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("kind", ["normal", "clustered"])
def test_every_metric_matches_oracle(device, metric, kind, make_normal, make_clustered):
    make = make_normal if kind == "normal" else make_clustered
    users, items = make(37, 613, 24, seed=1)
    engine = Engine(items, metric=metric, device=device)
    idx, val, _ = _search(engine, users, 10)
    assert idx.dtype == np.int64 and val.dtype == np.float32
    oracle.assert_topk_close(idx, val, users, items, 10, metric)
    atol = 1e-4 * oracle.score_scale(users, items, metric).max()
    assert oracle.recall_at_k(idx, users, items, 10, metric, atol=atol) == 1.0


@pytest.mark.parametrize("k", [700, 2500])
def test_large_k_with_ties_and_exclusions_is_exact(device, k, make_ties):
    # Large k (the CPU keeps buffers cut back to k, not heaps, from heap.BUFFER_MIN_K on): tied integer scores
    # across many cuts, exclusions, and a user left with fewer than k items.
    users, items = make_ties(9, 6000, 4, seed=3)
    exclude = {u: list(range(u * 7, 6000, 3)) for u in range(9)}
    exclude[4] = list(range(6000 - k // 2))  # k // 2 items remain: padding
    engine = Engine(items, device=device)
    idx, val, _ = _search(engine, users, k, exclude=exclude)
    _assert_exact(idx, val, users, items, k, exclude=exclude)
    assert (idx[4] >= 0).sum() == k // 2


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_ties_on_integer_data_are_exact(device, metric, make_ties):
    # Scores are small integers, exact in float32: every tie must be broken by the lower item row, and every score
    # must be exactly the oracle's.
    users, items = make_ties(23, 301, 5, seed=2)
    engine = Engine(items, metric=metric, device=device)
    for k in (1, 7, 40):
        idx, val, _ = _search(engine, users, k)
        _assert_exact(idx, val, users, items, k, metric)
    # The data really has ties at the cut, or this test would prove nothing.
    full = oracle.score_matrix(users, items, metric)
    kth = np.sort(full, axis=1)[:, ::-1][:, 6]
    assert np.mean((full == kth[:, None]).sum(axis=1) >= 2) > 0.75


def test_cosine_ties_on_power_of_two_norms_are_exact(device):
    # Vectors with four entries of +-1 (or +-2) have norm 2 (or 4): normalised entries are exactly +-0.5 and cosine
    # scores are exact multiples of 0.25, so ties are real ties in float32 too. Scaled copies tie exactly.
    rng = np.random.default_rng(3)

    def four_hot(n, dim, scale):
        out = np.zeros((n, dim), np.float32)
        for row in out:
            row[rng.choice(dim, 4, replace=False)] = scale * rng.choice([-1.0, 1.0], 4)
        return out

    items = np.concatenate([four_hot(60, 8, 1.0), four_hot(20, 8, 2.0)])
    items = np.concatenate([items, 2.0 * items[:10]])  # rows 80..89 are exact scaled copies of rows 0..9
    users = four_hot(15, 8, 1.0)
    engine = Engine(items, metric="cosine", device=device)
    idx, val, _ = _search(engine, users, 25)
    _assert_exact(idx, val, users, items, 25, "cosine")


@pytest.mark.parametrize("metric", METRICS)
def test_k_equal_one(device, metric, make_ties):
    users, items = make_ties(19, 57, 4, seed=4)
    users, items = _nonzero_rows(users), _nonzero_rows(items)
    idx, val, _ = _search(Engine(items, metric=metric, device=device), users, 1)
    assert idx.shape == (19, 1)
    if metric == "cosine":
        oracle.assert_topk_close(idx, val, users, items, 1, metric)
    else:
        _assert_exact(idx, val, users, items, 1, metric)


@pytest.mark.parametrize("metric", METRICS)
def test_k_equal_n_items_is_a_full_ranking(device, metric, make_normal):
    users, items = make_normal(9, 131, 6, seed=5)
    idx, val, _ = _search(Engine(items, metric=metric, device=device), users, 131)
    assert np.all(np.sort(idx, axis=1) == np.arange(131)), "every item exactly once per user"
    assert np.all(np.isfinite(val))
    oracle.assert_topk_close(idx, val, users, items, 131, metric)


def test_k_larger_than_catalog_is_clamped(device, make_ties):
    """k beyond the catalogue returns the whole catalogue, (n, n_items): the result is never allocated at k columns
    (k = 2^31 - 1 would be 150 GB here)."""
    users, items = make_ties(6, 5, 3, seed=6)
    ref_idx, ref_val, _ = _search(Engine(items, device=device), users, 5)
    for k in (9, 2 ** 31 - 1):
        idx, val, res = _search(Engine(items, device=device), users, k)
        assert idx.shape == val.shape == (6, 5) and res.k == 5
        np.testing.assert_array_equal(idx, ref_idx)
        np.testing.assert_array_equal(val, ref_val)
        np.testing.assert_array_equal(as_numpy(res.ids), idx)  # without ids, ids are the row positions
    with pytest.raises(InputError, match="below 2"):
        Engine(items, device=device).search(users, 2 ** 31)


def test_padding_where_exclusions_leave_fewer_than_k(device, make_ties):
    users, items = make_ties(6, 5, 3, seed=6)
    idx, val, res = _search(Engine(items, device=device), users, 9, exclude={0: [0, 1, 2]})
    assert idx.shape == val.shape == (6, 5)
    np.testing.assert_array_equal(idx[0, 2:], -1)
    assert np.all(np.isneginf(val[0, 2:])) and np.all(idx[1:] >= 0)
    np.testing.assert_array_equal(as_numpy(res.ids), idx)


def test_padding_in_ids_int_and_string(device, make_ties):
    users, items = make_ties(4, 3, 3, seed=7)
    int_ids = np.array([100, 200, 300], dtype=np.int64)
    exclude = {u: [0] for u in range(4)}  # every user gets two of the three items: one padded slot
    idx, _, res = _search(Engine(items, ids=int_ids, device=device), users, 5, exclude)
    ids = as_numpy(res.ids)
    assert ids.shape == (4, 3)
    np.testing.assert_array_equal(ids[:, :2], int_ids[idx[:, :2]])
    np.testing.assert_array_equal(ids[:, 2:], -1)
    str_ids = np.array(["a", "b", "c"])
    _, _, res = _search(Engine(items, ids=str_ids, device=device), users, 5, exclude)
    ids = as_numpy(res.ids)
    assert ids.dtype == object
    assert ids[:, 2:].tolist() == [[None]] * 4
    assert ids[:, :2].tolist() == str_ids[idx[:, :2]].tolist()


def test_padding_with_unsigned_int_ids(device, make_ties):
    # Hashed ids are often uint64 (here some above 2**63). Padded slots need not hold any particular value (the
    # contract is "test indices < 0"), but padding must not crash the search, and real slots must map exactly.
    users, items = make_ties(3, 4, 3, seed=48)
    ids = np.array([2**63 + 5, 7, 2**64 - 2, 0], dtype=np.uint64)
    exclude = {1: [0, 1]}
    idx, _, res = _search(Engine(items, ids=ids, device=device), users, 6, exclude)
    got = as_numpy(res.ids)
    assert got.shape == (3, 4)
    real = idx >= 0
    assert [int(x) for x in got[real]] == [int(x) for x in ids[idx[real]]]


def test_one_user(device, make_normal):
    users, items = make_normal(1, 300, 8, seed=8)
    idx, val, _ = _search(Engine(items, device=device), users, 12)
    assert idx.shape == (1, 12)
    oracle.assert_topk_close(idx, val, users, items, 12)


@pytest.mark.parametrize("metric", METRICS)
def test_one_item(device, metric, make_normal):
    users, items = make_normal(7, 1, 4, seed=9)
    idx, val, _ = _search(Engine(items, metric=metric, device=device), users, 3)
    np.testing.assert_array_equal(idx, np.zeros((7, 1)))  # k > n_items: the whole catalogue, one column
    want = oracle.score_matrix(users, items, metric)[:, 0]
    np.testing.assert_allclose(val[:, 0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("metric", METRICS)
def test_copy_false_keeps_the_callers_array_under_ip_only(device, metric, make_normal):
    """``copy=False``: the engine holds an ip catalogue in the caller's own array (on the CPU, or a device array on
    the GPU), and answers as a copying engine does; cosine and l2 keep vectors they derived either way."""
    users, items = make_normal(9, 400, 16, seed=11)
    xp = np
    if device == "gpu":
        import cupy as xp
    given = xp.asarray(items)
    kept, copied = Engine(given, metric=metric, device=device, copy=False), Engine(given, metric=metric,
                                                                                    device=device)
    assert xp.shares_memory(kept.prepared_items, given) == (metric == "ip")
    assert not xp.shares_memory(copied.prepared_items, given)
    a, b = kept.search(users, 20), copied.search(users, 20)
    np.testing.assert_array_equal(as_numpy(a.indices), as_numpy(b.indices))
    np.testing.assert_array_equal(as_numpy(a.scores), as_numpy(b.scores))
    oracle.assert_topk_close(as_numpy(a.indices), as_numpy(a.scores), users, items, 20, metric=metric)


def test_zero_users(device, make_normal):
    _, items = make_normal(1, 50, 8, seed=10)
    engine = Engine(items, ids=np.arange(50) * 3, device=device)
    idx, val, res = _search(engine, np.zeros((0, 8), np.float32), 4)
    assert idx.shape == (0, 4) and val.shape == (0, 4) and as_numpy(res.ids).shape == (0, 4)
    assert res.n_users == 0 and res.k == 4
    table = res.to_arrow()
    assert table.num_rows == 0


def test_non_contiguous_and_other_dtypes_match_float32(device, make_ties):
    users, items = make_ties(12, 40, 6, seed=11)
    engine = Engine(items, device=device)
    want_idx, want_val, _ = _search(engine, users, 8)
    fortran = np.asfortranarray(users)
    strided = np.repeat(users, 2, axis=0)[::2]
    assert not strided.flags.c_contiguous or not fortran.flags.c_contiguous
    for variant in (fortran, strided, users.astype(np.float64), users.astype(np.int32), users.tolist()):
        idx, val, _ = _search(engine, variant, 8)
        np.testing.assert_array_equal(idx, want_idx)
        np.testing.assert_array_equal(val, want_val)
    # Items given as float64 / Fortran order give the same engine.
    for variant in (items.astype(np.float64), np.asfortranarray(items)):
        idx, val, _ = _search(Engine(variant, device=device), users, 8)
        np.testing.assert_array_equal(idx, want_idx)
        np.testing.assert_array_equal(val, want_val)


# ---- exclusions --------------------------------------------------------------------------------------------------

def test_all_items_excluded_for_one_user(device, make_ties):
    users, items = make_ties(5, 20, 4, seed=12)
    exclude = {2: range(20)}
    idx, val, _ = _search(Engine(items, device=device), users, 6, exclude)
    np.testing.assert_array_equal(idx[2], -1)
    assert np.all(np.isneginf(val[2]))
    _assert_exact(idx, val, users, items, 6, exclude=exclude)
    assert np.all(idx[[0, 1, 3, 4]] >= 0), "other users are unaffected"


def test_exclusions_leaving_fewer_than_k(device, make_ties):
    users, items = make_ties(4, 12, 3, seed=13)
    exclude = {0: [0, 1, 2, 3, 4, 5, 6, 7, 8], 3: [11, 5]}
    idx, val, _ = _search(Engine(items, device=device), users, 5, exclude)
    assert (idx[0] >= 0).sum() == 3
    np.testing.assert_array_equal(np.sort(idx[0, :3]), [9, 10, 11])
    _assert_exact(idx, val, users, items, 5, exclude=exclude)


def test_exclusions_still_return_k_when_k_remain(device, make_normal):
    # Exclude each user's true top 10: the engine must return the next 10, not fewer.
    users, items = make_normal(20, 200, 8, seed=14)
    top10, _ = oracle.topk(users, items, 10)
    exclude = {u: top10[u].tolist() for u in range(20)}
    idx, val, _ = _search(Engine(items, device=device), users, 10, exclude)
    assert np.all(idx >= 0)
    oracle.assert_topk_close(idx, val, users, items, 10, exclude=exclude)


def test_empty_exclusions_equal_none(device, make_ties):
    users, items = make_ties(8, 30, 4, seed=15)
    engine = Engine(items, device=device)
    want_idx, want_val, _ = _search(engine, users, 7)
    empty_csr = (np.zeros(9, np.int64), np.zeros(0, np.int64))
    for empty in ({}, {3: []}, empty_csr):
        idx, val, _ = _search(engine, users, 7, empty)
        np.testing.assert_array_equal(idx, want_idx)
        np.testing.assert_array_equal(val, want_val)


@pytest.mark.parametrize("metric", METRICS)
def test_exclusions_dict_and_csr_agree_with_oracle(device, metric, make_ties):
    users, items = make_ties(10, 64, 5, seed=16)
    users, items = _nonzero_rows(users), _nonzero_rows(items)
    rng = np.random.default_rng(16)
    as_dict = {u: rng.choice(64, size=rng.integers(0, 20), replace=False).tolist() for u in range(0, 10, 2)}
    indptr = np.zeros(11, np.int64)
    for u in range(10):
        indptr[u + 1] = indptr[u] + len(as_dict.get(u, []))
    rows = np.array([r for u in range(10) for r in as_dict.get(u, [])], dtype=np.int64)
    engine = Engine(items, metric=metric, device=device)
    idx_d, val_d, _ = _search(engine, users, 15, as_dict)
    idx_c, val_c, _ = _search(engine, users, 15, (indptr, rows))
    np.testing.assert_array_equal(idx_d, idx_c)
    np.testing.assert_array_equal(val_d, val_c)
    if metric == "cosine":
        oracle.assert_topk_close(idx_d, val_d, users, items, 15, metric, as_dict)
    else:
        _assert_exact(idx_d, val_d, users, items, 15, metric, as_dict)


def test_duplicate_and_unsorted_exclusion_entries(device, make_ties):
    users, items = make_ties(3, 25, 4, seed=17)
    engine = Engine(items, device=device)
    clean = {0: [3, 7, 24], 2: [0]}
    messy = {0: [24, 7, 3, 7, 24, 24], 2: [0, 0]}
    indptr = np.array([0, 6, 6, 8])
    rows = np.array([24, 7, 3, 7, 24, 24, 0, 0])
    idx_c, val_c, _ = _search(engine, users, 24, clean)
    for exclude in (messy, (indptr, rows)):
        idx, val, _ = _search(engine, users, 24, exclude)
        np.testing.assert_array_equal(idx, idx_c)
        np.testing.assert_array_equal(val, val_c)
    _assert_exact(idx_c, val_c, users, items, 24, exclude=clean)
    assert (idx_c[0] >= 0).sum() == 22 and (idx_c[1] >= 0).sum() == 24


@pytest.mark.parametrize("exclude, needle", [
    ({0: [25]}, "25"),
    ({1: [-1]}, "-1"),
    ({5: [0]}, "user row 5"),
    ({-1: [0]}, "user row -1"),
    ((np.array([0, 1, 1, 2, 2]), np.array([3, 99])), "99"),
    ((np.array([0, 1, 2]), np.array([1, 2])), "indptr"),
    ((np.array([0, 2, 1, 2, 2]), np.array([1, 2])), "indptr"),
    ({0: [1.5]}, "integers"),
    ({"0": [1]}, "user key"),
    ([[0, 1]], "exclude"),
    ({0: 3}, "items of user row 0 must be an iterable"),
    ({0: None}, "items of user row 0 must be an iterable"),
    ({0: [None]}, "integers"),
])
def test_bad_exclusions_raise_input_error(device, exclude, needle, make_normal):
    users, items = make_normal(4, 25, 3, seed=18)
    engine = Engine(items, device=device)
    with pytest.raises(InputError, match=needle.replace("-", r"\-")):
        engine.search(users, 3, exclude=exclude)


# ---- validation --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["users", "items"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_inf_raise_input_error_naming_the_row(device, where, bad, make_normal):
    users, items = make_normal(6, 10, 4, seed=19)
    if where == "users":
        users[4, 2] = bad
        engine = Engine(items, device=device)
        with pytest.raises(InputError, match=r"user_vecs.*row 4\b"):
            engine.search(users, 2)
    else:
        items[7, 0] = bad
        with pytest.raises(InputError, match=r"item_vecs.*row 7\b"):
            Engine(items, device=device)


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
def test_first_bad_user_row_is_named_in_every_metric(device, metric, make_normal):
    # Finiteness is read off the rows' norms with the overflow bound (one transfer): the first non-finite row is
    # named, before a later row whose scores would overflow.
    users, items = make_normal(8, 10, 4, seed=23)
    users[5, 1] = np.nan
    users[3, 0] = -np.inf
    users[1] = 1e37  # finite, and its scores could overflow (ip, l2); cosine normalises it
    engine = Engine(items, metric=metric, device=device)
    with pytest.raises(InputError, match=r"user_vecs: row 3 has a NaN or infinite value"):
        engine.search(users, 2)
    users[3, 0] = users[5, 1] = 0.0
    if metric == "cosine":
        assert engine.search(users, 2).indices.shape == (8, 2)
    else:
        with pytest.raises(InputError, match=r"user_vecs: row 1 has norm 2e\+37"):
            engine.search(users, 2)


def test_float64_overflowing_float32_is_rejected(device, make_normal):
    users, items = make_normal(3, 10, 4, seed=20)
    items = items.astype(np.float64)
    items[6, 1] = 1e300  # finite in float64, inf in float32
    with pytest.raises(InputError, match=r"row 6\b"):
        Engine(items, device=device)


@pytest.mark.parametrize("metric, item, user", [
    ("ip", [1e20, 0.0], [-1e20, 0.0]),  # the score -1e40 overflows float32 to -inf
    ("ip", [1e20, -1e20], [1e20, 1e20]),  # inf + -inf: NaN inside the GEMM; the true score is 0
    ("l2", [3e19, 0.0], [3e19, 0.0]),  # ||v||^2 overflows in the expanded form; the true score is exactly 0
])
def test_float32_overflow_is_not_silently_dropped(device, metric, item, user):
    # Every input is finite in float32, so it passes validation; the item exists and passes, so with k=1 the engine
    # must either return both items (k=2) or refuse the input with an InputError, never report "no item" (-1).
    items = np.array([item, [1.0, 1.0]], np.float32)
    users = np.array([user], np.float32)
    try:
        idx, _, _ = _search(Engine(items, metric=metric, device=device), users, 2)
    except InputError:
        return
    assert np.all(idx >= 0), f"an existing item was silently dropped: indices {idx.tolist()}"


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("where", ["host", "device"])
def test_users_check_at_the_overflow_limit(device, metric, where):
    """The users' check takes the largest norm in one pass where every row is clearly within float32; at the limit's
    edge the rows' own norms decide, as before: a user whose bound is the limit searches, one just above is refused
    by its row (the first of two, after 70,000 good rows)."""
    from recall.engine.inputs import SCORE_LIMIT

    xp = np
    if where == "device":
        if device == "cpu":
            pytest.skip("device users on the GPU only")
        import cupy as xp
    items = np.array([[1e18, 0.0], [0.0, 1.0]], np.float32)
    engine = Engine(items, metric=metric, device=device)
    users = np.ones((70_003, 2), np.float32)
    item_norm = engine.item_norm
    edge = SCORE_LIMIT / item_norm if metric == "ip" else math.sqrt(SCORE_LIMIT) - item_norm
    # The largest float32 norm at or below the edge (a user [x, 0]), and the next float32 above.
    at = np.float32(edge)
    while (float(at) * item_norm if metric == "ip" else (float(at) + item_norm) ** 2) > SCORE_LIMIT:
        at = np.nextafter(at, np.float32(0))
    if metric == "l2":
        engine_centre = engine.l2_centre
        assert engine_centre is None or not np.any(engine_centre), "the check below assumes no l2 centre"
    users[70_001] = [at, 0.0]
    res = engine.search(xp.asarray(users), 1)
    assert as_numpy(res.indices)[70_001, 0] >= 0
    users[70_002] = [np.nextafter(at, np.float32(np.inf)) * np.float32(1.001), 0.0]
    users[70_000] = users[70_002]
    with pytest.raises(InputError, match=r"user_vecs: row 70000 has norm .* could overflow float32"):
        engine.search(xp.asarray(users), 1)
    users[70_000] = [np.nan, 0.0]
    with pytest.raises(InputError, match=r"user_vecs: row 70000 has a NaN or infinite value"):
        engine.search(xp.asarray(users), 1)


def test_dimension_mismatch(device, make_normal):
    users, items = make_normal(3, 10, 4, seed=21)
    engine = Engine(items, device=device)
    with pytest.raises(InputError, match="dimension 5.*4"):
        engine.search(np.zeros((3, 5), np.float32), 2)
    with pytest.raises(InputError, match="2-d"):
        engine.search(np.zeros(4, np.float32), 2)
    with pytest.raises(InputError, match="2-d"):
        Engine(np.zeros(4, np.float32), device=device)


def test_empty_catalog_and_zero_dim(device):
    with pytest.raises(InputError, match="no items"):
        Engine(np.zeros((0, 4), np.float32), device=device)
    with pytest.raises(InputError, match="dimension 0"):
        Engine(np.zeros((3, 0), np.float32), device=device)


@pytest.mark.parametrize("k", [0, -1, True, False, 2.0, "3", None, np.float32(4)])
def test_bad_k(device, k, make_normal):
    users, items = make_normal(2, 10, 4, seed=22)
    engine = Engine(items, device=device)
    with pytest.raises(InputError, match="k must be"):
        engine.search(users, k)


def test_numpy_integer_k_is_accepted(device, make_ties):
    users, items = make_ties(3, 10, 4, seed=23)
    engine = Engine(items, device=device)
    idx, val, _ = _search(engine, users, np.int64(4))
    _assert_exact(idx, val, users, items, 4)


def test_unknown_metric_and_device(device, make_normal):
    _, items = make_normal(1, 10, 4, seed=24)
    with pytest.raises(InputError, match="unknown metric 'dot'"):
        Engine(items, metric="dot", device=device)
    with pytest.raises(InputError, match="unknown device 'tpu'"):
        Engine(items, device="tpu")


@pytest.mark.parametrize("ids, needle", [
    (np.array([5, 6, 7, 6, 8]), r"duplicate item id 6\b.*rows 1 and 3"),
    (np.array(["a", "b", "c", "d", "a"]), r"duplicate item id 'a'.*rows 0 and 4"),
])
def test_duplicate_ids_name_the_id(device, ids, needle, make_normal):
    _, items = make_normal(1, 5, 4, seed=25)
    with pytest.raises(InputError, match=needle):
        Engine(items, ids=ids, device=device)


@pytest.mark.parametrize("ids, needle", [
    (np.array(["a", None, "c", "d", "e"], dtype=object), r"row 1 holds None \(NoneType\); ids must all be strings"),
    (np.array([1, "b", "c", "d", "e"], dtype=object), r"row 1 holds 'b' \(str\); ids must all be integers"),
    (np.array([None, "b", "c", "d", "e"], dtype=object), r"row 0 holds None .* integers or strings"),
    (np.array([1, 2, True, 4, 5], dtype=object), r"row 2 holds True \(bool\)"),
    (np.array([np.nan, np.nan, 1.0, 2.0, 3.0]), "integers or strings, got dtype float64"),
    (np.array([0.0, 1.0, 2.0, 3.0, 4.0]), "integers or strings, got dtype float64"),
])
def test_ids_that_are_not_integers_or_strings(device, ids, needle, make_normal):
    _, items = make_normal(1, 5, 4, seed=25)
    with pytest.raises(InputError, match=needle):
        Engine(items, ids=ids, device=device)


def test_object_arrays_of_integer_ids_are_integer_ids(device, make_ties):
    users, items = make_ties(4, 5, 3, seed=25)
    engine = Engine(items, ids=np.array([10, 11, np.int64(12), 13, 14], dtype=object), device=device)
    assert engine.ids.dtype == np.int64
    res = engine.search(users, 2)
    np.testing.assert_array_equal(as_numpy(res.ids), as_numpy(res.indices) + 10)


def test_ragged_nested_lists_raise_input_error(device, make_normal):
    users, items = make_normal(2, 5, 3, seed=25)
    with pytest.raises(InputError, match="item_vecs: not an"):
        Engine([[1.0, 2.0, 3.0], [1.0, 2.0]], device=device)
    engine = Engine(items, device=device)
    with pytest.raises(InputError, match="user_vecs: not an"):
        engine.search([[1.0, 2.0, 3.0], [1.0]], 2)


def test_an_empty_list_of_users_is_zero_users(device, make_normal):
    _, items = make_normal(1, 5, 3, seed=25)
    engine = Engine(items, device=device)
    for users in ([], ()):
        res = engine.search(users, 3)
        assert as_numpy(res.indices).shape == (0, 3) and as_numpy(res.scores).shape == (0, 3)


def test_l2_items_whose_norm_overflows_are_refused_at_construction(device, make_normal):
    _, items = make_normal(1, 6, 4, seed=25)
    items[4] = 2e19  # |v|^2 / 2 beyond float32
    with pytest.raises(InputError, match=r"item_vecs: row 4 has norm 4e\+19.*l2"):
        Engine(items, metric="l2", device=device)
    Engine(items, metric="ip", device=device)  # under ip the bound is the product with each user's norm


@pytest.mark.parametrize("offset", [3e3, 1e6, 1e7])
def test_l2_far_from_the_origin_is_exact_on_small_integers(device, offset):
    # Vectors at `offset` + small integers: their distances are small integers, exact in float32 once the centre is
    # taken off; each user's list and scores are the float64 oracle's, ties by row. (At 10^7 a centre rounded to 12
    # significant bits left the vectors ~1,200 from it, where float32's products lost the distances: every list wrong.)
    rng = np.random.default_rng(10)
    items = (rng.integers(-3, 4, (2000, 16)) + offset).astype(np.float32)
    users = (rng.integers(-3, 4, (150, 16)) + offset).astype(np.float32)
    res = Engine(items, metric="l2", device=device).search(users, 7)
    dist = ((users.astype(np.float64)[:, None, :] - items.astype(np.float64)[None]) ** 2).sum(axis=2)
    want = np.argsort(dist, axis=1, kind="stable")[:, :7]
    np.testing.assert_array_equal(as_numpy(res.indices), want)
    np.testing.assert_array_equal(as_numpy(res.scores), -np.take_along_axis(dist, want, axis=1))


def test_ids_of_wrong_length(device, make_normal):
    _, items = make_normal(1, 5, 4, seed=26)
    with pytest.raises(InputError, match="expected 5 ids"):
        Engine(items, ids=np.arange(4), device=device)


@pytest.mark.parametrize("ids", [
    np.arange(40, dtype=np.int64) * 7 + 1000,
    np.array([f"item-{i:03d}" for i in range(40)]),
    [f"sku{i}" for i in range(40)],
    np.arange(40, dtype=np.int32)[::-1].copy(),
])
def test_ids_map_rows(device, ids, make_ties):
    users, items = make_ties(9, 40, 4, seed=27)
    idx, _, res = _search(Engine(items, ids=ids, device=device), users, 6)
    got = as_numpy(res.ids)
    assert got.shape == (9, 6)
    assert got.tolist() == np.asarray(ids)[idx].tolist()


@pytest.mark.parametrize("where", ["users", "items"])
def test_zero_vector_under_cosine(device, where, make_normal):
    users, items = make_normal(5, 10, 4, seed=28)
    if where == "users":
        users[3] = 0.0
        with pytest.raises(InputError, match=r"user_vecs.*row 3\b.*zero"):
            Engine(items, metric="cosine", device=device).search(users, 2)
    else:
        items[8] = 0.0
        with pytest.raises(InputError, match=r"item_vecs.*row 8\b.*zero"):
            Engine(items, metric="cosine", device=device)


def test_zero_vector_is_fine_under_ip_and_l2(device, make_ties):
    users, items = make_ties(4, 10, 3, seed=29)
    users[1] = 0.0
    items[2] = 0.0
    for metric in ("ip", "l2"):
        idx, val, _ = _search(Engine(items, metric=metric, device=device), users, 4)
        _assert_exact(idx, val, users, items, 4, metric)


@pytest.mark.parametrize("budget", [0, -5, 1.5, "1k", True])
def test_bad_memory_budget(device, budget, make_normal):
    _, items = make_normal(1, 10, 4, seed=30)
    with pytest.raises(InputError, match="memory_budget"):
        Engine(items, device=device, memory_budget=budget)


# ---- memory budget and tiling -------------------------------------------------------------------------------------

@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_tiny_budget_gives_identical_results(device, metric, make_ties):
    # Integer-valued data: every tiling computes the same exact scores, so a few-KB budget (many small tiles) must
    # give bit-identical results to the default.
    users, items = make_ties(70, 900, 8, seed=31)
    default = Engine(items, metric=metric, device=device)
    tiny = Engine(items, metric=metric, device=device, memory_budget=_tiny_budget(items, device, 17, 4096, metric))
    exclude = {0: [1, 2, 3], 69: list(range(0, 900, 3))}
    for k in (1, 17):
        want_idx, want_val, _ = _search(default, users, k, exclude)
        idx, val, _ = _search(tiny, users, k, exclude)
        np.testing.assert_array_equal(idx, want_idx)
        np.testing.assert_array_equal(val, want_val)
        _assert_exact(idx, val, users, items, k, metric, exclude)


@pytest.mark.parametrize("metric", METRICS)
def test_tiny_budget_float_data_matches_default(device, metric, make_clustered):
    # Different tile shapes may round the last bit of a score differently (BLAS blocks differently); on seeded data
    # with no near-ties in the top 10 the ranking must not change.
    users, items = make_clustered(40, 700, 16, seed=32)
    want_idx, want_val, _ = _search(Engine(items, metric=metric, device=device), users, 10)
    tiny = Engine(items, metric=metric, device=device, memory_budget=_tiny_budget(items, device, 10, 3000, metric))
    idx, val, _ = _search(tiny, users, 10)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_allclose(val, want_val, rtol=1e-5, atol=1e-5)
    oracle.assert_topk_close(idx, val, users, items, 10, metric)


def test_budget_of_exactly_the_smallest_tile(device, make_ties):
    # The documented floor: ResourceError only "if even one user against one item does not fit". A budget of
    # exactly that workspace must run (exactly); one byte less must raise, quoting the caller's budget and the need.
    from recall.core.tiling import TilePlan

    users, items = make_ties(5, 30, 4, seed=47)
    k = 3
    probe = Engine(items, device=device)
    # (the state of a search of this catalogue: the GPU's candidate buffers hold no more than its 30 items)
    need = TilePlan(1, 1, 1).workspace_bytes(4, k, probe.backend.state_bytes(k, probe.n_items))
    idx, val, _ = _search(Engine(items, device=device, memory_budget=need), users, k)
    _assert_exact(idx, val, users, items, k)
    with pytest.raises(ResourceError, match=rf"budget of {need - 1:,} bytes.*needs {need:,} bytes"):
        Engine(items, device=device, memory_budget=need - 1).search(users, k)


def test_budget_too_small_even_for_smallest_tile(device, make_normal):
    users, items = make_normal(3, 50, 16, seed=33)
    engine = Engine(items, device=device, memory_budget=64)
    with pytest.raises(ResourceError, match=r"64 bytes.*k=10.*dim=16.*needs [\d,]+ bytes"):
        engine.search(users, 10)
    # A ResourceError is also a MemoryError, so generic handlers catch it.
    with pytest.raises(MemoryError):
        engine.search(users, 10)


def test_non_multiple_of_tile_shapes_exact(device, make_ties):
    # 1000 users (not a multiple of any power-of-two block) x 4097 items (one past a 4096 tile).
    users, items = make_ties(1000, 4097, 6, seed=34)
    engine = Engine(items, device=device)
    idx, val, _ = _search(engine, users, 5)
    _assert_exact(idx, val, users, items, 5)


def test_non_multiple_of_tile_shapes_float(device, make_normal):
    users, items = make_normal(301, 4097, 12, seed=35)
    # The one item past the 4096 boundary is the best item for most users: a last, one-item tile must be seen.
    lean = np.ones(12, np.float32) / np.sqrt(12)
    users = users + 3.0 * lean
    items[4096] = 8.0 * lean
    idx, val, _ = _search(Engine(items, device=device), users, 4)
    oracle.assert_topk_close(idx, val, users, items, 4)
    assert np.mean(idx[:, 0] == 4096) > 0.5


@pytest.mark.parametrize("n_users", [1, 2, 255, 256, 257, 513])
def test_user_counts_around_the_block_size(device, n_users, make_ties):
    users, items = make_ties(n_users, 300, 4, seed=36)
    idx, val, _ = _search(Engine(items, device=device), users, 3)
    _assert_exact(idx, val, users, items, 3)


def test_adversarial_rising_order(device, make_normal):
    # Items sorted by rising score against the mean user: every tile beats the last, so the running threshold is
    # always stale and every tile has survivors. Still exact.
    users, items = make_normal(50, 9000, 8, seed=37)
    users = users + 2.0 * np.ones(8, np.float32)
    mean_user = users.mean(axis=0)
    items = items[np.argsort(items @ mean_user, kind="stable")]
    for budget in (None, _tiny_budget(items, device, 30, 20_000)):
        idx, val, _ = _search(Engine(items, device=device, memory_budget=budget), users, 30)
        oracle.assert_topk_close(idx, val, users, items, 30)
        assert np.median(idx[:, 0]) > 8000, "the data is not adversarial: best items should sit at the end"


def test_adversarial_rising_order_ties(device):
    # Integer scores rising with the row, in runs of equal scores: ties straddle tile boundaries.
    n = 5000
    items = np.zeros((n, 2), np.float32)
    items[:, 0] = np.arange(n) // 37
    users = np.array([[1.0, 0.0], [2.0, 0.0], [-1.0, 0.0]], np.float32)
    engine = Engine(items, device=device, memory_budget=_tiny_budget(items, device, 50, 6000))
    idx, val, _ = _search(engine, users, 50)
    _assert_exact(idx, val, users, items, 50)


# ---- results as Arrow ---------------------------------------------------------------------------------------------

def test_to_arrow_schema_and_padding_dropped(device, make_ties):
    users, items = make_ties(4, 6, 3, seed=38)
    ids = np.array([10, 11, 12, 13, 14, 15], np.int64)
    exclude = {1: [0, 1, 2, 3, 4], 2: list(range(6))}
    idx, val, res = _search(Engine(items, ids=ids, device=device), users, 8, exclude)
    table = res.to_arrow(np.array([7, 8, 9, 10]))
    assert table.column_names == ["user_id", "item_ids", "scores"]
    assert table.schema.field("item_ids").type == pa.list_(pa.int64())
    assert table.schema.field("scores").type == pa.list_(pa.float32())
    assert table.column("user_id").to_pylist() == [7, 8, 9, 10]
    item_lists = table.column("item_ids").to_pylist()
    score_lists = table.column("scores").to_pylist()
    assert [len(x) for x in item_lists] == [6, 1, 0, 6]
    for u in range(4):
        keep = idx[u] >= 0
        assert item_lists[u] == ids[idx[u][keep]].tolist()
        assert score_lists[u] == val[u][keep].tolist()
        assert all(np.isfinite(score_lists[u]))


def test_to_arrow_string_ids_and_default_user_ids(device, make_ties):
    users, items = make_ties(3, 4, 3, seed=39)
    ids = np.array(["w", "x", "y", "z"])
    idx, _, res = _search(Engine(items, ids=ids, device=device), users, 6)
    table = res.to_arrow()
    assert table.schema.field("item_ids").type == pa.list_(pa.string())
    assert table.column("user_id").to_pylist() == [0, 1, 2]
    assert table.column("item_ids").to_pylist() == [ids[r[r >= 0]].tolist() for r in idx]
    table = res.to_arrow(["u1", "u2", "u3"])
    assert table.column("user_id").to_pylist() == ["u1", "u2", "u3"]
    table = res.to_arrow(pa.array([1, 2, 3]))
    assert table.column("user_id").to_pylist() == [1, 2, 3]


@pytest.mark.parametrize("kind", ["int", "str"])
def test_to_arrow_maps_rows_through_item_ids(device, make_ties, kind):
    """An engine without ids, its rows mapped at conversion (as the Parquet jobs do): the same table as an engine
    with ids, padding dropped, for ids as NumPy arrays and as the Arrow array ``id_lookup`` makes of strings."""
    from recall.core.results import id_lookup

    users, items = make_ties(5, 6, 3, seed=41)
    ids = np.array([10, 31, 12, 53, 14, 75]) if kind == "int" else np.array(list("uvwxyz"), object)
    exclude = {1: [0, 1, 2, 3, 4], 2: list(range(6))}
    _, _, with_ids = _search(Engine(items, ids=ids, device=device), users, 8, exclude)
    _, _, rows = _search(Engine(items, device=device), users, 8, exclude)
    want = with_ids.to_arrow(np.arange(5))
    lookup = id_lookup(ids)
    assert isinstance(lookup, np.ndarray if kind == "int" else pa.Array)
    for item_ids in (lookup, ids):
        assert rows.to_arrow(np.arange(5), item_ids).equals(want)
    assert [len(x) for x in want.column("item_ids").to_pylist()] == [6, 1, 0, 6, 6]


def test_to_arrow_user_ids_length_mismatch(device, make_ties):
    users, items = make_ties(3, 4, 3, seed=40)
    _, _, res = _search(Engine(items, device=device), users, 2)
    with pytest.raises(InputError, match="2 user ids for 3"):
        res.to_arrow([1, 2])
    with pytest.raises(InputError, match="4 user ids for 3"):
        res.to_arrow(np.arange(4))
    with pytest.raises(InputError, match="one-dimensional"):
        res.to_arrow(np.arange(3).reshape(3, 1))


# ---- engine life cycle and backend choice ----------------------------------------------------------------------

def test_engine_reused_gives_same_answers(device, make_ties):
    users, items = make_ties(30, 200, 5, seed=41)
    engine = Engine(items, device=device)
    first = _search(engine, users, 9)[:2]
    # Interleave different batch sizes, k and exclusions; none may leak state into the next call.
    _search(engine, users[:3], 200, {0: [1, 2]})
    _search(engine, users[::-1].copy(), 1)
    _search(engine, np.zeros((0, 5), np.float32), 4)
    again = _search(engine, users, 9)[:2]
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    part_idx, part_val, _ = _search(engine, users[10:20], 9)
    np.testing.assert_array_equal(part_idx, first[0][10:20])
    np.testing.assert_array_equal(part_val, first[1][10:20])
    _assert_exact(*first, users, items, 9)


def test_engine_is_isolated_from_later_changes_to_the_callers_arrays(device, make_ties):
    # "The engine keeps the item matrix prepared once": a caller that reuses its buffer after building the engine
    # (a feature pipeline refilling it) must not change, or invalidate, the engine's items.
    users, items = make_ties(6, 30, 4, seed=42)
    original = items.copy()
    ids = np.arange(30, dtype=np.int64) + 500
    engine = Engine(items, ids=ids, device=device)
    items[:] = np.nan
    ids[:] = 0
    idx, val, res = _search(engine, users, 5)
    _assert_exact(idx, val, users, original, 5)
    np.testing.assert_array_equal(as_numpy(res.ids), idx + 500)


def test_results_are_numpy_for_numpy_users(device, make_ties):
    users, items = make_ties(3, 10, 4, seed=43)
    res = Engine(items, device=device).search(users, 2)
    assert isinstance(res.indices, np.ndarray) and isinstance(res.scores, np.ndarray)


def test_engine_reports_its_device(device, make_normal):
    _, items = make_normal(1, 10, 4, seed=44)
    assert Engine(items, device=device).device == device


def test_gpu_without_gpu_raises_backend_unavailable(gpu_available, make_normal):
    if gpu_available:
        pytest.skip("a usable GPU is present")
    from recall.backends import cuda_status

    _, items = make_normal(1, 10, 4, seed=45)
    with pytest.raises(BackendUnavailable) as info:
        Engine(items, device="gpu")
    assert cuda_status()[1] in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_auto_falls_back_to_cpu(gpu_available, make_ties):
    if gpu_available:
        pytest.skip("a usable GPU is present: auto picks it")
    users, items = make_ties(5, 20, 3, seed=46)
    engine = Engine(items, device="auto")
    assert engine.device == "cpu"
    idx, val, _ = _search(engine, users, 4)
    _assert_exact(idx, val, users, items, 4)


# ---- properties ---------------------------------------------------------------------------------------------------

@st.composite
def _problems(draw, integer: bool):
    n_users = draw(st.integers(0, 9))
    n_items = draw(st.integers(1, 60))
    dim = draw(st.integers(1, 6))
    k = draw(st.integers(1, 70))
    metric = draw(st.sampled_from(["ip", "l2"] if integer else METRICS))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if integer:
        users = rng.integers(-2, 3, (n_users, dim)).astype(np.float32)
        items = rng.integers(-2, 3, (n_items, dim)).astype(np.float32)
    else:
        users = rng.standard_normal((n_users, dim)).astype(np.float32)
        items = (rng.standard_normal((n_items, dim)) * rng.lognormal(0, 1, (n_items, 1))).astype(np.float32)
    exclude = None
    if n_users and draw(st.booleans()):
        exclude = {u: draw(st.lists(st.integers(0, n_items - 1), max_size=n_items + 3))
                   for u in draw(st.sets(st.integers(0, n_users - 1)))}
        if draw(st.booleans()):  # as CSR instead
            indptr = np.zeros(n_users + 1, np.int64)
            for u in range(n_users):
                indptr[u + 1] = indptr[u] + len(exclude.get(u, []))
            rows = np.array([r for u in range(n_users) for r in exclude.get(u, [])], dtype=np.int64)
            exclude = (indptr, rows)
    budget_extra = draw(st.one_of(st.none(), st.integers(0, 8 * n_items * 4)))
    return users, items, k, metric, exclude, budget_extra


def _small_budget(engine: Engine, k: int, extra: int) -> int:
    """A budget a few times the smallest workspace (one user against one item; l2 adds up to 4 columns), from the
    backend's own state size so the property runs on either backend: small enough to force many user blocks and,
    for small k, narrow item tiles. (The exact floor is test_budget_of_exactly_the_smallest_tile's business.)"""
    return 8 * (4 + 4 * (engine.dim + 4) + engine.backend.state_bytes(min(k, engine.n_items))) + extra


def _check_sorted_unique(idx, val):
    finite = idx >= 0
    # Padding only at the end of a row, best first, no item twice.
    assert np.all(finite[:, 1:] <= finite[:, :-1])
    assert np.all(np.isneginf(val[~finite]))
    with np.errstate(invalid="ignore"):
        assert np.all((val[:, 1:] <= val[:, :-1]) | ~finite[:, 1:])
    for row in idx:
        kept = row[row >= 0]
        assert np.unique(kept).size == kept.size


def _problem_engine(items, metric, device, k, budget_extra):
    """The engine a property test searches with: the default budget, or one just above the smallest tile."""
    engine = Engine(items, metric=metric, device=device)
    if budget_extra is None:
        return engine
    return Engine(items, metric=metric, device=device, memory_budget=_small_budget(engine, k, budget_extra))


@given(problem=_problems(integer=True))
@settings(max_examples=100)
def test_property_exact_on_integer_data(device, problem):
    users, items, k, metric, exclude, budget_extra = problem
    idx, val, _ = _search(_problem_engine(items, metric, device, k, budget_extra), users, k, exclude)
    _check_sorted_unique(idx, val)
    _assert_exact(idx, val, users, items, k, metric, exclude)
    # Ties within a row are in increasing item order.
    same = (val[:, 1:] == val[:, :-1]) & (idx[:, 1:] >= 0)
    assert np.all(idx[:, 1:][same] > idx[:, :-1][same])


@given(problem=_problems(integer=False))
@settings(max_examples=100)
def test_property_float_data_matches_oracle(device, problem):
    users, items, k, metric, exclude, budget_extra = problem
    idx, val, _ = _search(_problem_engine(items, metric, device, k, budget_extra), users, k, exclude)
    _check_sorted_unique(idx, val)
    oracle.assert_topk_close(idx, val, users, items, k, metric, exclude)
    if users.shape[0]:
        scale = oracle.score_scale(users, items, metric).max()
        assert oracle.recall_at_k(idx, users, items, k, metric, exclude, atol=4e-4 * scale) == 1.0


@pytest.mark.parametrize("metric", METRICS)
def test_search_async_equals_search_with_several_queued(device, metric, make_normal):
    # Several searches started before any result is asked for, in another order than they were started; padding
    # (k beyond the catalogue for the last one), exclusions and every metric's score conversion.
    users, items = make_normal(300, 500, 16)
    engine = Engine(items, metric=metric, device=device)
    parts = [(users[:120], 30, {0: [1, 2, 3]}), (users[120:121], 7, None), (users[121:], 600, {5: list(range(400))})]
    pending = [engine.search_async(u, k, exclude=ex) for u, k, ex in parts]
    for (u, k, ex), p in reversed(list(zip(parts, pending))):
        got, want = p.result(), engine.search(u, k, exclude=ex)
        np.testing.assert_array_equal(as_numpy(got.indices), as_numpy(want.indices))
        np.testing.assert_array_equal(as_numpy(got.scores), as_numpy(want.scores))
        assert p.result() is p.result()
    with pytest.raises(InputError, match="k must be"):
        engine.search_async(users, 0)


def test_an_l2_centre_beyond_float32_is_refused_naming_it(device, make_normal):
    _, items = make_normal(1, 6, 4, seed=25)
    with pytest.raises(InputError, match="l2_centre: coordinate 0 is beyond the float32 range"):
        Engine(items, metric="l2", device=device, l2_centre=np.full(4, 1e39))


def test_norms_measured_from_the_l2_centre_say_so(device):
    # An explicit centre far from the data: the norms that overflow are the vectors' distances from it, and the
    # message says so (it named a norm the caller's vectors do not have).
    items = np.random.default_rng(3).standard_normal((50, 4)).astype(np.float32)
    with pytest.raises(InputError, match=r"item_vecs: row \d+ has norm 2e\+20 from the l2 centre \(whose own norm is "
                                         r"2e\+20\)"):
        Engine(items, metric="l2", device=device, l2_centre=np.full(4, 1e20))
    engine = Engine(np.full((50, 4), 1e18, np.float32), metric="l2", device=device)
    assert engine.l2_centre is not None
    with pytest.raises(InputError, match=r"user_vecs: row 0 has norm 2\.2e\+19 and the largest item norm is 0 from the "
                                         r"l2 centre"):
        engine.search(np.full((1, 4), -1e19, np.float32), 3)
