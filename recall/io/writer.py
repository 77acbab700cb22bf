"""Candidates Parquet out: encoded on several threads, written to a temporary file, renamed into place when complete."""
from __future__ import annotations

import os
import stat
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from ..core.errors import InputError
from . import atomic, parquet_footer

#: Parquet codecs a candidates file may be compressed with. The pairs are mostly random bits (ids spread over the
#: catalogue, float32 scores), so codecs gain little: on 10^7 pairs, snappy and lz4 save ~27% of the bytes at half the
#: encoding speed, zstd (level 1) ~40% at a third.
COMPRESSIONS = ("none", "snappy", "lz4", "zstd")
DEFAULT_COMPRESSION = "snappy"
#: Tables encoded at once by default (at most the number of CPUs). One thread encodes ~5·10^7 pairs/s with snappy
#: (~10^8 uncompressed); four keep ahead of a GPU at k = 1000 and leave cores to the reader and the searcher.
ENCODE_THREADS = 4
#: Rows of a table below which it is encoded whole; above, in up to ``threads`` row groups of at least this many.
_SPLIT_ROWS = 4096
#: Bytes appended between two flushes to disk (fdatasync), so that the fsync at the end has little left to do (16 MiB
#: at 1 GB/s is 16 ms) and the rest of the file went out while the search ran.
_SYNC_BYTES = 16 << 20


def candidates_schema(user_id_type: pa.DataType = pa.int64(), item_id_type: pa.DataType = pa.int64()) -> pa.Schema:
    """The candidates table: ``user_id``, ``item_ids`` list<item id type>, ``scores`` list<float32>, best first."""
    return pa.schema([
        pa.field("user_id", user_id_type),
        pa.field("item_ids", pa.list_(item_id_type)),
        pa.field("scores", pa.list_(pa.float32())),
    ])


def check_output_path(out_path: str | os.PathLike, inputs: tuple[Any, ...] = ()) -> Path:
    """Check that a file can be created at ``out_path`` without touching any input.

    Parameters
    ----------
    out_path : str or PathLike
    inputs : tuple of paths
        Files being read: writing over one of them would destroy it (the rename happens while it may still be
        needed, or leaves the user without their input), so that is refused.

    Returns
    -------
    Path
        ``out_path``, absolute.

    Raises
    ------
    InputError
        The path is empty, ``-``, ends with ``/``, is a directory, an unresolvable link (a loop, a dangling link) or an
        input; the directory does not exist or is not writable.
    """
    text = os.fspath(out_path)
    if text in ("", "-"):
        raise InputError(f"{text!r}: expected the path of the output Parquet file (writing to stdout is not "
                         f"supported)")
    if text.endswith(("/", os.sep)):
        raise InputError(f"{text}: names a directory (it ends with '/'), expected the path of the output Parquet "
                         f"file, e.g. {text}candidates.parquet")
    out = Path(out_path).absolute()
    try:
        st = out.stat()
    except FileNotFoundError:
        st = None
        if out.is_symlink():
            raise InputError(f"{out_path}: is a symbolic link to {os.readlink(out)}, which does not exist") from None
    except OSError as exc:
        raise InputError(f"{out_path}: cannot be used as the output: {exc.strerror or exc}") from exc
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise InputError(f"{out_path}: is a directory, expected the path of the output Parquet file")
    if not out.parent.is_dir():
        raise InputError(f"{out_path}: the directory {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise InputError(f"{out_path}: the directory {out.parent} is not writable")
    for inp in inputs:
        if inp is not None and Path(inp).exists() and out.exists() and os.path.samefile(out, inp):
            raise InputError(f"{out_path}: is also an input file ({inp}); choose another output path")
    return out


class CandidateWriter:
    """Write candidate tables to ``out_path`` atomically: the path holds either the old file or the complete new one.

    Each table given to :meth:`write` becomes a row group (or several, beyond pyarrow's 1,048,576 rows), encoded on a
    pool of threads into memory and appended in order; pyarrow encodes one file on one thread, so the row groups are
    encoded as separate small files and laid end to end with a merged footer (:mod:`recall.io.parquet_footer`). The
    file is byte for byte what one ``pq.ParquetWriter`` given the same (non-empty) tables would write.

    The bytes go to ``.{name}.tmp-{pid}`` in the same directory (so the final ``os.replace`` is a rename within one
    file system, atomic on POSIX), flushed to disk as they grow; on a clean exit the footer is written, the file
    fsynced, renamed into place and the directory entry fsynced. On an exception the temporary file is removed; after a
    kill it may remain, but the output path never holds a partial file; the writer holds an ``flock`` on it while it
    writes, so that :func:`recall.io.atomic.stale_temporaries` can tell it from the leftover of a dead process.
    Every page carries a CRC-32 checksum (``write_page_checksum``), so a reader that verifies them (recall does) finds
    a page damaged on disk or in transit.

    Item ids and scores are written without dictionary encoding or statistics: they hardly repeat, and hashing or
    scanning 10^8 values to find that out cost more than the rest of the encoding. ``user_id`` keeps its min/max
    statistics, so that readers can skip row groups by user.

    Parameters
    ----------
    out_path : str or PathLike
    user_id_type, item_id_type : pa.DataType
        ``pa.int64()`` or ``pa.string()``: the types of the users' and the items' ids.
    compression : {"none", "snappy", "lz4", "zstd"}
        Parquet compression codec (zstd at level 1).
    threads : int, optional
        Tables encoded at once, >= 1; default min(:data:`ENCODE_THREADS`, CPUs). It bounds memory too: :meth:`write`
        returns once its table is queued, unless ``threads`` tables are already waiting to be appended; then it
        appends the oldest first.

    Raises
    ------
    InputError
        An unknown compression or a bad thread count; on entering, if the output cannot be created (see
        :func:`check_output_path`).

    Examples
    --------
    >>> with CandidateWriter("out.parquet") as writer:          # doctest: +SKIP
    ...     writer.write(result.to_arrow(user_ids))
    """

    def __init__(self, out_path: str | os.PathLike, user_id_type: pa.DataType = pa.int64(),
                 item_id_type: pa.DataType = pa.int64(), compression: str = DEFAULT_COMPRESSION,
                 threads: int | None = None) -> None:
        self.compression = check_compression(compression)
        if threads is None:
            threads = min(ENCODE_THREADS, os.cpu_count() or 1)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise InputError(f"threads must be an integer >= 1, got {threads!r}")
        self.threads = threads
        self.out_path = Path(out_path).absolute()
        self.schema = candidates_schema(user_id_type, item_id_type)
        self.tmp_path = atomic.temporary_path(self.out_path)
        self.rows_written = 0
        self._options: dict[str, Any] = {
            "compression": compression, "compression_level": 1 if compression == "zstd" else None,
            "use_dictionary": False, "write_statistics": ["user_id"], "memory_pool": _encoding_pool(),
            "write_page_checksum": True,
        }
        self._file: BinaryIO | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[Future] = deque()
        self._template: list[parquet_footer.Field] = []
        self._groups: list[list[parquet_footer.Field]] = []
        self._file_rows = 0
        self._unsynced = 0

    def open(self) -> "CandidateWriter":
        """Create the temporary file. Called by ``__enter__``."""
        check_output_path(self.out_path)
        # The footer of a file with no row groups: the schema and writer options every part shares.
        _, self._template = parquet_footer.split_file(_encode(None, self.schema, self._options))
        import fcntl

        # Whatever stops the opening once the file exists (a SIGTERM raised in the middle, ``raising_signals``)
        # removes it: ``__exit__`` runs only once ``__enter__`` has returned (a CI run of the SIGTERM test of
        # tests/jobs/test_executors.py found a worker's file left so, 2026-12-07).
        try:
            try:
                self._file = open(self.tmp_path, "wb")
            except OSError as exc:
                if exc.errno in atomic.PATH_ERRNOS:  # the path given cannot take a file: the caller's to change
                    raise InputError(f"{self.out_path}: cannot create {self.tmp_path.name}: "
                                     f"{exc.strerror or exc}") from exc
                raise atomic.with_path(exc, self.out_path, f"cannot create {self.tmp_path.name}") from exc  # disk full
            # Blocking: a process looking for leftovers may hold it for a moment (it then sees our pid alive).
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
            self._write(parquet_footer.MAGIC)
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="recall-parquet")
        except BaseException:
            self.abort()
            raise
        return self

    def write(self, table: pa.Table) -> None:
        """Queue ``table`` (``SearchResult.to_arrow`` output) to be encoded and appended, after the tables before it.

        Raises
        ------
        InputError
            If the table's columns cannot be cast to the candidates schema (e.g. string ids into an int64 file).
        """
        if self._file is None:
            raise RuntimeError("CandidateWriter.write called outside 'with' (or after commit/abort)")
        if table.schema != self.schema:
            try:
                table = table.select(self.schema.names).cast(self.schema)
            except (pa.ArrowException, KeyError, ValueError) as exc:
                raise InputError(f"{self.out_path}: a result table does not fit the schema {self.schema}: {exc}") \
                    from exc
        if table.num_rows == 0:
            return  # no row group: pyarrow would write an empty one, whose positions do not survive the move
        # A large table is encoded in slices (row groups) on all threads at once: the last table of a job then takes
        # a fraction of the time to reach the file after the last search.
        pieces = max(1, min(self.threads, table.num_rows // _SPLIT_ROWS))
        step = -(-table.num_rows // pieces)
        for start in range(0, table.num_rows, step):
            self._pending.append(self._pool.submit(_encode, table.slice(start, step), self.schema, self._options))
        self.rows_written += table.num_rows
        # Append every table already encoded (in order), and wait only when all threads are busy: what reaches the
        # file (and the disk) early is not left for commit() to do after the last search.
        while self._pending and (len(self._pending) > self.threads or self._pending[0].done()):
            self._append(self._pending.popleft().result())

    def _append(self, encoded: pa.Buffer) -> None:
        """Copy one encoded file's column chunks to the end of ours and keep its row groups, shifted to match."""
        data, meta = parquet_footer.split_file(encoded)
        # Its chunks start at position 4 (after PAR1) of its own file, here at the current end of ours.
        delta = self._file.tell() - len(parquet_footer.MAGIC)
        for group in parquet_footer.row_groups(meta):
            self._groups.append(parquet_footer.move_row_group(group, delta, len(self._groups)))
        self._file_rows += parquet_footer.num_rows(meta)
        self._write(data)
        self._unsynced += len(data)
        if self._unsynced >= _SYNC_BYTES:
            # Flush as we go: the fsync of commit() then waits for the last few batches, not the whole file.
            try:
                self._file.flush()
                os.fdatasync(self._file.fileno())
            except OSError as exc:
                raise self._os_error(exc) from exc
            self._unsynced = 0

    def _write(self, data: bytes | pa.Buffer) -> None:
        try:
            self._file.write(data)
        except OSError as exc:
            raise self._os_error(exc) from exc

    def _os_error(self, exc: OSError) -> OSError:
        """A failed write, flush or fsync (disk full, quota, I/O error) as an OSError naming the output."""
        return atomic.with_path(exc, self.out_path, "cannot write", "the file at this path, if any, is as it was")

    def commit(self) -> None:
        """Append what is still being encoded, write the footer, fsync and rename the temporary file to ``out_path``."""
        if self._file is None:
            raise RuntimeError("CandidateWriter.commit called before open (or twice)")
        try:
            while self._pending:
                self._append(self._pending.popleft().result())
            self._write(parquet_footer.footer(self._template, self._groups, self._file_rows))
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._close()
            except OSError as exc:
                raise self._os_error(exc) from exc
            atomic.replace(self.tmp_path, self.out_path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop everything written so far; ``out_path`` is left as it was."""
        self._pending.clear()
        try:
            self._close()
        except OSError:  # closing a half-written file can fail (disk full); removing it is what matters
            pass
        atomic.remove(self.tmp_path)

    def _close(self) -> None:
        if self._pool is not None:
            # Queued encodings are cancelled, running ones finish (the pool's threads must not outlive the writer).
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        file, self._file = self._file, None
        if file is not None:
            file.close()

    def __enter__(self) -> "CandidateWriter":
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def check_compression(compression: Any) -> str:
    """``compression`` if it is one of :data:`COMPRESSIONS`, else InputError naming them."""
    if compression not in COMPRESSIONS:
        raise InputError(f"unknown compression {compression!r}: expected one of {', '.join(COMPRESSIONS)}")
    return compression


def _encoding_pool() -> pa.MemoryPool:
    """The memory pool encodings allocate from: jemalloc where pyarrow has it. It keeps freed pages for the next
    batch, where mimalloc (pyarrow's default on Linux) returns the tens of MiB of each encoded batch to the system and
    the next batch pays for fresh zeroed pages (about 6% of the CPU of a 10^8-pair job, measured)."""
    try:
        return pa.jemalloc_memory_pool()
    except NotImplementedError:
        return pa.default_memory_pool()


def _encode(table: pa.Table | None, schema: pa.Schema, options: dict[str, Any]) -> pa.Buffer:
    """``table`` as a whole Parquet file in memory (no row groups for None); runs on the pool, GIL released."""
    sink = pa.BufferOutputStream(memory_pool=options["memory_pool"])
    with pq.ParquetWriter(sink, schema, **options) as writer:
        if table is not None:
            writer.write_table(table)
    return sink.getvalue()
