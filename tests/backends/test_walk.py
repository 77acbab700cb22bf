"""The walk (recall/backends/cupy/kernels/walk_w.cu, ``EngineOptions.fused_walk``): float16 passes of at most 32
candidates a user in which each block of 128 users scores the whole catalogue and keeps its candidates in shared
memory.

Integer-valued data makes every float32 sum exact whatever its order, so the walk's candidates must be the CPU's
sorted pass's pairs exactly (ties everywhere, decided by the row); on real-valued data the answers of fast mode and
exact mode's certified route, which re-score them, must be the float64 oracle's.
"""
from __future__ import annotations

import numpy as np
import pytest

from recall import Engine, EngineOptions
from recall.backends import cuda_status
from recall.backends.cupy import fused as fused_path

from oracle import as_numpy, assert_topk_close, int_matrix as _ints
from test_fused import _best_first, _run_half

usable, reason = cuda_status()
on_gpu = pytest.mark.skipif(not usable, reason=f"no usable GPU: {reason}")


@pytest.fixture
def walk_any_size(monkeypatch):
    """The walk for searches of any number of users (the rule asks for 16,384), on Hopper (where it is built)."""
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the walk is built for compute capability 9.0 only")
    monkeypatch.setattr(fused_path, "WALK_MIN_USERS", 1)


def test_the_rule():
    assert not fused_path.walks(16_384, 27, 72, False, False, EngineOptions())  # off by default
    options = EngineOptions(fused_walk=True)
    assert fused_path.walks(16_384, 27, 72, False, False, options)  # d = 64, k = 10: 80 columns
    assert fused_path.walks(16_384, 32, 80, False, False, options)
    assert not fused_path.walks(16_383, 27, 72, False, False, options)  # too few users
    assert not fused_path.walks(16_384, 33, 72, False, False, options)  # k = 100 keeps 126
    assert not fused_path.walks(16_384, 27, 88, False, False, options)  # 96 columns
    assert not fused_path.walks(16_384, 27, 72, True, False, options)  # results sorted: the merges sort them
    assert not fused_path.walks(16_384, 27, 72, False, True, options)  # starting at floors
    assert not fused_path.walks(16_384, 27, 72, False, False, EngineOptions(fused_walk=False))


def test_two_blocks_an_sm():
    # The users' tile, the item tiles in flight and 128 users' stages stay within half of an H100/H200 SM's 228 KiB,
    # less the 1 KiB the device reserves a block, at every width the walk is built for.
    for padded in range(16, fused_path.WALK_MAX_WIDTH + 1, 16):
        assert 2 * (fused_path.walk_smem(padded) + 1024) <= 228 * 1024, padded
    assert fused_path.walk_smem(64) == 2 * 128 * 64 * 3 + 128 * 8 * 60


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("n_users,n_items,width,k", [
    (1, 1, 8, 1), (130, 1000, 24, 10), (300, 3001, 72, 27), (257, 2500, 64, 32), (129, 700, 40, 20),
    (200, 1300, 16, 16), (260, 20, 48, 27), (140, 2100, 80, 9), (3, 129, 56, 5), (1000, 4096, 32, 27),
])
@pytest.mark.parametrize("values", ["spread", "ties"])
def test_equals_the_cpu_exactly(walk_any_size, n_users, n_items, width, k, values):
    # Catalogues off the tile of 128 and shorter than k, users off the block of 128, every width the kernel is built
    # for (16 to 80 columns multiplied), k from 1 to 32; exclusions (every item for one user, most for others,
    # none for the rest). "ties": values in {-1, 0, 1}, where most of a user's best share a score and the row decides.
    rng = np.random.default_rng(n_users + n_items + width + k)
    lo, hi = (-3, 4) if values == "spread" else (-1, 2)
    items = _ints(rng, n_items, width, lo, hi).astype(np.float16)
    users = _ints(rng, n_users, width, lo, hi).astype(np.float16)
    excl = {u: rng.choice(n_items, (2 * n_items) // 3, replace=False).tolist() for u in range(1, n_users, 5)}
    excl[0] = list(range(n_items))
    options = EngineOptions(fused="force", certified_exact="off", fused_walk=True)
    got_vals, got_rows, stats = _run_half("gpu", items, users, k, excl, options, best_first=False)
    assert stats["walk"] and stats["fused"] and stats["seed_sample"] == 0
    want_vals, want_rows, _ = _run_half("cpu", items, users, k, excl)
    got_vals, got_rows = _best_first(got_vals, got_rows)
    np.testing.assert_array_equal(got_rows, want_rows)
    np.testing.assert_array_equal(got_vals, want_vals)
    assert (got_rows[0] == -1).all()
    # The same search without the walk (the sample, the segments and their merges): the same pairs.
    seg_vals, seg_rows, seg = _run_half("gpu", items, users, k, excl, EngineOptions(fused="force"), best_first=False)
    assert not seg["walk"]
    seg_vals, seg_rows = _best_first(seg_vals, seg_rows)
    np.testing.assert_array_equal(seg_rows, got_rows)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("order", ["rising", "falling"])
def test_scores_rising_or_falling_along_the_rows(walk_any_size, order):
    # Items whose scores rise with the row raise every user's threshold at every tile (each tile's survivors fill
    # the stage: the most selections); falling, the first tile's K are the answer and nothing passes after.
    n_items, width = 5000, 32
    scale = np.arange(1, n_items + 1, dtype=np.float64)
    scale = scale if order == "rising" else scale[::-1]
    items = np.zeros((n_items, width), np.float16)
    items[:, 0] = (scale % 2048).astype(np.float16)  # integers below 2,048: exact in float16
    items[:, 1] = (scale // 2048).astype(np.float16)
    rng = np.random.default_rng(3)
    users = np.zeros((300, width), np.float16)
    users[:, 0] = 1
    users[:, 1] = 2048
    users[:, 2:] = _ints(rng, 300, width - 2, 0, 1)  # zeros: every user's scores are the items' rank
    got_vals, got_rows, stats = _run_half("gpu", items, users, 27, None, EngineOptions(fused="force", fused_walk=True),
                                         best_first=False)
    assert stats["walk"]
    want_vals, want_rows, _ = _run_half("cpu", items, users, 27)
    got_vals, got_rows = _best_first(got_vals, got_rows)
    np.testing.assert_array_equal(got_rows, want_rows)
    np.testing.assert_array_equal(got_vals, want_vals)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
@pytest.mark.parametrize("dim,k", [(32, 10), (64, 10), (64, 1), (16, 15)])
def test_fast_and_certified_answers_are_the_oracles(walk_any_size, metric, dim, k):
    # Real-valued, skewed-norm data through fast mode and exact mode's certified route with the walk: the answers
    # (re-scored) equal the float64 oracle's, ties aware, and exact mode's equal its float32 search's bit for bit.
    rng = np.random.default_rng(dim + k)
    items = (rng.standard_normal((6000, dim)) * rng.lognormal(0, 0.6, (6000, 1))).astype(np.float32)
    users = (rng.standard_normal((700, dim)) * rng.lognormal(0, 0.6, (700, 1))).astype(np.float32)
    exclude = {u: rng.choice(6000, 300, replace=False).tolist() for u in range(0, 700, 3)}
    options = EngineOptions(certified_exact="on", float16_min_scores=0, fast_sample=0, fused_walk=True)
    check_fast_and_certified(items, users, metric, k, options, "walk", exclude)


def check_fast_and_certified(items, users, metric, k, options, stat, exclude=None):
    """Fast mode and exact mode's certified route with ``options``, each search's ``stats[stat]`` true: the answers
    (re-scored) equal the float64 oracle's, ties aware, and exact mode's equal its float32 search's bit for bit."""
    answers = {}
    for precision in ("fast", "exact"):
        engine = Engine(items, device="gpu", metric=metric, precision=precision, options=options)
        got = engine.search(users, k, exclude=exclude)
        assert engine.stats.get(stat), engine.stats
        idx, val = as_numpy(got.indices), as_numpy(got.scores)
        assert_topk_close(idx, val, users, items, k, metric=metric, exclude=exclude)
        answers[precision] = (idx, val)
    plain = Engine(items, device="gpu", metric=metric, options=EngineOptions(certified_exact="off"))
    want = plain.search(users, k, exclude=exclude)
    np.testing.assert_array_equal(answers["exact"][0], as_numpy(want.indices))
    np.testing.assert_array_equal(answers["exact"][1], as_numpy(want.scores))
