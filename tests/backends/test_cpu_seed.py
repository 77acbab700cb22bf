"""The CPU backend's threshold sample (k >= ``SEED_MIN_K``): ``heap.seed_buffers`` against a float64 model of what it
must return, ``heap.seed_heaps``, the size rule, and seeded searches (heaps and buffers) against unseeded ones,
exclusions and ties included."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recall import Engine, EngineOptions
from recall.backends.numpy import heap
from recall.backends.numpy.backend import SEED_MIN_K, seed_size


def _lowered(scores, norms, unorms, a, z):
    return scores.astype(np.float64) - (a * unorms[:, None] * norms[None, :] + z)


def _check(scores, rows, norms, unorms, a, z, k, sets):
    """seed_buffers' thresholds: below the k-th best of each user's lowered, non-excluded sampled scores, and no
    further below it than 2^8 float32 steps (its radix bucket); -inf where fewer than k are left."""
    n, size = scores.shape
    indptr = np.zeros(n + 1, np.int64)
    indptr[1:] = np.cumsum([len(s) for s in sets])
    items = np.array([r for s in sets for r in sorted(s)], np.int64)
    thr = np.full(n, 7.0, np.float32)
    heap.seed_buffers(scores, rows, norms, unorms, a, z, k, indptr, items, thr)
    low = _lowered(scores, norms, unorms, a, z)
    for u in range(n):
        keep = ~np.isin(rows, list(sets[u]))
        vals = np.sort(low[u, keep])[::-1]
        if vals.size < k:
            assert thr[u] == -np.inf
            continue
        kth = vals[k - 1]
        assert np.float64(thr[u]) < kth  # strictly: a score equal to the k-th best passes `score > thr`
        # Within the bucket: at most 2^8 float32 steps (plus the rounding down and one step) below the k-th best.
        steps = abs(int(np.float32(kth).view(np.int32)) - int(thr[u].view(np.int32)))
        assert steps <= (1 << 8) + 4 or np.sign(kth) != np.sign(thr[u])
    return thr


@pytest.mark.parametrize("k", [1, 5, 64, 200])
def test_seed_thresholds_bracket_the_kth_best(k):
    rng = np.random.default_rng(k)
    n, size = 40, 256
    scores = (rng.standard_normal((n, size)) * np.exp(rng.standard_normal((n, 1)))).astype(np.float32)
    scores[3] = 1.5  # every score tied
    scores[4, :] = -scores[4, :] ** 2  # all negative
    rows = np.sort(rng.choice(10_000, size, replace=False)).astype(np.int64)
    norms = np.exp(rng.standard_normal(size))
    unorms = np.exp(rng.standard_normal(n))
    sets = [set() for _ in range(n)]
    sets[1] = set(rows[:size - k + 1].tolist())  # k - 1 sampled items left: no seed
    sets[2] = set(rows[::3].tolist()) | {int(rows[0]) + 1, 10_001}  # some sampled, some not sampled
    sets[5] = set(rows[-k:].tolist())
    thr = _check(scores, rows, norms, unorms, 1e-6, 1e-30, k, sets)
    assert thr[1] == -np.inf and np.isfinite(thr[0]) and np.isfinite(thr[3])


def test_seed_margin_lowers_the_threshold():
    scores = np.full((1, 100), 2.0, np.float32)
    rows = np.arange(100, dtype=np.int64)
    thr = _check(scores, rows, np.ones(100), np.ones(1), 0.0, 0.0, 10, [set()])
    wide = _check(scores, rows, np.ones(100), np.ones(1), 1e-3, 0.0, 10, [set()])
    assert thr[0] < 2.0 and wide[0] < 2.0 - 1e-3 < thr[0]


def test_seed_threshold_below_a_kth_best_on_a_bucket_edge():
    """A k-th best lowered score whose key is a radix bucket's lowest (its last 8 bits 0): the threshold is still
    strictly below it, so that the items of that score pass the strict test."""
    edge = np.array([0x3F7FFF00], np.uint32).view(np.float32)[0]
    step = np.float32(2.0 ** -24)
    # The score whose lowering (the kernel's rounding from below, margin 0) lands on the edge.
    score = next(x for x in (edge + i * step for i in range(1, 8))
                 if np.float32(np.float64(x) - (abs(np.float64(x)) * 2.0 ** -23 + 2.0 ** -149)) == edge)
    scores = np.full((1, 50), score, np.float32)
    thr = _check(scores, np.arange(50, dtype=np.int64), np.ones(50), np.ones(1), 0.0, 0.0, 1, [set()])
    assert thr[0] < edge


@settings(max_examples=40)
@given(st.integers(0, 2**32 - 1), st.integers(1, 64), st.sampled_from(["normal", "ties", "tiny", "signs"]))
def test_property_seed_thresholds(seed, k, kind):
    rng = np.random.default_rng(seed)
    n, size = 6, int(rng.integers(k, 200))
    if kind == "ties":
        scores = rng.integers(-2, 3, (n, size)).astype(np.float32)
    elif kind == "tiny":
        scores = (rng.standard_normal((n, size)) * 1e-42).astype(np.float32)  # subnormals
    elif kind == "signs":
        scores = (rng.choice([-1.0, 1.0], (n, size)) * rng.random((n, size)) * 1e-30).astype(np.float32)
    else:
        scores = rng.standard_normal((n, size)).astype(np.float32)
    rows = np.sort(rng.choice(5 * size, size, replace=False)).astype(np.int64)
    sets = [set(rng.choice(5 * size, int(rng.integers(0, size)), replace=False).tolist()) for _ in range(n)]
    _check(scores, rows, rng.random(size), rng.random(n), float(rng.choice([0.0, 1e-7])), 2.0 ** -149, k, sets)


def test_seeded_heap_keeps_items_above_the_seed_and_pads_the_rest():
    """A heap filled with keys of its seed's score: only items above the seed enter, the root (the threshold) never
    falls below the seed, and slots no item took come out as padding."""
    keys, thr = heap.new_heaps(2, 4)
    thr[:] = [0.5, -np.inf]
    heap.seed_heaps(keys, thr)
    scores = np.array([[[0.1, 0.9, 0.5, 0.7, 0.2, 0.6]], [[0.1, 0.9, 0.5, 0.7, 0.2, 0.6]]], np.float32)
    scores = scores.reshape(1, 2, 6)
    none = np.zeros(3, np.int64), np.zeros(0, np.int64)
    heap.heap_update(scores, 0, 6, keys, thr, *none)
    vals = np.empty((2, 4), np.float32)
    rows = np.empty((2, 4), np.int64)
    heap.heap_sort_rows(keys, vals, rows)
    np.testing.assert_array_equal(rows[0], [1, 3, 5, -1])  # 0.5 itself is not above the seed
    np.testing.assert_array_equal(vals[0], np.array([0.9, 0.7, 0.6, -np.inf], np.float32))
    assert thr[0] == 0.5
    np.testing.assert_array_equal(rows[1], [1, 3, 5, 2])  # unseeded: the usual top 4


def test_seed_size_rule():
    assert seed_size(100_000, 100) == 0 and seed_size(100_000, SEED_MIN_K - 1) == 0  # small k: not seeded
    assert seed_size(100_000, 300) == 4096  # a heap
    assert seed_size(100_000, 1000) == 8192
    assert seed_size(100_000, 2048) == 8192  # an eighth of the catalogue, still 4 k
    assert seed_size(100_000, 4096) == 16384 and seed_size(100_000, 8192) == 32768  # 4 k, up to a third
    assert seed_size(90_000, 8192) == 0 and seed_size(40_000, 4096) == 0
    assert seed_size(1_000_000, 8192) == 65536
    assert seed_size(100_000, 1000, seeded=False) == 0
    assert seed_size(100_000, 1000, requested=4096) == 4096
    assert seed_size(100_000, 1000, requested=1024) == 0  # under 2 k
    assert seed_size(6000, 1000, requested=4096) == 0  # under twice it


def _pairs(lists):
    """Per-user exclusion lists (sorted item rows) as the (indptr, items) CSR a search takes."""
    indptr = np.zeros(len(lists) + 1, np.int64)
    indptr[1:] = np.cumsum([len(x) for x in lists])
    return indptr, np.concatenate(lists).astype(np.int64)


def _engines(items, metric="ip"):
    return (Engine(items, device="cpu", metric=metric),
            Engine(items, device="cpu", metric=metric, options=EngineOptions(seed_thresholds=False)))


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
@pytest.mark.parametrize("kind", ["float", "ints"])
@pytest.mark.parametrize("k", [300, 700])  # a heap, a buffer
def test_seeded_search_equals_unseeded(metric, kind, k):
    rng = np.random.default_rng(11)
    n_items, dim = 70_000, 8
    if kind == "ints":  # many exact ties: equal scores go to the lower row, seeded or not
        items = rng.integers(-2, 3, (n_items, dim)).astype(np.float32)
        users = rng.integers(-2, 3, (300, dim)).astype(np.float32)
        users[users.sum(axis=1) == 0, 0] = 1.0
        items[np.abs(items).sum(axis=1) == 0, 0] = 1.0
    else:
        items = (rng.standard_normal((n_items, dim)) * np.exp(rng.standard_normal((n_items, 1)))).astype(np.float32)
        users = rng.standard_normal((300, dim)).astype(np.float32)
    seeded, plain = _engines(items, metric=metric)
    a, b = seeded.search(users, k), plain.search(users, k)
    assert seeded.stats["seed_sample"] == seed_size(n_items, k) > 0 and plain.stats["seed_sample"] == 0
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.scores, b.scores)


@pytest.mark.parametrize("kind", ["float", "ints"])
def test_seeded_search_where_k_is_large_for_the_catalogue(kind):
    """k = 1,000 of 13,000 items: a sample of 4,096 items, a third of the catalogue."""
    rng = np.random.default_rng(15)
    if kind == "ints":
        items = rng.integers(-2, 3, (13_000, 5)).astype(np.float32)
        users = rng.integers(-2, 3, (300, 5)).astype(np.float32)
    else:
        items = rng.standard_normal((13_000, 5)).astype(np.float32)
        users = rng.standard_normal((300, 5)).astype(np.float32)
    seeded, plain = _engines(items)
    seeded.backend.workers = plain.backend.workers = 1
    a, b = seeded.search(users, 1000), plain.search(users, 1000)
    assert seeded.stats["seed_sample"] == 4096
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.scores, b.scores)


@pytest.mark.parametrize("k, groups", [(320, False), (640, False), (640, True)])
def test_seeded_search_with_exclusions_of_the_sample(monkeypatch, k, groups):
    """Users whose sampled items are all excluded, or all but a few, or whose best items are: the same answer (also
    with a block's users seeded in groups of 3, each group's exclusions a slice of the block's)."""
    from recall.backends.numpy import backend as cpu

    if groups:
        monkeypatch.setattr(cpu, "SEED_SCRATCH_VALUES", 3 * seed_size(80_000, k))
    rng = np.random.default_rng(12)
    n_items = 80_000
    items = rng.standard_normal((n_items, 6)).astype(np.float32)
    users = rng.standard_normal((200, 6)).astype(np.float32)
    seeded, plain = _engines(items)
    plain_best = plain.search(users, k).indices
    from recall.backends.tiled import sample_rows
    from recall.core.metrics import row_norms

    sampled = sample_rows(np, n_items, seed_size(n_items, k), row_norms(np, items))  # ip: half the largest norms
    lists = [np.sort(rng.choice(n_items, 30, replace=False)) for _ in range(200)]
    lists[0] = sampled  # every sampled item
    lists[1] = sampled[:-k + 1]  # all but k - 1
    lists[2] = np.sort(plain_best[2, :k // 2])  # its best half
    lists[3] = np.arange(n_items - k // 2, dtype=np.int64)  # all but k / 2 items: the rest padded
    excl = _pairs(lists)
    a, b = seeded.search(users, k, exclude=excl), plain.search(users, k, exclude=excl)
    assert seeded.stats["seed_sample"] > 0
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.scores, b.scores)
    assert np.all(a.indices[3, k // 2:] == -1) and np.all(a.indices[3, :k // 2] >= n_items - k // 2)
    for u in range(200):
        assert not np.isin(a.indices[u], lists[u]).any()


def test_seed_groups_take_their_own_users_exclusions(monkeypatch):
    """Users seeded in groups (a worker's scratch holds 3 users' sampled scores): a user of a later group who has
    excluded its best quarter of the catalogue (and so most of the sample's top k) is seeded from its own list. Seeded
    with the first group's empty lists, its threshold would sit above its true k-th best."""
    from recall.backends.numpy import backend as cpu

    rng = np.random.default_rng(14)
    n_items, k = 80_000, 640
    monkeypatch.setattr(cpu, "SEED_SCRATCH_VALUES", 3 * seed_size(n_items, k))
    items = rng.standard_normal((n_items, 6)).astype(np.float32)
    users = rng.standard_normal((12, 6)).astype(np.float32)
    seeded, plain = _engines(items)
    seeded.backend.workers = plain.backend.workers = 1  # one block, not item ranges
    scores = users.astype(np.float64) @ items.astype(np.float64).T
    lists = [np.zeros(0, np.int64)] * 3 + [np.sort(np.argsort(-scores[u])[:n_items // 4]) for u in range(3, 12)]
    excl = _pairs(lists)
    a, b = seeded.search(users, k, exclude=excl), plain.search(users, k, exclude=excl)
    assert seeded.stats["seed_sample"] > 0
    np.testing.assert_array_equal(a.indices, b.indices)
    assert np.all(a.indices >= 0)


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
def test_ip_samples_take_the_largest_norms(metric):
    """Under ip half the sample is the items of the largest norms (``tiled.sample_rows`` with norms); under cosine
    (all norms 1) and l2 (a far item has a large norm and scores low) evenly spread rows only."""
    from recall.backends.tiled import sample_rows
    from recall.core.metrics import row_norms

    rng = np.random.default_rng(16)
    items = (rng.standard_normal((70_000, 8)) * np.exp(rng.standard_normal((70_000, 1)))).astype(np.float32)
    engine = Engine(items, device="cpu", metric=metric)
    users = rng.standard_normal((500, 8)).astype(np.float32)
    plan = engine.plan(users, engine.n_items, 700)
    seed = engine.backend._seed(plan, engine._items, engine.n_items, 700, engine.options)
    size = seed_size(engine.n_items, 700)
    norms = row_norms(np, engine._items)  # the engine's own norms: their order decides the ties
    want = sample_rows(np, engine.n_items, size, norms if metric == "ip" else None)
    np.testing.assert_array_equal(seed.rows, want)
    if metric == "ip":
        assert np.argmax(norms) in seed.rows
    np.testing.assert_allclose(seed.norms, np.linalg.norm(engine._items[seed.rows].astype(np.float64), axis=1),
                               rtol=1e-14)


def test_item_ranges_are_not_seeded():
    """Fewer user blocks than workers: each block is searched in item ranges, whose own k-th best may lie below the
    catalogue's sample's; such a search runs unseeded."""
    rng = np.random.default_rng(13)
    items = rng.standard_normal((70_000, 8)).astype(np.float32)
    users = rng.standard_normal((3, 8)).astype(np.float32)
    seeded, plain = _engines(items)
    seeded.backend.workers = plain.backend.workers = 4  # what a 4-core machine plans: one block, 4 item ranges
    a, b = seeded.search(users, 700), plain.search(users, 700)
    assert seeded.stats["item_parts"] > 1 and seeded.stats["seed_sample"] == 0
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.scores, b.scores)


@pytest.mark.parametrize("k", [300, 700])  # a heap, a buffer
@pytest.mark.parametrize("sigmas", [4, -3])  # the rule; estimates far above most users' k-th best
def test_estimated_thresholds_give_the_bound_s_answer(monkeypatch, k, sigmas):
    """Exact search seeded at an estimate of each user's k-th best (``seed_estimate``): a user left with fewer than k
    items above it is searched again from the bound, so the answer is the unseeded one, ties, exclusions and users
    with fewer than k items left included."""
    from recall.backends.numpy import backend as cpu

    monkeypatch.setattr(cpu, "ESTIMATE_SIGMAS", sigmas)
    rng = np.random.default_rng(21)
    n_items = 60_000
    items = rng.integers(-2, 3, (n_items, 6)).astype(np.float32)  # ties by the thousand
    users = rng.integers(-2, 3, (150, 6)).astype(np.float32)
    users[users.sum(axis=1) == 0, 0] = 1.0
    lists = [np.sort(rng.choice(n_items, 40, replace=False)) for _ in range(150)]
    lists[5] = np.arange(n_items - k // 3, dtype=np.int64)  # fewer than k items left: padded either way
    excl = _pairs(lists)
    estimated = Engine(items, device="cpu")
    bound = Engine(items, device="cpu", options=EngineOptions(seed_estimate=False))
    plain = Engine(items, device="cpu", options=EngineOptions(seed_thresholds=False))
    a, b, c = (e.search(users, k, exclude=excl) for e in (estimated, bound, plain))
    for other in (b, c):
        np.testing.assert_array_equal(a.indices, other.indices)
        np.testing.assert_array_equal(a.scores, other.scores)
    stats = estimated.stats
    assert 0 < stats["seed_estimate"] < k and "seed_estimate" not in bound.stats, stats
    assert stats["estimate_short_users"] >= 1  # user 5 at least
    if sigmas < 0:
        assert stats["estimate_short_users"] > 75, stats  # most users searched again
    assert np.all(a.indices[5, k // 3:] == -1)
