"""Searching the first user batches while the item file is still being decoded.

A Parquet job cannot search a user against its items before every item is on the device, and decoding a large item
file takes a fraction of a second that, done first, the device spends idle: 0.6-0.8 s of a 4.6-4.8 s S4 job on the
H200 (a million items in one row group, which pyarrow decodes on one thread). But the exact top-k of a user over all
items is the best k of its exact top-k over each part of the items. So while the items arrive, :class:`EarlyStart`
closes a *part* once an eighth of the rows is on the device, then each time another quarter is, and searches the
first user batches against every closed part (an :class:`recall.Engine` over those rows, results left on the
device), taking another batch from the reader whenever no part is waiting: the device works while the items decode.
Once the last row is up, :meth:`EarlyStart.finish` searches those batches against the rows no part covered yet, and
each batch's result is the merge of its parts (``rescore_select``: score desc, ties to the lower item row), exactly
what one search over all the items returns.

It runs on a GPU engine of exact precision without exclusions (an exclusion file is mapped to item rows with every
item id, known only at the end); ``RECALL_EARLY=off`` turns it off.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from . import metrics
from .engine import Engine
from .errors import InputError
from .io import Embeddings
from .result import SearchResult

#: A part closes each time another 1/PARTS of the rows has arrived (the first at 1/(2 PARTS)); the rows left when
#: the file is read are searched last. More parts hide more of the decoding, at the cost of one more threshold seed
#: and merge per block and part.
PARTS = 4
#: User batches searched early at most: each holds one host result per part until it is merged.
MAX_BATCHES = 8
_WAIT_S = 0.005


def applies(on_gpu: bool, precision: str, exclusions: bool, dim: int | None) -> bool:
    """Whether a job searches early: ``RECALL_EARLY`` "auto" (the default: on a GPU, in exact precision, without
    exclusions, with a fixed vector dimension), "force" (also on the CPU: tests) or "off"."""
    mode = os.environ.get("RECALL_EARLY", "auto")
    if mode not in ("auto", "force", "off"):
        raise InputError(f"RECALL_EARLY must be auto, force or off, got {mode!r}")
    return mode != "off" and precision == "exact" and not exclusions and dim is not None \
        and (on_gpu or mode == "force")


def merge(backend: Any, parts: list[tuple[int, Any, Any]], k: int) -> tuple[Any, Any]:
    """The best ``k`` (score desc, lower row first) of each user over several parts' results, on ``backend``.

    ``parts``: (first item row of the part, scores, part rows) per part, each (n, width) as a search leaves them
    (padding: row -1, score -inf). Returns (scores, item rows), each (n, k), padded the same way."""
    xp = backend.xp
    scores = xp.concatenate([vals for _, vals, _ in parts], axis=1)
    rows = xp.concatenate([xp.where(r >= 0, r + lo, -1) for lo, _, r in parts], axis=1)
    return backend.rescore_select(scores, rows, k)


class MergedSearch:
    """The queued parts of one user batch; :meth:`result` waits for them and merges (on the caller's thread)."""

    def __init__(self, users: np.ndarray, parts: list[tuple[int, Engine, Callable[[], Any]]], k: int) -> None:
        self._users = users
        self._parts = parts
        self._k = k
        self.gpu_busy_s = 0.0

    def result(self) -> SearchResult:
        done = []
        for lo, engine, wait in self._parts:
            vals, rows = wait()
            self.gpu_busy_s += engine.stats.get("gpu_busy_s", 0.0)
            done.append((lo, vals, rows))
        backend, metric = engine.backend, engine.metric
        vals, rows = merge(backend, done, self._k)
        vals, rows = backend.to_host(vals), backend.to_host(rows)
        self._parts = []  # let the part engines go once every batch is merged
        scores = metrics.finish_scores(metric, np, vals, self._users)
        return SearchResult(indices=rows, scores=scores, ids=rows)


class EarlyStart:
    """Search user batches against the item rows already uploaded, part by part, on a thread of its own.

    ``take()`` gives the reader's next batch without waiting: an :class:`Embeddings`, None when none is ready, or
    ``end`` (the reader's end marker). :meth:`on_rows` is called (by ``read_embeddings``) each time more rows are on
    the device. ``engine_args`` are passed to every part's :class:`Engine` (metric, device, memory budget). Errors of
    the thread other than an input error in a part (which the full engine will report with its file and row) go to
    ``fail``.
    """

    def __init__(self, n_items: int, k: int, take: Callable[[], Any], end: Any, fail: Callable[[BaseException], None],
                 stop: threading.Event, **engine_args: Any) -> None:
        self.n_items, self.k = n_items, k
        self._take, self._end, self._fail, self._stop = take, end, fail, stop
        self._engine_args = engine_args
        self._part_rows = -(-n_items // (2 * PARTS))  # the first part is half as long: the device starts sooner
        self._cond = threading.Condition()
        self._matrix: Any = None
        self._rows = 0
        self._loaded = False
        self._lo = 0  # first row of the next part
        self._parts: list[tuple[int, Engine]] = []
        self.batches: list[tuple[Embeddings, list[tuple[int, Engine, Callable[[], Any]]]]] = []
        self.users_done = False  # the reader's end marker was taken here
        self.abandoned = False
        self._thread = threading.Thread(target=self._run, name="recall-early", daemon=True)

    def start(self) -> "EarlyStart":
        self._thread.start()
        return self

    def on_rows(self, matrix: Any, rows: int) -> None:
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
                        self.batches.append((batch, [(lo, e, e._queue_on_device(batch.vectors, self.k))
                                                     for lo, e in self._parts]))
                        continue
                with self._cond:
                    self._cond.wait(_WAIT_S)
        except InputError:
            self.abandoned = True  # bad rows in a part: the full engine reports them, naming the file
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
            self._fail(exc)

    def _search_part(self, matrix: Any, lo: int, hi: int) -> None:
        engine = Engine(matrix[lo:hi], **self._engine_args)
        self._parts.append((lo, engine))
        self._lo = hi
        self._part_rows = -(-self.n_items // PARTS)
        for batch, pending in self.batches:
            pending.append((lo, engine, engine._queue_on_device(batch.vectors, self.k)))

    def finish(self, matrix: Any, engine: Engine) -> list[tuple[Embeddings, MergedSearch]]:
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
        if self.abandoned:
            # A part refused its input: the full engine searches the batches taken (and raises what is wrong).
            return [(batch, engine.search_async(batch.vectors, self.k)) for batch, _ in taken]
        rest = Engine(matrix[self._lo:], **self._engine_args) if self._lo < self.n_items else None
        out = []
        for batch, pending in taken:
            engine._check_users(batch.vectors, None)  # scores within float32 against every item, not just a part's
            if rest is not None:
                pending.append((self._lo, rest, rest._queue_on_device(batch.vectors, self.k)))
            out.append((batch, MergedSearch(batch.vectors, pending, self.k)))
        return out

    def cancel(self) -> None:
        """Stop the thread (an error elsewhere); queued searches finish on the device and are dropped."""
        with self._cond:
            self._loaded = True
            self._cond.notify()
        self._thread.join()
        self.batches = []
