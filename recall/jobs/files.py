"""The Parquet jobs behind ``recall score`` and ``recall rescore``: files in, a candidates file out, through the one
runner (:func:`recall.jobs.runner.run_stream`).

- :func:`score_files`: every user against every item. One vector per user: the users are streamed batch by batch
  (on a GPU the first batches are searched while the items load, :mod:`recall.jobs.early`); several vectors per
  user (``aggregate``): the users file is read whole, then searched in batches.
- :func:`rescore_files`: each user against its own candidates (a pairs file), in batches of users.

Every job checks what it can before it reads much (arguments, schemas, the output path), then reads the items into
one resident :class:`recall.Engine`, and writes through :class:`recall.io.CandidateWriter` (atomically: a failure
leaves no partial file, and the previous file at the path as it was).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .. import backends
from ..core import metrics
from ..core.checks import DEVICES, check_batch_size, check_choice, check_k
from ..core.errors import InputError
from ..core.results import id_lookup
from ..engine.inputs import check_overflow
from ..io import (
    DEFAULT_COMPRESSION,
    CandidateWriter,
    Embeddings,
    check_compression,
    check_output_path,
    inspect_embeddings,
    inspect_interest_users,
    inspect_item_set,
    inspect_pairs,
    iter_embedding_batches,
    read_embeddings,
    read_ids,
    read_interest_users,
    read_item_filter,
    read_pairs,
)
from ..io import atomic
from ..io.parquet import at, fmt_id, open_parquet
from . import early
from .items import check_nonzero, load_engine, streams
from .options import DEFAULT_JOB_OPTIONS, JobOptions
from .runner import Done, Overlap, run_stream
from .summary import JobSummary

#: Host memory the batches in flight may hold together (read queue, the batch being searched, write queue, the one
#: being written): bounds the automatic batch size, so that a large k gets smaller batches.
INFLIGHT_BYTES = 512 << 20
_MAX_BATCH = 65_536
_MIN_BATCH = 16  # a batch of k = 50,000 results holds 1.6 MB a user: the bound holds to k of about 200,000

#: ``progress(done_users, total_users)``; called from the writer thread after each batch is handed to the Parquet
#: writer (whose encoding threads may still hold the last few).
Progress = Callable[[int, int], None]

log = logging.getLogger("recall")


def check_not_empty(path: str, n_rows: int, out: Path, allow_empty: bool, what: str = "users") -> None:
    """An input without rows would replace ``out`` with an empty candidates file: InputError unless
    ``allow_empty`` (an upstream job that failed quietly must not empty yesterday's candidates)."""
    if n_rows or allow_empty:
        return
    if out.exists():
        effect = f"replace {out} ({out.stat().st_size:,} bytes) with an empty candidates file"
    else:
        effect = f"write an empty candidates file to {out}"
    raise InputError(f"{path}: the {what} file has no rows, so this would {effect}; pass --allow-empty "
                     f"(allow_empty=True) if that is what you want")


def remove_leftovers(out: Path) -> None:
    """Remove the temporary files that killed runs left beside ``out`` (their process is dead, no lock is held on
    them), and say so once: those of ``out`` itself and of other Parquet files (a candidates file of another job
    into the same directory), never other programs' temporaries of other kinds of files."""
    removed = atomic.remove_stale_temporaries(out.parent, lambda name: name == out.name or name.endswith(".parquet"))
    if removed:
        log.warning("notice: %s", atomic.describe_removed(removed, out.parent))


def check_scores_fit(engine: Any, vectors: np.ndarray, ids: np.ndarray, path: str, row_start: int = 0,
                     file_rows: np.ndarray | None = None, owner: np.ndarray | None = None,
                     scale: np.ndarray | None = None) -> None:
    """The engine's float32 overflow check, in terms of the file: InputError naming ``path``, the row and the id
    (the engine itself can only name the row of its argument). The jobs call it only once the engine has refused a
    batch, so the common case pays for the check once, in the engine.

    ``vectors`` (n, dim) host float32; ``file_rows`` the file row of each vector (default ``row_start + i``);
    ``owner`` the position in ``ids`` of each vector's user (default ``i``); ``scale`` (n,) multiplies each norm (a
    sum over a user's interests is bounded by their count times the largest).
    """
    def where(i: int) -> str:
        row = int(file_rows[i]) if file_rows is not None else row_start + i
        return at(path, row, ids, int(owner[i]) if owner is not None else i)

    norms = metrics.row_norms(np, engine.centred(np, vectors))  # as the engine bounds them (l2: less its centre)
    check_overflow(np, norms if scale is None else norms * scale, engine.item_norm, engine.metric, where, what=None)


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


def check_job_args(k: Any, metric: str, device: Any, batch_size: Any) -> int:
    """Validate the arguments every Parquet job shares; returns k as an int.

    Raises
    ------
    InputError
        k < 1, an unknown metric or device, or a batch size that is not an integer >= 1.
    """
    k = check_k(k)
    metrics.check_metric(metric)
    if not hasattr(device, "run_blocks"):
        check_choice(device, DEVICES, "device")
    if batch_size is not None:
        check_batch_size(batch_size)
    return k


def user_batches(users_path: str, batch_size: int, id_col: str, vec_col: str, dim: int, metric: str,
                 dim_source: str) -> Iterator[Embeddings]:
    """The user file's batches, validated (a dimension other than ``dim``, a zero vector for cosine: InputError)."""
    for batch in iter_embedding_batches(users_path, batch_size, id_col, vec_col, dim=dim, dim_source=dim_source,
                                        check_unique=False):
        if metric == "cosine":
            check_nonzero(batch.vectors, batch.ids, users_path, batch.row_start)
        yield batch


class _Output:
    """The candidates file of a job, fed from the runner's writer thread: item rows mapped to ids there (not between
    two searches), progress reported after each batch."""

    def __init__(self, writer: CandidateWriter, item_ids: np.ndarray, n_users: int,
                 progress: Progress | None) -> None:
        self.writer, self.n_users, self.progress = writer, n_users, progress
        self.item_ids = id_lookup(item_ids)
        self.done = 0
        if progress is not None:
            progress(0, n_users)

    def write(self, user_ids: Any, result: Any) -> None:
        self.writer.write(result.to_arrow(user_ids, self.item_ids))
        self.done += len(user_ids)
        if self.progress is not None:
            self.progress(self.done, self.n_users)

    def check_complete(self) -> None:
        if self.writer.rows_written != self.n_users:
            # Cannot happen unless a stage dropped a batch; refuse to publish a file missing users.
            raise RuntimeError(f"wrote {self.writer.rows_written} rows for {self.n_users} users")


def _id_type(ids: np.ndarray) -> pa.DataType:
    return pa.string() if ids.dtype == object else pa.int64()


def _check_dims(users_info: Any, items_info: Any, users_path: str, items_path: str) -> None:
    if users_info.dim is not None and items_info.dim is not None and users_info.dim != items_info.dim:
        raise InputError(f"{users_path}: vectors have dimension {users_info.dim}, but the items ({items_path}) have "
                         f"dimension {items_info.dim}")


@dataclass(frozen=True)
class _Spec:
    """What every Parquet job shares, validated: the files, the search and the output."""

    users_path: str
    items_path: str
    out: Any
    out_label: str
    k: int
    metric: str
    id_col: str
    vec_col: str
    backend: Any
    batch_size: int | None
    memory_budget: int | None
    progress: Progress | None
    compression: str
    options: JobOptions
    t_start: float
    exclude_path: str | None = None
    allow_path: str | None = None
    deny_path: str | None = None

    @property
    def dim_source(self) -> str:
        return f"the items' dimension, {self.items_path}"


def _spec(users_path: Any, items_path: Any, out_path: Any, k: Any, metric: str, id_col: str, vec_col: str,
          device: Any, batch_size: Any, memory_budget: Any, progress: Any, compression: str,
          options: JobOptions | None, exclude_path: Any = None, allow_path: Any = None, deny_path: Any = None,
          extra_inputs: tuple = ()) -> _Spec:
    """The arguments every job shares, checked before anything is read (a typo in the last argument must not cost a
    full read of the items), and the backend resolved once."""
    t_start = time.perf_counter()
    k = check_job_args(k, metric, device, batch_size)
    check_compression(compression)
    paths = [os.fspath(p) if p is not None else None for p in (users_path, items_path, exclude_path, allow_path,
                                                                 deny_path)]
    out = check_output_path(out_path, (*paths, *extra_inputs))
    for path, what in zip(paths[2:], ("exclusion", "allow", "deny")):
        if path is not None:
            inspect_pairs(path, what) if what == "exclusion" else inspect_item_set(path, what)
    return _Spec(paths[0], paths[1], out, str(out_path), k, metric, id_col, vec_col, None, batch_size,
                 memory_budget, progress, compression, options or DEFAULT_JOB_OPTIONS, t_start, *paths[2:])


@dataclass
class _Side:
    """What a job reads beside the items and users, mapped to rows: exclusions and the item filter's files."""

    excl: Any = None
    allow: Any = None
    deny: Any = None
    excl_path: str = ""

    def apply(self, engine: Any) -> None:
        """Keep the item filter on the engine (the filtered catalogue is gathered once)."""
        if self.allow is not None or self.deny is not None:
            engine.set_item_filter(allow=None if self.allow is None else self.allow.rows,
                                   deny=None if self.deny is None else self.deny.rows)

    def summary(self) -> dict:
        unknown = sum(s.n_unknown for s in (self.allow, self.deny) if s is not None)
        return {"empty_exclusions": self.excl_path if self.excl is not None and self.excl.n_pairs == 0 else "",
                "pairs": self.excl.n_pairs if self.excl is not None else 0,
                "unknown_pairs": self.excl.n_unknown if self.excl is not None else 0,
                "filter_ids": sum(s.n_ids for s in (self.allow, self.deny) if s is not None),
                "unknown_filter_ids": unknown}


def _read_side(spec: _Spec, user_ids: Any, item_ids: Any) -> _Side:
    """The exclusions (``user_ids`` may be a future: the exclusions wait for them) and item filter files."""
    side = _Side()
    side.allow, side.deny = read_item_filter(spec.allow_path, spec.deny_path, item_ids)
    if spec.exclude_path is not None:
        users = user_ids.result() if hasattr(user_ids, "result") else user_ids
        side.excl = read_pairs(spec.exclude_path, users, item_ids, what="exclusion")
        side.excl_path = os.fspath(spec.exclude_path)
    return side


def score_files(users_path: str | os.PathLike, items_path: str | os.PathLike, out_path: str | os.PathLike, k: int,
                metric: str = "ip", exclude_path: str | os.PathLike | None = None, id_col: str = "id",
                vec_col: str = "embedding", device: str = "auto", batch_size: int | None = None,
                memory_budget: int | None = None, progress: Progress | None = None, precision: str = "exact",
                compression: str = DEFAULT_COMPRESSION, aggregate: str | None = None,
                options: JobOptions | None = None, allow_path: str | os.PathLike | None = None,
                deny_path: str | os.PathLike | None = None, allow_empty: bool = False) -> JobSummary:
    """Score every user of a Parquet file against every item of another and write the top-k candidates to Parquet.

    Parameters
    ----------
    users_path, items_path : str or PathLike
        Embedding Parquet files: an id column (integers or strings) and a vector column
        (``fixed_size_list<float16|float32|float64>[dim]`` or ``list`` of those), with the same dimension in both. With
        ``aggregate``, users have several vectors: one per row with the id repeated, or a list of vectors per row.
    out_path : str or PathLike
        The candidates Parquet file: ``user_id``, ``item_ids`` list<item id type>, ``scores`` list<float32>, one row
        per user in input order (of first appearance, with ``aggregate``), best first. Written to a temporary file
        and renamed into place when complete.
    k : int
        Items per user, >= 1 and below 2^31. Users with fewer than k qualifying items get shorter lists; a k beyond
        the number of items gives every user the whole catalogue, at the cost of ``k = n_items``.
    metric : {"ip", "cosine", "l2"}
    exclude_path : str or PathLike, optional
        Parquet of ``user_id``, ``item_id`` pairs (or ``user_id``, ``item_ids`` lists) never to return. Pairs with an
        unknown user or item id are ignored and counted in ``JobSummary.unknown_pairs``.
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
        As for :class:`recall.Engine` (single-vector users only).
    compression : {"none", "snappy", "lz4", "zstd"}
        Parquet codec of the output (see :data:`recall.io.COMPRESSIONS`).
    aggregate : {"max", "sum"}, optional
        Users with several vectors each: an item's score is the max or the sum over them.
    options : JobOptions, optional
    allow_path, deny_path : str or PathLike, optional
        Item filter files (an ``item_id`` column): only allowed items that are not denied are returned, to every
        user. Unknown ids are ignored and counted (``JobSummary.unknown_filter_ids``); an allow file that names no
        item is an InputError.
    allow_empty : bool
        Write an empty candidates file when the users file has no rows; by default that is an InputError, so that
        an upstream failure does not replace the previous output with an empty one.

    Returns
    -------
    JobSummary

    Raises
    ------
    InputError
        Any bad file, row or argument (the message names the file, row and id), an empty users file without
        ``allow_empty``; nothing is written.
    OSError
        The output cannot be written (disk full, I/O error): the message names the path; nothing is left behind.
    ResourceError
        The memory budget cannot hold the smallest tile.
    BackendUnavailable
        ``device="gpu"`` without a usable GPU.
    """
    spec = _spec(users_path, items_path, out_path, k, metric, id_col, vec_col, device, batch_size, memory_budget,
                 progress, compression, options, exclude_path, allow_path, deny_path)
    if aggregate is not None:
        check_choice(aggregate, ("max", "sum"), "aggregate")
        if precision != "exact":
            raise InputError("precision 'fast' applies to single-vector users; with several vectors per user use "
                             "precision 'exact'")
        inspect_interest_users(spec.users_path, id_col, vec_col)
        items_info = inspect_embeddings(spec.items_path, id_col, vec_col)
    else:
        users_info = inspect_embeddings(spec.users_path, id_col, vec_col)
        items_info = inspect_embeddings(spec.items_path, id_col, vec_col)
        _check_dims(users_info, items_info, spec.users_path, spec.items_path)
    n_users = (users_info.n_rows if aggregate is None
               else open_parquet(spec.users_path, "embeddings").metadata.num_rows)
    check_not_empty(spec.users_path, n_users, spec.out, allow_empty)
    # Never wider than the catalogue: a k beyond it returns every item, at the cost (and with the bytes) of k = n.
    spec = replace(spec, backend=backends.resolve(device), k=min(spec.k, max(1, items_info.n_rows)))
    remove_leftovers(spec.out)
    summary = _score_single(spec, precision, items_info) if aggregate is None else _score_interests(spec, aggregate)
    return replace(summary, k=k)


def _summary(spec: _Spec, kind: str, engine: Any, users: int, stream: Any, read_s: float, start_s: float,
             batch_size: int, side: _Side, **extra: Any) -> JobSummary:
    return JobSummary(
        kind=kind, users=users, items=engine.n_items, dim=engine.dim, k=spec.k, metric=spec.metric,
        device=engine.device, device_detail=engine.backend.describe(), seconds=time.perf_counter() - spec.t_start,
        read_s=read_s + stream.read_s, search_s=stream.search_s, write_s=stream.write_s, batch_size=batch_size,
        out_path=spec.out_label, device_busy_s=stream.device_busy_s, start_s=start_s, **side.summary(), **extra)


def _score_single(spec: _Spec, precision: str, items_info: Any) -> JobSummary:
    """One vector per user: users streamed through the runner; the first batches searched while the items load;
    the exclusions and filters read and mapped meanwhile too."""
    k, metric, backend = spec.k, spec.metric, spec.backend
    batch_size = spec.batch_size
    overlap = started = None
    # The users' ids (checked for duplicates), and the exclusions and filters mapped to rows (with the items' ids
    # read on their own), while the items load: all spend their time in pyarrow, NumPy and numba with the GIL
    # released; the early searches taken before the exclusions are mapped apply them once they are (early.py).
    pool = ThreadPoolExecutor(2, thread_name_prefix="recall-ids")
    ids_read = pool.submit(read_ids, spec.users_path, spec.id_col, spec.vec_col)
    side_read = None
    if spec.exclude_path or spec.allow_path or spec.deny_path:
        side_read = pool.submit(lambda: _read_side(spec, ids_read, read_ids(
            spec.items_path, spec.id_col, spec.vec_col, check_unique=False)))
    first: list = []
    try:
        if _searches_early(spec, precision, items_info):
            overlap = Overlap()

            def start_reader(dim: int) -> None:
                nonlocal batch_size
                batch_size = batch_size or auto_batch_size(k, dim)
                overlap.start_reader(user_batches(spec.users_path, batch_size, spec.id_col, spec.vec_col, dim,
                                                  metric, spec.dim_source))

            def exclusions(batch: Embeddings) -> tuple[Any, Any]:
                return side_read.result().excl.block(batch.row_start, batch.row_start + len(batch))

            started = early.EarlyStart(items_info.n_rows, k, spec.options.early_parts, overlap.take, Overlap.DONE,
                                       overlap.fail, overlap.stop, on_dim=start_reader,
                                       exclusions=exclusions if spec.exclude_path else None,
                                       exclusions_ready=side_read.done if spec.exclude_path else None, metric=metric,
                                       device=backend, memory_budget=spec.memory_budget,
                                       options=spec.options.engine)
            started.start()
        item_ids, vectors, engine, item_read_s = load_engine(
            spec.items_path, spec.id_col, spec.vec_col, metric, backend, spec.memory_budget, precision,
            spec.options.engine, on_rows=started.on_rows if started else None, item_memory=spec.options.item_memory,
            info=items_info, keep_vectors=started is not None)
        t0 = time.perf_counter()
        user_ids = ids_read.result()
        side = side_read.result() if side_read is not None else _Side()
        side.apply(engine)
        if started is not None:
            first = started.finish(vectors, engine)
            vectors = None
    except BaseException:
        if started is not None:
            started.cancel()  # a search waiting for the exclusions gets them, or their error, from the pool
        if overlap is not None:
            overlap.cancel()
        raise
    finally:
        pool.shutdown(wait=True)
    start_s = time.perf_counter() - spec.t_start
    item_read_s += time.perf_counter() - t0
    batch_size = batch_size or auto_batch_size(k, engine.dim)
    excl = side.excl

    def query(batch: Embeddings) -> Any:
        exclude = excl.block(batch.row_start, batch.row_start + len(batch)) if excl is not None else None
        try:
            return engine.search_async(batch.vectors, k, exclude=exclude)
        except InputError:
            check_scores_fit(engine, batch.vectors, batch.ids, spec.users_path, batch.row_start)
            raise

    batches = None
    if overlap is None:
        batches = user_batches(spec.users_path, batch_size, spec.id_col, spec.vec_col, engine.dim, metric,
                               spec.dim_source)
    try:
        with CandidateWriter(spec.out, _id_type(user_ids), _id_type(item_ids), spec.compression) as writer:
            output = _Output(writer, item_ids, int(user_ids.size), spec.progress)
            stream = run_stream(batches, query, lambda batch, res: output.write(batch.ids, res), overlap=overlap,
                                first=first, read_all=started is not None and started.users_done)
            output.check_complete()
    except BaseException:
        if overlap is not None:
            overlap.cancel()  # the reader started early may still be running
        raise
    return _summary(spec, "score", engine, int(user_ids.size), stream, item_read_s, start_s, batch_size, side,
                    early_users=sum(len(batch) for batch, _ in first))


def _searches_early(spec: _Spec, precision: str, items_info: Any) -> bool:
    """Whether a job searches its first batches while the items load (see :class:`JobOptions`): in exact
    precision, without an item filter (the filtered catalogue is gathered once every item is loaded), with items
    resident on the device (streamed items are read into host memory). Exclusions are mapped meanwhile, from the
    items' id column; batches taken before they are apply them afterwards (``recall.jobs.early``)."""
    if spec.options.early == "off" or precision != "exact" or spec.allow_path or spec.deny_path:
        return False
    item_memory = spec.options.item_memory
    if (item_memory is not None) if items_info.dim is None else streams(
            spec.backend, items_info.n_rows, items_info.dim, spec.metric, spec.memory_budget, item_memory):
        return False
    return spec.options.early == "on" or spec.backend.asynchronous


def _check_interests_fit(engine: Any, users: Any, path: str, start: int, stop: int, aggregate: str) -> None:
    """:func:`check_scores_fit` for users ``start:stop`` of a multi-interest file (a sum is bounded by the user's
    interest count times its largest score)."""
    lo, hi = int(users.indptr[start]), int(users.indptr[stop])
    counts = np.diff(users.indptr[start:stop + 1])
    owner = start + np.repeat(np.arange(stop - start), counts)
    check_scores_fit(engine, users.vectors[lo:hi], users.ids, path, file_rows=users.file_rows[lo:hi], owner=owner,
                     scale=np.repeat(counts, counts).astype(np.float64) if aggregate == "sum" else None)


def _slices(n: int, batch: int) -> Iterable[tuple[int, int]]:
    return ((start, min(start + batch, n)) for start in range(0, n, batch))


def _score_interests(spec: _Spec, aggregate: str) -> JobSummary:
    """Several vectors per user: the users file read whole (a user's rows need not be adjacent), then searched in
    batches through the runner."""
    t0 = time.perf_counter()
    k = spec.k
    item_ids, _, engine, _ = load_engine(spec.items_path, spec.id_col, spec.vec_col, spec.metric, spec.backend,
                                         spec.memory_budget, "exact", spec.options.engine,
                                         item_memory=spec.options.item_memory)
    users = read_interest_users(spec.users_path, spec.id_col, spec.vec_col, dim=engine.dim,
                                dim_source=spec.dim_source)
    if spec.metric == "cosine" and users.vectors.shape[0]:
        zero = ~users.vectors.any(axis=1)
        if zero.any():
            pos = int(np.argmax(zero))
            user = int(np.searchsorted(users.indptr, pos, side="right") - 1)
            raise InputError(f"{spec.users_path}: row {int(users.file_rows[pos])} (id {fmt_id(users.ids[user])}) "
                             f"{metrics.ZERO_VECTOR}")
    side = _read_side(spec, users.ids, item_ids)
    side.apply(engine)
    excl = side.excl
    read_s = time.perf_counter() - t0
    start_s = time.perf_counter() - spec.t_start
    n = len(users)
    batch = spec.batch_size or auto_batch_size(k, engine.dim * max(1, users.max_interests))

    def query(span: tuple[int, int]) -> Done:
        start, stop = span
        try:
            res = engine.search(users.batch(start, stop), k, aggregate=aggregate,
                                exclude=excl.block(start, stop) if excl is not None else None)
        except InputError:
            _check_interests_fit(engine, users, spec.users_path, start, stop, aggregate)
            raise
        return Done(res, engine.stats)

    with CandidateWriter(spec.out, _id_type(users.ids), _id_type(item_ids), spec.compression) as writer:
        output = _Output(writer, item_ids, n, spec.progress)
        stream = run_stream(_slices(n, batch), query, lambda span, res: output.write(users.ids[span[0]:span[1]], res))
        output.check_complete()
    return _summary(spec, "interests", engine, n, stream, read_s, start_s, batch, side,
                    vectors=int(users.vectors.shape[0]), aggregate=aggregate)


def rescore_files(users_path: str | os.PathLike, items_path: str | os.PathLike,
                  candidates_path: str | os.PathLike, out_path: str | os.PathLike, k: int, metric: str = "ip",
                  id_col: str = "id", vec_col: str = "embedding", device: str = "auto",
                  memory_budget: int | None = None, batch_size: int | None = None, progress: Progress | None = None,
                  compression: str = DEFAULT_COMPRESSION, options: JobOptions | None = None,
                  allow_path: str | os.PathLike | None = None, deny_path: str | os.PathLike | None = None,
                  allow_empty: bool = False) -> JobSummary:
    """Re-score each user's candidates from Parquet files and write its top-k to a candidates Parquet file.

    Parameters
    ----------
    users_path, items_path : str or PathLike
        Embedding files (id + vector columns, as for ``recall score``).
    candidates_path : str or PathLike
        ``user_id`` with ``item_ids`` (a list per row; a user may have several rows), or ``user_id`` with ``item_id``
        pairs. Unknown ids are skipped and counted (``JobSummary.unknown_pairs``); duplicates count once.
    out_path : str or PathLike
        ``user_id``, ``item_ids``, ``scores``: one row per user named in the candidates file, in the users file's
        order, best first; written to a temporary file and renamed into place when complete.
    k : int
    metric, id_col, vec_col, device, memory_budget, batch_size, progress, compression, options, allow_path, deny_path
        As for :func:`score_files` (a filtered-out candidate is never returned).
    allow_empty : bool
        Write an empty candidates file when the users or the candidates file has no rows (default: InputError).

    Raises
    ------
    InputError
        Any bad file, row, id type or argument (naming file, row and id), an empty input without ``allow_empty``;
        nothing is written.
    OSError
        As for :func:`score_files`.
    ResourceError, BackendUnavailable
        As for ``recall score``.
    """
    candidates_path = os.fspath(candidates_path)
    spec = _spec(users_path, items_path, out_path, k, metric, id_col, vec_col, device, batch_size, memory_budget,
                 progress, compression, options, None, allow_path, deny_path, extra_inputs=(candidates_path,))
    users_info = inspect_embeddings(spec.users_path, id_col, vec_col)
    items_info = inspect_embeddings(spec.items_path, id_col, vec_col)
    _check_dims(users_info, items_info, spec.users_path, spec.items_path)
    inspect_pairs(candidates_path, "candidate")
    check_not_empty(spec.users_path, users_info.n_rows, spec.out, allow_empty)
    check_not_empty(candidates_path, open_parquet(candidates_path, "candidates").metadata.num_rows, spec.out,
                    allow_empty, "candidates")
    # No user has more distinct candidates than there are items.
    spec = replace(spec, backend=backends.resolve(device), k=min(spec.k, max(1, items_info.n_rows)))
    remove_leftovers(spec.out)

    t0 = time.perf_counter()
    item_ids, _, engine, _ = load_engine(spec.items_path, id_col, vec_col, metric, spec.backend, spec.memory_budget,
                                         options=spec.options.engine, item_memory=spec.options.item_memory)
    users = read_embeddings(spec.users_path, id_col, vec_col)
    if len(users) and users.dim != engine.dim:
        raise InputError(f"{spec.users_path}: row 0 (id {fmt_id(users.ids[0])}) has dimension {users.dim}, expected "
                         f"{engine.dim} ({spec.dim_source})")
    cands = read_pairs(candidates_path, users.ids, item_ids, what="candidate", sort_unique=False)
    if cands.n_pairs and cands.n_unknown == cands.n_pairs and len(users):
        # Every user would get an empty list: ids of another catalogue or users file, a mistake to stop on (an empty
        # users file, which got here with allow_empty, names nobody: its empty output is what was asked for).
        raise InputError(f"{candidates_path}: no candidate pair names a user of the users file and an item of the "
                         f"items file ({cands.n_pairs:,} pairs, all unknown): every user would get no candidates")
    side = _read_side(spec, users.ids, item_ids)
    side.apply(engine)
    present = np.flatnonzero(cands.named)  # a named user gets a (maybe empty) row of output
    if metric == "cosine" and present.size:
        check_nonzero(users.vectors[present], users.ids[present], spec.users_path, file_rows=present)
    mine = cands.take(present)
    read_s = time.perf_counter() - t0
    start_s = time.perf_counter() - spec.t_start
    n = int(present.size)
    batch = spec.batch_size or auto_batch_size(spec.k, engine.dim)

    def query(span: tuple[int, int]) -> Done:
        start, stop = span
        rows = present[start:stop]
        try:
            res = engine.rescore(users.vectors[rows], mine.block(start, stop), spec.k)
        except InputError:
            check_scores_fit(engine, users.vectors[rows], users.ids, spec.users_path, file_rows=rows, owner=rows)
            raise
        return Done(res, engine.stats)

    with CandidateWriter(spec.out, _id_type(users.ids), _id_type(item_ids), spec.compression) as writer:
        output = _Output(writer, item_ids, n, spec.progress)
        stream = run_stream(_slices(n, batch), query,
                            lambda span, res: output.write(users.ids[present[span[0]:span[1]]], res))
        output.check_complete()
    side.excl = cands  # the candidates' pair counts stand where a search's exclusions would
    return replace(_summary(spec, "rescore", engine, n, stream, read_s, start_s, batch, side,
                            candidates=int(mine.item_rows.size)), k=k)
