"""The fused path: scores filtered in the GEMM's registers, never written to memory. Exact mode's float32 vectors go
through ``kernels/fused.cu`` (FMA on the CUDA cores), fast mode's float16 vectors through ``kernels/fused_h.cu``
(tensor cores, float32 accumulation). Each segment of items is followed by a merge that recomputes the segment for
a user whose candidate buffer overflowed (float32: with the same FMA sequence, so every score comes out bit for bit
the same; float16: in order, within the certificate's bound like the tensor cores' sums)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ...core.options import EngineOptions
from ...core.tiling import TilePlan
from .items import FUSED_CHUNK, FUSED_TILE, DeviceItems
from .selection import MERGE_THREADS, GpuTopK, Selection, fused_capacity, seed_size

FUSED_THREADS = 256
FUSED_MAX_DIM = 256  # the users' vectors of a block stay in shared memory: 128 x 256 floats at most
#: float16 rows of at most this many columns take the fused kernel (fused_h.cu): at 80 columns (S1's d = 64 with fast
#: mode's own) it beat cuBLAS + filter (fast mode on S1 0.19 s against 0.23 s), at 264 (d = 256) it lost (0.083 s
#: against 0.059 s), its filter then costing about as much per score as 80 columns of products. Measured before the
#: filter tested groups of scores first (docs/benchmarks.md); the limit has not been measured again since.
FUSED_H_MAX_WIDTH = 128
_H_CHUNK, _H_STAGES = 64, 3  # fused_h.cu's RH_CHUNK and RH_STAGES


def covers(dim: int, dtype: Any) -> bool:
    """Whether a fused kernel takes vectors of ``dim`` columns of ``dtype``: float32 of at most 256 dimensions, or
    float16 rows of whole 16-byte pieces (a multiple of 8 columns, as fast mode's are) of at most 128."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return dim <= FUSED_MAX_DIM
    return dtype == np.float16 and dim % 8 == 0 and dim <= FUSED_H_MAX_WIDTH


def applies(plan: TilePlan, n_items: int, k: int, dim: int, dtype: Any, options: EngineOptions) -> bool:
    """Whether a search takes the fused path: vectors a kernel covers (:func:`covers`), one vector per user, and
    either a seeded search or a k so large that a user's candidate buffer holds two whole segments (then the first
    segments, which pass every score before the threshold rises, cannot overflow it: at k = 8,192 on 10k x 1M x 64,
    0.18 s against 0.48 s for cuBLAS + filter, docs/benchmarks.md). ``options.fused``: "force" also otherwise,
    "off" never."""
    if options.fused == "off" or not covers(dim, dtype) or plan.interests is not None:
        return False
    return (options.fused == "force" or fused_capacity(k) >= 2 * options.fused_segment
            or seed_size(n_items, k, plan.item_tile * plan.tiles_per_call, options.seed_thresholds) > 0)


def operand(items: DeviceItems, stream: Any) -> Any:
    """The items as a fused kernel reads them: float32 transposed and padded (built once, on ``stream``), float16
    as they are."""
    return items.vecs if items.dtype == np.float16 else items.transposed(stream)


def merge_high_water(state: GpuTopK) -> int:
    """Candidates a user holds before the merge after a segment folds them in. Early merges raise the threshold: the
    seed's k-th best sampled score is about the (k * n_items / sample)-th best overall, while after one merge the
    threshold is the k-th best of a whole segment, so later segments pass (and append with a global atomic) a
    fraction of the scores."""
    return min(max(state.k, 256), state.cand_capacity // 2)


class FusedSearch:
    """The fused kernels' launches for one device (their shared-memory limits raised once)."""

    def __init__(self, selection: Selection) -> None:
        self.sel = selection
        self._smem_limits: dict[int, int] = {}

    def search(self, users_t: Any, users: Any, items_t: Any, n_items: int, state: GpuTopK, ex_ptr: Any,
               ex_items: Any, has_excl: bool, options: EngineOptions) -> None:
        """Score one block's n users against every item, a segment of items per launch, each followed by a merge;
        the last merge sorts. float32: ``users_t`` is the workspace's (padded dim, padded capacity) buffer for the
        block's users transposed (zero beyond them), ``items_t`` the items transposed (:func:`operand`); float16:
        ``users`` (n, W) and ``items_t`` the items (n_items, W) themselves, ``users_t`` unused."""
        if users.dtype == np.float16:
            self._search_h(users, items_t, n_items, state, ex_ptr, ex_items, has_excl, options)
            return
        n, dim = users.shape
        users_t[:dim, :n] = users.T
        dp, ldu = users_t.shape
        smem = 4 * FUSED_TILE * (dp + 2 * FUSED_CHUNK)
        fused = self.sel.fused
        self._allow_smem(fused, smem)
        tiles = -(-n_items // FUSED_TILE)
        seg = max(1, options.fused_segment // FUSED_TILE)
        per_cta = max(1, options.fused_tiles_per_block)
        for t0 in range(0, tiles, seg):
            nt = min(seg, tiles - t0)
            fused((-(-nt // per_cta), -(-n // FUSED_TILE)), (FUSED_THREADS,),
                  (users_t, np.int32(ldu), items_t, np.int64(items_t.shape[1]), np.int32(dp), np.int32(t0),
                   np.int32(nt), np.int32(per_cta), np.int32(n_items), np.int32(n), state.thr, state.cand,
                   np.int32(state.cand_capacity), state.cnt), shared_mem=smem)
            start = t0 * FUSED_TILE
            self._merge(state, users_t, items_t, n, start, min(nt * FUSED_TILE, n_items - start), n_items, False,
                        ex_ptr, ex_items, has_excl)
        self._merge(state, users_t, items_t, n, 0, 0, n_items, True, ex_ptr, ex_items, has_excl)

    def _search_h(self, users: Any, items: Any, n_items: int, state: GpuTopK, ex_ptr: Any, ex_items: Any,
                  has_excl: bool, options: EngineOptions) -> None:
        n, width = users.shape
        padded = -(-width // 16) * 16
        smem = 2 * FUSED_TILE * (padded + 8 + _H_STAGES * (_H_CHUNK + 8))
        fused = self.sel.fused_h
        self._allow_smem(fused, smem)
        tiles = -(-n_items // FUSED_TILE)
        seg = max(1, options.fused_segment // FUSED_TILE)
        per_cta = max(1, options.fused_tiles_per_block)
        k_pad, merge_smem = self.sel.merge_smem(state.k)
        c = state.cand_capacity
        merge_at = merge_high_water(state)

        def merge(start: int, n_tile: int, final: bool) -> None:
            self.sel.merge_fused_h((n,), (MERGE_THREADS,),
                                   (state.top, state.n_valid, state.thr, state.cand, state.cnt, state.base, users,
                                    items, np.int32(width), np.int32(start), np.int32(n_tile), np.int32(n_items),
                                    np.int32(state.k), np.int32(k_pad), np.int32(c), np.int32(merge_at),
                                    np.int32(1 if final else 0), state.out_vals, state.out_rows, ex_ptr, ex_items,
                                    np.int32(1 if has_excl else 0)),
                                   shared_mem=merge_smem)

        for t0 in range(0, tiles, seg):
            nt = min(seg, tiles - t0)
            fused((-(-nt // per_cta), -(-n // FUSED_TILE)), (FUSED_THREADS,),
                  (users, np.int32(n), items, np.int32(n_items), np.int32(width), np.int32(padded), np.int32(t0),
                   np.int32(nt), np.int32(per_cta), state.thr, state.cand, np.int32(c), state.cnt),
                  shared_mem=smem)
            start = t0 * FUSED_TILE
            merge(start, min(nt * FUSED_TILE, n_items - start), False)
        merge(0, 0, True)

    def _allow_smem(self, kernel: Any, smem: int) -> None:
        """Let ``kernel`` take ``smem`` bytes of dynamic shared memory (raised once per kernel, never lowered)."""
        if smem > 48 * 1024 and smem > self._smem_limits.get(id(kernel), 0):
            kernel.max_dynamic_shared_size_bytes = smem
            self._smem_limits[id(kernel)] = smem

    def _merge(self, state: GpuTopK, users_t: Any, items_t: Any, n: int, item_start: int, n_tile: int,
               n_items: int, final: bool, ex_ptr: Any, ex_items: Any, has_excl: bool) -> None:
        k_pad, smem = self.sel.merge_smem(state.k)
        c = state.cand_capacity
        merge_at = merge_high_water(state)
        self.sel.merge_fused((n,), (MERGE_THREADS,),
                             (state.top, state.n_valid, state.thr, state.cand, state.cnt, state.base, users_t,
                              np.int32(users_t.shape[1]), items_t, np.int64(items_t.shape[1]),
                              np.int32(users_t.shape[0]), np.int32(item_start), np.int32(n_tile), np.int32(n_items),
                              np.int32(state.k), np.int32(k_pad), np.int32(c), np.int32(merge_at),
                              np.int32(1 if final else 0), state.out_vals, state.out_rows, ex_ptr, ex_items,
                              np.int32(1 if has_excl else 0)),
                             shared_mem=smem)
