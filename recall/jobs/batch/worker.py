"""One worker of the batch job: the items prepared once in a resident engine, the job's exclusions (mapped once, by
the parent: :mod:`.exclusions`), and each shard streamed through the job runner into its own output file.

Everything that crosses a process or Ray boundary (:class:`JobSpec`, :class:`ShardTask`, :class:`ShardResult`,
:class:`WorkerInfo`) is a plain picklable dataclass.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ... import backends
from ...core.errors import InputError, RecallError
from ...core.results import id_lookup
from ...io import CandidateWriter, read_ids, read_item_filter
from ...io.atomic import sha256_file
from ..files import auto_batch_size, check_scores_fit, user_batches
from ..items import load_engine
from ..options import DEFAULT_JOB_OPTIONS, JobOptions
from ..runner import StreamStats, run_stream
from .exclusions import ExclusionFiles


class BatchError(RecallError, RuntimeError):
    """A worker died or failed for a reason that is not the input's fault (CLI exit code 1). The job can be resumed."""


@dataclass(frozen=True)
class JobSpec:
    """The job as every worker sees it.

    Attributes
    ----------
    items_path : str
    exclusions : ExclusionFiles or None
        The job's exclusions, mapped once by the parent (:mod:`.exclusions`).
    k : int
    metric : str
    id_col, vec_col : str
    user_id_type : {"int64", "string"}
        The users' id type (the same in every shard), for mapping exclusions.
    batch_size : int or None
        Users per batch; None: :func:`recall.jobs.files.auto_batch_size` of k and the items' dimension.
    memory_budget : int or None
        The engine's search working memory in bytes; None: the engine's default.
    options : JobOptions
    allow_path, deny_path : str or None
        Item filter files (an ``item_id`` column).
    after_batch : callable, optional
        Called in the worker after each batch is written (a module-level function, so that it crosses process
        boundaries): to pace or observe a job from outside.
    """

    items_path: str
    exclusions: ExclusionFiles | None
    k: int
    metric: str
    id_col: str
    vec_col: str
    user_id_type: str
    batch_size: int | None = None
    memory_budget: int | None = None
    options: JobOptions = DEFAULT_JOB_OPTIONS
    after_batch: Callable[[], None] | None = None
    allow_path: str | None = None
    deny_path: str | None = None


@dataclass(frozen=True)
class ShardTask:
    """One shard to score: read ``path``, write ``out_path`` (atomically)."""

    name: str
    path: str
    out_path: str
    rows: int


@dataclass(frozen=True)
class ShardResult:
    """What a worker reports for a finished shard; ``sha256`` and ``bytes`` describe the output as renamed in place;
    ``item_shards``: the item ranges it was scored against and merged from (1: the whole catalogue in one engine).

    Stage times (``read_s``, ``search_s``, ``write_s``) overlap, so they may add up to more than ``seconds``;
    ``device_busy_s`` is the GPU's compute time (0 on the CPU).
    """

    name: str
    rows: int
    bytes: int
    sha256: str
    seconds: float
    read_s: float
    search_s: float
    write_s: float
    hash_s: float
    device_busy_s: float
    batch_size: int
    memory_budget: int
    device: str
    worker: str
    exclusions_applied: int
    item_shards: int = 1

    @property
    def users_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class WorkerInfo:
    """A worker after loading the items: where it runs and what that cost. ``item_rows``: ``[start, stop)``, the
    item file rows an item-shard worker holds (None: every row)."""

    worker: str
    device: str
    device_detail: str
    host: str
    pid: int
    items_load_s: float
    n_items: int
    dim: int
    exclusion_pairs: int = 0
    unknown_exclusions: int = 0
    filter_ids: int = 0
    unknown_filter_ids: int = 0
    cuda_visible_devices: str | None = None
    cpu_affinity: list[int] | None = None
    item_rows: list[int] | None = None


def row_group_rows(k: int) -> int:
    """Rows per output row group: fixed by k alone, so the file's bytes do not depend on the batch size.

    About 64 MiB of uncompressed candidates per row group (12 bytes per (item, score) pair), between 1,024 and
    65,536 rows: large enough for efficient scans, small enough to buffer one in memory per worker.
    """
    return int(np.clip((64 << 20) // (12 * k + 16), 1024, 65_536))


class _RowGroups:
    """Re-chunk result tables into row groups of exactly ``rows`` rows (the last one shorter).

    pyarrow writes one row group per ``write_table`` call, and the page layout inside follows the input's chunking:
    writing each batch as it comes would make the file's bytes depend on the batch size. Buffering and writing
    contiguous (``combine_chunks``) slices of a fixed length makes them depend on the rows alone.
    """

    def __init__(self, writer: CandidateWriter, rows: int) -> None:
        self.writer, self.rows = writer, rows
        self.parts: list[pa.Table] = []
        self.buffered = 0

    def add(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        self.parts.append(table)
        self.buffered += table.num_rows
        while self.buffered >= self.rows:
            self._emit(self.rows)

    def close(self) -> None:
        if self.buffered:
            self._emit(self.buffered)

    def _emit(self, n: int) -> None:
        table = pa.concat_tables(self.parts).combine_chunks()
        self.writer.write(table.slice(0, n))
        rest = table.slice(n)
        self.parts = [rest] if rest.num_rows else []
        self.buffered = rest.num_rows


class ShardScorer:
    """One worker's resident state: the items prepared once in an :class:`recall.Engine`, the exclusions read once;
    :meth:`score` streams one shard through it.

    Parameters
    ----------
    spec : JobSpec
    device : {"auto", "cpu", "gpu"}
    worker : str
        A name for metrics and messages ("0", "gpu1", "ray-3").

    Raises
    ------
    InputError, ResourceError, BackendUnavailable
        Bad items or exclusions, an unusable memory budget, no GPU for ``device="gpu"``.
    """

    def __init__(self, spec: JobSpec, device: str = "auto", worker: str = "0") -> None:
        t0 = time.perf_counter()
        self.spec, self.worker = spec, worker
        item_ids, _, self.engine, _ = load_engine(spec.items_path, spec.id_col, spec.vec_col, spec.metric,
                                                  backends.resolve(device), spec.memory_budget,
                                                  options=spec.options.engine, item_memory=spec.options.item_memory)
        self.item_id_type = pa.string() if item_ids.dtype == object else pa.int64()
        self.item_ids = id_lookup(item_ids)
        self.exclusions = spec.exclusions.open() if spec.exclusions is not None else None
        allow, deny = read_item_filter(spec.allow_path, spec.deny_path, item_ids)
        if allow is not None or deny is not None:
            self.engine.set_item_filter(allow=None if allow is None else allow.rows,
                                        deny=None if deny is None else deny.rows)
        # Never wider than the catalogue: a k beyond it gives the bytes (and costs the memory) of k = n_items.
        self.k = min(spec.k, self.engine.n_items)
        self.batch_size = spec.batch_size or auto_batch_size(self.k, self.engine.dim)
        self.info = WorkerInfo(
            worker=worker, device=self.engine.device, device_detail=self.engine.backend.describe(),
            host=socket.gethostname(), pid=os.getpid(), items_load_s=time.perf_counter() - t0,
            n_items=self.engine.n_items, dim=self.engine.dim,
            exclusion_pairs=self.exclusions.pairs.n_pairs if self.exclusions else 0,
            unknown_exclusions=self.exclusions.pairs.n_unknown if self.exclusions else 0,
            filter_ids=sum(f.n_ids for f in (allow, deny) if f is not None),
            unknown_filter_ids=sum(f.n_unknown for f in (allow, deny) if f is not None),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            cpu_affinity=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        )

    def score(self, task: ShardTask, progress: Callable[[int], None] | None = None) -> ShardResult:
        """Score one shard into ``task.out_path`` (atomically) and return its size and sha256.

        Parameters
        ----------
        task : ShardTask
        progress : callable ``(users_just_written) -> None``, optional
            Called from the writer thread after each batch.

        Raises
        ------
        InputError
            A bad shard: the message names the file, the row and the id.
        """
        spec, engine = self.spec, self.engine
        t0 = time.perf_counter()
        user_ids = read_ids(task.path, spec.id_col, spec.vec_col)
        excl = self.exclusions.for_shard(user_ids) if self.exclusions is not None else None
        t_ids = time.perf_counter() - t0

        def query(batch: Any) -> Any:
            exclude = excl.block(batch.row_start, batch.row_start + len(batch)) if excl is not None else None
            try:
                return engine.search_async(batch.vectors, self.k, exclude=exclude)
            except InputError:
                check_scores_fit(engine, batch.vectors, batch.ids, task.path, batch.row_start)  # file, row, id
                raise

        layout = OutputLayout(self.k, self.batch_size, engine.dim, self.item_ids, self.item_id_type)
        written = stream_shard(task, spec, layout, user_ids, query, progress)
        return ShardResult(
            name=task.name, rows=written.rows, bytes=written.bytes, sha256=written.sha256,
            seconds=time.perf_counter() - t0, read_s=t_ids + written.stream.read_s,
            search_s=written.stream.search_s, write_s=written.stream.write_s, hash_s=written.hash_s,
            device_busy_s=written.stream.device_busy_s, batch_size=self.batch_size,
            memory_budget=engine.memory_budget, device=engine.device, worker=self.worker,
            exclusions_applied=int(excl.item_rows.size) if excl is not None else 0,
        )


@dataclass(frozen=True)
class OutputLayout:
    """What decides an output's bytes besides the results: k (the row groups), the users per batch, the items'
    dimension (checked against every user) and ids. The same for one worker and for the item shards' merge.

    Attributes
    ----------
    k : int
        Result width: the k asked, never wider than the catalogue.
    batch_size : int
    dim : int
    item_ids : np.ndarray or pa.Array, shape (n_items,)
        As :func:`recall.core.results.id_lookup` returns them.
    item_id_type : pa.DataType
    """

    k: int
    batch_size: int
    dim: int
    item_ids: Any
    item_id_type: pa.DataType


@dataclass(frozen=True)
class WrittenShard:
    """An output written by :func:`stream_shard`: its rows, size and sha256, and the runner's stage times."""

    rows: int
    bytes: int
    sha256: str
    hash_s: float
    stream: StreamStats


def stream_shard(task: ShardTask, spec: JobSpec, layout: OutputLayout, user_ids: np.ndarray,
                 query: Callable[[Any], Any], progress: Callable[[int], None] | None) -> WrittenShard:
    """Stream a shard's users, batch by batch, through ``query`` into ``task.out_path`` (atomically, in row groups
    of :func:`row_group_rows` rows) through the job runner, and hash the output.

    ``query(batch)`` starts a batch's search and returns a pending search whose ``result()`` is the batch's
    :class:`recall.SearchResult` (item rows as ``ids``, mapped to ``layout.item_ids`` here, on the writer thread).
    ``progress(n)`` and ``spec.after_batch()`` run after each batch is written.

    Raises
    ------
    InputError
        A bad shard (the reader names the file, the row and the id), or what ``query`` raises.
    """

    def write(batch: Any, result: Any) -> None:
        groups.add(result.to_arrow(batch.ids, layout.item_ids))
        if progress is not None:
            progress(len(batch))
        if spec.after_batch is not None:
            spec.after_batch()

    n_users = int(user_ids.size)
    user_type = pa.string() if user_ids.dtype == object else pa.int64()
    with CandidateWriter(task.out_path, user_type, layout.item_id_type) as writer:
        groups = _RowGroups(writer, row_group_rows(layout.k))
        batches = user_batches(task.path, layout.batch_size, spec.id_col, spec.vec_col, layout.dim, spec.metric,
                               f"the items' dimension, {spec.items_path}")
        stream = run_stream(batches, query, write)
        groups.close()
        if writer.rows_written != n_users:
            raise BatchError(f"{task.path}: wrote {writer.rows_written} rows for {n_users} users")
    t_hash = time.perf_counter()
    digest = sha256_file(task.out_path)
    return WrittenShard(n_users, os.path.getsize(task.out_path), digest, time.perf_counter() - t_hash, stream)
