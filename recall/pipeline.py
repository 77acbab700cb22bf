"""Parquet to Parquet: stream user batches through one ``Engine``, overlapping reading, searching and writing.

Three stages run at once on one host:

- a reader thread reads and validates the next user batch (pyarrow decodes with the GIL released);
- the calling thread searches the current batch (BLAS, the top-k kernels, or the GPU);
- a writer thread turns the previous result into Arrow and hands it to :class:`recall.io.CandidateWriter`, which
  encodes Parquet on a few threads of its own and appends the row groups in order.

Bounded queues (two batches each) keep memory flat whatever the number of users, and keep results in input order
(one producer, one consumer per queue). The first error in any stage stops the others and is re-raised in the caller;
the output is written through :class:`recall.io.CandidateWriter`, so an error or a kill never leaves a partial file.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from . import early, metrics
from .backends import DEVICES
from .backends.probe import cuda_status
from .engine import Engine, check_k
from .errors import InputError
from .io import (
    DEFAULT_COMPRESSION,
    CandidateWriter,
    Embeddings,
    check_compression,
    check_output_path,
    inspect_embeddings,
    inspect_exclusions,
    iter_embedding_batches,
    load_exclusions,
    read_embeddings,
    read_ids,
)
from .result import id_lookup

#: Host memory the batches in flight may hold together (read queue, the batch being searched, write queue, the one
#: being written): bounds the automatic batch size, so that a large k gets smaller batches.
INFLIGHT_BYTES = 512 << 20
_MAX_BATCH = 65_536
_MIN_BATCH = 256
_QUEUE_DEPTH = 2
_POLL_S = 0.05

#: ``progress(done_users, total_users)``; called from the writer thread after each batch is handed to the Parquet
#: writer (whose encoding threads may still hold the last few).
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ScoreSummary:
    """What :func:`score_files` did.

    Attributes
    ----------
    users, items, dim, k : int
    metric : str
    device : str
        "cpu" or "gpu".
    device_detail : str
        One line naming the device.
    seconds : float
        Wall time of the whole call, reading included.
    read_s, search_s, write_s : float
        Time spent in each stage. They overlap, so they add up to more than ``seconds`` when overlap works.
    batch_size : int
        Users per batch.
    exclusion_pairs : int
        Pairs in the exclusions file (0 without one).
    unknown_exclusions : int
        Of those, pairs ignored because their user or item id is unknown.
    out_path : str
    """

    users: int
    items: int
    dim: int
    k: int
    metric: str
    device: str
    device_detail: str
    seconds: float
    read_s: float
    search_s: float
    write_s: float
    batch_size: int
    exclusion_pairs: int
    unknown_exclusions: int
    out_path: str
    device_busy_s: float = 0.0  # GPU time spent computing (CUDA events); 0 on the CPU
    start_s: float = 0.0  # from the call until users could be searched: items read, engine built, user ids read
    early_users: int = 0  # users searched while the items were still being read (recall/early.py)

    @property
    def users_per_s(self) -> float:
        return self.users / self.seconds if self.seconds > 0 else float("inf")

    def line(self) -> str:
        """The one-line summary the CLI prints."""
        return (
            f"scored {self.users:,} users x {self.items:,} items, dim {self.dim}, k {self.k}, metric {self.metric}, "
            f"on {self.device} in {self.seconds:.2f} s ({self.users_per_s:,.0f} users/s) -> {self.out_path}"
        )

    def stages_line(self) -> str:
        """Per-stage times (overlapping), for ``--verbose``."""
        busy = (f"; GPU busy {self.device_busy_s:.2f} s ({self.device_busy_s / self.seconds:.0%} of wall)"
                if self.device_busy_s and self.seconds > 0 else "")
        return (
            f"start-up {self.start_s:.2f} s (items, engine, user ids"
            + (f"; {self.early_users:,} users searched meanwhile" if self.early_users else "") + "); "
            f"stages (overlapping): read {self.read_s:.2f} s, search {self.search_s:.2f} s, "
            f"write {self.write_s:.2f} s; batch {self.batch_size:,} users; device {self.device_detail}{busy}"
        )


def auto_batch_size(k: int, dim: int) -> int:
    """Users per batch such that the batches in flight fit in :data:`INFLIGHT_BYTES`.

    Per user a batch holds its vector (4·dim bytes) and its result (int64 rows, float32 scores, int64 ids: 20·k);
    once handed to the writer, the ids and scores (12·k, shared with the Arrow table) and their Parquet encoding (up
    to 12·k) until it is in the file. Alive at once: two batches queued for the search, one being searched, two queued
    for the writer (4·dim + 20·k each) and up to :data:`recall.io.writer.ENCODE_THREADS` (4) being encoded (24·k
    each), at most 20·dim + 156·k bytes per user, which the 5·(4·dim + 32·k) used here covers.
    """
    per_user = 4 * dim + 32 * k
    return int(np.clip(INFLIGHT_BYTES // (5 * per_user), _MIN_BATCH, _MAX_BATCH))


def check_job_args(k: Any, metric: str, device: str, batch_size: Any) -> int:
    """Validate the arguments every Parquet job shares (score, rescore, multi-interest); returns k as an int.

    Raises
    ------
    InputError
        k < 1, an unknown metric or device, or a batch size that is not an integer >= 1.
    """
    k = _check_k(k)
    metrics.check_metric(metric)
    if device not in DEVICES:
        raise InputError(f"unknown device {device!r}: expected one of {', '.join(DEVICES)}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise InputError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    return k


_check_k = check_k  # the engine's own check: one rule for k everywhere


def _check_nonzero(emb: Embeddings, path: str) -> None:
    """Cosine has no direction for a zero vector: name the file, row and id here, where they are known."""
    zero = ~emb.vectors.any(axis=1)
    if zero.any():
        pos = int(zero.argmax())  # host or device vectors
        rid = emb.ids[pos]
        rid = int(rid) if isinstance(rid, (int, np.integer)) else repr(str(rid))
        raise InputError(f"{path}: row {emb.row_start + pos} (id {rid}) is a zero vector, which has no direction "
                         f"for metric 'cosine'")


class _Stopped(Exception):
    """Another stage failed: leave quietly, the caller raises the first error."""


class _Overlap:
    """The reader / searcher / writer hand-off: bounded queues, one stop flag, the first error kept."""

    _DONE = object()

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

    def reader(self, batches: Iterable[Any]) -> None:
        try:
            it = iter(batches)
            while True:
                t0 = time.perf_counter()
                batch = next(it, self._DONE)
                self.seconds["read"] += time.perf_counter() - t0
                self.put(self.read_q, batch)
                if batch is self._DONE:
                    return
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
            self.fail(exc)

    def writer(self, write: Callable[[Any], None], first: Iterable[Any] = ()) -> None:
        try:
            pending = iter(first)  # written before anything queued: the searcher does not wait for these to go
            while True:
                item = next(pending, None)
                if item is None:
                    item = self.get(self.write_q)
                if item is self._DONE:
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
        self._reader = threading.Thread(target=self.reader, args=(batches,), name="recall-reader", daemon=True)
        self._reader.start()

    def take(self) -> Any:
        """The next batch read, or None if none is ready yet (without waiting); ``_DONE`` after the last."""
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
                   threading.Thread(target=self.writer, args=(write, list(first)), name="recall-writer", daemon=True)]
        threads[1].start()
        try:
            while not read_all:
                batch = self.get(self.read_q)
                if batch is self._DONE:
                    break
                t0 = time.perf_counter()
                result = search(batch)
                self.seconds["search"] += time.perf_counter() - t0
                self.put(self.write_q, (batch, result))
            self.put(self.write_q, self._DONE)
        except _Stopped:
            pass
        except BaseException as exc:
            self.fail(exc)
        finally:
            # A failed searcher must not leave the writer waiting for a DONE that never comes.
            if self.errors:
                self.stop.set()
            for t in threads:
                t.join()
        if self.errors:
            raise self.errors[0]

    def cancel(self) -> None:
        """Stop a reader started by :meth:`start_reader` (the job failed before :meth:`run`)."""
        self.stop.set()
        if self._reader is not None:
            self._reader.join()


def _device_matrix(n: int, dim: int) -> Any:
    import cupy

    return cupy.empty((n, dim), cupy.float32)


def load_engine(items_path: str, id_col: str, vec_col: str, metric: str, device: str,
                memory_budget: int | None, precision: str = "exact",
                on_rows: Callable[[Any, int], None] | None = None) -> tuple[Embeddings, Engine, float]:
    """Read and validate an item file and build the resident engine on it: the start of every Parquet job.

    The engine gets no ids: its results hold item rows, which the job maps to ids as it writes them
    (``result.to_arrow(user_ids, id_lookup(items.ids))``). So the gather of 10^8 ids runs on the writer thread
    rather than between two searches, and the ids, already checked by the reader (naming the file and rows), are not
    sorted a second time by the engine.

    ``on_rows(vectors, rows)`` is called as the rows arrive (see ``read_embeddings``).

    Returns (items, engine, seconds spent reading). Raises InputError naming the file, row and id of a bad item.
    """
    t0 = time.perf_counter()
    # For a GPU engine the vectors go to the device batch by batch as they are decoded (see read_embeddings).
    on_gpu = device in ("gpu", "auto") and cuda_status()[0]  # without a GPU, the engine says why
    items = read_embeddings(items_path, id_col, vec_col, allow_empty=False,
                            device_out=_device_matrix if on_gpu else None, on_rows=on_rows)
    if metric == "cosine":
        _check_nonzero(items, items_path)
    read_s = time.perf_counter() - t0
    engine = Engine(items.vectors, metric=metric, device=device, memory_budget=memory_budget, precision=precision)
    return items, engine, read_s


@dataclass(frozen=True)
class StreamStats:
    """Seconds each stage of :func:`stream_search` spent (they overlap) and the GPU's busy time (0 on the CPU)."""

    read_s: float
    search_s: float
    write_s: float
    device_busy_s: float


def user_batches(users_path: str, batch_size: int, id_col: str, vec_col: str, dim: int, metric: str,
                 dim_source: str) -> Iterable[Embeddings]:
    """The user file's batches, validated (a dimension other than ``dim``, a zero vector for cosine: InputError)."""
    for batch in iter_embedding_batches(users_path, batch_size, id_col, vec_col, dim=dim, dim_source=dim_source,
                                        check_unique=False):
        if metric == "cosine":
            _check_nonzero(batch, users_path)
        yield batch


def stream_search(engine: Engine, users_path: str, k: int, write: Callable[[tuple[Embeddings, Any]], None], *,
                  exclusions: Any = None, id_col: str = "id", vec_col: str = "embedding", batch_size: int,
                  dim_source: str, overlap: _Overlap | None = None, first: Iterable[tuple[Embeddings, Any]] = (),
                  read_all: bool = False) -> StreamStats:
    """Search a user Parquet file batch by batch with a resident engine, reading ahead and writing behind.

    A reader thread decodes and validates the next batch while the engine searches this one, and ``write`` (called
    on a writer thread, in input order, with ``(batch, SearchResult)``) handles the previous one. Searches are
    started with :meth:`Engine.search_async`: on a GPU the search thread queues the next batch while the writer
    waits for the previous one's results, so the device goes from batch to batch without an idle gap. The first
    error of any stage stops the others and is raised here. ``exclusions``: an object whose ``block(start, stop)``
    gives the CSR of user rows ``start:stop`` (see ``recall.io.load_exclusions``). ``overlap``: one whose reader
    was started already, ``first`` the (batch, pending search) pairs it started early (:mod:`recall.early`), and
    ``read_all`` whether they took the reader's end marker.
    """
    busy = waited = 0.0

    def search(batch: Embeddings) -> Any:
        exclude = exclusions.block(batch.row_start, batch.row_start + len(batch)) if exclusions is not None else None
        return engine.search_async(batch.vectors, k, exclude=exclude)

    def finish_and_write(item: tuple[Embeddings, Any]) -> None:
        nonlocal busy, waited
        batch, pending = item
        t0 = time.perf_counter()
        result = pending.result()
        waited += time.perf_counter() - t0
        busy += pending.gpu_busy_s if isinstance(pending, early.MergedSearch) else engine.stats.get("gpu_busy_s", 0.0)
        write((batch, result))

    batches = None
    if overlap is None:
        overlap = _Overlap()
        batches = user_batches(users_path, batch_size, id_col, vec_col, engine.dim, engine.metric, dim_source)
    overlap.run(batches, search, finish_and_write, first, read_all)
    # The writer's wait for results is search time, not writing.
    return StreamStats(overlap.seconds["read"], overlap.seconds["search"] + waited, overlap.seconds["write"] - waited,
                       busy)


def score_files(users_path: str | os.PathLike, items_path: str | os.PathLike, out_path: str | os.PathLike, k: int,
                metric: str = "ip", exclude_path: str | os.PathLike | None = None, id_col: str = "id",
                vec_col: str = "embedding", device: str = "auto", batch_size: int | None = None,
                memory_budget: int | None = None, progress: Progress | None = None,
                precision: str = "exact", compression: str = DEFAULT_COMPRESSION) -> ScoreSummary:
    """Score every user of a Parquet file against every item of another and write the top-k candidates to Parquet.

    Items are read whole and an :class:`recall.Engine` is built once; users are streamed in batches, in input
    order, each batch searched while the next is read and the previous one written.

    Parameters
    ----------
    users_path, items_path : str or PathLike
        Embedding Parquet files: an id column (integers or strings) and a vector column
        (``fixed_size_list<float32>[dim]`` or ``list<float32|float64>``), with the same dimension in both.
    out_path : str or PathLike
        The candidates Parquet file: ``user_id``, ``item_ids`` list<item id type>, ``scores`` list<float32>, one row
        per user in input order, best first. Written to a temporary file and renamed into place when complete.
    k : int
        Items per user, >= 1. Users with fewer than k qualifying items get shorter lists.
    metric : {"ip", "cosine", "l2"}
    exclude_path : str or PathLike, optional
        Parquet of ``user_id``, ``item_id`` pairs (or ``user_id``, ``item_ids`` lists) never to return. Pairs with an
        unknown user or item id are ignored and counted in ``ScoreSummary.unknown_exclusions``.
    id_col, vec_col : str
        Column names in both embedding files.
    device : {"auto", "cpu", "gpu"}
    batch_size : int, optional
        Users per batch; default :func:`auto_batch_size`.
    memory_budget : int, optional
        Working-memory bytes of the engine's search (see :class:`recall.Engine`).
    progress : callable ``(done_users, total_users) -> None``, optional
        Called from a worker thread after each batch is handed to the Parquet writer.
    precision : {"exact", "fast"}
        As for :class:`recall.Engine`: "fast" scores on tensor cores and certifies the exact answer.
    compression : {"none", "snappy", "lz4", "zstd"}
        Parquet codec of the output (see :data:`recall.io.COMPRESSIONS`).

    Returns
    -------
    ScoreSummary

    Raises
    ------
    InputError
        Any bad file, row or argument (the message names the file, row and id); nothing is written.
    ResourceError
        The memory budget cannot hold the smallest tile.
    BackendUnavailable
        ``device="gpu"`` without a usable GPU.
    """
    t_start = time.perf_counter()
    k = check_job_args(k, metric, device, batch_size)
    check_compression(compression)
    users_path, items_path = os.fspath(users_path), os.fspath(items_path)
    exclude_path = os.fspath(exclude_path) if exclude_path is not None else None

    # Cheap checks first, so that a typo in the last argument does not cost a full read of the items.
    out = check_output_path(out_path, (users_path, items_path, exclude_path))
    users_info = inspect_embeddings(users_path, id_col, vec_col)
    items_info = inspect_embeddings(items_path, id_col, vec_col)
    if users_info.dim is not None and items_info.dim is not None and users_info.dim != items_info.dim:
        raise InputError(f"{users_path}: vectors have dimension {users_info.dim}, but the items ({items_path}) have "
                         f"dimension {items_info.dim}")
    if exclude_path is not None:
        inspect_exclusions(exclude_path)

    # On a GPU the first user batches are searched against the items already uploaded while the rest decode
    # (recall/early.py): the reader starts now, and the device long before the last item row is read.
    overlap = started = None
    dim_source = f"the items' dimension, {items_path}"
    if early.applies(device in ("gpu", "auto") and cuda_status()[0], precision, exclude_path is not None,
                     items_info.dim):
        batch_size = int(batch_size) if batch_size is not None else auto_batch_size(k, items_info.dim)
        overlap = _Overlap()
        started = early.EarlyStart(items_info.n_rows, k, overlap.take, _Overlap._DONE, overlap.fail, overlap.stop,
                                   metric=metric, device=device, memory_budget=memory_budget)
        overlap.start_reader(user_batches(users_path, batch_size, id_col, vec_col, items_info.dim, metric,
                                          dim_source))
        started.start()
    first: list = []
    try:
        # The users' ids are read and checked for duplicates while the items load: both spend their time in pyarrow
        # and NumPy with the GIL released, and nothing can be searched before both are done.
        with ThreadPoolExecutor(1, thread_name_prefix="recall-ids") as pool:
            ids_read = pool.submit(read_ids, users_path, id_col, vec_col)
            items, engine, item_read_s = load_engine(items_path, id_col, vec_col, metric, device, memory_budget,
                                                     precision, on_rows=started.on_rows if started else None)
            t0 = time.perf_counter()
            user_ids = ids_read.result()
        if started is not None:
            first = started.finish(items.vectors, engine)
    except BaseException:
        if started is not None:
            started.cancel()
        if overlap is not None:
            overlap.cancel()
        raise
    start_s = time.perf_counter() - t_start
    early_users = sum(len(batch) for batch, _ in first)
    dim = engine.dim
    excl = load_exclusions(exclude_path, user_ids, items.ids) if exclude_path is not None else None
    n_users = int(user_ids.size)
    item_read_s += time.perf_counter() - t0
    batch_size = int(batch_size) if batch_size is not None else auto_batch_size(k, dim)

    done = 0
    item_ids = id_lookup(items.ids)

    def write(item: tuple[Embeddings, Any]) -> None:
        nonlocal done
        batch, result = item
        writer.write(result.to_arrow(batch.ids, item_ids))
        done += len(batch)
        if progress is not None:
            progress(done, n_users)

    id_type = {True: pa.string(), False: pa.int64()}
    try:
        with CandidateWriter(out, id_type[user_ids.dtype == object], id_type[items.ids.dtype == object],
                             compression) as writer:
            if progress is not None:
                progress(0, n_users)
            stream = stream_search(engine, users_path, k, write, exclusions=excl, id_col=id_col, vec_col=vec_col,
                                   batch_size=batch_size, dim_source=dim_source, overlap=overlap, first=first,
                                   read_all=started is not None and started.users_done)
            if writer.rows_written != n_users:
                # Cannot happen unless a stage dropped a batch; refuse to publish a file missing users.
                raise RuntimeError(f"wrote {writer.rows_written} rows for {n_users} users")
    except BaseException:
        if overlap is not None:
            overlap.cancel()  # the reader started early may still be running
        raise

    return ScoreSummary(
        users=n_users, items=engine.n_items, dim=dim, k=k, metric=metric, device=engine.device,
        device_detail=engine.backend.describe(), seconds=time.perf_counter() - t_start,
        read_s=item_read_s + stream.read_s, search_s=stream.search_s, write_s=stream.write_s, batch_size=batch_size,
        exclusion_pairs=excl.n_pairs if excl is not None else 0,
        unknown_exclusions=excl.n_unknown if excl is not None else 0, out_path=str(out_path),
        device_busy_s=stream.device_busy_s, start_s=start_s, early_users=early_users,
    )
