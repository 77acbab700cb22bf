"""Parquet primitives every reader shares: opening files with clear errors, batch iteration, ids and their types.

Every check is vectorised (NumPy / Arrow compute over a whole batch): a file of tens of millions of rows must
validate at the speed it is read, so nothing walks the rows in Python. Every error is an ``InputError`` whose message
names the file, the row (counted from 0 over the whole file, whatever the row group) and, where there is one, the id.
"""
from __future__ import annotations

import os
import re
import stat
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from numba import njit

from ..core.errors import InputError, one_line

#: Rows per Arrow batch when reading a whole file: large enough to amortise per-batch overhead, small enough that
#: the transient float64 copy of a batch stays in the tens of megabytes.
READ_BATCH_ROWS = 65_536

INT64_MAX = np.iinfo(np.int64).max


def fmt_id(value: Any) -> str:
    """An id as it should read in a message: 42, or 'u42' for strings (never ``np.int64(42)``)."""
    if isinstance(value, (np.integer, int)):
        return str(int(value))
    return repr(str(value)) if isinstance(value, (str, np.str_)) else repr(value)

def at(path: str, row: int, ids: Any = None, pos: int | None = None) -> str:
    """``"{path}: row {row} (id {id})"``, the prefix of every per-row message."""
    if ids is None or pos is None:
        return f"{path}: row {row}"
    return f"{path}: row {row} (id {fmt_id(ids[pos])})"


#: Bytes of a column chunk a read holds at once (pyarrow's ``buffer_size``): its pages are read as they are decoded,
#: not the whole chunk first (pyarrow 26 pre-buffers every row group of a read unless told not to: a 1M x 64 item
#: file's read peaked at 835 MiB, against 614 MiB streamed, in the same 0.45 s).
STREAM_BUFFER = 8 << 20


def open_parquet(path: str | os.PathLike, what: str = "data") -> pq.ParquetFile:
    """Open a Parquet file for reading, turning every way that can fail into one clear ``InputError``.

    Every page that carries a checksum (CRC-32 in its header, as written with pyarrow's ``write_page_checksum=True``,
    parquet-mr's ``parquet.page.write-checksum.enabled``, and by every recall output) is verified as it is read:
    a page damaged on disk or in transit is then an error (see :func:`iter_batches`), not wrong vectors. Pages
    without a checksum cannot be verified; damage to their values goes unnoticed unless it breaks their decoding.

    Parameters
    ----------
    path : str or PathLike
    what : str
        What the file holds ("embeddings", "exclusions"), for messages.

    Raises
    ------
    InputError
        The path does not exist (or is a dangling symbolic link), is a directory, cannot be resolved (a loop of
        symbolic links, a name too long) or read, or is not a (complete) Parquet file.
    """
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        if p.is_symlink():
            raise InputError(f"{path}: is a symbolic link to {os.readlink(p)}, which does not exist") from None
        raise InputError(f"{path}: no such file") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot open the {what} file: {exc.strerror or exc}") from exc
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"{path}: is a directory, expected a Parquet file of {what}")
    try:
        with open(p, "rb"):
            pass
    except OSError as exc:
        raise InputError(f"{path}: cannot read the {what} file: {exc.strerror or exc}") from exc
    try:
        return pq.ParquetFile(str(p), pre_buffer=False, buffer_size=STREAM_BUFFER, page_checksum_verification=True)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise InputError(f"{path}: not a Parquet file, or truncated: {exc}") from exc

def iter_batches(pf: pq.ParquetFile, path: str, columns: list[str], batch_size: int,
                 row_groups: list[int] | None = None) -> Iterator[pa.RecordBatch]:
    """``pf.iter_batches`` with damaged data reported as ``InputError`` naming the file and the row group: a page
    whose checksum does not match, or that does not decode (corrupt compressed bytes, truncated pages, wrong
    lengths). ``row_groups``: only these consecutive row groups (default: all)."""
    it = pf.iter_batches(batch_size=batch_size, columns=columns, use_threads=True, row_groups=row_groups)
    row = int(row_group_starts(pf)[row_groups[0]]) if row_groups else 0
    while True:
        try:
            batch = next(it)
        except StopIteration:
            # Arrow's allocator keeps the pages of the batches decoded and let go (mimalloc: 140 MiB after reading
            # 1M x 64 items, docs/benchmarks.md) for the process's next allocations; a job's next ones are NumPy's.
            pa.default_memory_pool().release_unused()
            return
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise InputError(damaged(pf, path, columns, row, exc)) from exc
        row += batch.num_rows
        yield batch


def row_group_starts(pf: pq.ParquetFile) -> np.ndarray:
    """(n_row_groups + 1,) int64: the first row of each row group, then the number of rows."""
    md = pf.metadata
    return np.cumsum([0] + [md.row_group(i).num_rows for i in range(md.num_row_groups)], dtype=np.int64)


def damaged(pf: pq.ParquetFile, path: str, columns: list[str], row: int, exc: BaseException) -> str:
    """The message for a read that failed after ``row`` good rows: which row group is damaged (found by reading
    the row groups from the one holding ``row`` on, one at a time, until one fails) and how."""
    md = pf.metadata
    starts = row_group_starts(pf)
    first = max(0, int(np.searchsorted(starts, row, side="right")) - 1)
    group, reason = None, one_line(exc)
    for i in range(first, md.num_row_groups):
        try:
            pf.read_row_group(i, columns=columns, use_threads=False)
        except (pa.ArrowException, OSError, ValueError) as err:
            group, reason = i, one_line(err)
            break
    kind = "a page checksum does not match" if "checksum" in reason.lower() or "crc" in reason.lower() else \
        "its data does not decode"
    if group is None:
        return f"{path}: unreadable data after row {row} (corrupt or truncated file): {reason}"
    return (f"{path}: row group {group} (rows {int(starts[group])}-{int(starts[group + 1]) - 1}) is damaged: {kind} "
            f"({reason})")

def prefetched(batches: Iterator[pa.RecordBatch], depth: int = 2) -> Iterator[pa.RecordBatch]:
    """``batches``, the next ``depth`` decoded on a thread while the caller converts this one (pyarrow and NumPy
    both release the GIL): a whole-file read then takes about the longer of the two instead of their sum."""
    with ThreadPoolExecutor(1, thread_name_prefix="recall-decode") as pool:
        it = iter(batches)
        ahead = deque(pool.submit(next, it, None) for _ in range(depth))
        while True:
            batch = ahead.popleft().result()
            if batch is None:
                return
            ahead.append(pool.submit(next, it, None))
            yield batch

def column_names(schema: pa.Schema) -> str:
    return ", ".join(repr(n) for n in schema.names) or "(none)"


def has_column(schema: pa.Schema, path: str, col: str) -> bool:
    """Whether the file has a column named ``col``; InputError where it has several (pyarrow would read them all,
    and which one a reader took would be anyone's guess)."""
    found = schema.get_all_field_indices(col)
    if len(found) > 1:
        raise InputError(f"{path}: {len(found)} columns are named {col!r} (the columns are {column_names(schema)}); "
                         f"expected one")
    return bool(found)


def is_text(t: pa.DataType) -> bool:
    """Whether ids of Arrow type ``t`` are strings: UTF-8 string types, and binary ones (a STRING column as Impala
    and older Hive write it, without the UTF-8 annotation; read as text, every value checked to be UTF-8)."""
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
            or pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t))


def as_text(col: pa.Array) -> pa.Array:
    """A column of a text type (:func:`is_text`) as Arrow strings: binary values taken as they are (not checked:
    see :func:`first_invalid_utf8`)."""
    if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type) or pa.types.is_binary_view(col.type):
        return col.cast(pa.binary()).view(pa.string())
    return col.cast(pa.string())


def id_type_of(path: str, col: str, t: pa.DataType) -> pa.DataType:
    """The type ids of Arrow type ``t`` are returned as: int64 or string. InputError for anything else."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_integer(t):
        return pa.int64()
    if is_text(t):
        return pa.string()
    raise InputError(f"{path}: id column {col!r} has type {t}, expected integers or strings")

def first_true(mask: np.ndarray) -> int:
    return int(np.argmax(mask))

def ids_from_arrow(path: str, col: pa.Array, row0: int) -> np.ndarray:
    """A batch's id column as int64 or object (str), with nulls and out-of-range integers rejected."""
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    if col.null_count:
        pos = first_true(col.is_null().to_numpy(zero_copy_only=False))
        raise InputError(f"{at(path, row0 + pos)} has a null id")
    if pa.types.is_integer(col.type):
        ids = col.to_numpy()
        if ids.dtype == np.uint64 and ids.size and ids.max() > INT64_MAX:
            pos = first_true(ids > INT64_MAX)
            raise InputError(f"{at(path, row0 + pos)} has id {int(ids[pos])}, beyond the int64 range")
        return ids.astype(np.int64, copy=False)
    col = as_text(col)
    bad = first_invalid_utf8(col)
    if bad is not None:
        raise InputError(f"{at(path, row0 + bad)} has an id that is not valid UTF-8 "
                         f"({col.cast(pa.binary())[bad].as_py()!r}): string ids must be UTF-8 text")
    return col.to_numpy(zero_copy_only=False).astype(object, copy=False)

def first_invalid_utf8(col: pa.Array) -> int | None:
    """The position of the first string of ``col`` that is not valid UTF-8 (a STRING column as Hive or Spark may write
    it, with Latin-1 bytes), or None where every one is."""
    try:
        col.validate(full=True)
        return None
    except pa.ArrowInvalid as exc:
        found = re.search(r"string index (\d+)", str(exc))
        if found is not None:
            return int(found.group(1))
    for pos, raw in enumerate(col.cast(pa.binary()).to_pylist()):  # the message named no position: look for it
        if raw is not None and not is_utf8(raw):
            return pos
    return None

def is_utf8(raw: bytes) -> bool:
    """Whether ``raw`` decodes as UTF-8."""
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False

def flatten_id_lists(path: str, lists: pa.Array, row0: int) -> tuple[pa.Array, np.ndarray]:
    """A column of item-id lists (rows ``row0`` on of ``path``) as (flat ids, list lengths); InputError naming the
    row of a null inside a list."""
    lengths = np.diff(lists.offsets.to_numpy()) if not pa.types.is_fixed_size_list(lists.type) else \
        np.full(len(lists), lists.type.list_size, np.int64)
    flat = lists.flatten()
    if flat.null_count:
        pos = first_true(flat.is_null().to_numpy(zero_copy_only=False))
        list_row = int(np.searchsorted(np.cumsum(lengths), pos, side="right"))
        raise InputError(f"{path}: row {row0 + list_row} has a null inside its item_ids list")
    return flat, lengths

#: Integer ids spanning at most this many times their count (plus a little) are looked up in a table indexed by the
#: id itself: one gather per value, several times faster than hashing (warehouse ids are often such ranges).
DENSE_SPAN = 8


def lookup(values: pa.Array | pa.ChunkedArray, ids: np.ndarray, dtype: Any = np.int64) -> np.ndarray:
    """Row position of each value in ``ids``, -1 where absent, as ``dtype``: a table indexed by the id where integer
    ids are dense (one compiled pass over the values, chunk by chunk, no temporaries), else a hash lookup in Arrow
    (no Python loop either way)."""
    if ids.dtype != object and ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        span = hi - lo + 1
        if span <= DENSE_SPAN * ids.size + 1024:
            table = np.full(span, -1, dtype)
            table[ids - lo] = np.arange(ids.size, dtype=dtype)
            chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
            out = np.empty(len(values), dtype)
            at = 0
            for chunk in chunks:
                n = len(chunk)
                _table_lookup(chunk.to_numpy(zero_copy_only=False).astype(np.int64, copy=False), lo, table,
                              out[at:at + n])
                at += n
            return out
    value_set = pa.array(ids, type=pa.string() if ids.dtype == object else pa.int64())
    pos = pc.index_in(values, value_set=value_set).fill_null(-1)
    if isinstance(pos, pa.ChunkedArray):
        return np.asarray(pos.to_numpy(), dtype=dtype) if pos.num_chunks else np.zeros(0, dtype)
    return pos.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


@njit(nogil=True, cache=True)
def _table_lookup(values, lo, table, out):
    """``out[i] = table[values[i] - lo]``, -1 outside the table. A difference that wraps cannot land inside it: the
    table spans ids from ``lo`` to at most int64's largest."""
    span = table.size
    for i in range(values.size):
        off = values[i] - lo
        out[i] = table[off] if 0 <= off < span else -1


def match_type(path: str, col: str, values: pa.Array, ids: np.ndarray, whose: str, row0: int = 0) -> pa.Array:
    """``values`` cast to the type of ``ids`` (int64 or string); InputError when integer meets string."""
    t = values.type
    if pa.types.is_dictionary(t):
        values, t = values.dictionary_decode(), t.value_type
    want_str = ids.dtype == object
    if want_str and is_text(t):
        return as_text(values)
    if not want_str and pa.types.is_integer(t):
        if pa.types.is_uint64(t):
            big = pc.greater(values, pa.scalar(INT64_MAX, pa.uint64())).to_numpy(zero_copy_only=False)
            if big.any():
                pos = first_true(big)
                raise InputError(f"{path}: row {row0 + pos} has {col} {values[pos].as_py()}, beyond the int64 range")
        return values.cast(pa.int64())
    kind = "strings" if want_str else "integers"
    raise InputError(f"{path}: column {col!r} has type {t}, but the {whose} ids are {kind}")
