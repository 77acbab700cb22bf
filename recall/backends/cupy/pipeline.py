"""The GPU's block pipeline: user blocks staged from pinned host memory on a copy stream while the compute stream
searches the previous ones, results fetched on a stream of their own, and each block's launches replayed as a CUDA
graph from the second block on (a search of many small tiles is then not bound by Python's launch overhead).

Workspaces (top-k state, score buffer, staging slots, graphs) are kept for the next search of the same shape, so an
embedded engine answering many calls allocates, and captures its graphs, once; ``run_blocks`` returns once every
block is queued, with a callable that waits for that search alone (``Engine.search_async``).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...core import host_threads
from ...core.errors import ResourceError
from ...core.exclusions import Exclusions
from ...core.options import EngineOptions
from ...core.tiling import TilePlan
from .. import tiled
from . import fused as fused_path
from .items import FUSED_CHUNK, FUSED_TILE, DeviceItems
from .selection import GpuTopK, fused_capacity, search_seed_size, start_rank

log = logging.getLogger("recall")

#: Staging slots: the host stages (and queues) up to this many blocks ahead of the device, so that the device has
#: that much work queued while the host prepares the next search or another thread holds the GIL (4 and 8 measured
#: alike on the S4 job, docs/benchmarks.md).
SLOTS = 4
#: Graphs kept per slot: one per engine sharing the backend (item parts) and kind of search.
_GRAPHS_PER_SLOT = 16
#: Workspaces kept, the most recently used: at most this many shapes, together at most WORKSPACE_SPREAD times the
#: largest of them. A fast search runs up to four shapes every time (its sample of users, all users, the widened
#: users, the exact fallback); with two kept, the widened pass's shape (30 users on 20k x 1M x 128 l2) evicted
#: the main pass's, and every search allocated its buffers and captured its graphs again.
_WORKSPACES = 4
WORKSPACE_SPREAD = 2.5
#: Catalogues of fewer rows stage and upload their excluded item rows as int32 (half the host's copies and the
#: bus's bytes of int64), widened on the device to the int64 the kernels read.
WIRE32_ROWS = 2 ** 31
#: A fused block of at least this many users whose results go to device arrays of the search's own width has its
#: final merge write them there itself, launched eagerly (a captured graph holds the addresses it was captured with),
#: instead of through the state's buffers and a copy of every result (51 MB each way for a block of 65,536 users at
#: 65 candidates): the certified route 2.4-3.6% faster on 1M-2M users x 4,096 items, the float32 search 0.4-2.8%
#: (H100, docs/benchmarks.md). Smaller blocks keep their graphs (an embedded engine's calls of a few users).
DIRECT_OUT_USERS = 16_384


def wire_dtype(n_items: int) -> Any:
    """The dtype a search of ``n_items`` items stages its excluded item rows in (WIRE32_ROWS)."""
    return np.int32 if n_items < WIRE32_ROWS else np.int64


@dataclass
class _Slot:
    """One of the :data:`SLOTS` staging slots of the block pipeline."""

    users: Any  # device (capacity, dim)
    floor: Any  # device (capacity,) float32: the block's score floors, when the search has them
    ex_ptr: Any  # device (capacity + 1,) int64
    ex_items: Any  # device (max exclusions per block,) int64: what the kernels read
    host_users: Any  # pinned (capacity, dim)
    host_ptr: Any  # pinned (capacity + 1,) int64
    host_items: Any  # pinned (max exclusions per block,) of the wire's dtype (wire_dtype)
    wire_items: Any  # device, like host_items, where that dtype is not int64 (else None: host_items go to ex_items)
    staged: Any  # event: this slot's uploads are done
    consumed: Any  # event: the compute stream no longer reads this slot
    graphs: dict = field(default_factory=dict)  # captured graphs by what they baked in (items, options...)
    ptr_zero: bool = True  # ex_ptr holds zeros: a block without exclusions stages nothing for them


@dataclass
class _Workspace:
    key: tuple
    max_excl: int
    state: GpuTopK
    scores: Any
    slots: list
    sample: Any = None  # (size, dim): the threshold sample's item rows, refreshed by every search
    users_t: Any = None  # fused path: (padded dim, padded capacity) the block's users transposed, zero-padded
    fetched: Any = None  # event: the last search's last results have left state.out_vals (None: nothing pending)
    nbytes: int = 0  # what its buffers take, about (the eviction rule's measure)


class PendingSearch:
    """What ``run_blocks`` returns: called, it waits for the search on the host and returns its stats (``Wait``);
    ``events``, recorded on each of the pipeline's streams after the search's last work there, order later work
    after it on the device alone (``CupyBackend.queue_after``)."""

    def __init__(self, finish: Any, events: tuple) -> None:
        self._finish, self.events = finish, events

    def __call__(self) -> dict:
        return self._finish()


def _direct_out(out_vals: Any, out_rows: Any, k: int) -> bool:
    """Whether device results ``out_vals`` / ``out_rows`` take a final merge's rows as they are: C-contiguous rows
    of ``k`` float32 scores and int64 item rows (a block's rows of them are then one contiguous (n, k) piece)."""
    return (out_vals.ndim == 2 and out_vals.shape[1] == k and out_vals.dtype == np.float32
            and out_rows.shape == out_vals.shape and out_rows.dtype == np.int64
            and bool(out_vals.flags.c_contiguous) and bool(out_rows.flags.c_contiguous))


def _sample_bias(items: DeviceItems, seed: tuple) -> tuple | None:
    """A threshold select's ``bias`` argument for the sample ``seed`` (``BlockPipeline._refresh_sample``'s tuple):
    the items' bias columns and the sampled rows' sums of them, or None where the items have none."""
    sums = seed[3]
    return None if sums is None else (*items.bias_columns, sums)


class BlockPipeline:
    """Streams, workspaces and graphs of one backend; ``backend`` provides the primitives of the tiled loop."""

    def __init__(self, backend: Any) -> None:
        import cupy

        self.backend = backend
        self.compute_stream = cupy.cuda.Stream(non_blocking=True)
        self.copy_stream = cupy.cuda.Stream(non_blocking=True)
        # Results go back on a stream of their own, so that fetching block i never delays staging block i + SLOTS.
        self.fetch_stream = cupy.cuda.Stream(non_blocking=True)
        self.fused = fused_path.FusedSearch(backend.selection)
        self.graphs_ok = True  # False after a capture failed: launch eagerly from then on
        self.capturing = False
        # Held while a block's launches are captured: other threads (a job's writer fetching results, its early
        # searches) must not synchronise the compute stream or the device meanwhile (CupyBackend.to_host).
        self.capture_lock = threading.RLock()
        # Held while a search stages and queues its blocks: searches started from several threads at once (a job's
        # writer searching again the users an early batch left short, beside the searches the job queues) take the
        # slots and the shared workspaces one after the other.
        self.search_lock = threading.RLock()
        self._ws: dict[tuple, _Workspace] = {}
        # Kinds of block (the graph keys) that have run once, eagerly: a capture must not be the first to compile
        # and load what a kind launches.
        self._ran: set[tuple] = set()

    def synchronize(self) -> None:
        """Wait for everything queued on the pipeline's streams: compute, staging and result fetches."""
        with self.capture_lock:
            self.compute_stream.synchronize()
            self.copy_stream.synchronize()
            self.fetch_stream.synchronize()

    def run_blocks(self, plan: TilePlan, users: Any, items: DeviceItems, n_items: int, k: int, excl: Exclusions,
                   out_vals: Any, out_rows: Any, options: EngineOptions, floor: Any = None,
                   left_out: Any = None, best_first: bool = True, need: int = 0) -> Any:
        with self.search_lock:
            return self._run_blocks(plan, users, items, n_items, k, excl, out_vals, out_rows, options, floor,
                                    left_out, best_first, need)

    def _run_blocks(self, plan: TilePlan, users: Any, items: DeviceItems, n_items: int, k: int, excl: Exclusions,
                    out_vals: Any, out_rows: Any, options: EngineOptions, floor: Any = None,
                    left_out: Any = None, best_first: bool = True, need: int = 0) -> Any:
        """Queue every block of the search and return a callable that waits for it and returns its stats (see
        ``Backend.run_blocks``).

        ``floor``: a device float32 (n_users,) of inner-product scores, or None. A user's threshold starts there
        (instead of at the seed of the threshold sample), so that only items scoring above it are returned (fewer
        than k where fewer do): for a search of the rows after others whose k-th best is known, items at or below it
        cannot enter the top k.

        ``left_out``: a device float32 (n_users,), or None. Given, a seeded search may start each user below its k-th
        best (``EngineOptions.seed_estimate``, ``selection.start_rank``): at an *estimate* of its ``need``-th best
        (``selection.estimate_rank``), or at a lower bound of it, and each user's starting threshold is written
        there: every item a user is not given scores at most the larger of that and its k-th result (-inf where it
        holds fewer than k)."""
        import cupy

        wall = time.perf_counter()
        n_users, dim = users.shape
        cap = plan.user_block
        blocks = [(s, min(s + cap, n_users)) for s in range(0, n_users, cap)]
        max_excl = max(1, max(int(excl.indptr[e] - excl.indptr[s]) for s, e in blocks))
        has_excl = excl.items.size > 0
        host_users = isinstance(users, np.ndarray)
        # A float16 pass of device users multiplies the columns they hold values in (fused_path.multiplied_width): a
        # fused kernel then covers rows wider than it would multiply whole. Host users are multiplied whole: NumPy's
        # float16 pass over them would cost more than it saves (0.35 s for 1M x 72 on a development machine).
        # The count is started here and read once the search's setup is queued (a pass the whole rows would not
        # take fused reads it now: narrower ones may be).
        half = np.dtype(users.dtype) == np.float16 and n_users > 0 and options.fused != "off" and not host_users
        counted = fused_path.count_multiplied(users) if half else None
        fused = self.backend.fused_applies(plan, n_users, n_items, k, dim, users.dtype, options)
        multiplied = 0
        if counted is not None and not fused:
            multiplied = counted()
            fused = self.backend.fused_applies(plan, n_users, n_items, k, multiplied, users.dtype, options)
        # The fused path keeps score room for the threshold sample only. A pass that may start at an estimate of each
        # user's k-th best (below) takes the rule's sample; one that starts at a bound, a larger one where k is large.
        may_estimate = left_out is not None and floor is None and options.seed_estimate
        # The walk (fused_path.walks) needs no sample: each block of users scores every item in one kernel.
        walk = (np.dtype(users.dtype) == np.float16 and fused
                and fused_path.walks(n_users, k, dim, best_first, floor is not None, options)
                and bool(self.backend.selection.walk_w))
        sample = 0 if walk else search_seed_size(plan, n_items, k, options, not may_estimate,
                                                  may_estimate and items.loose_ranking(self.compute_stream))
        # A pass that may start below its k-th best starts at the rank of selection.start_rank: an estimate over
        # evenly spaced rows, or a bound of the items a user needs (from a sample half of the items ranked first
        # where the items are ranked, DeviceItems.ranked); ``rank`` 0: the k-th best, a bound.
        rank, even = start_rank(k, need, sample, n_items, items.ranked) if sample and may_estimate else (0, False)
        # A float16 pass of a small k on Hopper without exclusions scores and selects its sample in one kernel
        # (fused_path.seeds_fused).
        seed_fused = (bool(sample) and floor is None and np.dtype(users.dtype) == np.float16 and fused
                      and fused_path.seeds_fused(k, rank, has_excl, options) and bool(self.backend.selection.seed_w))
        ws = self._workspace(plan, k, dim, max_excl, users.dtype, fused,
                             max(1, 0 if seed_fused else sample) if fused else None, wire_dtype(n_items), n_items)
        state, scores_buf, slots = ws.state, ws.scores, ws.slots
        stats = {"blocks": len(blocks), "graph_blocks": 0}
        compute, copy, fetch = self.compute_stream, self.copy_stream, self.fetch_stream
        host_out = isinstance(out_vals, np.ndarray)  # page-locked host results (empty_out), filled block by block
        # Fused blocks of DIRECT_OUT_USERS or more (not the walk's) write device results in place (their final merge).
        direct = fused and not walk and not host_out and _direct_out(out_vals, out_rows, k)
        # Our streams do not synchronise with the caller's: order them after whatever produced the inputs and
        # the output arrays (the item upload, the caller's device users, the allocation of out_vals).
        ready = cupy.cuda.get_current_stream().record()
        compute.wait_event(ready)
        copy.wait_event(ready)
        seed = self._refresh_sample(ws, items, n_items, sample, dim, even, users, rank or k) if sample else None
        stats["seed_sample"] = sample
        if sample and items.ranked and not even:
            stats["seed_even_every"] = items.even_every[(sample, n_items)]
        stats["seed_fused"] = seed_fused
        if left_out is not None:
            stats["seed_estimate"] = rank if even else 0
            stats["seed_need_rank"] = 0 if even else rank
        items_t = fused_path.operand(items, compute) if fused else None
        stats["fused"] = fused
        stats["walk"] = walk
        if half and fused:
            multiplied = multiplied or counted()
            stats["multiplied_columns"] = multiplied
        # Device users seeded in one kernel (seed_w.cu) are seeded all at once, before the blocks: a launch a block
        # of 32,768 users is 256 thread blocks of 128 users, under one wave of the GPU's, and 1M users' sample took
        # 2.49 ms in such launches against 2.05-2.09 ms in one (H100, docs/benchmarks.md). Each block's thresholds
        # then come in as a floor's do (slot.floor).
        preseeded = None
        if seed_fused and not host_users and n_users:
            with compute:  # (allocated on the stream that uses it: the pool reuses it only after that work)
                preseeded = cupy.empty(n_users, dtype=cupy.float32)
                self.fused.seed(state, users, seed[0], seed[2], rank, items.constant_column,
                                _sample_bias(items, seed), multiplied, thr=preseeded)
        stats["seed_preseeded"] = preseeded is not None
        # What the search's scores were compared and kept in: the fused kernels keep float32 (fast mode's float16
        # inputs too); the cuBLAS path selects from score tiles of the backend's score_dtype.
        stats["score_dtype"] = "float32" if fused else str(self.backend.score_dtype(users.dtype))
        # Event: the previous block's results have left state.out_vals for the host (of the previous search, for the
        # first block: it may still be fetching).
        fetched = ws.fetched
        timing = []  # (h2d start, h2d end, compute start, compute end[, d2h end]) events per block

        for i, (start, stop) in enumerate(blocks):
            slot = slots[i % len(slots)]
            n = stop - start
            ev = [cupy.cuda.Event() for _ in range(4)]
            # Stage: wait until the compute stream is done with this slot (block i - SLOTS), then upload.
            slot.consumed.synchronize()  # the pinned buffers are rewritten by the host below
            if has_excl:
                ptr, ex_items = excl.block(start, stop)
                slot.host_ptr[: n + 1] = ptr
                slot.host_ptr[n + 1:] = ptr[-1]  # rows past the block's end are empty
                # The host's threads copy the rows (cast to the wire's dtype): one thread's copy of 1M users' 50
                # exclusions each took 48 ms a search, four times the GPU's work (docs/benchmarks.md).
                n_excl = ex_items.size
                host_threads.copy_rows(slot.host_items[:n_excl], ex_items)
            with copy:
                # Nothing here waits for the compute stream (the host waited above for the block that last read the
                # slot): the uploads go up while it finishes the blocks before this one.
                ev[0].record(copy)
                # A search without exclusions leaves the slot's CSR at zeros (every user's count 0), writing it
                # only after one that had some: 32,768 users' staged offsets cost the host 0.1 ms a block.
                if has_excl:
                    slot.ex_ptr.set(slot.host_ptr, stream=copy)
                    if n_excl:  # (a block whose users exclude nothing sends its offsets only)
                        wire = slot.ex_items if slot.wire_items is None else slot.wire_items
                        wire[:n_excl].set(slot.host_items[:n_excl], stream=copy)
                        if wire is not slot.ex_items:  # widened to the kernels' int64 on the copy stream
                            slot.ex_items[:n_excl] = wire[:n_excl]
                    slot.ptr_zero = False
                elif not slot.ptr_zero:
                    slot.ex_ptr.fill(0)
                    slot.ptr_zero = True
                if host_users:
                    host_threads.copy_rows(slot.host_users[:n], users[start:stop])
                    slot.users.set(slot.host_users, stream=copy)
                ev[1].record(copy)
                slot.staged.record(copy)
            with compute:
                compute.wait_event(slot.staged)
                out = (out_vals[start:stop], out_rows[start:stop]) if direct and n >= DIRECT_OUT_USERS else None
                # Such a block, launched eagerly, reads C-contiguous device users where they are (a graph replays
                # the slot's fixed addresses): 1M users' copies were 96-128 MB of device copies a search.
                own = users[start:stop] if out is not None and not host_users and users.flags.c_contiguous else None
                if fetched is not None:
                    compute.wait_event(fetched)  # this block's final merge rewrites state.out_vals
                ev[2].record(compute)
                # Device users (and floors) may come from work queued on this stream: they are copied into the slot
                # here, in order. On the copy stream they made it wait for the blocks before this one, and the
                # slot's excluded rows queued behind them with it.
                if not host_users and own is None:
                    slot.users[:n] = users[start:stop]
                if floor is not None or preseeded is not None:
                    slot.floor[:n] = (floor if preseeded is None else preseeded)[start:stop]
                self._search_slot(slot, plan, items, n_items, state, scores_buf, n, has_excl, stats, seed,
                                  ws if fused else None, items_t, floor is not None, options, multiplied, rank,
                                  left_out is not None, best_first, walk, seed_fused, preseeded is not None, even, out,
                                  own)
                if left_out is not None:
                    left_out[start:stop] = state.seed_thr[:n]
                if not host_out and out is None:
                    out_vals[start:stop, :k] = state.out_vals[:n]
                    out_rows[start:stop, :k] = state.out_rows[:n]
                ev[3].record(compute)
                slot.consumed.record(compute)
            if host_out:
                with fetch:
                    fetch.wait_event(ev[3])
                    state.out_vals[:n].get(stream=fetch, out=out_vals[start:stop], blocking=False)
                    state.out_rows[:n].get(stream=fetch, out=out_rows[start:stop], blocking=False)
                    fetched = fetch.record()
                    ev.append(fetched)
            timing.append(ev)
        ws.fetched = fetched
        done = (compute.record(), fetch.record())
        device = self.backend.device

        def finish() -> dict:
            with device:
                for event in done:
                    event.synchronize()
                elapsed = time.perf_counter() - wall
                busy = sum(cupy.cuda.get_elapsed_time(e[2], e[3]) for e in timing) / 1e3
                h2d = sum(cupy.cuda.get_elapsed_time(e[0], e[1]) for e in timing) / 1e3
                d2h = sum(cupy.cuda.get_elapsed_time(e[3], e[4]) for e in timing if len(e) > 4) / 1e3
            stats.update(wall_s=elapsed, gpu_busy_s=busy, h2d_s=h2d, d2h_s=d2h,
                         busy_fraction=busy / elapsed if elapsed > 0 else 0.0,
                         tiles=(plan.user_block, plan.item_tile, plan.tiles_per_call))
            return stats

        return PendingSearch(finish, done)

    def _workspace(self, plan: TilePlan, k: int, dim: int, max_excl: int, dtype: Any, fused: bool = False,
                   score_width: int | None = None, wire: Any = np.int64, n_items: int = 0) -> _Workspace:
        """The device and pinned buffers of a search, kept for the next search of the same shape. The fused path
        needs score room for the threshold sample only, and a larger candidate buffer (``selection.fused_capacity``
        of ``n_items``). ``wire``: the dtype its excluded item rows are staged and uploaded in (``wire_dtype``)."""
        import cupy

        capacity = fused_capacity(k, n_items)
        key = (plan, k, dim, np.dtype(dtype), fused, score_width, np.dtype(wire), capacity)
        ws = self._ws.get(key)
        if ws is not None and ws.max_excl >= max_excl:
            self._ws[key] = self._ws.pop(key)  # the most recently used last
            with self.compute_stream:  # after a search still running on it (run_blocks returns before it is done)
                ws.state.clear()  # the last final merge emptied it, unless that search was interrupted
            return ws
        width = plan.item_tile * plan.tiles_per_call if score_width is None else score_width
        need = (4 * plan.user_block * width + plan.user_block * self.backend.state_bytes(k, n_items)
                + 2 * 4 * plan.user_block * dim)
        # Let the least recently used shapes go (_WORKSPACES, WORKSPACE_SPREAD) before taking new buffers, once no
        # queued search still uses them.
        self.synchronize()
        self._ws.pop(key, None)
        while self._ws and (len(self._ws) >= _WORKSPACES
                            or need + sum(w.nbytes for w in self._ws.values())
                            > WORKSPACE_SPREAD * max(need, max(w.nbytes for w in self._ws.values()))):
            self._ws.pop(next(iter(self._ws)))
        while True:
            try:
                # Blocks of fewer users than a fused tile (the cuBLAS path, in wide segments: tiling.plan_tiles)
                # take the fused path's buffers too: a seeded search's survivors of a whole catalogue fit, where the
                # cuBLAS path's would overflow, and each overflow rescans the segment's scores with one thread block
                # a user.
                state = GpuTopK.allocate(plan.user_block, k,
                                         capacity if fused or plan.user_block < FUSED_TILE else 0)
                # The fused path's buffer holds the threshold sample's scores, in the kernels' float32.
                scores = cupy.empty(plan.user_block * width,
                                    np.float32 if fused else self.backend.score_dtype(dtype))
                slots = [self._slot(plan.user_block, dim, max_excl, dtype, wire) for _ in range(SLOTS)]
                break
            except cupy.cuda.memory.OutOfMemoryError as exc:
                if self._ws:  # the kept shapes' buffers first: a new shape must not fail for an old one's
                    self._ws.clear()
                    cupy.get_default_memory_pool().free_all_blocks()
                    continue
                raise ResourceError(
                    f"GPU out of memory allocating a {need:,}-byte search workspace ({plan.user_block} users x "
                    f"{plan.item_tile * plan.tiles_per_call} items per tile, k={k}); "
                    f"{self.backend.free_memory():,} bytes free: lower memory_budget"
                ) from exc
        ws = _Workspace(key, max_excl, state, scores, slots, nbytes=need)
        if fused and np.dtype(dtype) == np.float32:
            ws.users_t = cupy.zeros((-(-dim // FUSED_CHUNK) * FUSED_CHUNK,
                                     -(-plan.user_block // FUSED_TILE) * FUSED_TILE), np.float32)
        self._ws[key] = ws
        return ws

    @staticmethod
    def _slot(cap: int, dim: int, max_excl: int, dtype: Any, wire: Any = np.int64) -> _Slot:
        import cupy
        import cupyx

        narrow = np.dtype(wire) != np.int64
        return _Slot(users=cupy.zeros((cap, dim), dtype), floor=cupy.full(cap, -np.inf, np.float32),
                     ex_ptr=cupy.zeros(cap + 1, cupy.int64),
                     ex_items=cupy.zeros(max_excl, cupy.int64),
                     host_users=cupyx.zeros_pinned((cap, dim), dtype),
                     host_ptr=cupyx.zeros_pinned(cap + 1, np.int64), host_items=cupyx.zeros_pinned(max_excl, wire),
                     wire_items=cupy.zeros(max_excl, wire) if narrow else None,
                     staged=cupy.cuda.Event(disable_timing=True), consumed=cupy.cuda.Event(disable_timing=True))

    def _refresh_sample(self, ws: _Workspace, items: DeviceItems, n_items: int, size: int, dim: int,
                        even: bool = False, users: Any = None, rank: int = 0) -> tuple[Any, Any, Any, Any]:
        """Gather this search's threshold sample of ``size`` rows (``seed_size``; which rows: ``sample_rows``,
        evenly spaced only where ``even``; a ranked sample made for the first time probes ``users`` started at their
        ``rank``-th best) into the workspace's buffer, on the compute stream: (the sample, its rows, their norms,
        their bias columns' sums or None: ``DeviceItems.sample``)."""
        if ws.sample is None or ws.sample.shape != (size, dim):
            ws.sample = self.backend.xp.empty((size, dim), items.dtype)
        rows, norms, sums = items.sample(size, n_items, self.compute_stream, even, users, rank)
        with self.compute_stream:
            self.backend.xp.take(items.vecs, rows, axis=0, out=ws.sample)
        return ws.sample, rows, norms, sums

    def _search_slot(self, slot: _Slot, plan: TilePlan, items: DeviceItems, n_items: int, state: GpuTopK,
                     scores_buf: Any, n: int, has_excl: bool, stats: dict, seed: Any, fused_ws: Any, items_t: Any,
                     has_floor: bool, options: EngineOptions, multiplied: int = 0, estimate: int = 0,
                     keep_seed: bool = False, best_first: bool = True, walk: bool = False,
                     seed_fused: bool = False, preseeded: bool = False, even: bool = False,
                     out: tuple | None = None, own: Any = None) -> None:
        """One block of n users (``multiplied``: the columns a float16 fused pass multiplies, 0: all; ``estimate``:
        the seed's rank where it is not k (``selection.start_rank``), 0: k; ``even``: its sample is of evenly spaced
        rows where the items would rank it (an estimate); ``keep_seed``: each user's starting threshold is kept in
        ``state.seed_thr``; ``best_first``: results sorted, else in no order; ``walk``: the fused pass is the walk,
        unseeded, whose users keep -inf there; ``seed_fused``: the sample is scored and selected in one kernel,
        ``FusedSearch.seed``; ``preseeded``: that kernel ran for the whole search, and the block's thresholds wait
        in ``slot.floor``; ``out``: the block's (n, k) device results, which its final merge writes itself, launched
        eagerly, else None: the state's buffers; ``own``: with ``out``, the block's device users read in place of the
        slot's copy, or None). The cuBLAS
        path always runs over the slot's full capacity of rows (rows past the real users are ignored), so that every
        block runs the same launches and the graph captured for a slot replays for each of its blocks; the fused
        path (``fused_ws`` set) scores the real rows only, and runs a short last block eagerly."""
        backend, sel = self.backend, self.backend.selection
        ex_items = slot.ex_items if has_excl else slot.ex_items[:0]
        cap = slot.users.shape[0]
        rows = n if fused_ws is not None else cap
        # A sample's k-th best seeds a fused search's first launch; the merge after it, the rest.
        first = 0
        if fused_ws is not None and seed is not None and not has_floor:
            first = fused_path.first_launch(options.fused_first_segment, seed[0].shape[0], n_items,
                                            even or not items.ranked)  # the rows _refresh_sample took
        if first:
            stats["fused_first_segment"] = first

        def launches() -> None:
            users = slot.users[:rows] if own is None else own
            backend.topk_reset(state, rows)
            if has_floor or preseeded:
                # The floor (the k-th best of the rows searched before) stands in for the threshold sample's seed,
                # or the seed was selected for the whole search before its blocks.
                state.thr[:rows] = slot.floor[:rows]
            elif seed is not None:
                sample, sample_rows, sample_norms, _ = seed
                bias = _sample_bias(items, seed)
                if seed_fused:
                    self.fused.seed(state, users, sample, sample_norms, estimate, items.constant_column, bias,
                                    multiplied)
                else:
                    size = sample.shape[0]
                    scores = scores_buf[: rows * size].reshape(1, rows, size)
                    backend.gemm_strided_batched(users.reshape(1, rows, users.shape[1]),
                                                 sample.reshape(1, size, -1), scores)
                    sel.seed(state, scores, sample_rows, users, sample_norms, slot.ex_ptr, ex_items, estimate,
                             items.constant_column, bias)
            if keep_seed:
                state.seed_thr[:rows] = state.thr[:rows]
            if fused_ws is None:
                tiled.search_block(backend, plan, users, items.vecs, n_items, state, scores_buf, slot.ex_ptr,
                                   ex_items)
                sel.result(state, best_first)
            elif walk:
                self.fused.walk(users, items_t, n_items, state, slot.ex_ptr, slot.ex_items, has_excl, multiplied)
            else:
                self.fused.search(fused_ws.users_t, users, items_t, n_items, state, slot.ex_ptr, slot.ex_items,
                                  has_excl, options, multiplied, best_first, first, out)

        # The workspace (and so every other pointer, the sample buffer included) is fixed per slot; the items are
        # keyed by the device memory the launches read, not by the Python object: a segment or filtered view's
        # object is freed after its search and its id() taken by the next one, which lives at other addresses (the
        # sample's rows and norms too, which its mask and seed read).
        vecs = items.vecs
        sample_ptr = None if seed is None else tuple(a.data.ptr for a in seed[1:] if a is not None)
        key = (vecs.data.ptr, vecs.shape, vecs.strides, n_items, has_excl, sample_ptr,
               None if items_t is None else items_t.data.ptr, has_floor, options, multiplied, estimate, keep_seed,
               best_first, walk, seed_fused, preseeded, even)
        graph = slot.graphs.get(key)
        # The first block of a kind runs eagerly: it compiles and loads everything the capture must not have to.
        # From the second on (the next block, or the next search of one block: an embedded engine answering one
        # user at a time), the slot's graph is captured and replayed: one launch instead of a few dozen.
        if (out is not None or not (options.cuda_graphs and self.graphs_ok) or rows != cap
                or (graph is None and key not in self._ran)):
            launches()
            if len(self._ran) > 4096:  # keys hold addresses of item arrays long gone: forget them now and then
                self._ran.clear()
            self._ran.add(key)
            return
        if graph is None:
            if len(slot.graphs) >= _GRAPHS_PER_SLOT:
                slot.graphs.pop(next(iter(slot.graphs)))
            graph = slot.graphs[key] = self._capture(launches)
        if graph is None:
            launches()
        else:
            graph.launch(self.compute_stream)
            stats["graph_blocks"] += 1

    def _capture(self, launches: Any) -> Any:
        stream = self.compute_stream
        try:
            with self.capture_lock:
                stream.begin_capture()
                self.capturing = True
                try:
                    launches()
                finally:
                    self.capturing = False
                    graph = stream.end_capture()
            return graph
        except Exception as exc:  # capture is an optimisation: never fail a search for it
            log.warning("recall: CUDA graph capture failed (%s: %s); launching eagerly", type(exc).__name__, exc)
            self.graphs_ok = False
            return None
