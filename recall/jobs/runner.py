"""The one Parquet -> Parquet runner: batches of users stream through a resident ``Engine``, reading, searching
and writing at once.

Three stages run at once on one host:

- a reader thread reads and validates the next user batch (pyarrow decodes with the GIL released);
- the calling thread starts the search of the current batch (``Engine.search_async``: on a GPU the search runs on
  the device while this thread queues the next one);
- a writer thread waits for the previous batch's result, turns it into Arrow and hands it to the writer
  (:class:`recall.io.CandidateWriter`, which encodes Parquet on a few threads of its own, in order).

Bounded queues (two batches each) keep memory flat whatever the number of users, and keep results in input order
(one producer, one consumer per queue). The first error in any stage stops the others and is re-raised in the caller;
outputs are written through ``CandidateWriter``, so an error or a kill never leaves a partial file. ``recall score``
(one or several vectors per user), ``recall rescore`` and every shard of ``recall batch`` run through
:func:`run_stream`.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

_QUEUE_DEPTH = 2
_POLL_S = 0.05

#: A batch's search: ``query(batch)`` starts it and returns a pending search (``result()`` gives the SearchResult;
#: ``stats`` is set by then).
Query = Callable[[Any], Any]
#: ``write(batch, result)``, called on the writer thread in input order.
Write = Callable[[Any, Any], None]


@dataclass(frozen=True)
class StreamStats:
    """Seconds each stage of :func:`run_stream` spent (they overlap) and the GPU's busy time (0 on the CPU)."""

    read_s: float
    search_s: float
    write_s: float
    device_busy_s: float


class _Stopped(Exception):
    """Another stage failed: leave quietly, the caller raises the first error."""


class Overlap:
    """The reader / searcher / writer hand-off: bounded queues, one stop flag, the first error kept."""

    DONE = object()

    def __init__(self) -> None:
        self.read_q: queue.Queue = queue.Queue(maxsize=_QUEUE_DEPTH)
        self.write_q: queue.Queue = queue.Queue(maxsize=_QUEUE_DEPTH)
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.seconds = {"read": 0.0, "search": 0.0, "write": 0.0}
        self._reader: threading.Thread | None = None

    def fail(self, exc: BaseException) -> None:
        self.errors.append(exc)
        self.stop.set()

    def put(self, q: queue.Queue, item: Any) -> None:
        # Poll rather than block: a stage whose consumer died must notice and stop instead of waiting forever.
        while not self.stop.is_set():
            try:
                q.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue
        raise _Stopped

    def get(self, q: queue.Queue) -> Any:
        while not self.stop.is_set():
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        raise _Stopped

    def _read(self, batches: Iterable[Any]) -> None:
        try:
            it = iter(batches)
            while True:
                t0 = time.perf_counter()
                batch = next(it, self.DONE)
                self.seconds["read"] += time.perf_counter() - t0
                self.put(self.read_q, batch)
                if batch is self.DONE:
                    return
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
            self.fail(exc)

    def _write(self, write: Callable[[Any], None], first: Iterable[Any] = ()) -> None:
        try:
            pending = iter(first)  # written before anything queued: the searcher does not wait for these to go
            while True:
                item = next(pending, None)
                if item is None:
                    item = self.get(self.write_q)
                if item is self.DONE:
                    return
                t0 = time.perf_counter()
                write(item)
                self.seconds["write"] += time.perf_counter() - t0
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001
            self.fail(exc)

    def start_reader(self, batches: Iterable[Any]) -> None:
        """Start reading ahead now, before :meth:`run` (e.g. while the items load)."""
        self._reader = threading.Thread(target=self._read, args=(batches,), name="recall-reader", daemon=True)
        self._reader.start()

    def take(self) -> Any:
        """The next batch read, or None if none is ready yet (without waiting); :attr:`DONE` after the last."""
        try:
            return self.read_q.get_nowait()
        except queue.Empty:
            return None

    def run(self, batches: Iterable[Any] | None, search: Callable[[Any], Any], write: Callable[[Any], None],
            first: Iterable[tuple[Any, Any]] = (), read_all: bool = False) -> None:
        """Run the stages to the end; re-raise the first error of any of them. ``batches`` may be None when
        :meth:`start_reader` started the reader; ``first``: (batch, search) pairs already started, written before
        the rest; ``read_all``: the reader's end marker was already taken (by whoever started those)."""
        if batches is not None:
            self.start_reader(batches)
        threads = [self._reader,
                   threading.Thread(target=self._write, args=(write, list(first)), name="recall-writer", daemon=True)]
        threads[1].start()
        try:
            while not read_all:
                batch = self.get(self.read_q)
                if batch is self.DONE:
                    break
                t0 = time.perf_counter()
                result = search(batch)
                self.seconds["search"] += time.perf_counter() - t0
                self.put(self.write_q, (batch, result))
            self.put(self.write_q, self.DONE)
        except _Stopped:
            pass
        except BaseException as exc:
            self.fail(exc)
        finally:
            # A failed searcher must not leave the writer waiting for a DONE that never comes.
            if self.errors:
                self.stop.set()
            for t in threads:
                if t is not None:
                    t.join()
        if self.errors:
            raise self.errors[0]

    def cancel(self) -> None:
        """Stop a reader started by :meth:`start_reader` (the job failed before :meth:`run`)."""
        self.stop.set()
        if self._reader is not None:
            self._reader.join()


def run_stream(batches: Iterable[Any] | None, query: Query, write: Write, *, overlap: Overlap | None = None,
               first: Iterable[tuple[Any, Any]] = (), read_all: bool = False) -> StreamStats:
    """Search batches of users with a resident engine, reading ahead and writing behind.

    Parameters
    ----------
    batches : iterable of batches, or None
        Read on the reader thread (validated there); None when ``overlap``'s reader was started already.
    query : callable ``(batch) -> pending``
        Starts a batch's search: ``Engine.search_async`` for streamed users (on a GPU the search thread then queues
        the next batch while the writer waits for the previous one's results, so the device goes from batch to
        batch without a gap), or a search done at once.
    write : callable ``(batch, SearchResult) -> None``
        Called on the writer thread, in input order.
    overlap, first, read_all
        A hand-off whose reader was started already, the (batch, pending) pairs started before (searched while the
        items loaded), and whether they took the reader's end marker.

    Raises
    ------
    Whatever the first failing stage raised.
    """
    busy = waited = 0.0

    def finish_and_write(item: tuple[Any, Any]) -> None:
        nonlocal busy, waited
        batch, pending = item
        t0 = time.perf_counter()
        result = pending.result()
        waited += time.perf_counter() - t0
        busy += (getattr(pending, "stats", None) or {}).get("gpu_busy_s", 0.0)
        write(batch, result)

    overlap = overlap or Overlap()
    overlap.run(batches, query, finish_and_write, first, read_all)
    # The writer's wait for results is search time, not writing.
    return StreamStats(overlap.seconds["read"], overlap.seconds["search"] + waited, overlap.seconds["write"] - waited,
                       busy)


class Done:
    """A search finished on the spot, as a pending one (for the queries that run synchronously)."""

    def __init__(self, result: Any, stats: dict | None = None) -> None:
        self._result, self.stats = result, stats or {}

    def result(self) -> Any:
        return self._result
