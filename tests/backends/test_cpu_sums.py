"""The CPU's scores are one float32 sum per (user, item), wherever it is computed: identical items score alike and
tie by row (the lower first), a search of one user scores as a search of many, and the re-scoring's scores are the
search's, whatever the lists' lengths and the batches they are cut into. BLAS's matrix-vector and small-matrix
kernels sum in an order that depends on the item's place in the product; the backend leaves those products to the
ordered kernel (``recall.backends.numpy.ordered``), whose sums are the blocked kernels' (and the GPU's fused
kernel's): every dimension in order, one FMA each."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from recall import Engine
from threadpoolctl import threadpool_limits

from recall import EngineOptions
from recall.backends.numpy import backend as numpy_backend
from recall.backends.numpy import ordered
from recall.backends.numpy.backend import SMALL_PRODUCT, NumpyBackend
from recall.backends.numpy.ordered import ordered_dots, ordered_products

METRICS = ["ip", "cosine", "l2"]


def _duplicated(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    """2n items: row r + n a copy of row r."""
    base = rng.standard_normal((n, dim)).astype(np.float32)
    return np.concatenate([base, base])


def _copies_follow_originals(indices: np.ndarray, scores: np.ndarray, n: int) -> None:
    """In every list, row r + n (a copy of row r) has row r's score and comes right after it or later."""
    for idx, val in zip(indices, scores):
        where = {int(r): j for j, r in enumerate(idx) if r >= 0}
        for r, j in where.items():
            if r < n and r + n in where:
                assert val[j] == val[where[r + n]], (r, val[j], val[where[r + n]])
                assert j < where[r + n], (r, j, where[r + n])


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("n_items", [21, 300, 40_000])
@pytest.mark.parametrize("n_users", [1, 2, 5, 64])
def test_identical_items_score_alike_and_tie_by_row(metric, n_items, n_users):
    rng = np.random.default_rng(n_items + n_users)
    items = _duplicated(rng, n_items, 32)
    users = rng.standard_normal((n_users, 32)).astype(np.float32)
    engine = Engine(items, metric=metric, device="cpu")
    res = engine.search(users, min(60, 2 * n_items))
    _copies_follow_originals(res.indices, res.scores, n_items)
    # k cutting between a row and its copy keeps the row.
    first = res.indices[:, :1]
    cut = engine.search(users, int((res.indices[0] < n_items).sum()))
    assert np.isin(first, cut.indices).all()


@pytest.mark.parametrize("metric", METRICS)
def test_one_user_scores_as_in_a_block_of_many(metric):
    rng = np.random.default_rng(3)
    items = rng.standard_normal((20_000, 48)).astype(np.float32)
    users = rng.standard_normal((40, 48)).astype(np.float32)
    engine = Engine(items, metric=metric, device="cpu")
    many = engine.search(users, 50)
    for u in (0, 17, 39):
        one = engine.search(users[u:u + 1], 50)
        np.testing.assert_array_equal(one.indices[0], many.indices[u])
        np.testing.assert_array_equal(one.scores[0], many.scores[u])


@pytest.mark.parametrize("metric", METRICS)
def test_rescore_scores_are_the_search_scores_whatever_the_batch(metric):
    rng = np.random.default_rng(5)
    n = 600
    items = _duplicated(rng, n, 24)
    users = rng.standard_normal((30, 24)).astype(np.float32)
    engine = Engine(items, metric=metric, device="cpu")
    lists = [rng.choice(2 * n, int(rng.integers(1, 400)), replace=False) for _ in range(30)]
    whole = engine.rescore(users, lists, 40)
    _copies_follow_originals(whole.indices, whole.scores, n)
    for lo, hi in ((0, 1), (3, 4), (5, 17), (17, 30)):  # other batches: other padded blocks
        part = engine.rescore(users[lo:hi], lists[lo:hi], 40)
        np.testing.assert_array_equal(part.indices, whole.indices[lo:hi])
        np.testing.assert_array_equal(part.scores, whole.scores[lo:hi])
    # Each re-scored item's score is the one a search gives it.
    full = engine.search(users, 2 * n)
    for u in range(30):
        search_score = dict(zip(full.indices[u].tolist(), full.scores[u].tolist()))
        for r, s in zip(whole.indices[u], whole.scores[u]):
            if r >= 0:
                assert search_score[int(r)] == s


def test_ordered_products_broadcast_users_are_the_fma_chain():
    rng = np.random.default_rng(9)
    users = (rng.standard_normal((1, 3, 19)) * np.exp2(rng.integers(-6, 6, (1, 3, 19)))).astype(np.float32)
    items = (rng.standard_normal((2, 13, 19)) * np.exp2(rng.integers(-6, 6, (2, 13, 19)))).astype(np.float32)
    out = np.empty((2, 3, 13), np.float32)
    ordered_products(users, items, out)
    for t in range(2):
        np.testing.assert_array_equal(out[t], ordered_dots(users[0], np.broadcast_to(items[t], (3, 13, 19))))


@pytest.mark.parametrize("n, w, dim", [(4, 64, 1), (6, 1500, 7), (9, 2049, 33), (5, 64, 130)])
def test_four_rows_at_a_time_are_the_fma_chains(n, w, dim):
    # ordered_products' blocks of four rows (items transposed, ROW_BLOCK_ITEMS a scratch row, the compiler's vector
    # FMAs) against each row's chains alone: the rows past the last four, items past a block, values of many
    # exponents, products that cancel to zero.
    rng = np.random.default_rng(n + w + dim)
    users = (rng.standard_normal((2, n, dim)) * np.exp2(rng.integers(-20, 20, (2, n, dim)))).astype(np.float32)
    items = (rng.standard_normal((2, w, dim)) * np.exp2(rng.integers(-20, 20, (2, w, dim)))).astype(np.float32)
    items[:, 3] = 0
    users[:, 1] = -users[:, 0]
    out = np.empty((2, n, w), np.float32)
    ordered_products(users, items, out)
    for t in range(2):
        want = ordered_dots(users[t], np.broadcast_to(items[t], (n, w, dim)))
        np.testing.assert_array_equal(out[t], want)
        assert not np.signbit(out[t][want == 0]).any()  # a chain from +0 never ends at -0


@pytest.mark.parametrize("shape", [(1, 42, 16), (2, 42, 32), (3, 1000, 64), (64, 4096, 64), (16, 8192, 130)])
def test_every_product_is_the_ordered_sum(shape):
    # Small products are the ordered kernel's by construction; larger ones BLAS's blocked kernels, which add the
    # dimensions in order, one FMA each (OpenBLAS on x86): a BLAS that sums otherwise fails here.
    n, w, dim = shape
    rng = np.random.default_rng(n * w + dim)
    users = rng.standard_normal((1, n, dim)).astype(np.float32)
    items = rng.standard_normal((3, w, dim)).astype(np.float32)
    out = np.empty((3, n, w), np.float32)
    NumpyBackend().gemm_strided_batched(users, items, out)
    want = np.stack([ordered_dots(users[0], np.broadcast_to(items[t], (n, w, dim))) for t in range(3)])
    assert (max(n, 2) * w * dim <= SMALL_PRODUCT) or n * w * dim > 1 << 20  # both routes are covered
    np.testing.assert_array_equal(out, want)


def test_ties_on_duplicates_match_the_oracle_tie_rule():
    rng = np.random.default_rng(11)
    items = _duplicated(rng, 21, 16)
    users = rng.standard_normal((1, 16)).astype(np.float32)
    res = Engine(items, device="cpu").search(users, 21)
    want, _ = oracle.topk(users, items, 21, "ip")
    np.testing.assert_array_equal(res.indices, want)


def test_one_user_search_is_certified_or_searched_again_with_the_ordered_sums():
    rng = np.random.default_rng(13)
    items = rng.standard_normal((30_000, 40)).astype(np.float32)
    user = rng.standard_normal((1, 40)).astype(np.float32)
    engine = Engine(items, device="cpu")
    res = engine.search(user, 25)
    assert engine.stats["one_user"] == "certified"
    want, _ = oracle.topk(user, items, 25, "ip")
    np.testing.assert_array_equal(res.indices, want)
    # 100 more copies of the user's best item, spread over the catalogue: the 25 + 16 kept all score alike, no bound
    # separates them from the copies left out, and the user is searched again: the 25 lowest rows of the copies.
    best = items[int(want[0, 0])].copy()
    where = np.union1d(rng.choice(30_000, 100, replace=False), want[0, :1])  # the best item among its copies
    items[where] = best
    engine = Engine(items, device="cpu")
    res = engine.search(user, 25)
    assert engine.stats["one_user"] == "ordered"
    np.testing.assert_array_equal(res.indices[0], where[:25])
    assert (res.scores[0] == res.scores[0, 0]).all()


def _blocked(users: np.ndarray, items: np.ndarray) -> np.ndarray:
    """users (n, D) @ items (w, D).T as one product of BLAS's blocked kernels at one thread (rows repeated up to a
    product no other kernel takes)."""
    n, w, dim = users.shape[0], items.shape[0], users.shape[1]
    reps = -(-ordered.blocked_rows(n, max(w, 2), dim) // n)
    wide = np.concatenate([items, np.zeros((max(0, 2 - w), dim), np.float32)])  # one column: NumPy's matrix-vector
    with threadpool_limits(1, "blas"):
        return np.matmul(np.concatenate([users] * reps), wide.T)[:n, :w]


@pytest.mark.parametrize("dim", [300, 448, 449, 700])
@pytest.mark.parametrize("shape", [(1, 300), (2, 64), (17, 64), (35, 32), (128, 8), (40, 100), (64, 1), (600, 300)])
def test_every_product_is_the_cpu_score_whatever_its_shape(dim, shape):
    # OpenBLAS takes products of up to 1,200 scores (rows x items) and 10^6 multiply-adds to small-matrix kernels
    # whose sums are not the blocked kernels' (17 users x 64 items x 300 dimensions among them), and sums products
    # deeper than its panels panel by panel (448 dimensions here): every product is the ordered sums up to the probed
    # depth, and BLAS's blocked sums at one thread beyond, whatever its rows and items.
    n, w = shape
    rng = np.random.default_rng(n * w + dim)
    users = (rng.standard_normal((n, dim)) * np.exp2(rng.integers(-6, 6, (n, dim)))).astype(np.float32)
    items = rng.standard_normal((w, dim)).astype(np.float32)
    out = np.empty((1, n, w), np.float32)
    NumpyBackend().gemm_strided_batched(users[None], items[None], out)
    if numpy_backend.blas_summation(dim) != "blocked":
        want = ordered_dots(users, np.broadcast_to(items, (n, w, dim)))
    else:
        want = _blocked(users, items)
    np.testing.assert_array_equal(out[0], want)


_MATMUL = np.matmul  # (the tests below replace NumPy's while they run)


def _reversed_sums(users, items_t):
    """users @ items_t with every score summed from the last dimension to the first: another order, the same for every
    place in the product."""
    out = np.zeros(users.shape[:-1] + items_t.shape[-1:], np.float32)
    for d in range(users.shape[-1] - 1, -1, -1):
        out = ordered.fma32(users[..., d:d + 1], items_t[..., d:d + 1, :], out)
    return out


def _placed_sums(users, items_t):
    """The ordered sums but for every third item of every row, reversed: an order that depends on the place."""
    out = _MATMUL(users, items_t)
    rev = _reversed_sums(users, items_t)
    out[..., ::3] = rev[..., ::3]
    return out


@pytest.mark.parametrize("blas, want", [(None, None), (_reversed_sums, "blocked"), (_placed_sums, "placed")])
def test_blas_sums_tells_how_blas_sums(monkeypatch, blas, want):
    # The probe against BLASes of each kind: this machine's (its blocked kernels are the ordered sums at d = 4 on
    # every x86 kernel seen: a product of 4 dimensions in order is one FMA chain), one summing in another order
    # everywhere, one whose order depends on the place.
    if blas is None:
        with threadpool_limits(1, "blas"):
            assert ordered.blas_sums(4) == "ordered"
        return
    def matmul(a, b, out=None):
        got = blas(a, b) if a.ndim >= 2 and b.ndim >= 2 and a.shape[-2] > 1 else _MATMUL(a, b)
        if out is None:
            return got
        out[...] = got
        return out

    monkeypatch.setattr(ordered.np, "matmul", matmul)
    for dim in (8, 64, 300):
        assert ordered.blas_sums(dim) == want, dim


@pytest.mark.parametrize("metric", METRICS)
def test_scores_are_one_sum_where_blas_sums_by_place(monkeypatch, metric):
    # Where BLAS's sums depend on the place (OpenBLAS's Haswell kernels on an AMD EPYC: 18 tests of this file failed
    # there before the probe), every product is the ordered kernel's: identical items score alike and tie by row, a
    # user alone scores as in a block, the re-scoring's scores are the search's. Forced here for every dimension.
    monkeypatch.setattr(numpy_backend, "_blas_sums", {d: "placed" for d in range(1, 4096)})
    rng = np.random.default_rng(21)
    items = _duplicated(rng, 3000, 48)
    users = rng.standard_normal((64, 48)).astype(np.float32)
    out = np.empty((1, 64, 6000), np.float32)  # 18M multiply-adds: BLAS's, where it sums in order
    NumpyBackend().gemm_strided_batched(users[None], items[None], out)
    np.testing.assert_array_equal(out[0], ordered_dots(users, np.broadcast_to(items, (64, 6000, 48))))
    engine = Engine(items, metric=metric, device="cpu")
    block = engine.search(users, 60)
    _copies_follow_originals(block.indices, block.scores, 3000)
    alone = engine.search(users[5:6], 60)
    np.testing.assert_array_equal(alone.indices[0], block.indices[5])
    np.testing.assert_array_equal(alone.scores[0], block.scores[5])
    again = engine.rescore(users, [block.indices[u][::-1] for u in range(64)], 60)
    for u in range(64):
        score = dict(zip(block.indices[u].tolist(), block.scores[u].tolist()))
        for r, v in zip(again.indices[u], again.scores[u]):
            assert score[int(r)] == v


def test_blas_first_pass_where_blas_sums_by_place(monkeypatch):
    # Where BLAS sums by place, a search of many users (of a catalogue of at least BLAS_FIRST_MIN_ITEMS, at k up to
    # BLAS_FIRST_MAX_K) takes BLAS's products first, keeps 16 more than k, re-scores
    # them with the ordered sums and searches again the users no bound certifies (101 copies of one item: its
    # fans' lists tie past the kept ones): every list the ordered sums' own top k, ties to the lower row, with
    # exclusions and a shared filter.
    from recall.core import keys

    monkeypatch.setattr(numpy_backend, "_blas_sums", {d: "placed" for d in range(1, 4096)})
    rng = np.random.default_rng(23)
    items = rng.standard_normal((20_000, 40)).astype(np.float32)
    items[4000:4100] = items[0]
    users = rng.standard_normal((300, 40)).astype(np.float32)
    users[:40] = items[0] + 0.01 * users[:40]  # these users' best items: item 0 and its copies
    exclude = {u: rng.choice(20_000, 50, replace=False).tolist() for u in range(0, 300, 7)}
    deny = np.arange(2500, 2600)
    engine = Engine(items, device="cpu")
    res = engine.search(users, 30, exclude=exclude, deny=deny)
    assert 40 <= engine.stats["blas_searched_again"] < 100, engine.stats
    full = np.empty((1, 300, 20_000), np.float32)
    ordered_products(users[None], items[None], full)
    full = full[0]
    for u, rows in exclude.items():
        full[u, rows] = -np.inf
    full[:, deny] = -np.inf
    want_vals, want_rows = keys.select(np, full, np.broadcast_to(np.arange(20_000), full.shape).copy(), 30)
    np.testing.assert_array_equal(res.indices, want_rows)
    np.testing.assert_array_equal(res.scores, want_vals)


@settings(max_examples=15, deadline=None)
@given(n_users=st.sampled_from([2, 5, 40, 700]), dim=st.integers(1, 24), k=st.integers(1, 60),
       copies=st.integers(0, 80), excluded=st.integers(0, 40), sampled=st.sampled_from([None, "estimate", "too-high"]),
       seed=st.integers(0, 2 ** 16))
def test_blas_first_is_the_ordered_sums_top_k(monkeypatch, n_users, dim, k, copies, excluded, sampled, seed):
    # Any shape, k, run of copies of one item (half the users near it: their lists tie past what the first pass
    # keeps), exclusions, a threshold sample started at an estimate (EngineOptions.seed_sample; "too-high": ranked
    # far below the estimate's rule, so that many users start above their best and hold too few) or none, BLAS
    # summing by place: every list is the ordered sums' own top k (ties to the lower row), whether the bound
    # certified its user or it was searched again.
    from recall.core import keys

    monkeypatch.setattr(numpy_backend, "_blas_sums", {d: "placed" for d in range(1, 64)})
    rng = np.random.default_rng(seed)
    n_items = numpy_backend.BLAS_FIRST_MIN_ITEMS
    items = (rng.standard_normal((n_items, dim)) * rng.choice([1.0, 1e-3, 1e3], (n_items, 1))).astype(np.float32)
    items[0] *= np.float32(1e3)
    items[rng.choice(np.arange(1, n_items), copies, replace=False)] = items[0]
    users = rng.standard_normal((n_users, dim)).astype(np.float32)
    users[: n_users // 2] += items[0] / np.float32(1e3)
    exclude = {u: rng.choice(n_items, excluded, replace=False).tolist() for u in range(0, n_users, 3)}
    # (The CPU samples from k = SEED_MIN_K, above BLAS_FIRST_MAX_K: lowered so that this path runs, where the users
    # are enough for blocks over the whole catalogue: 700.)
    if sampled:
        monkeypatch.setattr(numpy_backend, "SEED_MIN_K", 1)
    if sampled == "too-high":
        monkeypatch.setattr(numpy_backend, "ESTIMATE_SIGMAS", -3)
    engine = Engine(items, device="cpu", options=EngineOptions(seed_sample=2048 if sampled else 0))
    res = engine.search(users, k, exclude=exclude)
    assert "blas_searched_again" in engine.stats
    full = np.empty((1, n_users, n_items), np.float32)
    ordered_products(users[None], items[None], full)
    full = full[0]
    for u, rows in exclude.items():
        full[u, rows] = -np.inf
    want_vals, want_rows = keys.select(np, full, np.broadcast_to(np.arange(n_items), full.shape).copy(), k)
    np.testing.assert_array_equal(res.indices, want_rows)
    np.testing.assert_array_equal(res.scores, want_vals)


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("dim", [520, 1025])
def test_wide_rows_score_alike_in_a_block_alone_rescored_and_certified(metric, dim):
    # Rows deeper than BLAS's panels: a block's scores (BLAS's panel sums), a user searched alone (the
    # matrix-vector kernel re-scored), the re-scoring, the certified route and another tiling all give every item
    # the same float32 score (before, only the first: 28 of 64 users' top 5 changed with the tiling at d = 512).
    rng = np.random.default_rng(dim)
    base = rng.standard_normal((1, dim)).astype(np.float32)
    items = (base + 1e-3 * rng.standard_normal((300, dim))).astype(np.float32)
    users = rng.standard_normal((40, dim)).astype(np.float32)
    engine = Engine(items, metric=metric, device="cpu")
    block = engine.search(users, 20)
    for other in (Engine(items, metric=metric, device="cpu", options=EngineOptions(certified_exact="on")),
                  Engine(items, metric=metric, device="cpu", options=EngineOptions(tiles=(7, 33, 1)))):
        res = other.search(users, 20)
        np.testing.assert_array_equal(res.indices, block.indices)
        np.testing.assert_array_equal(res.scores, block.scores)
    for u in (0, 13, 39):
        alone = engine.search(users[u:u + 1], 20)
        np.testing.assert_array_equal(alone.indices[0], block.indices[u])
        np.testing.assert_array_equal(alone.scores[0], block.scores[u])
    again = engine.rescore(users, [rng.permutation(300)[:150] for _ in range(40)], 300)
    full = engine.search(users, 300)
    for u in range(40):
        score = dict(zip(full.indices[u].tolist(), full.scores[u].tolist()))
        for r, v in zip(again.indices[u], again.scores[u]):
            if r >= 0:
                assert score[int(r)] == v
