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

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .. import backends
from ..core import metrics
from ..core.checks import DEVICES, check_choice, check_int, check_k
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
    inspect_pairs,
    iter_embedding_batches,
    read_embeddings,
    read_ids,
    read_interest_users,
    read_pairs,
)
from ..io import atomic
from ..io.parquet import at, fmt_id, open_parquet
from . import early
from .items import check_nonzero, load_engine
from .options import DEFAULT_JOB_OPTIONS, JobOptions
from .runner import Done, Overlap, run_stream
from .summary import JobSummary

#: Host memory the batches in flight may hold together (read queue, the batch being searched, write queue, the one
#: being written): bounds the automatic batch size, so that a large k gets smaller batches.
INFLIGHT_BYTES = 512 << 20
_MAX_BATCH = 65_536
_MIN_BATCH = 256

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

    norms = metrics.row_norms(np, vectors)
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
        check_int(batch_size, "batch_size")
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


def score_files(users_path: str | os.PathLike, items_path: str | os.PathLike, out_path: str | os.PathLike, k: int,
                metric: str = "ip", exclude_path: str | os.PathLike | None = None, id_col: str = "id",
                vec_col: str = "embedding", device: str = "auto", batch_size: int | None = None,
                memory_budget: int | None = None, progress: Progress | None = None, precision: str = "exact",
                compression: str = DEFAULT_COMPRESSION, aggregate: str | None = None,
                options: JobOptions | None = None, allow_empty: bool = False) -> JobSummary:
    """Score every user of a Parquet file against every item of another and write the top-k candidates to Parquet.

    Parameters
    ----------
    users_path, items_path : str or PathLike
        Embedding Parquet files: an id column (integers or strings) and a vector column
        (``fixed_size_list<float32>[dim]`` or ``list<float32|float64>``), with the same dimension in both. With
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
    t_start = time.perf_counter()
    k = check_job_args(k, metric, device, batch_size)
    check_compression(compression)
    options = options or DEFAULT_JOB_OPTIONS
    if aggregate is not None:
        check_choice(aggregate, ("max", "sum"), "aggregate")
        if precision != "exact":
            raise InputError("precision 'fast' applies to single-vector users; with several vectors per user use "
                             "precision 'exact'")
    users_path, items_path = os.fspath(users_path), os.fspath(items_path)
    exclude_path = os.fspath(exclude_path) if exclude_path is not None else None
    # Cheap checks first, so that a typo in the last argument does not cost a full read of the items.
    out = check_output_path(out_path, (users_path, items_path, exclude_path))
    users_info = inspect_embeddings(users_path, id_col, vec_col) if aggregate is None else \
        inspect_interest_users(users_path, id_col, vec_col)
    items_info = inspect_embeddings(items_path, id_col, vec_col)
    if aggregate is None:
        _check_dims(users_info, items_info, users_path, items_path)
    if exclude_path is not None:
        inspect_pairs(exclude_path, "exclusion")
    n_users = users_info.n_rows if aggregate is None else open_parquet(users_path, "embeddings").metadata.num_rows
    check_not_empty(users_path, n_users, out, allow_empty)
    backend = backends.resolve(device)
    remove_leftovers(out)
    run = _score_single if aggregate is None else _score_interests
    # Never wider than the catalogue: a k beyond it returns every item, at the cost (and with the bytes) of k = n.
    k_run = min(k, max(1, items_info.n_rows))
    summary = run(users_path, items_path, out, str(out_path), k_run, metric, exclude_path, id_col, vec_col, backend,
                  batch_size, memory_budget, progress, precision, compression, aggregate, options, items_info,
                  t_start)
    return dataclasses.replace(summary, k=k)


def _score_single(users_path: str, items_path: str, out: Any, out_label: str, k: int, metric: str,
                  exclude_path: str | None, id_col: str, vec_col: str, backend: Any, batch_size: int | None,
                  memory_budget: int | None, progress: Progress | None, precision: str, compression: str,
                  aggregate: Any, options: JobOptions, items_info: Any, t_start: float) -> JobSummary:
    """One vector per user: users streamed through the runner; the first batches searched while the items load."""
    dim_source = f"the items' dimension, {items_path}"
    overlap = started = None
    if _searches_early(options, backend, precision, exclude_path):
        overlap = Overlap()

        def start_reader(dim: int) -> None:
            nonlocal batch_size
            batch_size = batch_size or auto_batch_size(k, dim)
            overlap.start_reader(user_batches(users_path, batch_size, id_col, vec_col, dim, metric, dim_source))

        started = early.EarlyStart(items_info.n_rows, k, options.early_parts, overlap.take, Overlap.DONE,
                                   overlap.fail, overlap.stop, on_dim=start_reader, metric=metric, device=backend,
                                   memory_budget=memory_budget, options=options.engine)
        started.start()
    first: list = []
    try:
        # The users' ids are read and checked for duplicates while the items load: both spend their time in pyarrow
        # and NumPy with the GIL released, and nothing can be searched before both are done.
        with ThreadPoolExecutor(1, thread_name_prefix="recall-ids") as pool:
            ids_read = pool.submit(read_ids, users_path, id_col, vec_col)
            items, engine, item_read_s = load_engine(items_path, id_col, vec_col, metric, backend, memory_budget,
                                                     precision, options.engine,
                                                     on_rows=started.on_rows if started else None)
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
    excl = read_pairs(exclude_path, user_ids, items.ids, what="exclusion") if exclude_path is not None else None
    item_read_s += time.perf_counter() - t0
    batch_size = batch_size or auto_batch_size(k, engine.dim)

    def query(batch: Embeddings) -> Any:
        exclude = excl.block(batch.row_start, batch.row_start + len(batch)) if excl is not None else None
        try:
            return engine.search_async(batch.vectors, k, exclude=exclude)
        except InputError:
            check_scores_fit(engine, batch.vectors, batch.ids, users_path, batch.row_start)
            raise

    batches = None
    if overlap is None:
        batches = user_batches(users_path, batch_size, id_col, vec_col, engine.dim, metric, dim_source)
    try:
        with CandidateWriter(out, _id_type(user_ids), _id_type(items.ids), compression) as writer:
            output = _Output(writer, items.ids, int(user_ids.size), progress)
            stream = run_stream(batches, query, lambda batch, res: output.write(batch.ids, res), overlap=overlap,
                                first=first, read_all=started is not None and started.users_done)
            output.check_complete()
    except BaseException:
        if overlap is not None:
            overlap.cancel()  # the reader started early may still be running
        raise
    return JobSummary(
        kind="score", users=int(user_ids.size), items=engine.n_items, dim=engine.dim, k=k, metric=metric,
        device=engine.device, device_detail=engine.backend.describe(), seconds=time.perf_counter() - t_start,
        read_s=item_read_s + stream.read_s, search_s=stream.search_s, write_s=stream.write_s, batch_size=batch_size,
        pairs=excl.n_pairs if excl is not None else 0, unknown_pairs=excl.n_unknown if excl is not None else 0,
        out_path=out_label, device_busy_s=stream.device_busy_s, start_s=start_s,
        early_users=sum(len(batch) for batch, _ in first))


def _searches_early(options: JobOptions, backend: Any, precision: str, exclude_path: str | None) -> bool:
    """Whether a job searches its first batches while the items load (see :class:`JobOptions`)."""
    if options.early == "off" or precision != "exact" or exclude_path is not None:
        return False
    return options.early == "on" or backend.asynchronous


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


def _score_interests(users_path: str, items_path: str, out: Any, out_label: str, k: int, metric: str,
                     exclude_path: str | None, id_col: str, vec_col: str, backend: Any, batch_size: int | None,
                     memory_budget: int | None, progress: Progress | None, precision: str, compression: str,
                     aggregate: str, options: JobOptions, items_info: Any, t_start: float) -> JobSummary:
    """Several vectors per user: the users file read whole (a user's rows need not be adjacent), then searched in
    batches through the runner."""
    t0 = time.perf_counter()
    items, engine, _ = load_engine(items_path, id_col, vec_col, metric, backend, memory_budget, precision,
                                   options.engine)
    users = read_interest_users(users_path, id_col, vec_col, dim=engine.dim,
                                dim_source=f"the items' dimension, {items_path}")
    if metric == "cosine" and users.vectors.shape[0]:
        zero = ~users.vectors.any(axis=1)
        if zero.any():
            pos = int(np.argmax(zero))
            user = int(np.searchsorted(users.indptr, pos, side="right") - 1)
            raise InputError(f"{users_path}: row {int(users.file_rows[pos])} (id {fmt_id(users.ids[user])}) has a "
                             f"zero vector, which has no direction for metric 'cosine'")
    excl = read_pairs(exclude_path, users.ids, items.ids, what="exclusion") if exclude_path is not None else None
    read_s = time.perf_counter() - t0
    start_s = time.perf_counter() - t_start
    n = len(users)
    batch = batch_size or auto_batch_size(k, engine.dim * max(1, users.max_interests))

    def query(span: tuple[int, int]) -> Done:
        start, stop = span
        try:
            res = engine.search(users.batch(start, stop), k, aggregate=aggregate,
                                exclude=excl.block(start, stop) if excl is not None else None)
        except InputError:
            _check_interests_fit(engine, users, users_path, start, stop, aggregate)
            raise
        return Done(res, engine.stats)

    with CandidateWriter(out, _id_type(users.ids), _id_type(items.ids), compression) as writer:
        output = _Output(writer, items.ids, n, progress)
        stream = run_stream(_slices(n, batch), query, lambda span, res: output.write(users.ids[span[0]:span[1]], res))
        output.check_complete()
    return JobSummary(
        kind="interests", users=n, items=engine.n_items, dim=engine.dim, k=k, metric=metric, device=engine.device,
        device_detail=engine.backend.describe(), seconds=time.perf_counter() - t_start, read_s=read_s + stream.read_s,
        search_s=stream.search_s, write_s=stream.write_s, batch_size=batch,
        pairs=excl.n_pairs if excl is not None else 0, unknown_pairs=excl.n_unknown if excl is not None else 0,
        out_path=out_label, device_busy_s=stream.device_busy_s, start_s=start_s,
        vectors=int(users.vectors.shape[0]), aggregate=aggregate)


def rescore_files(users_path: str | os.PathLike, items_path: str | os.PathLike,
                  candidates_path: str | os.PathLike, out_path: str | os.PathLike, k: int, metric: str = "ip",
                  id_col: str = "id", vec_col: str = "embedding", device: str = "auto",
                  memory_budget: int | None = None, batch_size: int | None = None, progress: Progress | None = None,
                  compression: str = DEFAULT_COMPRESSION, options: JobOptions | None = None,
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
    metric, id_col, vec_col, device, memory_budget, batch_size, progress, compression, options
        As for :func:`score_files`.
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
    t_start = time.perf_counter()
    k = check_job_args(k, metric, device, batch_size)
    check_compression(compression)
    options = options or DEFAULT_JOB_OPTIONS
    users_path, items_path, candidates_path = (os.fspath(p) for p in (users_path, items_path, candidates_path))
    out = check_output_path(out_path, (users_path, items_path, candidates_path))
    users_info = inspect_embeddings(users_path, id_col, vec_col)
    items_info = inspect_embeddings(items_path, id_col, vec_col)
    _check_dims(users_info, items_info, users_path, items_path)
    inspect_pairs(candidates_path, "candidate")
    check_not_empty(users_path, users_info.n_rows, out, allow_empty)
    check_not_empty(candidates_path, open_parquet(candidates_path, "candidates").metadata.num_rows, out, allow_empty,
                    "candidates")
    backend = backends.resolve(device)
    remove_leftovers(out)
    k_run = min(k, max(1, items_info.n_rows))  # no user has more distinct candidates than there are items

    t0 = time.perf_counter()
    items, engine, _ = load_engine(items_path, id_col, vec_col, metric, backend, memory_budget,
                                   options=options.engine)
    users = read_embeddings(users_path, id_col, vec_col)
    if len(users) and users.dim != engine.dim:
        raise InputError(f"{users_path}: row 0 (id {fmt_id(users.ids[0])}) has dimension {users.dim}, expected "
                         f"{engine.dim} (the items' dimension, {items_path})")
    cands = read_pairs(candidates_path, users.ids, items.ids, what="candidate", sort_unique=False)
    present = np.flatnonzero(cands.named)  # a named user gets a (maybe empty) row of output
    if metric == "cosine" and present.size:
        check_nonzero(users.vectors[present], users.ids[present], users_path)
    mine = cands.take(present)
    read_s = time.perf_counter() - t0
    start_s = time.perf_counter() - t_start
    n = int(present.size)
    batch = batch_size or auto_batch_size(k_run, engine.dim)

    def query(span: tuple[int, int]) -> Done:
        start, stop = span
        rows = present[start:stop]
        try:
            res = engine.rescore(users.vectors[rows], mine.block(start, stop), k_run)
        except InputError:
            check_scores_fit(engine, users.vectors[rows], users.ids, users_path, file_rows=rows, owner=rows)
            raise
        return Done(res, engine.stats)

    with CandidateWriter(out, _id_type(users.ids), _id_type(items.ids), compression) as writer:
        output = _Output(writer, items.ids, n, progress)
        stream = run_stream(_slices(n, batch), query,
                            lambda span, res: output.write(users.ids[present[span[0]:span[1]]], res))
        output.check_complete()
    return JobSummary(
        kind="rescore", users=n, items=engine.n_items, dim=engine.dim, k=k, metric=metric, device=engine.device,
        device_detail=engine.backend.describe(), seconds=time.perf_counter() - t_start, read_s=read_s + stream.read_s,
        search_s=stream.search_s, write_s=stream.write_s, batch_size=batch, pairs=cands.n_pairs,
        unknown_pairs=cands.n_unknown, out_path=str(out_path), device_busy_s=stream.device_busy_s, start_s=start_s,
        candidates=int(mine.item_rows.size))
