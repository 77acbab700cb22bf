"""Exact running top-k on the device (``kernels/topk.cu``): the per-block state and the launches that filter score
tiles into candidate buffers, merge candidates into the state by radix select, and seed thresholds from a sample."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...core.certificate import seed_margin
from . import kernels

log = logging.getLogger("recall")

MERGE_THREADS = 256
FILTER_THREADS = 256
SEED_THREADS = 256  # RECALL_SEED_THREADS in topk.cu
#: Block sizes of the block-a-user select (``recall_seed``, ``recall_seed512``, ``recall_seed1024``): each thread holds
#: 32 keys in registers (RECALL_SEED_HELD float4 loads) where the row is a multiple of 4 long, so a row of up to 32
#: times the block's threads is read once; a longer one (or one not a multiple of 4) is read again for every pass of
#: the select (``seed_threads``).
SEED_BLOCKS = (256, 512, 1024)
SEED_HELD_PER_THREAD = 32
SEED_WARP_USERS = 8  # RECALL_SEED_WARP_USERS in topk.cu
#: Threshold samples whose rank (k, or the estimate's) is at most this and whose rows hold at most SEED_WARP_MAX_SIZE
#: scores are selected one warp a user (``recall_seed_warp*``), larger ranks one block a user (``recall_seed``). On the
#: H200 (docs/benchmarks.md) the warp select took 1.5 ms for 200k users x 2,048 sampled scores at rank 30 (the block
#: 5.5 ms), 2.2 ms for 100k x 8,192 at rank 100 (3.4 ms), 1.4 ms for 20k x 32,768 at rank 100 (3.0 ms); rows of
#: 65,536 (the longest either takes) were tested, not timed.
SEED_WARP_RANK = 128
SEED_WARP_MAX_SIZE = 65_536
#: Ranks at most this take the warp-a-user select whose lanes keep 8 keys each (``recall_seed_warp*8``), not 16: each
#: key a lane reads costs a place of the ones it keeps, and a lane holds more than 8 of a row's best 64 rarely (the
#: whole-row bisection covers it when it does). At k = 10 (H100, 2026-12-06, docs/benchmarks.md) ranks up to 16 made
#: the route 0-3.8% faster on 200k-1M users x 20k items, the float32 search 1.3-2.7%; up to 64 (the route's rank at
#: k = 10 is 27: k + its margin + 1) the route a further 4-6% on 1M x 4,096, 200k x 20k l2 and 100k x 20k (0.0195
#: -> 0.0183 s, 0.0098 -> 0.0093, 0.0046 -> 0.0044), the same elsewhere.
SEED_WARP_SMALL_RANK = 64


#: The threshold selects' (score type, vector type) and their kernels' suffix: exact mode; fast mode's cuBLAS path;
#: fast mode's fused path (float32 scores of its samples).
_SEED_TYPES = (((np.dtype(np.float32), np.dtype(np.float32)), ""), ((np.dtype(np.float16), np.dtype(np.float16)), "_h"),
               ((np.dtype(np.float32), np.dtype(np.float16)), "_fh"))


def seed_w_kernels(mod: Any) -> dict:
    """seed_w.cu's kernels of a built Hopper module by (the columns multiplied, 16 to 144; whether they are the
    ``_wide`` kernels, which keep more keys a lane: ``fused.seed_w_wide``)."""
    return {(16 * ks, wide): mod.get_function(f"recall_seed_w{ks}{'_wide' if wide else ''}") for ks in range(1, 10)
            for wide in (False, True)}


def seed_warp_kernels(mod: Any) -> dict:
    """The warp-a-user select of small ranks (SEED_WARP_RANK) of a built selection module, by (score type, vector
    type, keys a lane keeps: 16, or 8 for ranks up to SEED_WARP_SMALL_RANK)."""
    return {(s, v, m): mod.get_function(f"recall_seed_warp{name}{'' if m == 16 else m}")
            for (s, v), name in _SEED_TYPES for m in (8, 16)}


def seed_threads(size: int) -> int:
    """Threads of the block-a-user select of a row of ``size`` sampled scores: the fewest of SEED_BLOCKS that hold the
    row in registers (a multiple of 4 up to 32,768 scores), else SEED_THREADS, which streams it. A row of 16,384
    (the certified route's sample at k = 2,048 on 100k items) streamed at 256 threads was read twice or more (its
    range, then a digit or two)."""
    if size % 4 == 0:
        for threads in SEED_BLOCKS:
            if size <= SEED_HELD_PER_THREAD * threads:
                return threads
    return SEED_THREADS


def candidate_capacity(k: int) -> int:
    """Candidates a user holds between merges on the cuBLAS path: room for several tiles' survivors (a merge runs
    once a user's buffer is half full)."""
    return max(4096, 4 * k)


def fused_capacity(k: int, n_items: int = 0) -> int:
    """Candidates a user holds on the fused path: it cannot rescan a score tile when a user's buffer overflows (it
    recomputes the segment's scores, slowly), so its buffer holds about all the survivors a seeded search passes:
    k * n_items / sample size. A search of ``n_items`` items (0: not known) holds no more than the power of two at
    least n_items: a user's filters pass each item at most once a search, so such a buffer never overflows (at 4,096
    items, 4,096 keys a user where 16,384 put 32,768 users at 4 GiB)."""
    room = pow2(max(16384, 32 * k))
    return min(room, pow2(n_items)) if n_items > 0 else room


#: A search seeded from a bound (not an estimate, ``estimate_rank``) on a small catalogue doubles its sample where
#: the rule's sample holds fewer than this many times k items (its k-th best, the seed, would pass more than a
#: sixteenth of the catalogue), from a catalogue of at least 3 doubled samples:
#: 200k x 100k x 32, k = 2,048, l2 (the float32 search): 0.20 s from 32,768 items, 0.27 s from 16,384 (H200,
#: 2026-12-04, docs/benchmarks.md). Passes that estimate keep the rule's sample (k = 1,000 there: 0.104 s from
#: 16,384, 0.124 s from 32,768).
BOUND_SAMPLE_PER_K = 16
#: A search that may start at an estimate (not ``bound``) takes this fraction of the rule's sample where the smaller
#: one still holds 2 k items and the estimate applies to it (``estimate_rank`` of it, counted as if half its rows came
#: from the largest norms: mu >= ESTIMATE_EVEN_MU and a rank under k): the estimate's rank, not k, is selected from it,
#: and its few more survivors cost less than the sample's GEMM and select. The certified route on the H100
#: (2026-12-05, docs/benchmarks.md), half the sample against the whole, side by side: 0.98x the time on 200k x 100k x
#: 64 l2 at k = 2,048 (8,192 items from 16,384), 0.95-0.97x at d = 32, 0.95x on 100k x 130k x 64 cosine, 0.96-0.98x
#: on 200k x 100k x 64 ip at k = 1,000 (4,096 from 8,192), 0.94x on 100k x 400k at k = 3,000, 0.95-0.97x on 10k x 1M
#: at k = 4,096, 0.97-1.01x on 20k x 1M at k = 1,000 and 2,048 (16,384 from 32,768); a quarter took 0.95x on the ip
#: cell and 1.11x on 20k x 1M l2.
ESTIMATE_SAMPLE_SHARE = 2
#: A catalogue of fewer than 8 rule samples where k is small for it (at most a 256th of it) samples the largest power of
#: two at most a SMALL_K_SAMPLE_SHARE-th of it or SMALL_K_SAMPLE_PER_K k, whichever is more, and at most a
#: SMALL_K_TINY_SHARE-th of it up to SMALL_K_MIN_SAMPLE items where that is more (catalogues under 8,192 items), of at
#: least SMALL_K_LEAST_SAMPLE items (else it is not seeded). Unseeded, such a search took the cuBLAS path, every score a
#: tile: 200k x 20k x 32 l2 at k = 10 0.083 s, seeded from 1,024 items 0.017 s (2,048: 0.017, 4,096: 0.026); 500k x 20k
#: x 64 cosine at k = 50 0.223 s, from 2,048 0.058 s (1,024: 0.061, 4,096: 0.062); 200k x 50k x 128 ip at k = 100 0.251
#: s, from 2,048 0.070 s (4,096: 0.073, 8,192: 0.081); 1M x 20k x 32 at k = 10 0.391 s, from 1,024 0.061 s (H100,
#: 2026-12-05, docs/benchmarks.md). From 512 items on: 1M x 8,192 x 64 at k = 10 took 0.208 s unseeded, the float32
#: search from 512 items 0.048 s (256: 0.050, 1,024: 0.050), the route 0.036 s; 300k x 16,000 x 128 at k = 16 0.128 s,
#: 0.037 s, the route 0.015 s. Under 8,192 items (H100, 2026-12-05): 1M x 8,000 x 64 at k = 10 0.195 s unseeded, the
#: route from 512 items 0.027 s (256: 0.029, 128: 0.043); 1M x 4,096 x 64 at k = 1 0.088 s, from 512 0.023 s (256:
#: 0.023, 128: 0.026); 100k x 4,096 x 128 cosine at k = 5 0.0114 s, from 64-512 0.0052-0.0055 s.
SMALL_K_SAMPLE_SHARE = 16
SMALL_K_SAMPLE_PER_K = 32
SMALL_K_TINY_SHARE = 8
SMALL_K_MIN_SAMPLE = 512
SMALL_K_LEAST_SAMPLE = 128


def seed_size(n_items: int, k: int, capacity: int, seeded: bool = True, requested: int = 0,
              bound: bool = False, loose: bool = False) -> int:
    """Items in a block's threshold sample (see ``recall_seed``), or 0 where seeding does not pay (or is off):
    the sample costs ``size / n_items`` of the search's GEMM work and leaves about ``k * n_items / size`` scores per
    user to pass the filter over the whole search. The rule: 8,192 items or 32 k, whichever is more, from a
    catalogue of at least 8 such samples; from a smaller catalogue where k is large for it (32 k more than an
    eighth of it), the largest power of two at most a quarter of it, whose seed spares the merges the scores of
    whole unseeded tiles (200k x 100k x 32, k = 1,000: 0.190 s seeded from 16,384 items, 0.256 s unseeded,
    docs/benchmarks.md), twice that for a search that starts at the sample's k-th best (``bound``) where it would
    hold fewer than BOUND_SAMPLE_PER_K k items, and half that (an eighth of the catalogue, at least 4 k) for one
    that may start at an estimate (not ``bound``: fast mode's float16 passes, ``estimate_rank``), whose few more
    survivors cost less than the larger sample's select (the certified route on the H200, 2026-12-04,
    docs/benchmarks.md: 8,192 items against 16,384 took 0.875x the time on 200k x 100k x 64 ip at k = 1,000, 0.928x
    under l2 at d = 32, 0.926x on 100k x 65,536 x 64 cosine), unless the sample's ranking sorts few of each user's
    best items first (``loose``: the inner product over items of close norms, ``DeviceItems.loose_ranking``) and the
    pass would not estimate from the half (``estimate_rank`` of k over it, ranked): it would start at the half's
    bound, and the whole sample's is much tighter (normal 1M x 4,096 x 64 ip at k = 50: 1,024 sampled, not 512, took
    0.75x the route's time; where norms spread, clustered and skewed, 1,024 took 1.09x: H100, 2026-12-07,
    docs/benchmarks.md). From a smaller catalogue where k is small for it, a smaller sample (SMALL_K_SAMPLE_SHARE;
    under 8,192 items up to SMALL_K_MIN_SAMPLE, at most an eighth of them), where that holds SMALL_K_LEAST_SAMPLE
    items. Capped by ``capacity``, the score room a block has; at least 4 k items or none. Then a search that may
    start at an estimate takes a smaller share of it where the estimate applies (ESTIMATE_SAMPLE_SHARE). ``requested``:
    ``EngineOptions.seed_sample`` (0: the rule), taken from catalogues of at least twice it."""
    if not seeded:
        return 0
    if requested:
        size, least = min(capacity, requested), 2
    else:
        size, least = min(capacity, max(8192, 32 * k)), 8
        if n_items < 8 * size and 256 * k > n_items:
            size, least = 1 << max(0, (n_items // 4).bit_length() - 1), 4
            if not bound and 8 * k <= size and not (loose and not estimate_rank(k, size // 2, n_items, True)):
                size, least = size // 2, 8
            size = min(capacity, size)
            if (bound and 4 * k <= size < BOUND_SAMPLE_PER_K * k and 2 * size <= capacity
                    and n_items >= 6 * size):
                size, least = 2 * size, 3
        elif n_items < 8 * size:
            share = max(n_items // SMALL_K_SAMPLE_SHARE, SMALL_K_SAMPLE_PER_K * k,
                        min(n_items // SMALL_K_TINY_SHARE, SMALL_K_MIN_SAMPLE))
            size = min(capacity, 1 << (share.bit_length() - 1))
            if size < SMALL_K_LEAST_SAMPLE:
                return 0
    if size < 4 * k or n_items < least * size:
        return 0
    smaller = size // ESTIMATE_SAMPLE_SHARE
    if not bound and not requested and smaller >= 2 * k and estimate_rank(k, smaller, n_items, ranked=True):
        return smaller
    return size


def search_seed_size(plan: Any, n_items: int, k: int, options: Any, bound: bool = False, loose: bool = False) -> int:
    """``seed_size`` of a search under ``plan`` (``TilePlan``) and ``options`` (``EngineOptions``): the score room is
    one GEMM call's tiles; users with several vectors are not seeded. ``bound``: the search cannot start at an
    estimate (``estimate_rank``); ``loose``: its sample's ranking sorts few of a user's best items first."""
    if plan.interests is not None:
        return 0
    return seed_size(n_items, k, plan.item_tile * plan.tiles_per_call, options.seed_thresholds, options.seed_sample,
                     bound, loose)


#: The estimate's rank (``estimate_rank``) sits this many standard deviations, plus ESTIMATE_SLACK, above the expected
#: number of evenly spaced sampled items that score above a user's K-th best: the count is about Poisson(mu), and the
#: chance that it reaches the rank (the estimate then lies above the K-th best, and the user ends short) is under 1e-6
#: a user for every mu (mu = 0.5: rank 7, mu = 42: rank 78).
ESTIMATE_SIGMAS = 5.0
ESTIMATE_SLACK = 3
#: An inner-product pass whose estimate is expected this many sampled items above the k-th best (mu, below) or more
#: samples evenly for it, instead of half from the largest norms and a bound: on skewed norms (H200, 2026-12-02,
#: docs/benchmarks.md) mu = 41 (k = 1,000 of 1M items) took 0.92 and 0.90 of the bound's time, mu = 84 (k = 2,048)
#: 0.82; mu = 1 (S1) 0.99 and mu = 0.2 (k = 10) 1.04.
ESTIMATE_EVEN_MU = 16


def estimate_rank(k: int, size: int, n_items: int, ranked: bool = False) -> int:
    """The rank KE in a threshold sample of ``size`` evenly spaced rows of ``n_items`` items whose score starts a
    pass of ``k`` at an *estimate* of each user's k-th best (``recall_seed``): mu = k * size / n_items sampled items
    score above the k-th best on average, and KE = mu + ESTIMATE_SIGMAS sqrt(mu) + ESTIMATE_SLACK, so that about KE *
    n_items / size items pass the filter, not the k * n_items / size of the lower bound. 0 where KE is not below k.

    Only over evenly spaced rows. ``ranked``: the search would otherwise sample half its rows from the largest norms
    (the inner product), which hold more of every user's best items than their share, so that their k-th best is a
    good bound already where the estimate is loose: such a search estimates (from evenly spaced rows) only where mu
    >= ESTIMATE_EVEN_MU. (An estimate over the evenly spaced half of a ranked sample, selected as well as the bound,
    cost 3-18% on S1, 1M x 100k and popular data on the H200, docs/benchmarks.md.)"""
    if size <= 0 or n_items <= 0:
        return 0
    mu = k * size / n_items
    if ranked and mu < ESTIMATE_EVEN_MU:
        return 0
    ke = int(np.ceil(mu + ESTIMATE_SIGMAS * np.sqrt(mu))) + ESTIMATE_SLACK
    return ke if ke < k else 0


def start_rank(k: int, need: int, size: int, n_items: int, ranked: bool = False) -> tuple[int, bool]:
    """Where a seeded pass of ``k`` that may start each user below its k-th best (``Backend.run_blocks``'
    ``left_out``) starts, in its threshold sample of ``size`` rows: (the rank, 0 for k; whether it is an estimate,
    over evenly spaced rows, rather than a bound). ``need`` (1 to k; 0: k): the items above its start a user needs,
    fewer than the pass keeps where the caller checks each user against its start (fast mode's certificate needs its
    k best clear of the start, ``fast.NEED_SLACK``: every item left out then lies below it). The start is an estimate
    at ``estimate_rank`` of need over evenly spaced rows where the pass would estimate its k (for a ranked sample,
    where that estimate is tight: ``estimate_rank``'s ``ranked``) and the need's rank is below the need, else the
    sample's need-th best: at least need items score above it (a bound), however few of the k the pass keeps do. On
    4,096 items at k = 10 (a pass of 27; need 13), counted on the CPU (``scripts/lab/need_counts.py``): 26 scores a
    user passed from the need-th best of a sample half of the largest norms where 55 passed from its 27th (skewed
    ip), 48 from a sample half of the items nearest the centroid (``metrics.centroid_ranks``) where 138 passed from an
    estimate over evenly spaced rows (skewed l2; docs/benchmarks.md)."""
    need = k if need <= 0 else min(need, k)
    # Whether to estimate is the pass's own choice (its sample was sized for it, seed_size); then at the need's rank.
    ke = estimate_rank(need, size, n_items) if estimate_rank(k, size, n_items, ranked) else 0
    if ke:
        return ke, True
    return (need if need < k else 0), False


def final_code(final: bool, best_first: bool = True) -> int:
    """A merge kernel's ``final_pass``: 0 folds candidates in, 1 writes the results sorted best first, 2 writes the k
    kept in no order (for a caller that re-ranks them, fast mode's pass: the sort is most of a final merge at large k,
    66 phases of 2,048 keys a user at k = 1,251)."""
    return 0 if not final else 1 if best_first else 2


def pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass
class GpuTopK:
    """Running top-k of one block of users on the device (see topk.cu for the meaning of each array)."""

    k: int
    n_users: int  # rows of this block that are real users (the arrays hold capacity rows)
    capacity: int
    cand_capacity: int
    top: Any
    n_valid: Any
    thr: Any
    cand: Any
    cnt: Any
    base: Any
    out_vals: Any
    out_rows: Any
    seed_thr: Any  # (capacity,) float32: each user's threshold as its block started (Backend.run_blocks' left_out)

    @classmethod
    def allocate(cls, capacity: int, k: int, cand_capacity: int = 0) -> "GpuTopK":
        import cupy

        c = cand_capacity or candidate_capacity(k)
        return cls(k, capacity, capacity, c,
                   top=cupy.zeros((capacity, k), cupy.uint64), n_valid=cupy.zeros(capacity, cupy.int32),
                   thr=cupy.full(capacity, -cupy.inf, cupy.float32), cand=cupy.zeros((capacity, c), cupy.uint64),
                   cnt=cupy.zeros(capacity, cupy.int32), base=cupy.zeros(capacity, cupy.int32),
                   out_vals=cupy.empty((capacity, k), cupy.float32), out_rows=cupy.empty((capacity, k), cupy.int64),
                   seed_thr=cupy.full(capacity, -cupy.inf, cupy.float32))

    def clear(self) -> None:
        """Empty every row (the final merge also leaves its rows empty; this recovers from an interrupted search)."""
        self.n_valid.fill(0)
        self.thr.fill(-np.inf)
        self.cnt.fill(0)
        self.base.fill(0)


class Selection:
    """The selection kernels of one device, launched on the current stream."""

    def __init__(self) -> None:
        mod = kernels.selection_module()
        # By score type: float32 tiles, or float16 tiles of fast mode.
        self.mask = {np.dtype(np.float32): mod.get_function("recall_mask_excluded"),
                     np.dtype(np.float16): mod.get_function("recall_mask_excluded_h")}
        self.filter = {np.dtype(np.float32): mod.get_function("recall_filter"),
                       np.dtype(np.float16): mod.get_function("recall_filter_h")}
        self.merge = {np.dtype(np.float32): mod.get_function("recall_merge"),
                      np.dtype(np.float16): mod.get_function("recall_merge_h")}
        self.mask_sampled = {np.dtype(np.float32): mod.get_function("recall_mask_sampled"),
                             np.dtype(np.float16): mod.get_function("recall_mask_sampled_h")}
        # By (score type, vector type) (_SEED_TYPES), and by the block's size (seed_threads; the kernel's suffix).
        self.seed_kth = {(t, s, v): mod.get_function(f"recall_seed{name}{'' if t == SEED_THREADS else t}")
                         for t in SEED_BLOCKS for (s, v), name in _SEED_TYPES}
        self.seed_warp = seed_warp_kernels(mod)
        self.fused = mod.get_function("recall_fused_filter")
        self.merge_fused = mod.get_function("recall_merge_fused")
        # fused_h.cu's kernels by the halves of an item row a pipeline stage holds (fused.half_chunk).
        self.fused_h = {64: mod.get_function("recall_fused_filter_h"),
                        **{ch: mod.get_function(f"recall_fused_filter_h{ch}") for ch in (16, 32, 48, 80, 96)}}
        self.merge_fused_h = mod.get_function("recall_merge_fused_h")
        # The same one warp a user (fused.MERGE_WARP_K), by the keys a lane holds in registers (MERGE_WARP_HELD).
        self.merge_fused_warp = {held: mod.get_function(f"recall_merge_fused_w{held}") for held in (8, 16)}
        self.merge_fused_h_warp = {held: mod.get_function(f"recall_merge_fused_hw{held}") for held in (8, 16)}
        self._fused_w: dict[int, Any] | None = None
        self._seed_w: dict[tuple[int, bool], Any] = {}
        self._walk_w: dict[int, Any] | None = None
        self._merge_smem_limit = 0

    @property
    def fused_w(self) -> dict[int, Any]:
        """fused_w.cu's kernels (wgmma) by the columns multiplied (16 to 144), built on first use; empty off Hopper."""
        self._hopper()
        return self._fused_w

    @property
    def seed_w(self) -> dict[tuple[int, bool], Any]:
        """seed_w.cu's threshold selects (wgmma), by (the columns multiplied, 16 to 144; the ``_wide`` kernels:
        ``seed_w_kernels``), built with :attr:`fused_w`'s module; empty off Hopper."""
        self._hopper()
        return self._seed_w

    def _hopper(self) -> None:
        if self._fused_w is None:
            try:
                mod = kernels.hopper_fused_module()
            except RuntimeError as exc:  # an NVRTC that cannot build sm_90a (before CUDA 12), said once
                log.warning("recall: Hopper's wgmma kernels could not be built (%s); the mma.sync kernel runs "
                            "instead", str(exc).splitlines()[0])
                mod = None
            widths = range(1, 10)
            self._fused_w = {} if mod is None else {16 * ks: mod.get_function(f"recall_fused_filter_w{ks}")
                                                    for ks in widths}
            self._seed_w = {} if mod is None else seed_w_kernels(mod)

    @property
    def walk_w(self) -> dict[int, Any]:
        """walk_w.cu's kernels by the columns multiplied (16 to 80, fused.WALK_MAX_WIDTH), built on first use (a
        search asking for the walk: ``EngineOptions.fused_walk``); empty off Hopper or where :attr:`fused_w`'s
        module could not be built."""
        if self._walk_w is None:
            mod = kernels.hopper_walk_module() if self.fused_w else None
            self._walk_w = {} if mod is None else {16 * ks: mod.get_function(f"recall_walk_w{ks}")
                                                   for ks in range(1, 6)}
        return self._walk_w

    def update(self, state: GpuTopK, scores: Any, item_start: int, n_items: int, excl_indptr: Any,
               excl_items: Any) -> None:
        """Fold a score tile (tiles, n, width) into the running top-k, skipping excluded items and rows >= n_items."""
        tiles, n, width = scores.shape
        if excl_items.size:
            self.mask[scores.dtype](((n + 127) // 128,), (128,),
                                    (scores, np.int32(n), np.int32(width), np.int32(tiles), np.int32(item_start),
                                     excl_indptr, excl_items))
        self.filter[scores.dtype]((n, tiles), (FILTER_THREADS,),
                                  (scores, np.int32(n), np.int32(width), np.int32(item_start), np.int32(n_items),
                                   state.thr, state.cand, np.int32(state.cand_capacity), state.cnt))
        self._merge(state, scores, n, width, tiles, item_start, n_items, final=0)

    def seed(self, state: GpuTopK, scores: Any, rows: Any, users: Any, item_norms: Any, excl_indptr: Any,
             excl_items: Any, estimate: int = 0, constant: tuple[int, float] | None = None,
             bias: tuple[int, int, Any] | None = None) -> None:
        """Start every user's threshold just below its k-th best score over the sample whose scores are ``scores`` (1,
        n, size) (column j: item row ``rows[j]``, ``tiled.sample_rows``, of norm ``item_norms[j]``, float32 rounded
        up), each lowered by what the search's own score of that item may lie below it (``certificate.seed_margin``;
        ``users`` (n, width) the vectors scored): a lower bound of the final k-th best, so that later tiles pass few
        scores to the merge whatever the item order. It may start lower, with at most k/8 more sampled scores above it
        (the block-a-user select stops one digit early where that is all it would gain; the warp-a-user select of
        small ranks, SEED_WARP_RANK, is exact). Excluded sampled items are masked first; the k-th best is selected in
        place (``recall_seed``, ``recall_seed_warp*``), and the state is left empty. ``estimate`` (``estimate_rank``;
        0 < estimate < k): start instead at the estimate-th best of a sample of evenly spaced rows, an estimate of the
        k-th best and not a bound, for a caller that checks its users (fast mode's certificate). ``constant`` (column,
        value): a column every item holds that value in (``DeviceItems.constant_column``; ``item_norms`` then leave it
        out), whose product the margin takes on its own. ``bias`` (first, end, sums): columns whose products the margin
        bounds on their own, the user's largest |value| there times each sampled item's sum of |v| over them (``sums``,
        (size,) float32 rounded up; ``item_norms`` then leave those columns out too: ``DeviceItems.bias_columns``)."""
        _, n, size = scores.shape
        if excl_items.size:
            self.mask_sampled[scores.dtype](((n + 127) // 128,), (128,),
                                            (scores, np.int32(n), np.int32(size), rows, excl_indptr, excl_items))
        args = self.seed_args(state, users, item_norms, scores.dtype == np.float16, estimate, constant, bias)
        rank = estimate if 0 < estimate < state.k else state.k
        if rank <= SEED_WARP_RANK and size <= SEED_WARP_MAX_SIZE:
            kept = 8 if rank <= SEED_WARP_SMALL_RANK else 16
            self.seed_warp[(scores.dtype, users.dtype, kept)](
                ((n + SEED_WARP_USERS - 1) // SEED_WARP_USERS,), (32 * SEED_WARP_USERS,),
                (scores, np.int32(n), np.int32(size), np.int32(state.k), *args))
        else:
            threads = seed_threads(size)
            self.seed_kth[(threads, scores.dtype, users.dtype)]((n,), (threads,),
                                                                (scores, np.int32(size), np.int32(state.k), *args))

    @staticmethod
    def seed_args(state: GpuTopK, users: Any, item_norms: Any, half_scores: bool, estimate: int = 0,
                  constant: tuple[int, float] | None = None, bias: tuple[int, int, Any] | None = None,
                  thr: Any = None) -> tuple:
        """The arguments every threshold select takes after the scores (``recall_seed*``'s, ``recall_seed_w*``'s):
        the thresholds (``state.thr``, or ``thr``: a float32 array of a row a user), the users and their margin's
        terms (:meth:`seed`'s ``users``, ``item_norms``, ``constant`` and ``bias``; ``half_scores``: the sampled
        scores were rounded to float16), the estimate's rank."""
        width = int(users.shape[1])
        a, r, z = seed_margin(width, users.dtype == np.float16, half_scores)
        col, value = constant if constant is not None else (-1, 0.0)
        lo, hi, sums = bias if bias is not None else (0, 0, item_norms)  # hi == lo: no bias columns, sums unread
        return (state.thr if thr is None else thr, users, np.int32(width), item_norms, sums, np.int32(lo),
                np.int32(hi), np.int32(col), np.float64(value), np.float64(a), np.float64(r), np.float64(z),
                np.int32(estimate))

    def result(self, state: GpuTopK, best_first: bool = True) -> tuple[Any, Any]:
        """The final merge: results of the block's users in ``state.out_vals`` / ``out_rows``, sorted best first, or
        where not ``best_first`` in no order (``final_code``)."""
        n = state.n_users
        self._merge(state, state.out_vals, n, 1, 1, 0, 0, final=final_code(True, best_first))
        return state.out_vals[:n], state.out_rows[:n]

    def merge_smem(self, k: int) -> tuple[int, int]:
        """(K_pad, dynamic shared memory bytes) of a merge for k, the merge kernels allowed that much."""
        k_pad = pow2(k)
        smem = 8 * k_pad
        if smem > 48 * 1024 and smem > self._merge_smem_limit:
            for fn in (*self.merge.values(), self.merge_fused, self.merge_fused_h):
                fn.max_dynamic_shared_size_bytes = smem
            self._merge_smem_limit = smem
        return k_pad, smem

    def _merge(self, state: GpuTopK, scores: Any, n: int, width: int, tiles: int, item_start: int, n_items: int,
               final: int) -> None:
        k_pad, smem = self.merge_smem(state.k)
        self.merge[scores.dtype]((n,), (MERGE_THREADS,),
                                 (state.top, state.n_valid, state.thr, state.cand, state.cnt, state.base, scores,
                                  np.int32(n), np.int32(width), np.int32(tiles), np.int32(item_start),
                                  np.int32(n_items), np.int32(state.k), np.int32(k_pad),
                                  np.int32(state.cand_capacity),
                                  np.int32(state.cand_capacity // 2),
                                  np.int32(final), state.out_vals, state.out_rows),
                                 shared_mem=smem)
