"""Candidates Parquet out: written incrementally to a temporary file, renamed into place only when complete."""
from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import InputError


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
        The directory does not exist or is not writable, the path is a directory, or it names an input.
    """
    out = Path(out_path).absolute()
    if out.is_dir():
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

    Tables go to ``.{name}.tmp-{pid}`` in the same directory (so the final ``os.replace`` is a rename within one file
    system, atomic on POSIX); on a clean exit the file is flushed to disk (fsync), renamed into place and the
    directory entry fsynced. On an exception the temporary file is removed; after a kill it may remain, but the
    output path never holds a partial file.

    Parameters
    ----------
    out_path : str or PathLike
    user_id_type, item_id_type : pa.DataType
        ``pa.int64()`` or ``pa.string()``: the types of the users' and the items' ids.
    compression : str
        Parquet compression codec.

    Raises
    ------
    InputError
        On entering, if the output cannot be created (see :func:`check_output_path`).

    Examples
    --------
    >>> with CandidateWriter("out.parquet") as writer:          # doctest: +SKIP
    ...     writer.write(result.to_arrow(user_ids))
    """

    def __init__(self, out_path: str | os.PathLike, user_id_type: pa.DataType = pa.int64(),
                 item_id_type: pa.DataType = pa.int64(), compression: str = "snappy") -> None:
        self.out_path = Path(out_path).absolute()
        self.schema = candidates_schema(user_id_type, item_id_type)
        self.tmp_path = self.out_path.with_name(f".{self.out_path.name}.tmp-{os.getpid()}")
        self.compression = compression
        self.rows_written = 0
        self._writer: pq.ParquetWriter | None = None
        self._done = False

    def open(self) -> "CandidateWriter":
        """Create the temporary file. Called by ``__enter__``."""
        check_output_path(self.out_path)
        try:
            self._writer = pq.ParquetWriter(str(self.tmp_path), self.schema, compression=self.compression)
        except OSError as exc:
            raise InputError(f"{self.out_path}: cannot create {self.tmp_path.name}: {exc}") from exc
        return self

    def write(self, table: pa.Table) -> None:
        """Append ``table`` (``SearchResult.to_arrow`` output) as one or more row groups.

        Raises
        ------
        InputError
            If the table's columns cannot be cast to the candidates schema (e.g. string ids into an int64 file).
        """
        if self._writer is None:
            raise RuntimeError("CandidateWriter.write called outside 'with' (or after commit/abort)")
        if table.schema != self.schema:
            try:
                table = table.select(self.schema.names).cast(self.schema)
            except (pa.ArrowException, KeyError, ValueError) as exc:
                raise InputError(f"{self.out_path}: a result table does not fit the schema {self.schema}: {exc}") \
                    from exc
        self._writer.write_table(table)
        self.rows_written += table.num_rows

    def commit(self) -> None:
        """Close, fsync and rename the temporary file to ``out_path``."""
        if self._writer is None:
            raise RuntimeError("CandidateWriter.commit called before open (or twice)")
        writer, self._writer = self._writer, None
        try:
            writer.close()
            fd = os.open(self.tmp_path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self.tmp_path, self.out_path)
        except BaseException:
            self._remove_tmp()
            raise
        self._fsync_dir()
        self._done = True

    def abort(self) -> None:
        """Drop everything written so far; ``out_path`` is left as it was."""
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:  # closing a half-written file can fail (disk full); removing it is what matters
                pass
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        try:
            self.tmp_path.unlink()
        except FileNotFoundError:
            pass

    def _fsync_dir(self) -> None:
        # The rename is only durable once the directory entry is on disk.
        fsync_dir(self.out_path.parent)

    def __enter__(self) -> "CandidateWriter":
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def fsync_dir(path: os.PathLike | str) -> None:
    """Flush a directory's entries (a rename into it) to disk; a no-op where the platform cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
