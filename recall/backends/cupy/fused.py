"""The fused path: scores filtered in the GEMM's registers, never written to memory. Exact mode's float32 vectors go
through ``kernels/fused.cu`` (FMA on the CUDA cores), fast mode's float16 vectors through ``kernels/fused_h.cu``
(tensor cores, float32 accumulation). Each segment of items is followed by a merge that recomputes the segment for
a user whose candidate buffer overflowed (float32: with the same FMA sequence, so every score comes out bit for bit
the same; float16: in order, within the certificate's bound like the tensor cores' sums)."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ...core.options import EngineOptions
from ...core.tiling import TilePlan
from . import kernels
from .items import FUSED_CHUNK, FUSED_TILE, DeviceItems
from .selection import MERGE_THREADS, GpuTopK, Selection, final_code, fused_capacity, search_seed_size

FUSED_THREADS = 256
FUSED_MAX_DIM = 256  # the users' vectors of a block stay in shared memory: 128 x 256 floats at most
#: float16 rows of at most this many columns multiplied (``multiplied_width``) take the fused kernel (fused_h.cu): at
#: 80 columns (S1's d = 64 with fast mode's own) it beat cuBLAS + filter (fast mode on S1 0.19 s against 0.23 s), at
#: 264 (d = 256) it lost (0.083 s against 0.059 s), its filter then costing about as much per score as 80 columns of
#: products. Measured before the filter tested groups of scores first (docs/benchmarks.md); at 128 columns (d = 128
#: cosine, 20k x 1M) fast mode's search took 0.0337 s with it against 0.0453 s with cuBLAS + filter (2026-12-02).
FUSED_H_MAX_WIDTH = 128
#: The same on Hopper's wgmma kernel (fused_w.cu): 144 columns hold d = 128 with fast mode's bound columns or l2's
#: bias column (9 products of k = 16; two blocks an SM, 108 KB of shared memory each).
FUSED_W_MAX_WIDTH = 144
#: Seeded searches of a larger k take cuBLAS + filter (:func:`applies`). Up to k = 8,192 the float32 search is the
#: fused kernel's, so that exact mode's certified route, which repeats that kernel's sums, can take its place there;
#: at k = 8,192 (10k x 1M x 64, H200 2026-12-04, docs/benchmarks.md) it took 0.0737 s fused, 0.0891 s on cuBLAS.
FUSED_SEEDED_MAX_K = 8192
#: The same for float16 passes (fast mode's and the certified route's): up to the pass of k = 4,096, which keeps
#: k + certificate.margin(k) + 1 = 5,121 candidates a user. Exact mode on the H200 (2026-12-04, 10k x 1M x 64,
#: docs/benchmarks.md): at k = 4,096 the certified route on this kernel 0.0457 s, against 0.0519 s where the pass
#: kept float16 score tiles (the route then declined for the float32 search). At k = 8,192 (a pass of 10,241) the
#: route took 0.0871 s, its re-scoring 0.041 s of it (one block an SM: 8,192 keys a user fill a block's shared
#: memory), against 0.0737 s for the float32 search: that pass keeps cuBLAS + filter, and the route declines there.
FUSED_HALF_SEEDED_MAX_K = 5121
#: A float16 pass on Hopper that keeps at most SEED_W_MAX_K candidates a user (k + margin + 1: k up to 63) scores and
#: selects its threshold sample in one kernel (kernels/seed_w.cu, ``EngineOptions.fused_seed``) where the search
#: excludes nothing and it starts at a rank its lanes' kept keys hold (:func:`seeds_fused`): no sampled score goes
#: through memory. Passes of at most SEED_W_NARROW_K keep SEED_W_KEPT keys a lane (seed_w.cu's RS_KEPT), wider ones
#: SEED_W_WIDE_KEPT (RS_KEPT_WIDE, the ``_wide`` kernels). At k = 50 (a pass of 64 starting at rank 53 or an
#: estimate's 35) the route with cuBLAS's GEMM and recall_seed_warp instead took 1.096-1.104x its time on 1M users x
#: 4,096 items (clustered and skewed ip, skewed l2, normal ip), 1.026x at d = 128 (cosine), 1.019x on 100k x 1M and
#: 1.126x on 500k x 100k (H100, 2026-12-07, interleaved, docs/benchmarks.md).
SEED_W_MAX_K = 80
SEED_W_NARROW_K = 32
SEED_W_KEPT = 12
SEED_W_WIDE_KEPT = 16
#: The walk (kernels/walk_w.cu, Hopper, ``EngineOptions.fused_walk``, off by default): a float16 pass that keeps at
#: most WALK_MAX_K candidates a user (k + margin + 1: k up to 15) of rows of at most WALK_MAX_WIDTH columns
#: multiplied, in searches of at least WALK_MIN_USERS users, takes one kernel in which each block of 128 users scores
#: every item and keeps their candidates in shared memory: no threshold sample, no merges (:func:`walks`). Slower than
#: the segmented search as of 2026-12-06: the route on 1M users x 4,096 items 24.8 ms against 15.7 ms; the kernel
#: alone 16.8-17.3 ms, of which its products and filter 2.8 ms and its selections (5.5-7 a user) about 12 ms (H100,
#: docs/benchmarks.md).
WALK_MAX_K = 32
WALK_MAX_WIDTH = 80
WALK_MIN_USERS = 16_384
_H_CHUNK, _H_STAGES = 64, 3  # fused_h.cu's RH_CHUNK and RH_STAGES
_H_WHOLE_MAX = 96  # rows of at most this many columns multiplied come in one chunk a tile (fused_h.cu)
_H_THREADS = 256  # fused_h.cu's RH_THREADS: 8 warps of 64 users x 32 items (RH_WN = 32)


def multiplied_width(users: Any) -> int:
    """The columns a fused float16 pass multiplies for ``users`` ((n, W) float16, on the device or, for tests, the
    host): up to the last column in which some user holds a value other than 0, rounded up to the tensor cores' 16
    (at least 16), at most W rounded up. Beyond it every product is 0 whatever the item holds (items are finite), so
    leaving those columns out changes no sum: fast mode's users hold zeros in the columns of a shift and of bound
    factors they do not use (d = 64: 64 columns multiplied instead of 80, d = 32: 32 instead of 48)."""
    return count_multiplied(users)()


def count_multiplied(users: Any) -> Callable[[], int]:
    """Start :func:`multiplied_width` of ``users``: device users take one launch on the current stream
    (``recall_last_column``, kernels/fast16.cu), and the callable returned waits for it and reads its 4 bytes, so that
    a caller may queue other work before it waits (the array operations it replaced cost 0.42 ms of host time a search,
    H100, docs/benchmarks.md). Host users are counted at once."""
    n, width = users.shape
    if n == 0 or width == 0:
        return lambda: 16
    if isinstance(users, np.ndarray):
        used = np.flatnonzero(abs(users).max(axis=0) > 0)  # -0 counts as 0
        last = int(used[-1]) + 1 if used.size else 0
        return lambda: _rounded(last)
    import cupy

    rows = cupy.ascontiguousarray(users).view(cupy.uint16)
    last_d = cupy.zeros(1, dtype=cupy.int32)
    kernel = kernels.fast16_module().get_function("recall_last_column")
    kernel((min(-(-n // 8), 2048),), (256,), (rows, np.int64(n), np.int32(width), last_d))
    return lambda: _rounded(int(last_d.get()[0]))


def _rounded(last: int) -> int:
    """One more than the last column used (0: none) -> the columns multiplied: a multiple of 16, at least 16."""
    return max(16, -(-max(last, 1) // 16) * 16)


def wgmma_staged(padded: int) -> int:
    """Survivors of a user fused_w.cu's kernel keeps in shared memory (its RW_STAGED_OF) for rows of ``padded``
    columns multiplied: what two blocks an SM leave beside the tiles (96 at 16 columns down to 32 at 80, 4 at 144)."""
    ks = padded // 16
    return {1: 96, 2: 80, 3: 64, 4: 48, 5: 32, 7: 24}.get(ks, 16 if ks <= 8 else 4)


def wgmma_smem(padded: int) -> int:
    """Dynamic shared memory of fused_w.cu's kernel for rows of ``padded`` columns multiplied: its tiles
    (:func:`seed_w_smem`), then each user's stage of survivors (8-byte keys, :func:`wgmma_staged` of them a user)
    and its count."""
    return seed_w_smem(padded) + FUSED_TILE * (8 * wgmma_staged(padded) + 4)


def seed_w_smem(padded: int) -> int:
    """Dynamic shared memory of seed_w.cu's kernel for rows of ``padded`` columns multiplied, fused_w.cu's tiles
    and nothing after them: the users' tile and its item tiles in flight (three up to 96 columns, two above:
    fused_w.cu's RW_STAGES_OF), 128 rows each."""
    return 2 * FUSED_TILE * padded * (1 + (2 if padded > 96 else 3))


def seed_w_wide(k: int) -> bool:
    """Whether a pass of ``k`` candidates a user takes seed_w.cu's ``_wide`` kernels (above SEED_W_NARROW_K)."""
    return k > SEED_W_NARROW_K


def seed_w_kept(k: int) -> int:
    """Keys a lane of seed_w.cu's kernel keeps for a pass of ``k`` candidates a user (:func:`seed_w_wide`)."""
    return SEED_W_WIDE_KEPT if seed_w_wide(k) else SEED_W_KEPT


def seeds_fused(k: int, rank: int, has_excl: bool, options: EngineOptions) -> bool:
    """Whether a float16 fused pass keeping ``k`` candidates a user and starting at the ``rank``-th best of its
    threshold sample (0: the k-th, ``selection.start_rank``) scores and selects the sample in one kernel (seed_w.cu,
    where Hopper's kernels are built: the caller checks): ``EngineOptions.fused_seed`` and ``warpgroup_mma``, k at
    most SEED_W_MAX_K, a rank within the 4 lanes' kept keys (:func:`seed_w_kept`), and a search without exclusions
    (``has_excl`` False: with them, cuBLAS's GEMM, the mask and the select took less GPU time, docs/benchmarks.md)."""
    return (options.fused_seed and options.warpgroup_mma and 0 < k <= SEED_W_MAX_K
            and (rank or k) <= 4 * seed_w_kept(k) and not has_excl)


def walk_smem(padded: int) -> int:
    """Dynamic shared memory of walk_w.cu's kernel for rows of ``padded`` columns multiplied (at most
    WALK_MAX_WIDTH): the users' tile and the item tiles in flight (three up to 48 columns, two above: RK_STAGES_OF),
    128 rows each, then each user's stage of 60 keys (52 at 80 columns: RK_STAGE_OF), 8 bytes a key."""
    ks = padded // 16
    return 2 * FUSED_TILE * padded * (1 + (3 if ks <= 3 else 2)) + FUSED_TILE * 8 * (60 if ks <= 4 else 52)


def walks(n_users: int, k: int, width: int, best_first: bool, has_floor: bool, options: EngineOptions) -> bool:
    """Whether a float16 fused pass of ``n_users`` keeping ``k`` candidates a user, of rows ``width`` halves wide,
    takes the walk (where ``EngineOptions.fused_walk`` asks for it, and ``warpgroup_mma`` for Hopper's kernels,
    whose building the caller checks): a pass whose candidates come in no order (``best_first`` False: fast mode's
    and the certified route's), not starting from floors, with rows of at most WALK_MAX_WIDTH columns once rounded
    up to 16 and k at most WALK_MAX_K, and at least WALK_MIN_USERS users (a kernel's blocks are 128 users each:
    fewer leave most of the GPU idle)."""
    return (options.fused_walk and options.warpgroup_mma and not best_first and not has_floor and 0 < k <= WALK_MAX_K
            and padded_width(width) <= WALK_MAX_WIDTH and n_users >= WALK_MIN_USERS)


def padded_width(width: int, multiplied: int = 0) -> int:
    """The columns a float16 kernel multiplies of rows ``width`` halves wide: ``multiplied`` (a multiple of 16;
    0: the rows' width rounded up to 16), at most that."""
    return min(multiplied or width + 15, width + 15) // 16 * 16


def half_smem(padded: int, chunk: int = 0) -> int:
    """Dynamic shared memory of fused_h.cu's kernel for rows of ``padded`` columns multiplied, taken ``chunk`` halves
    a pipeline stage (0: :func:`half_chunk`'s): the users' rows and three item chunks, each row padded by 8 halves."""
    chunk = chunk or half_chunk(padded)
    return 2 * FUSED_TILE * (padded + 8 + _H_STAGES * (chunk + 8))


def half_kernel_name(chunk: int) -> str:
    """fused_h.cu's kernel that takes ``chunk`` halves a pipeline stage (``Selection.fused_h``'s keys)."""
    return "recall_fused_filter_h" if chunk == _H_CHUNK else f"recall_fused_filter_h{chunk}"


def half_chunk(padded: int) -> int:
    """The halves of an item row each pipeline stage of the float16 kernel holds, for ``padded`` columns multiplied
    (a multiple of 16): the whole row up to 96 (one chunk a tile: one barrier and one wait a tile, and at 80 columns
    no second stage for the last 16), else 64 (three stages of the whole row would leave room for one block an SM)."""
    return padded if padded <= _H_WHOLE_MAX else _H_CHUNK


def covers(dim: int, dtype: Any, half_max: int = FUSED_H_MAX_WIDTH) -> bool:
    """Whether a fused kernel takes vectors of ``dim`` columns of ``dtype``: float32 of at most 256 dimensions, or
    float16 rows of whole 16-byte pieces (a multiple of 8 columns, as fast mode's are) of at most ``half_max``
    (:func:`half_max_width`; for float16, ``dim`` is the columns multiplied: :func:`multiplied_width`)."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return dim <= FUSED_MAX_DIM
    return dtype == np.float16 and dim % 8 == 0 and dim <= half_max


def half_max_width(warpgroup_kernels: bool, options: EngineOptions) -> int:
    """The most columns a fused float16 kernel multiplies: 144 where Hopper's wgmma kernels are built
    (``warpgroup_kernels``) and asked for (``options.warpgroup_mma``), else 128 (fused_h.cu)."""
    return FUSED_W_MAX_WIDTH if warpgroup_kernels and options.warpgroup_mma else FUSED_H_MAX_WIDTH


def applies(plan: TilePlan, n_users: int, n_items: int, k: int, dim: int, dtype: Any,
            options: EngineOptions, half_max: int = FUSED_H_MAX_WIDTH) -> bool:
    """Whether a search takes the fused path: vectors a kernel covers (:func:`covers`), one vector per user, at
    least a kernel tile's 128 users, and either a seeded search of k up to FUSED_SEEDED_MAX_K (float16:
    FUSED_HALF_SEEDED_MAX_K) or an unseeded one of a k so large that a user's candidate buffer holds two whole
    segments (then the first segments, which pass every score before the threshold rises, cannot overflow it: at
    k = 8,192 on 10k x 1M x 64, 0.18 s against 0.48 s for cuBLAS + filter). ``options.fused``: "force" also
    otherwise (fewer users too), "off" never. ``half_max``: :func:`half_max_width`."""
    if options.fused == "off" or not covers(dim, dtype, half_max) or plan.interests is not None:
        return False
    if options.fused == "force":
        return True
    # Fewer users than a kernel's tile of 128 would pay for the whole tile's products (one user: 128 times the
    # work); cuBLAS's GEMM does not.
    if n_users < FUSED_TILE:
        return False
    if search_seed_size(plan, n_items, k, options):
        return k <= (FUSED_HALF_SEEDED_MAX_K if np.dtype(dtype) == np.float16 else FUSED_SEEDED_MAX_K)
    return fused_capacity(k) >= 2 * options.fused_segment


def operand(items: DeviceItems, stream: Any) -> Any:
    """The items as a fused kernel reads them: float32 transposed and padded (built once, on ``stream``), float16
    as they are."""
    return items.vecs if items.dtype == np.float16 else items.transposed(stream)


#: The fused path's block merge takes a block of MERGE_SMALL_THREADS threads a user where the user keeps at most
#: MERGE_SMALL_K keys (K rounded up to a power of two), else MERGE_THREADS: at small k a user holds few keys besides
#: its candidates, and the radix select's loops over them, its histogram and its barriers cost a 256-thread block
#: the same however few there are. (Up to MERGE_WARP_K keys the warp merge below takes them.)
MERGE_SMALL_K = 64
MERGE_SMALL_THREADS = 64


#: Where a user keeps at most MERGE_WARP_K keys (K rounded up to a power of two), the fused path's merge takes a warp
#: a user, MERGE_WARP_USERS users a block (RECALL_MERGE_WARPS in topk.cu): each lane holds MERGE_WARP_HELD of the
#: user's keys (8 or 16) in registers and the warp finds the K-th largest bit by bit, with no barrier and no shared
#: memory (but a best-first final merge's sort); a user with more keys than the warp holds (or whose buffer
#: overflowed) is merged by the block merge's radix select, run by its warp (``recall_merge_warp_body``). The block
#: merge (64 threads a user) was issue-bound with a third of its stalls at barriers (1M x 20k x 32 l2, Nsight
#: Compute, docs/benchmarks.md), where a user at k = 10 merges 27-60 keys. 0: the block merge at every k.
MERGE_WARP_K = 64
MERGE_WARP_HELD = 8
MERGE_WARP_USERS = 8


def merge_threads(k_pad: int) -> int:
    """Threads of a fused-path merge block of a state of ``k_pad`` keys a user (the kernel takes any multiple of
    32)."""
    return MERGE_SMALL_THREADS if k_pad <= MERGE_SMALL_K else MERGE_THREADS


def merge_high_water(state: GpuTopK) -> int:
    """Candidates a user holds before the merge after a segment folds them in. Early merges raise the threshold: the
    seed's k-th best sampled score is about the (k * n_items / sample)-th best overall, while after one merge the
    threshold is the k-th best of a whole segment, so later segments pass (and append with a global atomic) a
    fraction of the scores."""
    return min(max(state.k, 256), state.cand_capacity // 2)


def segments(tiles: int, seg: int, first: int = 0) -> list[tuple[int, int]]:
    """(first tile, tiles) of each launch of a fused search over ``tiles`` item tiles: ``first`` tiles (0: ``seg``),
    then ``seg`` tiles a launch."""
    first = min(first or seg, seg, tiles)
    return [(0, first)] * (tiles > 0) + [(t0, min(seg, tiles - t0)) for t0 in range(first, tiles, seg)]


def first_launch(option: int | str, sample: int, n_items: int, even: bool) -> int:
    """Items of a seeded fused search's first launch (``EngineOptions.fused_first_segment``; 0: a whole segment).
    "auto": sqrt(sample x items) where the threshold sample is ``even`` (evenly spaced rows, not half the largest
    norms) and that is at most half the catalogue, else 0. Why: a sample of s evenly spaced items puts each user's
    threshold near the (k x items / s)-th best score, so one launch passes about k x items / s scores a user; a first
    launch of F items whose merge raises the threshold to their k-th best passes about k F / s, then k items / F, in
    all least at F = sqrt(s x items): 2.0-2.8x fewer on the CPU's count (scripts/lab/pass_counts.py,
    docs/benchmarks.md) for l2 and cosine, and for the float16 pass at k = 10 where it starts at an estimate; a
    sample half from the largest norms (the inner product) already starts near the k-th best."""
    if option != "auto":
        return int(option)
    first = math.isqrt(sample * n_items) if sample and even else 0
    return first if first <= n_items // 2 else 0


class FusedSearch:
    """The fused kernels' launches for one device (their shared-memory limits raised once)."""

    def __init__(self, selection: Selection) -> None:
        self.sel = selection
        self._smem_limits: dict[int, int] = {}

    def search(self, users_t: Any, users: Any, items_t: Any, n_items: int, state: GpuTopK, ex_ptr: Any,
               ex_items: Any, has_excl: bool, options: EngineOptions, multiplied: int = 0,
               best_first: bool = True, first: int = 0, out: tuple | None = None) -> None:
        """Score one block's n users against every item, a segment of items per launch, each followed by a merge;
        the last merge sorts. float32: ``users_t`` is the workspace's (padded dim, padded capacity) buffer for the
        block's users transposed (zero beyond them), ``items_t`` the items transposed (:func:`operand`); float16:
        ``users`` (n, W) and ``items_t`` the items (n_items, W) themselves, ``users_t`` unused, ``multiplied`` the
        columns multiplied (:func:`multiplied_width` of the search's users; 0: all of them). ``best_first``: the
        last merge sorts each user's results (else they are written in no order, ``selection.final_code``);
        ``first``: the items of the first launch (``EngineOptions.fused_first_segment`` where the search is seeded
        from a sample; 0: a whole segment); ``out``: (n, k) device float32 scores and int64 rows, C-contiguous, that the
        final merge writes the results to instead of ``state.out_vals`` / ``out_rows``."""
        n = users.shape[0]
        if users.dtype == np.float16:
            launch, merges, operands = self._half(users, items_t, n_items, state, multiplied, options.warpgroup_mma)
        else:
            launch, merges, operands = self._single(users_t, users, items_t, n_items, state)
        block_merge, warp_merges = merges
        k_pad, merge_smem = self.sel.merge_smem(state.k)
        # The merge's arguments around its operands: the state, then the segment and the search's constants.
        head = (state.top, state.n_valid, state.thr, state.cand, state.cnt, state.base, *operands)
        sizes = (np.int32(state.k), np.int32(k_pad), np.int32(state.cand_capacity))
        results = (state.out_vals, state.out_rows) if out is None else out
        done = (*results, ex_ptr, ex_items, np.int32(1 if has_excl else 0))
        if k_pad <= MERGE_WARP_K:
            merge = warp_merges[MERGE_WARP_HELD]
            grid, threads = (-(-n // MERGE_WARP_USERS),), 32 * MERGE_WARP_USERS
            done, merge_smem = (*done, np.int32(n)), MERGE_WARP_USERS * merge_smem
        else:
            merge, grid, threads = block_merge, (n,), merge_threads(k_pad)

        def merged(start: int, n_tile: int, final: bool, high_water: int) -> None:
            merge(grid, (threads,), (*head, np.int32(start), np.int32(n_tile), np.int32(n_items), *sizes,
                                     np.int32(high_water), np.int32(final_code(final, best_first)), *done),
                  shared_mem=merge_smem)

        tiles = -(-n_items // FUSED_TILE)
        seg = max(1, options.fused_segment // FUSED_TILE)
        per_cta = max(1, options.fused_tiles_per_block)
        # The last segment's merge is the final one: it folds that segment's candidates in (recomputing the segment
        # where a user's buffer overflowed) and writes the results, one launch where a merge and then a final merge
        # of nothing new took two. A shorter first launch's merge folds whatever it passed (high water 0), so that
        # the thresholds rise before the rest; later ones only past merge_high_water.
        for i, (t0, nt) in enumerate(segments(tiles, seg, -(-first // FUSED_TILE))):
            launch((-(-nt // per_cta), -(-n // FUSED_TILE)), t0, nt, per_cta)
            start, final = t0 * FUSED_TILE, t0 + nt >= tiles
            raising = i == 0 and first > 0 and not final
            merged(start, min(nt * FUSED_TILE, n_items - start), final, 0 if raising else merge_high_water(state))
        if not tiles:
            merged(0, 0, True, merge_high_water(state))

    def walk(self, users: Any, items: Any, n_items: int, state: GpuTopK, ex_ptr: Any, ex_items: Any,
             has_excl: bool, multiplied: int = 0) -> None:
        """The walk (:func:`walks`) of one block's n users ((n, W) float16) against the float16 ``items`` (n_items,
        W): each user's ``state.k`` best scores, in no order, into ``state.out_vals`` / ``out_rows`` (-inf and -1
        past its candidates), excluded items (``ex_ptr`` / ``ex_items``, where ``has_excl``) left out; the state's
        other arrays are not touched."""
        n, width = users.shape
        padded = padded_width(width, multiplied)
        kernel, smem = self.sel.walk_w[padded], walk_smem(padded)
        self._allow_smem(kernel, smem)
        kernel((-(-n // FUSED_TILE),), (_H_THREADS,),
               (users, np.int32(n), items, np.int32(n_items), np.int32(width), np.int32(state.k), state.out_vals,
                state.out_rows, ex_ptr, ex_items, np.int32(1 if has_excl else 0)), shared_mem=smem)

    def seed(self, state: GpuTopK, users: Any, sample: Any, item_norms: Any, estimate: int = 0,
             constant: tuple[int, float] | None = None, bias: tuple[int, int, Any] | None = None,
             multiplied: int = 0, thr: Any = None) -> None:
        """``Selection.seed``'s thresholds for n float16 users (n, W) from the sample's float16 rows ``sample``
        (size, W) themselves, in a search without exclusions (:func:`seeds_fused`): seed_w.cu scores and selects them
        in one kernel, just below each user's rank-th best of the keys its lanes kept, unlowered: the pass's own
        scores of those items (the same wgmma sums), at or below its rank-th best sampled score (see the kernel).
        Into ``state.thr`` (one block's users), or ``thr`` (float32 (n,): a whole search's users at once, the
        pipeline's ``preseeded``; ``state`` then gives only k). ``item_norms``, ``estimate``, ``constant``, ``bias``:
        ``Selection.seed``'s arguments (the margins' unread); ``multiplied``: :meth:`search`'s."""
        n, width = users.shape
        padded = padded_width(width, multiplied)
        kernel, smem = self.sel.seed_w[(padded, seed_w_wide(state.k))], seed_w_smem(padded)
        self._allow_smem(kernel, smem)
        args = self.sel.seed_args(state, users, item_norms, False, estimate, constant, bias, thr)
        kernel((-(-n // FUSED_TILE),), (_H_THREADS,),
               (sample, np.int32(sample.shape[0]), np.int32(state.k), np.int32(n), *args), shared_mem=smem)

    def _single(self, users_t: Any, users: Any, items_t: Any, n_items: int, state: GpuTopK) -> tuple:
        """(launch of a segment, merge kernels (one block a user, and one warp a user by MERGE_WARP_HELD), the
        merge's operands) of float32 vectors (fused.cu); the block's users
        are written transposed into ``users_t``."""
        n, dim = users.shape
        users_t[:dim, :n] = users.T
        dp, ldu = users_t.shape
        dk = -(-dim // 8) * 8  # the dimensions multiplied: the last chunk of 32 takes only what it needs
        smem = 4 * FUSED_TILE * (dp + 2 * FUSED_CHUNK)
        fused = self.sel.fused
        self._allow_smem(fused, smem)

        def launch(grid: tuple, t0: int, nt: int, per_cta: int) -> None:
            fused(grid, (FUSED_THREADS,),
                  (users_t, np.int32(ldu), items_t, np.int64(items_t.shape[1]), np.int32(dp), np.int32(dk),
                   np.int32(t0), np.int32(nt), np.int32(per_cta), np.int32(n_items), np.int32(n), state.thr,
                   state.cand, np.int32(state.cand_capacity), state.cnt), shared_mem=smem)

        operands = (users_t, np.int32(ldu), items_t, np.int64(items_t.shape[1]), np.int32(dk))
        return launch, (self.sel.merge_fused, self.sel.merge_fused_warp), operands

    def _half(self, users: Any, items: Any, n_items: int, state: GpuTopK, multiplied: int = 0,
              warpgroup: bool = True) -> tuple:
        """The same for fast mode's float16 rows, read where they are; the kernel multiplies the first
        ``multiplied`` columns (a multiple of 16; 0: the rows' width rounded up to 16) and reads items of the rows'
        width. On Hopper (``warpgroup``, ``EngineOptions.warpgroup_mma``) fused_w.cu's kernel (wgmma), elsewhere
        fused_h.cu's (mma.sync): the same arguments and candidates."""
        n, width = users.shape
        padded = padded_width(width, multiplied)
        wide = self.sel.fused_w.get(padded) if warpgroup else None
        if wide is not None:
            fused, smem = wide, wgmma_smem(padded)
        else:
            fused, smem = self.sel.fused_h[half_chunk(padded)], half_smem(padded)
        self._allow_smem(fused, smem)

        def launch(grid: tuple, t0: int, nt: int, per_cta: int) -> None:
            fused(grid, (_H_THREADS,),
                  (users, np.int32(n), items, np.int32(n_items), np.int32(width), np.int32(padded), np.int32(t0),
                   np.int32(nt), np.int32(per_cta), state.thr, state.cand, np.int32(state.cand_capacity),
                   state.cnt), shared_mem=smem)

        return launch, (self.sel.merge_fused_h, self.sel.merge_fused_h_warp), (users, items, np.int32(width))

    def _allow_smem(self, kernel: Any, smem: int) -> None:
        """Let ``kernel`` take ``smem`` bytes of dynamic shared memory (raised once per kernel, never lowered)."""
        if smem > 48 * 1024 and smem > self._smem_limits.get(id(kernel), 0):
            kernel.max_dynamic_shared_size_bytes = smem
            self._smem_limits[id(kernel)] = smem

