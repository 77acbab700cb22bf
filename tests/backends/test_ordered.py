"""The fused exact kernel's float32 sums (one FMA per dimension, in order, from 0): the CPU's emulation against exact
rational arithmetic, and the GPU's ordered re-scoring against both the emulation and the fused kernel itself."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import clustered_data
from oracle import as_numpy
from recall import Engine, EngineOptions
from recall.backends import cuda_status
from recall.backends.numpy.ordered import fma32, ordered_dots
from recall.core import metrics
from recall.core.exclusions import Exclusions

gpu_usable, gpu_reason = cuda_status()


def _fma_exact(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """fmaf by rational arithmetic: the float32 nearest a·b + c, ties to the even significand."""
    x = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(x))
    best = None
    for g in (near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))):
        if np.isfinite(g):
            key = (abs(Fraction(float(g)) - x), int(np.array(g).view(np.int32)) & 1)
            if best is None or key < best[0]:
                best = (key, g)
    return best[1]


def test_fma32_rounds_once_where_float64_would_round_twice():
    # a·b + c = (1 + 2^-23) + 2^-24 - 2^-60: just below the midpoint between 1 + 2^-23 and 1 + 2^-22. float64 rounds
    # it to the midpoint, and float32 then to the even 1 + 2^-22; one rounding gives 1 + 2^-23.
    a, b, c = np.float32(2.0 ** -24 * (1 + 2.0 ** -18)), np.float32(1 - 2.0 ** -18), np.float32(1 + 2.0 ** -23)
    twice = np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    assert twice == np.float32(1 + 2.0 ** -22)
    assert fma32(a, b, c) == np.float32(1 + 2.0 ** -23) == _fma_exact(a, b, c)


_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-2.0 ** 50, max_value=2.0 ** 50)


@settings(max_examples=300)
@given(_f32, _f32, _f32)
def test_fma32_equals_rational_arithmetic(a, b, c):
    a, b, c = np.float32(a), np.float32(b), np.float32(c)
    got, want = fma32(a, b, c), _fma_exact(a, b, c)
    assert got == want or (got == 0 and want == 0)


def test_fma32_near_midpoints():
    # Products of 24-bit significands against sums whose low bits sit near float32 midpoints.
    rng = np.random.default_rng(0)
    a = (1 + rng.integers(0, 1 << 23, 4000) * 2.0 ** -23).astype(np.float32) * np.float32(2.0 ** -24)
    b = (1 - rng.integers(0, 1 << 12, 4000) * 2.0 ** -23).astype(np.float32)
    c = (1 + rng.integers(0, 1 << 23, 4000) * 2.0 ** -23).astype(np.float32)
    got = fma32(a, b, c)
    want = np.array([_fma_exact(x, y, z) for x, y, z in zip(a, b, c)], np.float32)
    np.testing.assert_array_equal(got, want)


def test_ordered_dots_is_the_fma_chain():
    rng = np.random.default_rng(1)
    users = (rng.standard_normal((3, 13)) * np.exp2(rng.integers(-8, 8, (3, 13)))).astype(np.float32)
    vecs = (rng.standard_normal((3, 5, 13)) * np.exp2(rng.integers(-8, 8, (3, 5, 13)))).astype(np.float32)
    got = ordered_dots(users, vecs)
    for u in range(3):
        for j in range(5):
            acc = np.float32(0)
            for d in range(13):
                acc = _fma_exact(users[u, d], vecs[u, j, d], acc)
            assert got[u, j] == acc


# ---- GPU ---------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("metric,dim", [("ip", 64), ("ip", 37), ("cosine", 256), ("l2", 100), ("ip", 200)])
def test_fused_kernel_scores_are_the_emulated_sums(metric, dim):
    # The claim the certified route rests on: every score exact mode's fused kernel returns is the FMA chain, bit for
    # bit (real-valued data, user norms over several binades, so that another order would differ somewhere).
    if not gpu_usable:
        pytest.skip(gpu_reason)
    users, items = clustered_data(300, 20000, dim, seed=dim)
    users *= np.exp2(np.random.default_rng(0).integers(-6, 6, (300, 1))).astype(np.float32)
    engine = Engine(items, metric=metric, device="gpu", options=EngineOptions(fused="force",
                                                                              certified_exact="off"))
    prepared = metrics.prepare_users(metric, np, users)
    # Inner-product space: the backend's own result, before the metric finishes the scores.
    vals = engine.backend.empty_out((300, 50), np.float32, False)
    rows = engine.backend.empty_out((300, 50), np.int64, False)
    stats = engine.run(prepared, 50, Exclusions.empty(300), vals, rows)()
    assert stats["fused"]
    want = ordered_dots(prepared, as_numpy(engine.prepared_items)[as_numpy(rows)])
    np.testing.assert_array_equal(as_numpy(vals), want)


_SHORT = [(64, 40), (37, 100), (68, 128), (1, 7), (33, 1), (257, 128), (3, 126)]


@pytest.mark.gpu
@pytest.mark.parametrize("dim,path,longest,k", [
    (64, "fused", 300, 40), (37, "fused", 300, 40), (256, "fused", 300, 40), (68, "fused", 300, 40),
    (4, "fused", 300, 40), (100, "fused", 300, 40), (33, "fused", 300, 40), (1, "fused", 300, 40),
    (3, "fused", 300, 40), (17, "fused", 300, 40), (65, "fused", 300, 40), (257, "fused", 300, 40),
    (64, "gemm", 300, 40), (37, "gemm", 300, 40),
    # Float4 rows whose last piece is short: 1 float4 (36: l2's rows at d = 32; 68, 100, 4 above), 2 (40), 3 (12), 4
    # (48) and 6 (56) float4 columns.
    (36, "fused", 300, 40), (40, "fused", 300, 40), (12, "fused", 300, 40), (48, "fused", 300, 40),
    (56, "fused", 300, 40),
    # k = 3,000 (K_pad 4,096): lists of at most 4,000 in one chunk of their longest rounded up (rescore.SZ_STEP).
    (64, "fused", 4000, 3000), (37, "fused", 4000, 2500),
    # K_pad of 512 and 1,024, sorted with the phases of stride < 128 in registers (rescore.cu's rs_sort_desc): lists
    # of up to 5,000 rows drawn with repeats, two chunks of 4,096 keys (the second after the best 300 so far).
    (64, "fused", 5000, 300), (37, "fused", 2000, 1000),
    # One chunk of the longest list rounded up to 32 keys (rescore.SZ_STEP): 1,504 keys, not a power of two,
    # sorted the long way at any length where rows repeat; 704 keys, fewer than K_pad's 1,024.
    (64, "fused", 1500, 1000), (37, "fused", 700, 1000),
    # k = 2,048 over lists of up to 2,113 (the certified route's at k = 2,048): 2,144 keys, the selected 2,048 in the
    # warps' stage and the duplicate flags in the rows' scratch (rescore.smem_bytes), float4 and float rows.
    (64, "fused", 2113, 2048), (65, "fused", 2113, 2048), (68, "fused", 2113, 2048), (36, "fused", 2113, 2048),
    # Lists of at most 128 and k <= 128: a warp a user (rescore.takes_warp), float4 and float rows; lists of at
    # most 32 (64) at k <= 32 (64) sorted 1 (2) keys a lane (rescore.cu's RS_WARP_SHORT), beside longer ones in the
    # same launch.
    *[(dim, "fused", 128, k) for dim, k in _SHORT],
    (64, "fused", 32, 10), (36, "fused", 32, 32), (37, "fused", 32, 27), (64, "fused", 27, 1),
    (64, "fused", 64, 46), (37, "fused", 64, 64), (68, "fused", 50, 33), (36, "fused", 60, 20)])
def test_ordered_rescore_equals_the_emulation(dim, path, longest, k):
    # Rows are read by the candidate's warp, a piece of 32 columns at a time: float4 rows where dim % 4 == 0 (68,
    # 100, 36: a last piece of 4 columns; 4, 12: one short piece; 40, 48, 56: last pieces of 8, 16, 24), float rows
    # otherwise (37: a last piece of 5 columns, 33
    # and 65 of 1; 1 and 3: one short piece; 17; 257: nine pieces); lists of every length around a
    # warp's 32 candidates, an empty slot (-1), a list of one repeated row, and two rows of one vector (a tie).
    if not gpu_usable:
        pytest.skip(gpu_reason)
    import cupy

    from recall.backends import resolve
    from recall.backends.cupy import rescore

    rng = np.random.default_rng(dim + k)
    items = (rng.standard_normal((5000, dim)) * np.exp2(rng.integers(-5, 5, (5000, 1)))).astype(np.float32)
    items[4001] = items[4000]
    users = rng.standard_normal((200, dim)).astype(np.float32)
    lengths = rng.integers(1, longest + 1, 200)
    lengths[:10] = (longest, 1, 31, 32, 33, 65, 40, 50, 64, 50)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = rng.integers(0, 5000, int(indptr[-1]))
    rows[indptr[7]:indptr[8]] = rows[indptr[7]]  # one user's list all one row: counted once
    rows[indptr[9] + 3] = -1  # an empty slot
    rows[indptr[2]:indptr[2] + 2] = (4001, 4000)  # a tie: the lower row first
    rows[indptr[3] + 5] = rows[indptr[3] + 9]  # a repeated row among others
    assert rescore.takes_warp(k, int(lengths.max()), dim) == (longest <= 128 and path == "fused")
    backend = resolve("gpu")
    loaded = backend.load_items(cupy.asarray(items))
    vals, got, taken = backend.rescore(users, loaded, indptr, cupy.asarray(rows), k, 1 << 28,
                                       EngineOptions(rescore=path), ordered=True)
    assert taken == path
    vals, got = as_numpy(vals), as_numpy(got)
    for u in range(200):
        mine = rows[indptr[u]:indptr[u + 1]]
        mine = mine[mine >= 0]
        scores = ordered_dots(users[u:u + 1], items[mine][None])[0]
        want = {int(r): s for r, s in zip(mine, scores)}
        keep = got[u] >= 0
        assert keep.sum() == min(k, len(want)), u
        assert (got[u][keep.sum():] == -1).all() and np.isneginf(vals[u][keep.sum():]).all(), u
        np.testing.assert_array_equal(vals[u][keep], np.array([want[int(r)] for r in got[u][keep]], np.float32))
        # The best k distinct rows under the tie rule (score descending, lower row first).
        best = sorted(want.items(), key=lambda rs: (-rs[1], rs[0]))[:k]
        assert [r for r, _ in best] == [int(r) for r in got[u][keep]], u
    assert (got[7] >= 0).sum() == 1
