"""Exact mode's fused path: float32 scores filtered in the GEMM's registers (``kernels/fused.cu``), never written
to memory; each segment of items is followed by a merge that recomputes the segment for a user whose candidate
buffer overflowed (with the same FMA sequence, so every score comes out bit for bit the same)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ...core.options import EngineOptions
from ...core.tiling import TilePlan
from .items import FUSED_CHUNK, FUSED_TILE
from .selection import MERGE_THREADS, GpuTopK, Selection, fused_capacity, seed_size

FUSED_THREADS = 256
FUSED_MAX_DIM = 256  # the users' vectors of a block stay in shared memory: 128 x 256 floats at most


def applies(plan: TilePlan, n_items: int, k: int, dim: int, dtype: Any, options: EngineOptions) -> bool:
    """Whether a search takes the fused path: float32 vectors of at most 256 dimensions, one vector per user, and
    either a seeded search or a k so large that a user's candidate buffer holds two whole segments (then the first
    segments, which pass every score before the threshold rises, cannot overflow it: at k = 8,192 on 10k x 1M x 64,
    0.18 s against 0.48 s for cuBLAS + filter, docs/benchmarks.md). ``options.fused``: "force" also otherwise,
    "off" never."""
    if options.fused == "off" or np.dtype(dtype) != np.float32 or dim > FUSED_MAX_DIM or plan.interests is not None:
        return False
    return (options.fused == "force" or fused_capacity(k) >= 2 * options.fused_segment
            or seed_size(n_items, k, plan.item_tile * plan.tiles_per_call, options.seed_thresholds) > 0)


class FusedSearch:
    """The fused kernel's launches for one device (its shared-memory limit raised once)."""

    def __init__(self, selection: Selection) -> None:
        self.sel = selection
        self._smem_limit = 0

    def search(self, users_t: Any, users: Any, items_t: Any, n_items: int, state: GpuTopK, ex_ptr: Any,
               ex_items: Any, has_excl: bool, options: EngineOptions) -> None:
        """Score one block's n users against every item, a segment of items per launch, each followed by a merge;
        the last merge sorts. ``users_t``: the workspace's (padded dim, padded capacity) buffer for the block's
        users transposed (zero beyond them)."""
        n, dim = users.shape
        users_t[:dim, :n] = users.T
        dp, ldu = users_t.shape
        smem = 4 * FUSED_TILE * (dp + 2 * FUSED_CHUNK)
        fused = self.sel.fused
        if smem > 48 * 1024 and smem > self._smem_limit:
            fused.max_dynamic_shared_size_bytes = smem
            self._smem_limit = smem
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

    def _merge(self, state: GpuTopK, users_t: Any, items_t: Any, n: int, item_start: int, n_tile: int,
               n_items: int, final: bool, ex_ptr: Any, ex_items: Any, has_excl: bool) -> None:
        k_pad, smem = self.sel.merge_smem(state.k)
        c = state.cand_capacity
        # Candidates a user holds before the merge after a segment folds them in. Early merges raise the threshold:
        # the seed's k-th best sampled score is about the (k * n_items / sample)-th best overall, while after one
        # merge the threshold is the k-th best of a whole segment, so later segments pass (and append with a global
        # atomic) a fraction of the scores.
        merge_at = min(max(state.k, 256), c // 2)
        self.sel.merge_fused((n,), (MERGE_THREADS,),
                             (state.top, state.n_valid, state.thr, state.cand, state.cnt, state.base, users_t,
                              np.int32(users_t.shape[1]), items_t, np.int64(items_t.shape[1]),
                              np.int32(users_t.shape[0]), np.int32(item_start), np.int32(n_tile), np.int32(n_items),
                              np.int32(state.k), np.int32(k_pad), np.int32(c), np.int32(merge_at),
                              np.int32(1 if final else 0), state.out_vals, state.out_rows, ex_ptr, ex_items,
                              np.int32(1 if has_excl else 0)),
                             shared_mem=smem)
