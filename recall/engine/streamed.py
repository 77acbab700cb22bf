"""Catalogues beyond the device's memory: the prepared items kept in host memory, streamed to the device in segments.

An engine whose items do not fit in ``item_memory`` (default: what the device holds beside the search's budget)
keeps them, checked and prepared for the metric, in page-locked host memory. A search then takes the users in the
largest groups whose running results fit in half the memory budget (users outer: each item byte crosses the bus
once per group) and, for each group, the items segment by segment (items inner): each segment is uploaded while the
previous one is searched (two segments on the device at once, so a segment is half of ``item_memory``), searched
with the floor of the group's results so far (a user's threshold starts at its k-th best over the segments before,
as in one whole search), and merged into them on the device (``Backend.merge``: score desc, ties to the lower item
row). The best k of each segment's exact top k is the exact top k over all items, so the answer is the resident
answer, ties, exclusions (each moved into the segment's rows) and item filters included.

Nothing here asks which device it runs on: the CPU backend streams the same way when ``item_memory`` is set (its
segments are views of the host matrix), which is how CI exercises it.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core import metrics
from ..core.errors import InputError
from ..core.exclusions import Exclusions
from ..core.results import to_numpy
from . import inputs

#: Rows checked and prepared at a time while an engine is built (on the device, a chunk at a time).
PREPARE_ROWS = 1 << 20
#: Running results per user in a group: the group's merge so far, a segment's part, and the merge's temporaries.
_GROUP_COPIES = 5
#: Segments and user groups start at multiples of this many rows where they are longer: a multiple of every tile
#: the backends search in (the CPU's 128 users x 2048 items, its few users' tiles of up to
#: ``tiling.WIDEST_FEW_USERS_TILE`` items, the GPU's), so that each GEMM of a streamed search has the shape of the
#: resident search's GEMM over the same rows and every score comes out bit for bit the same.
ALIGN = 8192


def _aligned(rows: int) -> int:
    return rows // ALIGN * ALIGN if rows >= ALIGN else rows


def _pieces(n: int, size: int, unit: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` pieces of ``n`` rows, at most ``size`` each, for a search that takes them ``unit`` rows a GEMM
    (the plan's user block, or its item tile), cut so that its GEMMs give the resident search's bits.

    Pieces of at least one unit start on the unit's grid: each GEMM is then the resident search's over the same
    rows (a piece cut inside a unit would search its rows in GEMMs of another shape). Shorter pieces cannot be; the
    shape of their GEMMs only matters there where a GEMM has one row (a matrix-vector product, whose sums differ in
    the last bits), so the last piece holds one row only where the resident search's last GEMM does."""
    if size >= unit:
        size = size // unit * unit
    cuts = [(lo, min(lo + size, n)) for lo in range(0, n, size)]
    if cuts and size < unit:
        single = n % unit == 1  # the resident search's last GEMM takes one row
        lo, hi = cuts[-1]
        if hi - lo == 1 and not single and len(cuts) > 1 and size > 2:
            cuts[-2:] = [(cuts[-2][0], hi - 2), (hi - 2, hi)]
        elif hi - lo > 2 and single:
            cuts[-1:] = [(lo, hi - 1), (hi - 1, hi)]
    return cuts


@dataclass
class StreamedItems:
    """Prepared items (n_items, width) float32 in host memory (page-locked where the backend has such memory),
    searched in segments of ``segment_rows``."""

    host: np.ndarray
    segment_rows: int
    item_memory: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.host.shape)

    def segments(self, tile: int = 1) -> list[tuple[int, int]]:
        """(first row, end) of each segment, for a search of ``tile`` items a GEMM (:func:`_pieces`)."""
        return _pieces(self.host.shape[0], self.segment_rows, tile)


def row_bytes(backend: Any, width: int) -> int:
    """Device bytes per resident item row of ``width`` (the backend's derived copies and their padding included)."""
    return -(-backend.resident_bytes(ALIGN, width) // ALIGN)


def needs_streaming(backend: Any, n_items: int, width: int, item_memory: int | None, budget: int) -> int | None:
    """The ``item_memory`` an engine of (n_items, width) prepared items streams under, or None where they fit."""
    cap = item_memory if item_memory is not None else backend.item_memory(budget)
    if cap is None or backend.resident_bytes(n_items, width) <= cap:
        return None
    return cap


def prepare(backend: Any, metric: str, item_vecs: Any, cap: int,
            centre: np.ndarray | None = None) -> tuple[StreamedItems, float]:
    """Check and prepare ``item_vecs`` chunk by chunk (on the backend: a chunk is uploaded, checked, less ``centre``
    where there is one (``Engine.l2_centre``), prepared and brought back) into host memory: (the streamed items, the
    largest item norm).

    Raises
    ------
    InputError
        As :class:`recall.Engine` (the bad row named in the caller's numbering); ``item_memory`` too small for one
        row of each of two segments.
    """
    shape = getattr(item_vecs, "shape", None)
    if shape is None or len(shape) != 2:
        item_vecs = np.asarray(item_vecs)
    inputs.check_kind(item_vecs, "item_vecs")
    if len(item_vecs.shape) != 2:
        raise InputError(f"item_vecs: expected a 2-d (n, dim) array, got shape {tuple(item_vecs.shape)}")
    n, dim = int(item_vecs.shape[0]), int(item_vecs.shape[1])
    width = metrics.scored_width(metric, dim)
    per_row = row_bytes(backend, width)
    segment_rows = cap // (2 * per_row)  # two on the device at once: one searched, the next arriving
    if segment_rows < 1:
        raise InputError(f"item_memory {cap:,} bytes cannot hold two item rows of dimension {dim} "
                         f"({2 * per_row:,} bytes): raise it")
    host = backend.empty_out((n, width), np.float32, True)
    item_norm, worst = 0.0, 0
    xp = backend.xp
    shift = None if centre is None else xp.asarray(centre)
    for lo in range(0, n, PREPARE_ROWS):
        hi = min(n, lo + PREPARE_ROWS)
        chunk = inputs.matrix(backend, xp, item_vecs[lo:hi], "item_vecs", first_row=lo)
        prepared = metrics.prepare_items(metric, xp, chunk, first_row=lo, centre=shift)
        if metric != "cosine":
            norms = metrics.row_norms(xp, prepared[:, :dim])
            top = int(xp.argmax(norms))
            if float(norms[top]) > item_norm:
                item_norm, worst = float(norms[top]), lo + top
        host[lo:hi] = backend.to_host(prepared)
    # Named here, where the row of the largest norm is known (the resident engine names it too).
    inputs.check_item_norm(item_norm, metric, lambda: worst, centre)
    return StreamedItems(host, min(n, _aligned(segment_rows)), cap), (item_norm if metric != "cosine" else 1.0)


def group_users(budget: int, k: int, n_users: int) -> int:
    """Users searched together against every segment: their running results (a few copies of (n, k) scores and
    rows) take at most half the memory budget, beside the tiled search of each segment (which plans under the whole
    budget, as the resident search does: a streamed search may use up to 1.5 times it)."""
    return max(1, min(n_users, _aligned(budget // 2 // (_GROUP_COPIES * 12 * max(1, k)))))


def run(engine: Any, items: StreamedItems, users: Any, k: int, excl: Exclusions, out_vals: Any, out_rows: Any,
        plan: Any = None) -> Any:
    """``Engine.run`` over streamed items: fills ``out_vals`` / ``out_rows`` (n, k) before it returns, and returns
    a wait that returns the stats."""
    backend = engine.backend
    wall = time.perf_counter()
    n_users = int(users.shape[0])
    # The tiling the resident search of all these users against all the items would take, for every segment: the
    # same GEMM calls over the same rows, so the same score bits (groups and segments start on its blocks).
    plan = plan or engine.plan(users, items.shape[0], k)
    groups = _pieces(n_users, group_users(engine.memory_budget, k, n_users), plan.user_block)
    # Items a GEMM takes: with several interests a user, the plan's item tile counts each item's score rows.
    segments = items.segments(plan.interests.width if plan.interests is not None else plan.item_tile)
    busy = 0.0
    blocks = 0
    uploaded = 0
    host_out = isinstance(out_vals, np.ndarray)

    def finished(wait: Any) -> None:
        nonlocal busy, blocks
        stats = wait()
        busy += stats.get("gpu_busy_s", 0.0)
        blocks += stats.get("blocks", 0)

    for g0, g1 in groups:
        gu = users[g0:g1]
        gx = Exclusions(*excl.block(g0, g1))
        best = None
        inflight: deque = deque()  # (resident segment, its search's wait): kept until the search is done
        for lo, hi in segments:
            resident = backend.load_items(backend.ingest(items.host[lo:hi]), metrics.norms_rank(engine.metric))
            uploaded += (hi - lo) * items.host.shape[1] * 4
            kseg = min(k, hi - lo)
            floor = best[0][:, k - 1] if best is not None and best[0].shape[1] >= k else None
            vals = backend.empty_out((g1 - g0, kseg), np.float32, False)
            rows = backend.empty_out((g1 - g0, kseg), np.int64, False)
            wait = engine.run(gu, kseg, gx.window(lo, hi), vals, rows, items=resident, floor=floor, plan=plan)
            parts = [(vals, rows, lo)] if best is None else [(*best, 0), (vals, rows, lo)]
            best = backend.merge(parts, k)  # queued after the segment's search, on the backend
            inflight.append((resident, wait))
            while len(inflight) > 1:  # the segment before is searched: its memory may go to the next upload
                finished(inflight.popleft()[1])
        for _, wait in inflight:
            finished(wait)
        if host_out:
            out_vals[g0:g1] = backend.to_host(best[0])  # waits for the last merge
            out_rows[g0:g1] = backend.to_host(best[1])
        else:
            backend.synchronize()  # the last merge, queued on the backend's own stream, is done
            out_vals[g0:g1], out_rows[g0:g1] = best
    elapsed = time.perf_counter() - wall
    stats = {"streamed": True, "item_segments": len(segments), "segment_rows": segments[0][1] - segments[0][0],
             "user_groups": len(groups), "item_bytes_uploaded": uploaded, "blocks": blocks,
             "wall_s": elapsed, "gpu_busy_s": busy, "busy_fraction": busy / elapsed if elapsed > 0 else 0.0}
    return lambda: stats


def gather(backend: Any, metric: str, items: StreamedItems, rows: Any, item_memory: int | None,
           budget: int) -> tuple[Any, Any]:
    """The prepared rows ``rows`` (host or device int64, increasing) of streamed items as a catalogue of their own:
    (its items, its prepared matrix): resident on the backend where they fit, else streamed again."""
    rows = to_numpy(rows)
    shape = (int(rows.shape[0]), int(items.host.shape[1]))
    cap = needs_streaming(backend, shape[0], shape[1], item_memory, budget)
    if cap is None:
        prepared = backend.ingest(items.host[rows])
        return backend.load_items(prepared, metrics.norms_rank(metric)), prepared
    segment_rows = max(1, cap // (2 * row_bytes(backend, shape[1])))
    pinned = backend.empty_out(shape, np.float32, True)
    np.take(items.host, rows, axis=0, out=pinned)  # gathered straight into page-locked memory
    return StreamedItems(pinned, min(shape[0], _aligned(segment_rows)), cap), pinned


def rescore(engine: Any, items: StreamedItems, users: Any, indptr: np.ndarray, rows: Any, k: int) -> tuple[Any, Any,
                                                                                                          str]:
    """``Backend.rescore`` against streamed items: the users in groups whose candidate rows fit in ``item_memory``,
    each group's distinct candidate rows gathered from host memory, uploaded and re-scored, rows mapped back."""
    backend, xp = engine.backend, engine.backend.xp
    host_rows = to_numpy(rows).astype(np.int64, copy=False)
    n = int(indptr.size) - 1
    most = max(1, items.item_memory // row_bytes(backend, items.host.shape[1]))  # candidate rows per group (distinct or not: an upper bound)
    vals_out = xp.full((n, k), -np.inf, dtype=np.float32)
    rows_out = xp.full((n, k), -1, dtype=np.int64)
    path = "none"
    start = 0
    while start < n:
        stop = int(np.searchsorted(indptr, indptr[start] + most, side="right")) - 1
        stop = min(n, max(stop, start + 1))
        lo, hi = int(indptr[start]), int(indptr[stop])
        if hi > lo:
            distinct, local = np.unique(host_rows[lo:hi], return_inverse=True)
            resident = backend.load_items(backend.ingest(items.host[distinct]))
            vals, got, path = backend.rescore(users[start:stop], resident, indptr[start:stop + 1] - lo,
                                              local.astype(np.int64), k, engine.memory_budget, engine.options)
            table = xp.asarray(distinct)
            vals_out[start:stop] = vals
            rows_out[start:stop] = xp.where(got >= 0, table[xp.maximum(got, 0)], -1)
        start = stop
    return vals_out, rows_out, path
