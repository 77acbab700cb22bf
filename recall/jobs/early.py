"""Searching the first user batches while the item file is still being read.

A Parquet job cannot search a user against its items before every item is on the device, and decoding a large item
file takes a fraction of a second that, done first, the device spends idle: 0.6-0.8 s of a 4.6-4.8 s S4 job on the
H200 (a million items in one row group, which pyarrow decodes on one thread). But the exact top-k of a user over all
items is the best k of its exact top-k over each part of the items. So while the items arrive, :class:`EarlyStart`
closes a *part* once 1/16 of the rows is on the device, then each time another eighth is, and searches the first
user batches against every closed part (an :class:`recall.Engine` over those rows, sharing the job's backend),
taking another batch from the reader whenever no part is waiting: the device works while the items decode. Once the
last row is up, :meth:`EarlyStart.finish` searches those batches against the rows no part covered yet.

Each batch's parts are merged on the backend as they finish (``Engine.merge_topk``: score desc, ties to the lower
item row), which is exactly what one search over all the items returns. The k-th best score merged so far is the
*floor* of the batch's next part: its thresholds start there instead of at a sample's seed, so a part passes only
what can still enter the top k (an item scoring the floor loses the tie to the lower rows already held) and costs
about what the same rows cost late in one whole search. A part's blocks hold 8192 users, so that launching them on
the host does not hold back the device.

It runs for jobs in exact precision without an item filter, on a backend whose searches run while the host goes on
(``JobOptions.early``), whatever the file layout (a ``list<float>`` column gives its dimension with the first decoded
rows). A job's exclusions are mapped to item rows with the item file's id column, read on its own beside the vectors;
each part searches a batch with the exclusions that fall in its rows (``Exclusions.window``). A batch taken before
they are mapped does not wait for them: its parts keep the best ``k + slack`` items per user without exclusions
(:func:`slack`), and once the exclusions are known each user's excluded items are dropped from that list. Where at
least k remain they are the exact answer (every item outside the list scores below it, by the tie rule too); a user
left with fewer, whose list was full, is searched again with its exclusions.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
from numba import njit, prange

from ..core import metrics
from ..core.errors import InputError, ResourceError
from ..core.exclusions import Exclusions
from ..core.results import SearchResult
from ..engine import Engine, TopK
from ..io import Embeddings

#: User batches searched early at most: each holds its merge so far (k, or k + slack, per user) on the device until
#: it is written.
MAX_BATCHES = 8
_WAIT_S = 0.005
_PART_USER_BLOCK = 8192


def slack(k: int) -> int:
    """Items a batch searched before its exclusions are known keeps per user beyond k: room for the excluded items
    among its best (a user with more of them there is searched again)."""
    return max(32, k // 4)


@njit(parallel=True, cache=True)
def _drop_excluded(vals: np.ndarray, rows: np.ndarray, indptr: np.ndarray, items: np.ndarray,
                   k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each user's first ``k`` entries of ``rows`` (best first, -1 padding) that are not among its sorted excluded
    rows ``items[indptr[u]:indptr[u + 1]]``, padded with (-inf, -1); and whether a user kept fewer than k from a list
    with no padding (the items beyond its list may hold its answer)."""
    n, m = rows.shape
    out_vals = np.full((n, k), -np.inf, np.float32)
    out_rows = np.full((n, k), -1, np.int64)
    short = np.zeros(n, np.bool_)
    for u in prange(n):
        lo, hi = indptr[u], indptr[u + 1]
        w = 0
        for j in range(m):
            r = rows[u, j]
            if r < 0 or w == k:
                break
            a, b = lo, hi
            while a < b:
                c = (a + b) >> 1
                if items[c] < r:
                    a = c + 1
                else:
                    b = c
            if a < hi and items[a] == r:
                continue
            out_vals[u, w] = vals[u, j]
            out_rows[u, w] = r
            w += 1
        short[u] = w < k and m > 0 and rows[u, m - 1] >= 0
    return out_vals, out_rows, short


class _Early:
    """One user batch searched part by part: the running merge of its parts' results, on the backend."""

    def __init__(self, batch: Embeddings, excl: Exclusions | None = None, width: int = 0) -> None:
        self.batch = batch
        self.excl = excl  # the batch's exclusions, in the rows of all the items
        self.width = width  # items kept per user: k, or k + slack while the exclusions are deferred
        self.deferred = False  # searched without its exclusions (not mapped yet when it was taken)
        self.best: TopK | None = None  # (scores, item rows) (n, width), inner-product space
        self.waits: list[Callable[[], dict]] = []


class MergedSearch:
    """The parts of one user batch, queued; :meth:`result` waits for them and returns their merge (with the batch's
    exclusions applied, where they were deferred: ``exclusions(batch)`` waits for them)."""

    def __init__(self, early: _Early, engine: Engine, k: int,
                 exclusions: Callable[[Embeddings], tuple[Any, Any]] | None = None) -> None:
        self._early, self._engine, self._k = early, engine, k
        self._exclusions = exclusions
        self.stats: dict = {}

    def result(self) -> SearchResult:
        early, engine = self._early, self._engine
        busy = sum(wait().get("gpu_busy_s", 0.0) for wait in early.waits)
        self.stats = {"gpu_busy_s": busy, "parts": len(early.waits)}
        if early.deferred:
            result = self._apply_exclusions(early)
        else:
            result = engine.finish_topk(early.best, early.batch.vectors)
        self._early = None  # let the device arrays go
        return result

    def _apply_exclusions(self, early: _Early) -> SearchResult:
        engine, batch = self._engine, early.batch
        excl = Exclusions(*(np.asarray(a, np.int64) for a in self._exclusions(batch)))
        vals, rows = engine.backend.to_host(early.best.vals), engine.backend.to_host(early.best.rows)
        width = min(self._k, engine.n_items)
        vals, rows, short = _drop_excluded(np.ascontiguousarray(vals), np.ascontiguousarray(rows), excl.indptr,
                                           excl.items, width)
        scores = engine.finish_topk(TopK(vals, rows, lambda: {}), batch.vectors).scores
        again = np.flatnonzero(short)
        self.stats["searched_again"] = int(again.size)
        if again.size:
            sub = excl.subset(again)
            res = engine.search(batch.vectors[again], width, exclude=(sub.indptr, sub.items))
            rows[again] = engine.backend.to_host(res.indices)
            scores[again] = engine.backend.to_host(res.scores)
        return SearchResult(indices=rows, scores=scores, ids=rows)


class EarlyStart:
    """Search user batches against the item rows already uploaded, part by part, on a thread of its own.

    ``take()`` gives the reader's next batch without waiting: an :class:`Embeddings`, None when none is ready, or
    ``end`` (the reader's end marker). :meth:`on_rows` is called (by ``read_embeddings``) each time more rows are on
    the device; the first time, it calls ``on_dim(dim)`` (the job starts its user reader there). ``exclusions(batch)``
    (optional) returns a batch's exclusions as CSR ``(indptr, item rows)`` over its users, waiting until they are
    mapped; ``exclusions_ready()`` says whether they are (a batch taken before is searched with them deferred; by
    default every batch waits). ``engine_args`` are passed to every part's :class:`Engine` (metric, device: the
    job's backend, memory budget, options). A part refusing its input (the full engine reports it, with its file
    and row) or without room ends the early searches (:meth:`finish` hands their batches to the full engine); any
    other error of the thread goes to ``fail``.
    """

    def __init__(self, n_items: int, k: int, parts: int, take: Callable[[], Any], end: Any,
                 fail: Callable[[BaseException], None], stop: threading.Event,
                 on_dim: Callable[[int], None] | None = None,
                 exclusions: Callable[[Embeddings], tuple[Any, Any]] | None = None,
                 exclusions_ready: Callable[[], bool] | None = None, **engine_args: Any) -> None:
        self.n_items, self.k = n_items, k
        self._exclusions = exclusions
        self._exclusions_ready = exclusions_ready or (lambda: True)
        self._take, self._end, self._fail, self._stop = take, end, fail, stop
        self._on_dim = on_dim  # called once, with the items' dimension, when the first rows arrive
        self._n_parts = parts
        backend = engine_args["device"]
        total = engine_args.pop("memory_budget", None) or backend.free_memory() // 2
        # The parts' engines live together until the items are loaded: each gets 1/(parts + 1) of the memory budget
        # (the job's, or half the device's free memory), which caps its blocks. Not tuned: the tune cache's tilings
        # are for whole searches. A part's blocks take a fraction of a whole search's time each: blocks of 4x the
        # users, so that the device, not the launching of blocks, sets the pace.
        options = engine_args.pop("options")
        self._engine_args = {**engine_args, "memory_budget": max(1, total // (parts + 1)), "tune": "off",
                             "options": replace(options, min_user_block=max(options.min_user_block,
                                                                            _PART_USER_BLOCK))}
        # The first part is half as long: the device starts sooner. Under l2 it holds the rows the centre is taken
        # from (metrics.CENTRE_ROWS).
        self._part_rows = -(-n_items // (2 * parts))
        if engine_args.get("metric") == "l2":
            self._part_rows = max(self._part_rows, min(n_items, metrics.CENTRE_ROWS))
        self._cond = threading.Condition()
        self._matrix: Any = None
        self._rows = 0
        self._loaded = False
        self._lo = 0  # first row of the next part
        self._parts: list[tuple[int, Engine]] = []
        self.batches: list[_Early] = []
        self.users_done = False  # the reader's end marker was taken here
        self.abandoned = False
        self._thread = threading.Thread(target=self._run, name="recall-early", daemon=True)

    def start(self) -> "EarlyStart":
        self._thread.start()
        return self

    def on_rows(self, matrix: Any, rows: int) -> None:
        if self._on_dim is not None:
            # The dimension is known once the first rows are decoded (a list<float> column declares none): the user
            # reader can start, checking every user against it.
            on_dim, self._on_dim = self._on_dim, None
            on_dim(int(matrix.shape[1]))
        with self._cond:
            self._matrix, self._rows = matrix, rows
            self._cond.notify()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cond:
                    rows, matrix, loaded = self._rows, self._matrix, self._loaded
                if loaded:
                    return
                if rows - self._lo >= self._part_rows:
                    self._search_part(matrix, self._lo, rows)
                    continue
                if self._parts and len(self.batches) < MAX_BATCHES and not self.users_done:
                    batch = self._take()
                    if batch is self._end:
                        self.users_done = True
                        continue
                    if batch is not None:
                        early = _Early(batch, width=self.k)
                        self.batches.append(early)  # taken from the reader: kept, whatever happens next
                        early.excl = self._excl(batch)
                        if self._exclusions is not None and early.excl is None:
                            early.deferred, early.width = True, self.k + slack(self.k)
                        for lo, engine in self._parts:
                            self._queue(self.batches[-1], lo, engine)
                        continue
                with self._cond:
                    self._cond.wait(_WAIT_S)
        except (InputError, ResourceError, MemoryError):
            # Bad rows in a part (the full engine reports them, naming the file), or no room for another part's
            # engine: the full engine searches the batches taken. An optimisation never fails a job.
            self.abandoned = True
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
            self._fail(exc)

    def _search_part(self, matrix: Any, lo: int, hi: int) -> None:
        if lo == 0 and self._engine_args.get("metric") == "l2":
            # Every part is moved by the whole catalogue's centre (the full engine's, from the same first rows), so
            # that the parts' lists merge as one search's.
            backend = self._engine_args["device"]
            self._engine_args["l2_centre"] = metrics.far_centre(backend.to_host(matrix[:metrics.CENTRE_ROWS]))
        engine = Engine(matrix[lo:hi], copy=False, **self._engine_args)  # rows that are not written again
        self._parts.append((lo, engine))
        self._lo = hi
        self._part_rows = -(-self.n_items // self._n_parts)
        for early in self.batches:
            self._queue(early, lo, engine)

    def _excl(self, batch: Embeddings) -> Exclusions | None:
        """The batch's exclusions, or None where the job has none or they are not mapped yet."""
        if self._exclusions is None or not self._exclusions_ready():
            return None
        return Exclusions(*self._exclusions(batch))

    def _queue(self, early: _Early, lo: int, engine: Engine) -> None:
        """Search ``early``'s batch against the part of ``engine`` (first row ``lo``) and merge it into its best;
        the merge so far gives the part's floor."""
        best, width = early.best, early.width
        floor = best.vals[:, width - 1] if best is not None and best.vals.shape[1] >= width else None
        excl = None
        if early.excl is not None:
            window = early.excl.window(lo, lo + engine.n_items)
            excl = (window.indptr, window.items)
        part = engine.search_topk(early.batch.vectors, width, floor=floor, exclude=excl)
        early.waits.append(part.wait)
        early.best = engine.merge_topk(best, part, lo, width)

    def finish(self, matrix: Any, engine: Engine) -> list[tuple[Embeddings, Any]]:
        """Every item is on the device (``matrix``) and ``engine`` holds them all: stop the thread, search each early
        batch against the rows no part covered, and return the batches taken from the reader, in input order, with
        their merged searches (empty when none was taken: the caller then searches every batch itself)."""
        with self._cond:
            self._loaded = True
            self._cond.notify()
        self._thread.join()
        taken, self.batches = self.batches, []
        if self._stop.is_set():
            return []  # another stage failed: the job is over
        if not self.abandoned:
            try:
                rest = Engine(matrix[self._lo:], copy=False, **self._engine_args) if self._lo < self.n_items else None
                if rest is not None:
                    self._parts.append((self._lo, rest))
                out = []
                for early in taken:
                    engine.check_users(early.batch.vectors)  # within float32 against all items, not a part's
                    if rest is not None:
                        self._queue(early, self._lo, rest)
                    out.append((early.batch, MergedSearch(early, engine, self.k, self._exclusions)))
                self._parts = []
                return out
            except (ResourceError, MemoryError):
                pass  # no room for the last part: as below
        # A part refused its input or had no room: the full engine searches the batches taken (and raises what is
        # wrong with them).
        self._drop(engine)
        return [(early.batch, engine.search_async(early.batch.vectors, self.k,
                                                  exclude=None if self._exclusions is None else
                                                  self._exclusions(early.batch)))
                for early in taken]

    def _drop(self, engine: Engine) -> None:
        """Let the parts' engines go, once nothing queued on them still runs (their memory is reused at once)."""
        engine.backend.synchronize()
        self._parts = []

    def cancel(self) -> None:
        """Stop the thread (an error elsewhere); queued searches finish on the device and are dropped."""
        with self._cond:
            self._loaded = True
            self._cond.notify()
        if self._thread.ident is not None:  # started
            self._thread.join()
        self.batches = []
        if self._parts:
            self._parts[0][1].backend.synchronize()
        self._parts = []
