"""``recall batch``: the nightly job. A directory (or glob) of user Parquet shards in, one candidates file per shard out.

Sharded, resumable, idempotent:

- every output is written under a temporary name and renamed into place when complete (``CandidateWriter``);
- ``OUT_DIR/_manifest.json`` records the job (parameters, a fingerprint of every input) and, per finished shard, its
  rows, size and the sha256 of its output file; it is rewritten atomically after every finished shard, by the parent
  process only;
- a rerun of the same command skips the shards whose output exists and matches the manifest's size and sha256, and
  redoes the others; a different job (other parameters, item file, exclusions or users) into the same directory is
  refused unless ``overwrite``;
- ``_SUCCESS`` is written last, and removed first whenever anything has to be (re)done;
- Parquet bytes are deterministic (fixed row groups, no timestamps): a run killed at any moment and run again gives
  the same bytes as an uninterrupted run, with the same code, device and tiling (see :func:`run_batch`).

Each worker (this process, a process per GPU, or a Ray actor; see :mod:`recall.distributed`) loads and prepares the
items once in a :class:`ShardScorer` and streams shards through it. The parent owns the manifest, the metrics file
(``_metrics.json``), the progress display and ``_SUCCESS``.
"""
from __future__ import annotations

import datetime as _dt
import fcntl
import glob
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from . import metrics as _metrics
from .backends import DEVICES
from .errors import InputError, RecallError
from .io import (
    CandidateWriter,
    Embeddings,
    ExclusionPairs,
    inspect_embeddings,
    inspect_exclusions,
    load_exclusions,
    read_ids,
)
from .io.writer import fsync_dir

# The pipeline's streaming search (reader thread, search with a resident engine, writer thread), shared with
# `recall score` rather than copied.
from .pipeline import _check_k, auto_batch_size, load_engine, stream_search  # noqa: PLC2701
from .result import id_lookup

log = logging.getLogger("recall")

MANIFEST = "_manifest.json"
METRICS = "_metrics.json"
SUCCESS = "_SUCCESS"
LOCK = ".recall-batch.lock"
FORMAT = "recall-batch/1"
ENGINES = ("local", "ray")

#: Test hook: seconds a worker sleeps after each batch it writes, so that a test's kill -9 lands mid-shard, with a
#: temporary file open. Never set in production.
TEST_SLEEP_ENV = "RECALL_BATCH_TEST_SLEEP_S"

# Temporary files of CandidateWriter (``.{name}.tmp-{pid}``) and of the JSON writer below.
_TMP_NAME = re.compile(r"^\..+\.tmp-\d+$")
_OWN_NAMES = {MANIFEST, METRICS, SUCCESS, LOCK}
_HASH_CHUNK = 8 << 20


class BatchError(RecallError, RuntimeError):
    """A worker died or failed for a reason that is not the input's fault (CLI exit code 1). The job can be resumed."""


# --------------------------------------------------------------------------------------------------------------------
# Small file helpers


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a whole file, read in 8 MiB chunks (hashlib releases the GIL, so threads hash in parallel)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _footer_sha256(path: str, size: int) -> str:
    """sha256 of a Parquet file's footer (metadata + length + magic): row counts, row-group offsets, sizes and
    statistics. Any rewrite of a shard changes it; reading it costs two small reads, not the file."""
    with open(path, "rb") as f:
        if size < 12:
            raise InputError(f"{path}: not a Parquet file, or truncated ({size} bytes)")
        f.seek(size - 8)
        tail = f.read(8)
        n = int.from_bytes(tail[:4], "little")
        if tail[4:] != b"PAR1" or n > size - 12:
            raise InputError(f"{path}: not a Parquet file, or truncated (no footer)")
        f.seek(size - 8 - n)
        return hashlib.sha256(f.read(n) + tail).hexdigest()


def _fsync_dir(path: Path) -> None:
    fsync_dir(path)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync and rename: the path holds the old or the new bytes."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def _write_json(path: Path, obj: Any) -> None:
    _write_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------------------------------
# What the workers need (everything here is picklable: it crosses process and Ray boundaries)


@dataclass(frozen=True)
class JobSpec:
    """The job as every worker sees it.

    Attributes
    ----------
    items_path : str
    exclude_path : str or None
    k : int
    metric : str
    id_col, vec_col : str
    user_id_type : {"int64", "string"}
        The users' id type (the same in every shard), for mapping exclusions.
    batch_size : int or None
        Users per batch; None: :func:`recall.pipeline.auto_batch_size` of k and the items' dimension.
    memory_budget : int or None
        The engine's search working memory in bytes; None: the engine's default.
    """

    items_path: str
    exclude_path: str | None
    k: int
    metric: str
    id_col: str
    vec_col: str
    user_id_type: str
    batch_size: int | None = None
    memory_budget: int | None = None


@dataclass(frozen=True)
class ShardTask:
    """One shard to score: read ``path``, write ``out_path`` (atomically)."""

    name: str
    path: str
    out_path: str
    rows: int


@dataclass(frozen=True)
class ShardResult:
    """What a worker reports for a finished shard; ``sha256`` and ``bytes`` describe the output as renamed in place.

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

    @property
    def users_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class WorkerInfo:
    """A worker after loading the items: where it runs and what that cost."""

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
    cuda_visible_devices: str | None = None
    cpu_affinity: list[int] | None = None


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


class _ExclusionIndex:
    """The exclusions file read once per worker, then cut per shard in memory.

    Pairs are keyed by the file's own distinct user ids, so the index needs no list of every user of the job and a
    user id in several shards gets its exclusions in each. Reading and validation are :func:`recall.io.load_exclusions`.
    """

    def __init__(self, path: str, user_ids_are_strings: bool, item_ids: np.ndarray) -> None:
        keys = self._distinct_users(path, user_ids_are_strings)
        pairs = load_exclusions(path, keys, item_ids)
        self.keys = keys
        self.indptr, self.items = pairs.csr()
        self.n_pairs, self.n_unknown = pairs.n_pairs, pairs.n_unknown

    @staticmethod
    def _distinct_users(path: str, want_str: bool) -> np.ndarray:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        empty = np.zeros(0, object if want_str else np.int64)
        try:
            col = pq.read_table(path, columns=["user_id"]).column("user_id").combine_chunks()
        except (pa.ArrowException, OSError):
            return empty  # load_exclusions reads the file again and names the problem (file, row)
        if pa.types.is_dictionary(col.type):
            col = col.dictionary_decode()
        col = pc.unique(col.drop_null())
        t = col.type
        if want_str and (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
            return col.cast(pa.string()).to_numpy(zero_copy_only=False).astype(object)
        if not want_str and pa.types.is_integer(t):
            if pa.types.is_uint64(t):
                col = col.filter(pc.less_equal(col, pa.scalar(np.iinfo(np.int64).max, pa.uint64())))
            return col.cast(pa.int64()).to_numpy(zero_copy_only=False)
        # A type mismatch: load_exclusions names the file, the column and the two types.
        return empty

    def for_shard(self, user_ids: np.ndarray) -> tuple[ExclusionPairs, int]:
        """(the pairs of this shard's users, keyed by shard row; how many pairs that is)."""
        import pyarrow.compute as pc

        if self.keys.size == 0 or user_ids.size == 0:
            empty = np.zeros(0, np.int64)
            return ExclusionPairs(empty, empty, int(user_ids.size), 0, 0), 0
        value_set = pa.array(self.keys, type=pa.string() if self.keys.dtype == object else pa.int64())
        ids = pa.array(user_ids, type=value_set.type)
        pos = pc.index_in(ids, value_set=value_set).fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        has = pos >= 0
        starts = np.where(has, self.indptr[np.maximum(pos, 0)], 0)
        counts = np.where(has, self.indptr[np.maximum(pos, 0) + 1] - starts, 0)
        total = int(counts.sum())
        user_rows = np.repeat(np.arange(user_ids.size, dtype=np.int64), counts)
        # Position j of the output takes items[starts[u] + (j - first output position of u)].
        first = np.cumsum(counts) - counts
        item_rows = self.items[np.repeat(starts - first, counts) + np.arange(total, dtype=np.int64)]
        return ExclusionPairs(user_rows, item_rows, int(user_ids.size), total, 0), total


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
        items, self.engine, _ = load_engine(spec.items_path, spec.id_col, spec.vec_col, spec.metric, device,
                                            spec.memory_budget)
        self.item_id_type = pa.string() if items.ids.dtype == object else pa.int64()
        self.item_ids = id_lookup(items.ids)
        self.exclusions = (_ExclusionIndex(spec.exclude_path, spec.user_id_type == "string", items.ids)
                           if spec.exclude_path is not None else None)
        self.batch_size = spec.batch_size or auto_batch_size(spec.k, self.engine.dim)
        self.group_rows = row_group_rows(spec.k)
        self.test_sleep = float(os.environ.get(TEST_SLEEP_ENV) or 0)
        self.info = WorkerInfo(
            worker=worker, device=self.engine.device, device_detail=self.engine.backend.describe(),
            host=socket.gethostname(), pid=os.getpid(), items_load_s=time.perf_counter() - t0,
            n_items=self.engine.n_items, dim=self.engine.dim,
            exclusion_pairs=self.exclusions.n_pairs if self.exclusions else 0,
            unknown_exclusions=self.exclusions.n_unknown if self.exclusions else 0,
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
        excl, applied = self.exclusions.for_shard(user_ids) if self.exclusions is not None else (None, 0)
        t_ids = time.perf_counter() - t0
        n_users = int(user_ids.size)

        def write(item: tuple[Embeddings, Any]) -> None:
            batch, result = item
            groups.add(result.to_arrow(batch.ids, self.item_ids))
            if progress is not None:
                progress(len(batch))
            if self.test_sleep:
                time.sleep(self.test_sleep)

        user_type = pa.string() if user_ids.dtype == object else pa.int64()
        with CandidateWriter(task.out_path, user_type, self.item_id_type) as writer:
            groups = _RowGroups(writer, self.group_rows)
            stream = stream_search(engine, task.path, spec.k, write, exclusions=excl, id_col=spec.id_col,
                                   vec_col=spec.vec_col, batch_size=self.batch_size,
                                   dim_source=f"the items' dimension, {spec.items_path}")
            groups.close()
            if writer.rows_written != n_users:
                raise BatchError(f"{task.path}: wrote {writer.rows_written} rows for {n_users} users")
        t_hash = time.perf_counter()
        digest = sha256_file(task.out_path)
        t_end = time.perf_counter()
        return ShardResult(
            name=task.name, rows=n_users, bytes=os.path.getsize(task.out_path), sha256=digest,
            seconds=t_end - t0, read_s=t_ids + stream.read_s, search_s=stream.search_s, write_s=stream.write_s,
            hash_s=t_end - t_hash, device_busy_s=stream.device_busy_s, batch_size=self.batch_size,
            memory_budget=engine.memory_budget, device=engine.device, worker=self.worker, exclusions_applied=applied,
        )


# --------------------------------------------------------------------------------------------------------------------
# Inputs: discovery, validation, fingerprints


@dataclass(frozen=True)
class Shard:
    """An input shard as found by :func:`discover_shards` and inspected by the parent."""

    name: str
    path: str
    rows: int
    size: int
    footer_sha256: str
    id_type: str

    def fingerprint(self) -> dict:
        return {"rows": self.rows, "size": self.size, "footer_sha256": self.footer_sha256}


def _hidden(name: str) -> bool:
    # Hadoop/Spark convention: _SUCCESS, _metadata, _common_metadata, .crc files are not data.
    return name.startswith((".", "_"))


def discover_shards(users: str | os.PathLike) -> list[Path]:
    """The user shards named by ``users``: a directory (its ``*.parquet`` files, not recursive), a glob pattern
    (``**`` recurses), or one file. Names starting with ``.`` or ``_`` are skipped. Sorted by path.

    Raises
    ------
    InputError
        Nothing found, or two shards with the same file name (their outputs would collide).
    """
    spec = os.fspath(users)
    p = Path(spec)
    if p.is_dir():
        files = sorted(q for q in p.iterdir() if q.is_file() and q.suffix == ".parquet" and not _hidden(q.name))
        if not files:
            raise InputError(f"{spec}: no *.parquet files in this directory")
    elif any(c in spec for c in "*?["):
        files = sorted(Path(m) for m in glob.glob(spec, recursive=True)
                       if Path(m).is_file() and not _hidden(Path(m).name))
        if not files:
            raise InputError(f"{spec}: no files match this pattern")
    elif p.is_file():
        files = [p]
    else:
        raise InputError(f"{spec}: no such file or directory")
    seen: dict[str, Path] = {}
    for f in files:
        if f.name in seen:
            raise InputError(f"{f}: has the same file name as {seen[f.name]}; outputs are named after their input, "
                             f"so shard names must be unique")
        seen[f.name] = f
    return files


def _fingerprint_full(path: str) -> dict:
    st = os.stat(path)
    return {"size": st.st_size, "sha256": sha256_file(path)}


def _inspect_shards(files: list[Path], id_col: str, vec_col: str, dim: int | None, items_path: str) -> list[Shard]:
    shards = []
    for f in files:
        path = str(f)
        info = inspect_embeddings(path, id_col, vec_col)
        if dim is not None and info.dim is not None and info.dim != dim:
            raise InputError(f"{path}: vectors have dimension {info.dim}, but the items ({items_path}) have "
                             f"dimension {dim}")
        size = os.path.getsize(path)
        id_type = "string" if info.id_type == pa.string() else "int64"
        shards.append(Shard(f.name, path, info.n_rows, size, _footer_sha256(path, size), id_type))
    kinds = {s.id_type for s in shards}
    if len(kinds) > 1:
        first = shards[0]
        odd = next(s for s in shards if s.id_type != first.id_type)
        raise InputError(f"{odd.path}: user ids are {odd.id_type}, but in {first.path} they are {first.id_type}; "
                         f"every shard must use the same id type")
    return shards


# --------------------------------------------------------------------------------------------------------------------
# The output directory: lock, manifest, verification


class _DirLock:
    """An exclusive ``flock`` on ``OUT_DIR/.recall-batch.lock`` for the length of the job: two jobs writing the same
    directory would corrupt each other's manifest. The kernel drops it when the process dies, even by kill -9."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK
        self.fd: int | None = None

    def __enter__(self) -> "_DirLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise InputError(f"{self.path.parent}: another recall batch (pid {holder}) is writing to this directory; "
                             f"wait for it to finish or stop it") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock; the file stays (removing it would race with a waiting job)
            self.fd = None


def _describe_difference(old: dict, new: dict) -> str:
    """What differs between two manifests' ``job`` sections, in a few words."""
    diffs = []
    for key in ("k", "metric", "id_col", "vec_col"):
        if old.get(key) != new.get(key):
            diffs.append(f"{key} {old.get(key)!r} -> {new.get(key)!r}")
    for key, what in (("items", "item file"), ("exclude", "exclusions file")):
        a, b = old.get(key), new.get(key)
        if a != b:
            if a is None or b is None:
                diffs.append(f"{what} {'added' if a is None else 'removed'}")
            else:
                diffs.append(f"{what} content changed (sha256 {a.get('sha256', '?')[:12]} -> {b['sha256'][:12]}, "
                             f"size {a.get('size')} -> {b['size']})")
    a, b = old.get("shards") or {}, new.get("shards") or {}
    added = sorted(set(b) - set(a))
    removed = sorted(set(a) - set(b))
    changed = sorted(n for n in set(a) & set(b) if a[n] != b[n])
    for label, names in (("added", added), ("removed", removed), ("changed", changed)):
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            diffs.append(f"user shards {label}: {shown}")
    extra = sorted(set(old) ^ set(new))
    if extra and not diffs:
        diffs.append(f"manifest fields differ: {', '.join(extra)}")
    return "; ".join(diffs) or "the job description differs"


def _verify(out_dir: Path, name: str, entry: dict) -> str | None:
    """None when ``OUT_DIR/name`` matches the manifest entry (size, then sha256), else what is wrong."""
    path = out_dir / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "the output file is missing"
    if size != entry.get("bytes"):
        return f"the output has {size:,} bytes, the manifest says {entry.get('bytes'):,}"
    if sha256_file(path) != entry.get("sha256"):
        return "the output's sha256 differs from the manifest's"
    return None


# --------------------------------------------------------------------------------------------------------------------
# The job


class BatchProgress:
    """What :func:`run_batch` reports while it runs; the CLI draws it. Methods may be called from worker threads."""

    def begin(self, shards: int, users: int) -> None:
        """Work is about to start: ``shards`` shards holding ``users`` users to score."""

    def workers_ready(self, n: int) -> None:
        """``n`` workers have loaded the items."""

    def users(self, n: int) -> None:
        """``n`` more users were written."""

    def shard_done(self, done: int, total: int) -> None:
        """A shard finished: ``done`` of ``total`` in this run."""

    def end(self) -> None:
        """The run is over (success or failure)."""


@dataclass
class BatchSummary:
    """What :func:`run_batch` did.

    Attributes
    ----------
    shards_total : int
        Shards in the input.
    shards_skipped : int
        Already done (verified against the manifest), not recomputed.
    shards_scored : int
        Scored in this run.
    users_scored : int
        Users in the shards scored in this run.
    users_total : int
        Users in all shards.
    seconds : float
        Wall time of this run, from the call to the end.
    engine, device : str
        "local" or "ray"; "cpu" or "gpu" ("" when nothing had to be done).
    workers : int
    out_dir : str
    exclusion_pairs, unknown_exclusions : int
        Pairs in the exclusions file; of those, pairs naming an item id the items file does not have (ignored).
    """

    shards_total: int
    shards_skipped: int
    shards_scored: int
    users_scored: int
    users_total: int
    seconds: float
    engine: str
    device: str
    workers: int
    out_dir: str
    n_items: int = 0
    k: int = 0
    metric: str = ""
    exclusion_pairs: int = 0
    unknown_exclusions: int = 0
    notices: list[str] = field(default_factory=list)
    worker_infos: list[WorkerInfo] = field(default_factory=list)

    @property
    def users_per_s(self) -> float:
        return self.users_scored / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """The one-line summary the CLI prints."""
        if self.shards_scored == 0:
            return (f"batch: all {self.shards_total:,} shard{'s' if self.shards_total != 1 else ''} "
                    f"({self.users_total:,} users) already done and verified, nothing to do -> {self.out_dir}")
        skipped = f", {self.shards_skipped:,} already done" if self.shards_skipped else ""
        return (f"batch: {self.shards_scored:,} of {self.shards_total:,} shards scored{skipped}; "
                f"{self.users_scored:,} users x {self.n_items:,} items, k {self.k}, metric {self.metric}, "
                f"{self.workers} {self.device} worker{'s' if self.workers != 1 else ''} ({self.engine}) in "
                f"{self.seconds:.2f} s ({self.users_per_s:,.0f} users/s) -> {self.out_dir}")


class _Job:
    """The parent's bookkeeping while workers run: the manifest, ``_metrics.json`` and progress, all under one lock
    (the in-process executor reports from the pipeline's writer thread)."""

    def __init__(self, out_dir: Path, manifest: dict, metrics: dict, progress: BatchProgress, n_todo: int,
                 say: Callable[[str], None], t_start: float) -> None:
        self.out_dir, self.manifest, self.metrics, self.progress = out_dir, manifest, metrics, progress
        self.n_todo, self.say, self.t_start = n_todo, say, t_start
        # How the outputs kept from earlier runs were computed: a resume that computes differently is said once.
        self.earlier = {_numerics(e) for e in manifest["outputs"].values()}
        self.warned_numerics = False
        self.done = 0
        self.users_done = 0
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.workers: list[WorkerInfo] = []

    def worker_ready(self, info: WorkerInfo) -> None:
        with self.lock:
            self.workers.append(info)
            self.metrics["workers"] = [{key: round(v, 4) if isinstance(v, float) else v
                                        for key, v in asdict(w).items()} for w in self.workers]
            _write_json(self.out_dir / METRICS, self.metrics)
            n = len(self.workers)
        self.progress.workers_ready(n)

    def users(self, n: int) -> None:
        self.progress.users(n)

    def shard_done(self, result: ShardResult) -> None:
        now = _numerics(asdict(result))
        if self.earlier and not self.warned_numerics and self.earlier != {now}:
            self.warned_numerics = True
            self.say(f"shards kept from earlier runs were computed with {_describe_numerics(self.earlier)}, this run "
                     f"uses {_describe_numerics({now})}: every list is still the exact top-k, but scores may differ "
                     f"in the last bits from a single uninterrupted run")
        with self.lock:
            self.manifest["outputs"][result.name] = {
                "rows": result.rows, "bytes": result.bytes, "sha256": result.sha256, "device": result.device,
                "batch_size": result.batch_size, "memory_budget": result.memory_budget,
                "exclusions_applied": result.exclusions_applied,
            }
            self.manifest["shards_done"] = len(self.manifest["outputs"])
            _write_json(self.out_dir / MANIFEST, self.manifest)
            self.done += 1
            self.users_done += result.rows
            entry = {key: round(v, 4) if isinstance(v, float) else v for key, v in asdict(result).items()
                     if key != "name"}
            entry["users_per_s"] = round(result.users_per_s, 1)
            self.metrics["shards"][result.name] = entry
            self._update_totals()
            _write_json(self.out_dir / METRICS, self.metrics)
            done = self.done
        self.progress.shard_done(done, self.n_todo)

    def _update_totals(self) -> None:
        seconds = time.perf_counter() - self.t0
        job = self.metrics["job"]
        job.update(seconds=round(seconds, 3), wall_s=round(time.perf_counter() - self.t_start, 3),
                   shards_scored=self.done, users_scored=self.users_done,
                   users_per_s=round(self.users_done / seconds, 1) if seconds > 0 else 0.0,
                   items_load_s_max=max((w.items_load_s for w in self.workers), default=0.0))

    def finish(self, status: str, notices: list[str], error: str | None = None) -> None:
        with self.lock:
            self._update_totals()
            self.metrics["job"].update(status=status, finished_at=_now(), notices=list(notices))
            if error is not None:
                self.metrics["job"]["error"] = error
            _write_json(self.out_dir / METRICS, self.metrics)


def _numerics(entry: dict) -> tuple:
    """What decides an output's last bits besides its inputs: the device and the tiling (batch size, budget)."""
    return entry.get("device"), entry.get("batch_size"), entry.get("memory_budget")


def _describe_numerics(values: set[tuple]) -> str:
    return " / ".join(f"device {d}, batch size {b}, memory budget {m}" for d, b, m in sorted(values, key=str))


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> str:
    if value not in choices:
        raise InputError(f"unknown {what} {value!r}: expected one of {', '.join(choices)}")
    return value


def parse_gpus(value: Any) -> int | str | None:
    """``--gpus``: None, "all", or an integer >= 1 (also given as text).

    Raises
    ------
    InputError
        Anything else.
    """
    if value is None or value == "all":
        return value
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if isinstance(value, bool) or n < 1 or (isinstance(value, str) and not value.strip().isdigit()):
        raise InputError(f"--gpus must be 'all' or an integer >= 1, got {value!r}")
    return n


def run_batch(users: str | os.PathLike, items: str | os.PathLike, out_dir: str | os.PathLike, k: int, *,
              metric: str = "ip", exclude: str | os.PathLike | None = None, id_col: str = "id",
              vec_col: str = "embedding", device: str = "auto", gpus: int | str | None = None,
              workers: int | None = None, engine: str = "local", ray_address: str | None = None,
              overwrite: bool = False, batch_size: int | None = None, memory_budget: int | None = None,
              progress: BatchProgress | None = None, notice: Callable[[str], None] | None = None) -> BatchSummary:
    """Score every user shard of ``users`` against ``items`` into ``out_dir``: one candidates file per shard,
    resumable, idempotent (see the module docstring).

    Parameters
    ----------
    users : str or PathLike
        A directory of user embedding Parquet files (``*.parquet``, not recursive), a glob pattern, or one file.
    items : str or PathLike
        The item embedding Parquet file.
    out_dir : str or PathLike
        Created if missing. Holds ``<shard name>`` per input shard, ``_manifest.json``, ``_metrics.json``,
        ``_SUCCESS``.
    k : int
    metric : {"ip", "cosine", "l2"}
    exclude : str or PathLike, optional
        Exclusion pairs (as for ``recall score``), applied to every shard.
    id_col, vec_col : str
    device : {"auto", "cpu", "gpu"}
    gpus : int, "all" or None
        GPU workers (one process, or Ray actor, per GPU). Ignored, with a notice, on the CPU.
    workers : int, optional
        CPU workers (processes pinned to disjoint cores, or Ray actors); default 1. Ignored on GPUs.
    engine : {"local", "ray"}
    ray_address : str, optional
        ``ray.init(address=...)``: "auto", "ray://head:10001", ...; default: a local Ray (or ``RAY_ADDRESS``).
    overwrite : bool
        Discard what ``out_dir`` holds (the outputs its manifest lists, and files named like this job's outputs)
        and compute every shard again. Without it, a directory holding another job's output, or files recall batch
        did not write, is refused.
    batch_size : int, optional
    memory_budget : int, optional
    progress : BatchProgress, optional
    notice : callable ``(message) -> None``, optional
        Receives notices (ignored options, redone shards); default: the ``recall`` logger at WARNING.

    Returns
    -------
    BatchSummary

    Raises
    ------
    InputError
        Bad arguments, inputs (named), or an ``out_dir`` that holds something else (use ``overwrite``).
    ResourceError, BackendUnavailable
        As :class:`recall.Engine`.
    BatchError
        A worker failed for a reason that is not the input's; rerun to resume.

    Notes
    -----
    Byte-for-byte equal outputs between a resumed and an uninterrupted run need the same recall and pyarrow
    versions, the same device model, and the same tiling: the same ``batch_size`` and ``memory_budget`` (the default
    budget is a share of free memory, capped; it only varies when memory is short). The manifest records, per output,
    the device, batch size and budget it was computed with.
    """
    t_start = time.perf_counter()
    progress = progress or BatchProgress()
    notices: list[str] = []

    def say(msg: str) -> None:
        notices.append(msg)
        (notice or log.warning)(msg)

    k = _check_k(k)
    _metrics.check_metric(metric)
    _check_choice(device, DEVICES, "device")
    _check_choice(engine, ENGINES, "engine")
    gpus = parse_gpus(gpus)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, (int, np.integer))
                                or workers < 1):
        raise InputError(f"--workers must be an integer >= 1, got {workers!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise InputError(f"--batch-size must be an integer >= 1, got {batch_size!r}")
    if memory_budget is not None and (isinstance(memory_budget, bool) or memory_budget <= 0):
        raise InputError(f"--memory-budget must be a positive number of bytes, got {memory_budget!r}")
    if ray_address is not None and engine != "ray":
        raise InputError("--ray-address needs --engine ray")

    items_path = os.fspath(items)
    exclude_path = os.fspath(exclude) if exclude is not None else None
    files = discover_shards(users)

    # Cheap checks first (footers only), so that a typo costs no item read and touches no output.
    items_info = inspect_embeddings(items_path, id_col, vec_col)
    if items_info.n_rows == 0:
        raise InputError(f"{items_path}: the file has no rows, at least one is required")
    if exclude_path is not None:
        inspect_exclusions(exclude_path)
    shards = _inspect_shards(files, id_col, vec_col, items_info.dim, items_path)

    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise InputError(f"{out_dir}: exists and is not a directory")
    for p in [items_path, exclude_path, *(s.path for s in shards)]:
        if p is not None and Path(p).absolute().parent == out:
            raise InputError(f"{p}: is inside the output directory {out_dir}; outputs are named after the user "
                             f"shards and would overwrite or mix with inputs; choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{out_dir}: cannot create the output directory: {exc.strerror or exc}") from exc
    if not os.access(out, os.W_OK | os.X_OK):
        raise InputError(f"{out_dir}: the output directory is not writable")

    with _DirLock(out):
        return _run_locked(
            out=out, out_label=os.fspath(out_dir), users=os.fspath(users), items_path=items_path,
            exclude_path=exclude_path, shards=shards, k=k, metric=metric, id_col=id_col, vec_col=vec_col,
            device=device, gpus=gpus, workers=workers, engine=engine, ray_address=ray_address, overwrite=overwrite,
            batch_size=batch_size, memory_budget=memory_budget, progress=progress, say=say, notices=notices,
            t_start=t_start,
        )


def _run_locked(*, out: Path, out_label: str, users: str, items_path: str, exclude_path: str | None,
                shards: list[Shard], k: int, metric: str, id_col: str, vec_col: str, device: str,
                gpus: int | str | None, workers: int | None, engine: str, ray_address: str | None, overwrite: bool,
                batch_size: int | None, memory_budget: int | None, progress: BatchProgress,
                say: Callable[[str], None], notices: list[str], t_start: float) -> BatchSummary:
    t0 = time.perf_counter()
    job = {
        "k": k, "metric": metric, "id_col": id_col, "vec_col": vec_col,
        "items": _fingerprint_full(items_path),
        "exclude": _fingerprint_full(exclude_path) if exclude_path is not None else None,
        "shards": {s.name: s.fingerprint() for s in shards},
    }
    fingerprint_s = time.perf_counter() - t0

    manifest_path = out / MANIFEST
    old: dict | None = None
    if manifest_path.exists():
        try:
            old = json.loads(manifest_path.read_text())
            if old.get("format") != FORMAT or not isinstance(old.get("job"), dict):
                raise ValueError(f"format {old.get('format')!r}")
        except (ValueError, OSError) as exc:
            if not overwrite:
                raise InputError(f"{manifest_path}: cannot be read as a recall batch manifest ({exc}); pass "
                                 f"--overwrite to start this directory over") from None
            old = {"job": {}, "outputs": {}}
    names = {s.name for s in shards}
    foreign = sorted(p.name for p in out.iterdir()
                     if p.name not in _OWN_NAMES and not _TMP_NAME.match(p.name)
                     and (old is None or p.name not in old.get("outputs", {})) and p.name not in names)

    if overwrite:
        # _SUCCESS goes first: from here on the directory is not a finished dataset. The old manifest goes last, so
        # a kill in between leaves a directory that the same --overwrite command starts over again.
        _remove(out / SUCCESS)
        doomed = set(names) | set((old or {}).get("outputs", {}))
        for name in sorted(doomed):
            _remove(out / name)
        _remove(out / METRICS)
        _remove(manifest_path)
        if foreign:
            say(f"{out_label}: --overwrite left {len(foreign)} file(s) recall batch did not write: "
                f"{', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}")
        old = None
    elif old is None:
        stray = [p.name for p in out.iterdir() if p.name not in _OWN_NAMES and not _TMP_NAME.match(p.name)]
        if stray:
            raise InputError(f"{out_label}: is not empty and has no {MANIFEST} (it holds "
                             f"{', '.join(sorted(stray)[:3])}{' ...' if len(stray) > 3 else ''}), so it is not the "
                             f"output of this job; choose an empty or new directory, or pass --overwrite")
    elif old["job"] != job:
        raise InputError(f"{out_label}: holds the output of a different job ({_describe_difference(old['job'], job)}); "
                         f"rerun with the same parameters and inputs to resume it, pass --overwrite to replace it, "
                         f"or choose another --out")

    # Leftovers of a killed run: temporary files (ours, by name) can go; we hold the lock, so nobody writes them.
    for p in out.iterdir():
        if _TMP_NAME.match(p.name) and p.is_file():
            _remove(p)

    # Resume: a shard is done when its output matches the manifest's size and sha256.
    t0 = time.perf_counter()
    outputs: dict[str, dict] = {}
    if old is not None:
        listed = [(n, e) for n, e in sorted(old.get("outputs", {}).items()) if n in names]
        with ThreadPoolExecutor(max_workers=min(8, max(1, len(listed)))) as pool:
            problems = list(pool.map(lambda ne: _verify(out, ne[0], ne[1]), listed))
        for (name, entry), problem in zip(listed, problems):
            if problem is None:
                outputs[name] = entry
            else:
                say(f"{out / name}: {problem}; scoring this shard again")
        prev = old.get("versions", {})
        now_versions = _versions()
        if outputs and prev and prev != now_versions:
            say(f"{out_label}: earlier outputs were written with {prev}, this run uses {now_versions}; "
                f"outputs stay exact, but may differ in bytes from a run with one version")
    verify_s = time.perf_counter() - t0

    todo = [s for s in shards if s.name not in outputs]
    manifest = {
        "format": FORMAT, "job": job, "versions": _versions(),
        "inputs": {"users": users, "items": os.path.abspath(items_path),
                   "exclude": os.path.abspath(exclude_path) if exclude_path else None},
        "shards_total": len(shards), "shards_done": len(outputs), "outputs": outputs,
    }
    users_total = sum(s.rows for s in shards)
    base = dict(shards_total=len(shards), shards_skipped=len(outputs), users_total=users_total, out_dir=out_label,
                k=k, metric=metric, notices=notices, engine=engine)

    if not todo:
        # Idempotent: nothing is rewritten, unless a kill landed between the last manifest update and _SUCCESS.
        if not (out / SUCCESS).exists():
            _write_json(manifest_path, manifest)
            _write_atomic(out / SUCCESS, b"")
        return BatchSummary(shards_scored=0, users_scored=0, seconds=time.perf_counter() - t_start, device="",
                            workers=0, **base)

    # Placement errors (more GPUs than there are, Ray missing) before anything in OUT_DIR changes.
    from .distributed import make_executor

    executor = make_executor(engine, device=device, gpus=gpus, workers=workers, ray_address=ray_address, say=say)

    _remove(out / SUCCESS)
    _write_json(manifest_path, manifest)
    metrics = {
        "job": {"status": "running", "started_at": _now(), "engine": engine, "device_requested": device,
                "shards_total": len(shards), "shards_skipped": len(outputs), "shards_todo": len(todo),
                "users_total": users_total, "users_todo": sum(s.rows for s in todo), "k": k, "metric": metric,
                "fingerprint_s": round(fingerprint_s, 3), "verify_s": round(verify_s, 3), "host": socket.gethostname()},
        "workers": [], "shards": _earlier_shard_metrics(out / METRICS, outputs),
    }
    _write_json(out / METRICS, metrics)
    state = _Job(out, manifest, metrics, progress, len(todo), say, t_start)
    spec = JobSpec(items_path=items_path, exclude_path=exclude_path, k=k, metric=metric, id_col=id_col,
                   vec_col=vec_col, user_id_type=shards[0].id_type, batch_size=batch_size,
                   memory_budget=memory_budget)
    # Largest shards first: with several workers the last one to finish is then a small one.
    tasks = [ShardTask(s.name, s.path, str(out / s.name), s.rows)
             for s in sorted(todo, key=lambda s: (-s.rows, s.name))]

    progress.begin(len(tasks), sum(t.rows for t in tasks))
    try:
        executor.run(spec, tasks, state)
    except BaseException as exc:
        state.finish("failed", notices, f"{type(exc).__name__}: {' '.join(str(exc).split())}")
        raise
    finally:
        progress.end()
    state.finish("succeeded", notices)
    _write_atomic(out / SUCCESS, b"")
    info = state.workers[0] if state.workers else None
    return BatchSummary(
        shards_scored=state.done, users_scored=state.users_done, seconds=time.perf_counter() - t_start,
        device=info.device if info else "", workers=executor.n_workers, n_items=info.n_items if info else 0,
        exclusion_pairs=info.exclusion_pairs if info else 0, unknown_exclusions=info.unknown_exclusions if info else 0,
        worker_infos=list(state.workers), **base,
    )


def _earlier_shard_metrics(path: Path, kept: dict[str, dict]) -> dict[str, dict]:
    """The previous ``_metrics.json`` entries of the shards a resumed run keeps, marked ``"earlier_run": true``, so
    the file still describes every shard of the job."""
    try:
        shards = json.loads(path.read_text()).get("shards", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return {name: {**entry, "earlier_run": True} for name, entry in shards.items()
            if name in kept and isinstance(entry, dict)}


def _versions() -> dict:
    from . import __version__

    return {"recall": __version__, "pyarrow": pa.__version__, "numpy": np.__version__}


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
