"""The threshold sample of a float16 pass scored and selected in one kernel (recall/backends/cupy/kernels/seed_w.cu,
``EngineOptions.fused_seed``, Hopper): each lane of a quad keeps its largest keys of a user (RS_KEPT, or RS_KEPT_WIDE
in passes of more than 32 candidates: ``fused.seed_w_kept``), and just below the quad's rank-th largest kept key is
the threshold, unlowered: the kernel's scores are the pass's own.

Integer-valued data makes every float32 sum exact whatever its order: the thresholds must be just below the rank-th
best of the exact scores with each lane's share cut to the keys it keeps (for a pass of more candidates than the 4
lanes keep, the cut select of a pass of that many), never above the uncut row's, and equal to it wherever no lane held
more than it keeps of a user's best. Over real values, the thresholds sit just below an unseeded fused pass's own
scores. Searches with exclusions keep cuBLAS's GEMM and the (lowered) select (``fused.seeds_fused``).
"""
from __future__ import annotations

import numpy as np
import pytest

from recall import Engine, EngineOptions
from recall.backends import cuda_status
from recall.backends.cupy import fused as fused_path

from oracle import as_numpy, assert_topk_close, int_matrix as _ints
from test_fused import _best_first, _run_half
from test_walk import check_fast_and_certified

usable, reason = cuda_status()
on_gpu = pytest.mark.skipif(not usable, reason=f"no usable GPU: {reason}")


def test_the_rule():
    options = EngineOptions()
    assert fused_path.seeds_fused(27, 0, False, options)  # d = 64, k = 10: the route's pass keeps 27
    assert fused_path.seeds_fused(27, 13, False, options)  # ... starting at its need
    assert fused_path.seeds_fused(32, 0, False, options)
    assert fused_path.seeds_fused(1, 0, False, options)
    assert fused_path.seeds_fused(64, 53, False, options)  # k = 50's pass at its need: 16 keys a lane
    assert fused_path.seeds_fused(64, 35, False, options)  # ... or an estimate
    assert fused_path.seeds_fused(64, 0, False, options)  # its k-th: every key the 4 lanes keep
    assert fused_path.seeds_fused(80, 64, False, options)
    assert not fused_path.seeds_fused(73, 0, False, options)  # a rank past the 64 kept keys
    assert not fused_path.seeds_fused(80, 65, False, options)
    assert not fused_path.seeds_fused(81, 20, False, options)  # k = 100's pass: cuBLAS's GEMM and a select
    assert not fused_path.seeds_fused(27, 0, True, options)  # exclusions: the GEMM, the mask and the select
    assert not fused_path.seeds_fused(64, 53, True, options)
    assert not fused_path.seeds_fused(27, 0, False, EngineOptions(fused_seed=False))
    assert not fused_path.seeds_fused(27, 0, False, EngineOptions(warpgroup_mma=False))  # the mma.sync kernels' GPUs
    assert [fused_path.seed_w_kept(k) for k in (1, 32, 33, 64, 80)] == [12, 12, 16, 16, 16]


def test_two_blocks_an_sm():
    # fused_w.cu's tiles only: at every width the wgmma kernels take, two blocks an SM fit an H100/H200 SM's 228 KiB
    # (less the 1 KiB the device reserves a block).
    for padded in range(16, fused_path.FUSED_W_MAX_WIDTH + 1, 16):
        assert 2 * (fused_path.seed_w_smem(padded) + 1024) <= 228 * 1024, padded
        assert fused_path.seed_w_smem(padded) < fused_path.wgmma_smem(padded)
    assert fused_path.seed_w_smem(64) == 2 * 128 * 64 * 4


@pytest.fixture
def hopper():
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("seed_w.cu is built for compute capability 9.0 only")


def _lane(size):
    """The lane of a quad (t = 0..3) whose share holds each sampled item: item 8j + 2t + c of every tile of 128."""
    return (np.arange(size) % 8) // 2


def _thresholds(users, sample, k, estimate=0, constant=None, bias_columns=None, multiplied=0, scores=None):
    """(seed_w.cu's thresholds, Selection.seed's) of float16 ``users`` (n, W) over the float16 ``sample`` (T, W)
    (item rows 0 .. T - 1); ``scores`` (n, T) float32: what Selection.seed selects from instead of the exact
    products (-inf: left out)."""
    import cupy

    from recall.backends import resolve
    from recall.backends.cupy.items import DeviceItems
    from recall.backends.cupy.selection import GpuTopK
    n, size = users.shape[0], sample.shape[0]
    backend = resolve("gpu")
    sel = backend.selection
    items = DeviceItems(cupy.asarray(sample), constant_column=constant, bias_columns=bias_columns)
    rows, norms, sums = items.sample(size, size, cupy.cuda.get_current_stream(), even=True)
    np.testing.assert_array_equal(cupy.asnumpy(rows), np.arange(size))
    bias = None if sums is None else (*bias_columns, sums)
    ex_ptr, ex_items = cupy.zeros(n + 1, cupy.int64), cupy.zeros(0, cupy.int64)  # nothing excluded
    users_d = cupy.asarray(users)
    got = {}
    state = GpuTopK.allocate(n, k)
    fused_path.FusedSearch(sel).seed(state, users_d, items.vecs, norms, estimate, constant, bias, multiplied)
    got["fused"] = cupy.asnumpy(state.thr)
    if scores is None:
        scores = users.astype(np.float32) @ sample.astype(np.float32).T  # exact: small integers
    state = GpuTopK.allocate(n, k)
    sel.seed(state, cupy.asarray(scores, dtype=cupy.float32).reshape(1, n, size), rows, users_d, norms, ex_ptr,
             ex_items, estimate, constant, bias)
    got["select"] = cupy.asnumpy(state.thr)
    return got["fused"], got["select"]


def _one_norm(rng, size, width, lead=0, bias=0):
    """float16 integer rows of one norm: signed permutations of one row, but for the first ``lead`` columns (0, for
    the caller to fill with values of one magnitude) and the last ``bias`` (2 in each): a lowered score's order is
    its score's."""
    n = width - lead - bias
    base = rng.integers(1, 5, n).astype(np.float32)
    out = np.zeros((size, width), np.float32)
    for i in range(size):
        out[i, lead: lead + n] = rng.permutation(base) * rng.choice([-1, 1], n)
    out[:, width - bias:] = 2
    return out.astype(np.float16)


def _cut(scores, kept):
    """Each user's scores with each lane's share cut to its ``kept`` best (the rest -inf)."""
    out = np.full_like(scores, -np.inf)
    lane = _lane(scores.shape[1])
    for u in range(scores.shape[0]):
        row = scores[u]
        for t in range(4):
            share = np.flatnonzero(lane == t)
            best = share[np.argsort(-row[share], kind="stable")[:kept]]
            out[u, best] = row[best]
    return out


def _unlowered(scores, k, estimate, kept):
    """seed_w.cu's thresholds from the pass's own float32 ``scores`` (n, T) of the sampled items: each lane's share
    cut to its ``kept`` best, just below the quad's rank-th best kept score (ties counted), -inf where the quad kept
    fewer than min(k, 4 kept) (fewer sampled items than k)."""
    rank = estimate if 0 < estimate < k else k
    out = np.full(scores.shape[0], -np.inf, np.float32)
    for u, row in enumerate(_cut(scores, kept)):
        held = -np.sort(-row[row > -np.inf])
        if held.size >= min(k, 4 * kept):
            out[u] = np.nextafter(np.float32(held[rank - 1]), np.float32(-np.inf))
    return out


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("n_users,size,width,k,estimate", [
    (1, 128, 16, 1, 0), (130, 512, 64, 27, 0), (300, 300, 72, 27, 9), (257, 1024, 32, 32, 0), (129, 700, 40, 20, 5),
    (200, 128, 144, 16, 0), (260, 2048, 128, 10, 3), (140, 256, 80, 32, 31), (3, 129, 56, 5, 0), (1000, 512, 24, 27, 0),
    (2, 20, 16, 27, 0),
    # wider passes, 16 keys a lane: k = 50's 64 at its need (53) or an estimate, at its k-th, and 80 at rank 64
    (300, 1024, 32, 64, 53), (257, 512, 64, 64, 35), (130, 600, 144, 64, 0), (200, 2048, 128, 80, 64),
    (129, 256, 48, 33, 0), (5, 60, 16, 64, 53),
])
@pytest.mark.parametrize("best", ["spread", "one lane"])
def test_thresholds_are_the_select_of_what_each_lane_keeps(hopper, n_users, size, width, k, estimate, best):
    # Small-integer rows (every sum exact, the pass's own scores whatever the order): the kernel's thresholds are
    # just below the rank-th best of the exact scores cut to each lane's kept best, bit for bit, and never above the
    # uncut row's. "one lane": every user's best scores in lane 0's share (its kept keys fall short of the rank:
    # strictly lower); samples off the tile of 128, and one shorter than K (fewer than K kept: -inf); every width the
    # kernel is built for (16 to 144 columns multiplied); ranks 1 to 64 and estimates below them. A pass of more
    # candidates than the 4 lanes keep (80 against 64) takes all 64 kept as enough: the cut select of a pass of 64 at
    # the same rank.
    rng = np.random.default_rng(n_users + size + width + k)
    kept = fused_path.seed_w_kept(k)
    sample = _one_norm(rng, size, width, lead=1)
    users = _ints(rng, n_users, width, -3, 4).astype(np.float16)
    sample[:, 0] = rng.choice([-1, 1], size)
    if best == "one lane":
        users[:, 0] = 64  # 3,840 above the rest, whose products sum to at most 1,716 (143 columns of 3 x 4)
        sample[:, 0] = np.where(_lane(size) == 0, 60, -60)
    exact = users.astype(np.float32) @ sample.astype(np.float32).T
    fused, _ = _thresholds(users, sample, k, estimate)
    np.testing.assert_array_equal(fused, _unlowered(exact, min(k, 4 * kept), estimate, kept))
    uncut = _unlowered(exact, k, estimate, size)  # every lane keeping all it holds
    assert (fused <= uncut).all()
    rank = estimate if 0 < estimate < k else k
    if size < k:
        assert (fused == -np.inf).all()
    elif best == "one lane" and rank > kept:
        assert (fused < uncut).all()  # lane 0 held the rank's best; the others' kept stood in
    elif best == "spread" and rank <= 53:  # (at rank 64 of 64 kept, only where each lane held 16 of the best)
        assert np.mean(fused == uncut) >= (0.9 if rank <= 32 else 0.3)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("size,width,k,estimate", [(512, 72, 27, 0), (1024, 40, 32, 12), (384, 136, 10, 0),
                                                   (1024, 64, 64, 53)])
def test_constant_and_bias_columns_are_scored_as_any_other(hopper, size, width, k, estimate):
    # A constant column (fast mode's shift: every item holds one value there) and bias columns (l2's), which the GEMM
    # path's select bounds on their own: here unlowered, they are products like any other, and the thresholds are
    # those of the exact scores cut to each lane's kept keys.
    rng = np.random.default_rng(size + width)
    sample = _one_norm(rng, size, width, lead=1, bias=2)
    sample[:, 0] = 4  # the constant column
    users = _ints(rng, 400, width, -3, 4).astype(np.float16)
    constant, bias_columns = (0, 4.0), (width - 2, width)
    exact = users.astype(np.float32) @ sample.astype(np.float32).T
    kept = fused_path.seed_w_kept(k)
    fused, _ = _thresholds(users, sample, k, estimate, constant, bias_columns)
    np.testing.assert_array_equal(fused, _unlowered(exact, k, estimate, kept))
    uncut = _unlowered(exact, k, estimate, size)
    assert (fused <= uncut).all() and np.mean(fused == uncut) >= (0.9 if k <= 32 else 0.3)


@pytest.mark.gpu
@on_gpu
def test_real_valued_thresholds_stay_below_the_kth_best(hopper):
    # Real-valued rows of skewed norms: every threshold is at most the user's k-th best exact (float64) score over the
    # sample plus the float32 sums' error (the pass's own scores, unlowered), and within 1e-3 of the GEMM path's
    # select (lowered by its margin) for most users (the rest: a lane held more than it keeps of the best).
    rng = np.random.default_rng(7)
    size, width, k = 512, 64, 27
    sample = (rng.standard_normal((size, width)) * rng.lognormal(0, 1, (size, 1))).astype(np.float16)
    users = (rng.standard_normal((2000, width)) * rng.lognormal(0, 1, (2000, 1))).astype(np.float16)
    scores = users.astype(np.float32) @ sample.astype(np.float32).T
    exact = users.astype(np.float64) @ sample.astype(np.float64).T
    error = width * 2.0 ** -23 * (np.abs(users.astype(np.float64)) @ np.abs(sample.astype(np.float64)).T).max(axis=1)
    for kk, estimate, share in ((k, 0, 0.95), (64, 53, 0.3)):  # and k = 50's pass of 64 at its need's rank
        fused, select = _thresholds(users, sample, kk, estimate, scores=scores)
        kth = -np.sort(-exact, axis=1)[:, (estimate or kk) - 1]
        assert (fused <= kth + error).all()
        assert np.mean(np.isclose(fused, select, rtol=1e-3, atol=0)) >= share


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("n_sample,width,k,estimate", [(512, 64, 27, 0), (500, 40, 27, 9), (1024, 32, 64, 53),
                                                       (640, 144, 64, 35), (300, 16, 10, 0)])
def test_thresholds_sit_just_below_the_passs_own_scores(hopper, n_sample, width, k, estimate):
    # Real-valued rows: an unseeded fused float16 pass over the sample itself (fused_w.cu) keeps each user's k best
    # with its own float32 scores; seed_w.cu's threshold is never above the rank-th of them, and just below it, bit
    # for bit, wherever the lanes kept the rank's best (most users): the sampled items pass the seeded pass's filter.
    rng = np.random.default_rng(n_sample + width + k)
    sample = (rng.standard_normal((n_sample, width)) * rng.lognormal(0, 1, (n_sample, 1))).astype(np.float16)
    users = (rng.standard_normal((700, width)) * rng.lognormal(0, 1, (700, 1))).astype(np.float16)
    fused, _ = _thresholds(users, sample, k, estimate)
    own, _rows, stats = _run_half("gpu", sample, users, k, None, EngineOptions(fused="force", seed_thresholds=False))
    assert stats["fused"] and not stats["seed_sample"]
    rank = estimate if 0 < estimate < k else k
    below = np.nextafter(own[:, rank - 1], np.float32(-np.inf))
    assert (fused <= below).all()
    assert np.mean(fused == below) >= (0.9 if k <= 32 else 0.3)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("n_users,n_items,width,k", [
    (130, 1000, 24, 10), (300, 3001, 72, 27), (257, 2500, 64, 32), (1000, 4096, 32, 27), (200, 1300, 136, 16),
    (300, 4096, 64, 64), (200, 3000, 40, 48),
])
def test_passes_seeded_in_one_kernel_equal_the_cpu_exactly(hopper, n_users, n_items, width, k):
    # Fused float16 passes seeded by seed_w.cu (stats["seed_fused"]) and by cuBLAS's GEMM and a select: the CPU's
    # pairs exactly, ties decided by the row. With exclusions (every item for one user, most for others) the pass
    # keeps the GEMM and the select, whatever the option says.
    rng = np.random.default_rng(n_users + n_items + width + k)
    items = _ints(rng, n_items, width, -3, 4).astype(np.float16)
    users = _ints(rng, n_users, width, -3, 4).astype(np.float16)
    excl = {u: rng.choice(n_items, (2 * n_items) // 3, replace=False).tolist() for u in range(1, n_users, 5)}
    excl[0] = list(range(n_items))
    for exclude in (None, excl):
        want_vals, want_rows, _ = _run_half("cpu", items, users, k, exclude)
        for seed_fused in (True, False):
            options = EngineOptions(fused="force", fused_seed=seed_fused, seed_sample=256)
            vals, rows, stats = _run_half("gpu", items, users, k, exclude, options, best_first=False)
            assert stats["fused"] and stats["seed_sample"] > 0
            assert stats["seed_fused"] == (seed_fused and exclude is None)
            vals, rows = _best_first(vals, rows)
            np.testing.assert_array_equal(rows, want_rows)
            np.testing.assert_array_equal(vals, want_vals)
    for wide in (73, 81) if n_items >= 1024 else ():  # its k-th past the 64 keys 4 lanes keep; above SEED_W_MAX_K
        _, _, stats = _run_half("gpu", items, users, wide, None, EngineOptions(fused="force", seed_sample=512),
                                best_first=False)
        assert stats["seed_sample"] == 512 and not stats["seed_fused"]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("n_users,user_block", [(1000, 256), (700, 128), (129, 4096)])
def test_device_users_are_seeded_all_at_once_as_each_block_would_be(hopper, n_users, user_block):
    # Device users of a pass seeded in one kernel take the sample's thresholds for the whole search in one launch
    # before the blocks (stats["seed_preseeded"]); host users, block by block. The same pairs either way and the CPU's,
    # over blocks of 128-256 users (a short last one too) and one block (real-valued data, an estimate's rank and
    # l2's bias columns: test_device_users_of_the_certified_route_are_seeded_all_at_once).
    rng = np.random.default_rng(n_users + user_block)
    items = _ints(rng, 3000, 40, -3, 4).astype(np.float16)
    users = _ints(rng, n_users, 40, -3, 4).astype(np.float16)
    k = 27
    want_vals, want_rows, _ = _run_half("cpu", items, users, k)
    options = EngineOptions(fused="force", seed_sample=256, tiles=(user_block, 1024, 4))
    for device_users in (False, True):
        vals, rows, stats = _run_half("gpu", items, users, k, None, options, device_users, best_first=False)
        assert stats["seed_fused"] and stats["seed_preseeded"] == device_users
        assert stats["blocks"] == -(-n_users // min(user_block, n_users)) or user_block > n_users
        vals, rows = _best_first(vals, rows)
        np.testing.assert_array_equal(rows, want_rows)
        np.testing.assert_array_equal(vals, want_vals)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
@pytest.mark.parametrize("dim,k", [(32, 10), (64, 10), (64, 1), (128, 15), (32, 50), (64, 50)])
def test_fast_and_certified_answers_are_the_oracles(hopper, metric, dim, k):
    # Real-valued, skewed-norm data through fast mode and exact mode's certified route, seeded in one kernel (no
    # exclusions): the answers equal the float64 oracle's, ties aware, and exact mode's equal its float32 search's bit
    # for bit.
    rng = np.random.default_rng(dim + k)
    items = (rng.standard_normal((10_000, dim)) * rng.lognormal(0, 0.6, (10_000, 1))).astype(np.float32)
    users = (rng.standard_normal((700, dim)) * rng.lognormal(0, 0.6, (700, 1))).astype(np.float32)
    options = EngineOptions(certified_exact="on", float16_min_scores=0, fast_sample=0)
    check_fast_and_certified(items, users, metric, k, options, "seed_fused")


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_device_users_of_the_certified_route_are_seeded_all_at_once(hopper, metric):
    # Real-valued, skewed-norm device users (their float16 copies made on the device) through fast mode and exact
    # mode's certified route in blocks of 256: seeded before the blocks (l2 with its bias columns), the answers the
    # float64 oracle's, ties aware, and exact mode's its float32 search's bit for bit.
    import cupy

    rng = np.random.default_rng(len(metric))
    items = (rng.standard_normal((6_000, 32)) * rng.lognormal(0, 0.6, (6_000, 1))).astype(np.float32)
    users = (rng.standard_normal((900, 32)) * rng.lognormal(0, 0.6, (900, 1))).astype(np.float32)
    options = EngineOptions(certified_exact="on", float16_min_scores=0, fast_sample=0, tiles=(256, 1024, 4))
    plain = Engine(items, device="gpu", metric=metric, options=EngineOptions(certified_exact="off"))
    want = plain.search(users, 10)
    for precision in ("fast", "exact"):
        engine = Engine(items, device="gpu", metric=metric, precision=precision, options=options)
        got = engine.search(cupy.asarray(users), 10)
        assert engine.stats.get("seed_preseeded") and engine.stats["blocks"] > 1, engine.stats
        idx, val = as_numpy(got.indices), as_numpy(got.scores)
        assert_topk_close(idx, val, users, items, 10, metric=metric)
        if precision == "exact":
            np.testing.assert_array_equal(idx, as_numpy(want.indices))
            np.testing.assert_array_equal(val, as_numpy(want.scores))

