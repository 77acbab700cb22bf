"""Parquet -> arrays: embeddings and exclusions, read row group by row group and validated on the way in.

Every check here is vectorised (NumPy / Arrow compute over a whole batch): a file of tens of millions of rows must
validate at the speed it is read, so nothing walks the rows in Python. Every error is an ``InputError`` whose message
names the file, the row (counted from 0 over the whole file, whatever the row group) and, where there is one, the id.
"""
from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import InputError

#: Rows per Arrow batch when reading a whole file: large enough to amortise per-batch overhead, small enough that
#: the transient float64 copy of a batch stays in the tens of megabytes.
READ_BATCH_ROWS = 65_536

_INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Embeddings:
    """Ids and vectors read from an embedding Parquet file.

    Attributes
    ----------
    ids : np.ndarray, shape (n,)
        int64 for integer id columns; object (Python ``str``) for string id columns.
    vectors : np.ndarray of float32, shape (n, dim)
        C-contiguous, on the host (on the device for :func:`read_embeddings` given ``device_out``).
    row_start : int
        Row number, in the file, of the first row here: 0 for a whole file, the batch's offset for the batches of
        :func:`iter_embedding_batches`.
    """

    ids: np.ndarray
    vectors: np.ndarray
    row_start: int = 0

    def __len__(self) -> int:
        return int(self.vectors.shape[0])

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])


@dataclass(frozen=True)
class EmbeddingFileInfo:
    """What the footer and schema of an embedding file say, before any row is read.

    Attributes
    ----------
    path : str
    n_rows : int
    n_row_groups : int
    id_type : pa.DataType
        ``pa.int64()`` or ``pa.string()``: the type the ids are returned (and written back) as.
    dim : int or None
        The vector dimension when the column is a fixed-size list; None for variable-size lists, whose dimension is
        set by the first row.
    """

    path: str
    n_rows: int
    n_row_groups: int
    id_type: pa.DataType
    dim: int | None


# --------------------------------------------------------------------------------------------------------------------
# Opening files


def _fmt_id(value: Any) -> str:
    """An id as it should read in a message: 42, or 'u42' for strings (never ``np.int64(42)``)."""
    if isinstance(value, (np.integer, int)):
        return str(int(value))
    return repr(str(value)) if isinstance(value, (str, np.str_)) else repr(value)


def _at(path: str, row: int, ids: Any = None, pos: int | None = None) -> str:
    """``"{path}: row {row} (id {id})"``, the prefix of every per-row message."""
    if ids is None or pos is None:
        return f"{path}: row {row}"
    return f"{path}: row {row} (id {_fmt_id(ids[pos])})"


def open_parquet(path: str | os.PathLike, what: str = "data", whole: bool = False) -> pq.ParquetFile:
    """Open a Parquet file for reading, turning every way that can fail into one clear ``InputError``.

    Parameters
    ----------
    path : str or PathLike
    what : str
        What the file holds ("embeddings", "exclusions"), for messages.
    whole : bool
        The file will be read whole: each row group's column chunks are then read in a few large requests before
        they are decoded (pyarrow's ``pre_buffer``; 1M x 64 float32 embeddings decoded in 0.23 s instead of 0.32 s
        on the development machine), at the cost of holding a row group's compressed bytes at once.

    Raises
    ------
    InputError
        The path does not exist, is a directory, cannot be read, or is not a (complete) Parquet file.
    """
    p = Path(path)
    if not p.exists():
        raise InputError(f"{path}: no such file")
    if p.is_dir():
        raise InputError(f"{path}: is a directory, expected a Parquet file of {what}")
    try:
        with open(p, "rb"):
            pass
    except OSError as exc:
        raise InputError(f"{path}: cannot read the {what} file: {exc.strerror or exc}") from exc
    try:
        return pq.ParquetFile(str(p), pre_buffer=whole)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise InputError(f"{path}: not a Parquet file, or truncated: {exc}") from exc


def _iter_batches(pf: pq.ParquetFile, path: str, columns: list[str], batch_size: int) -> Iterator[pa.RecordBatch]:
    """``pf.iter_batches`` with corrupt or truncated data pages reported as ``InputError`` naming the file."""
    it = pf.iter_batches(batch_size=batch_size, columns=columns, use_threads=True)
    row = 0
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise InputError(f"{path}: unreadable data after row {row} (corrupt or truncated file): {exc}") from exc
        row += batch.num_rows
        yield batch


def _prefetched(batches: Iterator[pa.RecordBatch], depth: int = 2) -> Iterator[pa.RecordBatch]:
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


def _column_names(schema: pa.Schema) -> str:
    return ", ".join(repr(n) for n in schema.names) or "(none)"


def _id_type(path: str, col: str, t: pa.DataType) -> pa.DataType:
    """The type ids of Arrow type ``t`` are returned as: int64 or string. InputError for anything else."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_integer(t):
        return pa.int64()
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    raise InputError(f"{path}: id column {col!r} has type {t}, expected integers or strings")


def _check_columns(pf: pq.ParquetFile, path: str, id_col: str, vec_col: str) -> tuple[pa.DataType, int | None]:
    schema = pf.schema_arrow
    for col, role, option in ((id_col, "id", "--id-col"), (vec_col, "vector", "--vec-col")):
        if schema.get_field_index(col) < 0:
            raise InputError(
                f"{path}: no {role} column {col!r}; the columns are {_column_names(schema)} "
                f"(choose another with {option})"
            )
    id_type = _id_type(path, id_col, schema.field(id_col).type)
    vt = schema.field(vec_col).type
    ok_list = pa.types.is_fixed_size_list(vt) or pa.types.is_list(vt) or pa.types.is_large_list(vt)
    if not ok_list or not pa.types.is_floating(vt.value_type):
        raise InputError(
            f"{path}: vector column {vec_col!r} has type {vt}, expected fixed_size_list<float32>[dim] or "
            f"list<float32|float64>"
        )
    dim = vt.list_size if pa.types.is_fixed_size_list(vt) else None
    if dim == 0:
        raise InputError(f"{path}: vector column {vec_col!r} has dimension 0")
    return id_type, dim


def inspect_embeddings(path: str | os.PathLike, id_col: str = "id", vec_col: str = "embedding") -> EmbeddingFileInfo:
    """Open an embedding file and check its schema without reading its rows.

    Lets a caller reject a bad file (missing column, wrong type, not Parquet) before spending time on other work.

    Raises
    ------
    InputError
        Unreadable or not Parquet; ``id_col`` or ``vec_col`` missing (the message lists the columns there are);
        a column of the wrong type.
    """
    path = os.fspath(path)
    pf = open_parquet(path, "embeddings")
    id_type, dim = _check_columns(pf, path, id_col, vec_col)
    return EmbeddingFileInfo(path, pf.metadata.num_rows, pf.metadata.num_row_groups, id_type, dim)


# --------------------------------------------------------------------------------------------------------------------
# Converting one batch


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def _ids_from_arrow(path: str, col: pa.Array, row0: int) -> np.ndarray:
    """A batch's id column as int64 or object (str), with nulls and out-of-range integers rejected."""
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    if col.null_count:
        pos = _first(col.is_null().to_numpy(zero_copy_only=False))
        raise InputError(f"{_at(path, row0 + pos)} has a null id")
    if pa.types.is_integer(col.type):
        ids = col.to_numpy()
        if ids.dtype == np.uint64 and ids.size and ids.max() > _INT64_MAX:
            pos = _first(ids > _INT64_MAX)
            raise InputError(f"{_at(path, row0 + pos)} has id {int(ids[pos])}, beyond the int64 range")
        return ids.astype(np.int64, copy=False)
    return col.to_numpy(zero_copy_only=False).astype(object, copy=False)


def _vectors_from_arrow(path: str, col: pa.Array, ids: np.ndarray, row0: int, dim: int | None,
                        dim_source: str | None) -> np.ndarray:
    """A batch's vector column as an (n, dim) array of its own float dtype (a view where Arrow allows).

    ``dim`` is the dimension every row must have (None: the batch's first row sets it).
    """
    n = len(col)
    if col.null_count:
        pos = _first(col.is_null().to_numpy(zero_copy_only=False))
        raise InputError(f"{_at(path, row0 + pos, ids, pos)} has a null vector")
    if pa.types.is_fixed_size_list(col.type):
        got = col.type.list_size
        lengths = None
    else:
        offsets = col.offsets.to_numpy()
        lengths = np.diff(offsets)
        got = int(lengths[0]) if n else (dim or 0)
    if dim is not None and got != dim:
        where = f" ({dim_source})" if dim_source else ""
        raise InputError(f"{_at(path, row0, ids, 0)} has dimension {got}, expected {dim}{where}")
    if n and got == 0:
        raise InputError(f"{_at(path, row0, ids, 0)} has an empty vector (dimension 0)")
    if lengths is not None and n:
        bad = lengths != got
        if bad.any():
            pos = _first(bad)
            ref = dim_source if dim is not None and dim_source else f"the length of row {row0}"
            raise InputError(
                f"{_at(path, row0 + pos, ids, pos)} has {int(lengths[pos])} values, expected {got} "
                f"(ragged vectors: every row must have {ref})"
            )
    # flatten() honours the array's slice offset, unlike .values, and there are no null lists left to skip.
    flat = col.flatten()
    if flat.null_count:
        pos = _first(flat.is_null().to_numpy(zero_copy_only=False)) // got
        raise InputError(f"{_at(path, row0 + pos, ids, pos)} has a null value inside its vector")
    vecs = flat.to_numpy(zero_copy_only=False).reshape(n, got)
    finite = np.isfinite(vecs).all(axis=1)
    if not finite.all():
        pos = _first(~finite)
        raise InputError(f"{_at(path, row0 + pos, ids, pos)} has a NaN or infinite value in its vector")
    return vecs


def _to_float32(path: str, vecs: np.ndarray, ids: np.ndarray, row0: int, out: np.ndarray | None = None) -> np.ndarray:
    """``vecs`` as float32 (into ``out`` when given), rejecting float64 values that overflow float32."""
    # Overflow to inf is expected here and reported below, with the row: no RuntimeWarning.
    with np.errstate(over="ignore"):
        if out is None:
            out = np.ascontiguousarray(vecs, dtype=np.float32)
        else:
            out[...] = vecs
    if vecs.dtype.itemsize > 4:
        finite = np.isfinite(out).all(axis=1)
        if not finite.all():
            pos = _first(~finite)
            raise InputError(f"{_at(path, row0 + pos, ids, pos)} has a value beyond the float32 range")
    return out


def _duplicate(path: str, ids: np.ndarray, what: str = "id") -> None:
    """Raise InputError naming the first duplicated id and two rows holding it."""
    if ids.size < 2:
        return
    arr = pa.array(ids, type=pa.string() if ids.dtype == object else pa.int64())
    # Arrow's sort is stable and runs in C++ for strings too, where np.argsort would compare Python objects.
    order = pc.array_sort_indices(arr).to_numpy()
    sorted_ids = ids[order]
    same = sorted_ids[1:] == sorted_ids[:-1]
    if same.any():
        j = _first(same)
        rows = sorted(order[j:j + 2].tolist())
        raise InputError(
            f"{path}: duplicate {what} {_fmt_id(sorted_ids[j])} at rows {rows[0]} and {rows[1]}; ids must be unique"
        )


# --------------------------------------------------------------------------------------------------------------------
# Public readers


def read_ids(path: str | os.PathLike, id_col: str = "id", vec_col: str | None = "embedding",
             check_unique: bool = True) -> np.ndarray:
    """Read and validate only the id column of an embedding file (cheap: Parquet is columnar).

    Used by streaming readers to check uniqueness over the whole file, and to map exclusions, before the vectors
    are read batch by batch.

    Parameters
    ----------
    path : str or PathLike
    id_col, vec_col : str
        ``vec_col`` is checked for presence and type too (None: not checked).
    check_unique : bool
        Raise on a duplicate id.

    Returns
    -------
    np.ndarray, shape (n_rows,)
        int64, or object (``str``) for string ids.

    Raises
    ------
    InputError
        Bad file or schema, a null id, an integer id beyond int64, a duplicate id.
    """
    path = os.fspath(path)
    pf = open_parquet(path, "embeddings")
    if vec_col is not None:
        _check_columns(pf, path, id_col, vec_col)
    else:
        if pf.schema_arrow.get_field_index(id_col) < 0:
            raise InputError(f"{path}: no id column {id_col!r}; the columns are {_column_names(pf.schema_arrow)}")
        _id_type(path, id_col, pf.schema_arrow.field(id_col).type)
    parts, row = [], 0
    for batch in _iter_batches(pf, path, [id_col], READ_BATCH_ROWS):
        parts.append(_ids_from_arrow(path, batch.column(0), row))
        row += batch.num_rows
    id_type = _id_type(path, id_col, pf.schema_arrow.field(id_col).type)
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int64 if id_type == pa.int64() else object)
    if check_unique:
        _duplicate(path, ids)
    return ids


def iter_embedding_batches(path: str | os.PathLike, batch_size: int = READ_BATCH_ROWS, id_col: str = "id",
                           vec_col: str = "embedding", *, dim: int | None = None, dim_source: str | None = None,
                           check_unique: bool = True) -> Iterator[Embeddings]:
    """Stream an embedding file as batches of at most ``batch_size`` rows, validated as :func:`read_embeddings`.

    Parameters
    ----------
    path : str or PathLike
    batch_size : int
        Rows per batch, >= 1 (batches may be shorter at row-group ends).
    id_col, vec_col : str
    dim : int, optional
        The dimension every vector must have (e.g. the items'); by default the first row sets it.
    dim_source : str, optional
        Where ``dim`` comes from, for the message ("the items' dimension, items.parquet").
    check_unique : bool
        Check, before the first batch, that the ids are unique over the whole file (reads the id column once);
        pass False when the caller has done so with :func:`read_ids`.

    Yields
    ------
    Embeddings
        ``ids`` (batch,), ``vectors`` (batch, dim) float32, ``row_start`` the batch's first row in the file.

    Raises
    ------
    InputError
        As :func:`read_embeddings`, with row numbers counted over the whole file. Raised lazily, when the bad
        batch is reached (except for duplicates, checked up front).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise InputError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    path = os.fspath(path)
    pf = open_parquet(path, "embeddings")
    _, fixed_dim = _check_columns(pf, path, id_col, vec_col)
    if fixed_dim is not None and dim is not None and fixed_dim != dim:
        where = f" ({dim_source})" if dim_source else ""
        raise InputError(f"{path}: vectors have dimension {fixed_dim}, expected {dim}{where}")
    if check_unique:
        read_ids(path, id_col, vec_col)
    return _stream(pf, path, int(batch_size), id_col, vec_col, dim, dim_source)


def _stream(pf: pq.ParquetFile, path: str, batch_size: int, id_col: str, vec_col: str, dim: int | None,
            dim_source: str | None) -> Iterator[Embeddings]:
    row = 0
    for batch in _iter_batches(pf, path, [id_col, vec_col], batch_size):
        ids = _ids_from_arrow(path, batch.column(0), row)
        vecs = _vectors_from_arrow(path, batch.column(1), ids, row, dim, dim_source)
        if dim is None and len(ids):
            # The file's first row fixes the dimension of every later batch.
            dim, dim_source = vecs.shape[1], f"the dimension of row 0 of {path}"
        yield Embeddings(ids, _to_float32(path, vecs, ids, row), row)
        row += batch.num_rows


def read_embeddings(path: str | os.PathLike, id_col: str = "id", vec_col: str = "embedding", *,
                    allow_empty: bool = True, device_out: Callable[[int, int], Any] | None = None,
                    on_rows: Callable[[Any, int], None] | None = None) -> Embeddings:
    """Read a whole embedding Parquet file into host arrays, row group by row group.

    Parameters
    ----------
    path : str or PathLike
        A Parquet file with an id column (integers, or strings) and a vector column
        (``fixed_size_list<float32|float64>[dim]`` or ``list<float32|float64>``, every row the same length).
    id_col, vec_col : str
        Column names.
    allow_empty : bool
        When False, a file without rows is an error (items are required; users may be none).
    device_out : callable ``(n_rows, dim) -> device array``, optional
        Where the vectors go instead of a host array (e.g. ``cupy.empty`` with float32): each decoded batch is
        uploaded into its rows as it comes, so a GPU job never assembles (nor pages in) the whole matrix on the host.
    on_rows : callable ``(vectors, rows) -> None``, optional
        Called after each batch with the vectors' array and the number of rows filled so far (and converted: a
        later batch may still turn out bad), e.g. to start work on the first rows while the rest are decoded.

    Returns
    -------
    Embeddings
        ``ids`` (n,) int64 or object (str); ``vectors`` (n, dim) float32, C-contiguous (on the device with
        ``device_out``). An empty file gives ``vectors`` of shape (0, dim) (dim 0 for a variable-size list column).

    Raises
    ------
    InputError
        Naming the file, and the row and id where there is one: missing or unreadable file, not Parquet or truncated,
        missing column (listing the columns there are), wrong column type, null id, null vector, ragged vector
        lengths, NaN/Inf, float64 values beyond float32, duplicate ids, no rows when ``allow_empty`` is False.
    """
    path = os.fspath(path)
    pf = open_parquet(path, "embeddings", whole=True)
    id_type, fixed_dim = _check_columns(pf, path, id_col, vec_col)
    n_rows = pf.metadata.num_rows
    if n_rows == 0 and not allow_empty:
        raise InputError(f"{path}: the file has no rows, at least one is required")
    out: np.ndarray | None = None
    id_parts: list[np.ndarray] = []
    row, dim = 0, fixed_dim
    # The duplicate check (a sort of every id) runs on the id column alone while the vectors are decoded: both
    # release the GIL, and the vectors are most of the time. An error in a row still comes first.
    with ThreadPoolExecutor(1, thread_name_prefix="recall-unique") as pool:
        unique = pool.submit(read_ids, path, id_col, vec_col)
        for batch in _prefetched(_iter_batches(pf, path, [id_col, vec_col], READ_BATCH_ROWS)):
            ids = _ids_from_arrow(path, batch.column(0), row)
            vecs = _vectors_from_arrow(path, batch.column(1), ids, row, dim, None if row == 0 else
                                       f"the dimension of row 0 of {path}")
            if out is None and len(ids):
                dim = vecs.shape[1]
                # One float32 buffer for the whole file, filled batch by batch: peak memory is the result plus one
                # batch.
                out = np.empty((n_rows, dim), np.float32) if device_out is None else device_out(n_rows, dim)
            if len(ids):
                if row + len(ids) > n_rows:
                    raise InputError(f"{path}: holds more rows than its footer declares ({n_rows}); corrupt file")
                if device_out is None:
                    _to_float32(path, vecs, ids, row, out[row:row + len(ids)])
                else:
                    out[row:row + len(ids)].set(_to_float32(path, vecs, ids, row))
                if on_rows is not None:
                    on_rows(out, row + len(ids))
            id_parts.append(ids)
            row += batch.num_rows
        if row != n_rows:
            raise InputError(f"{path}: read {row} rows but the footer declares {n_rows}; corrupt or truncated file")
        if row == 0 and not allow_empty:
            raise InputError(f"{path}: the file has no rows, at least one is required")
        unique.result()
    ids = np.concatenate(id_parts) if id_parts else np.zeros(0, np.int64 if id_type == pa.int64() else object)
    if ids.size == 0:
        ids = ids.astype(np.int64 if id_type == pa.int64() else object)
    if out is None:
        out = np.zeros((0, dim or 0), np.float32) if device_out is None else device_out(0, dim or 0)
    return Embeddings(ids, out)


# --------------------------------------------------------------------------------------------------------------------
# Exclusions


@dataclass(frozen=True)
class ExclusionPairs:
    """Exclusion pairs mapped to (user row, item row), sorted by user row then item row, duplicates removed.

    Slicing by user rows (:meth:`block`) costs two binary searches, so a streaming pipeline takes each batch's CSR
    from one object read once.

    Attributes
    ----------
    user_rows, item_rows : np.ndarray of int64, shape (nnz,)
        Row positions in the users' and the items' files.
    n_users : int
        Number of users the rows index into.
    n_pairs : int
        Pairs in the file (list form: list elements).
    n_unknown : int
        Pairs ignored because their user id or item id is not in the users' or items' file.
    """

    user_rows: np.ndarray
    item_rows: np.ndarray
    n_users: int
    n_pairs: int
    n_unknown: int

    def block(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """The CSR ``(indptr, item_rows)`` of users ``start:stop``, re-based so user ``start`` is row 0.

        Returns
        -------
        indptr : np.ndarray of int64, shape (stop - start + 1,)
        item_rows : np.ndarray of int64, shape (indptr[-1],)
            Sorted and unique within each user; the form ``Engine.search(exclude=...)`` accepts.
        """
        lo, hi = np.searchsorted(self.user_rows, [start, stop])
        users = self.user_rows[lo:hi] - start
        indptr = np.zeros(stop - start + 1, np.int64)
        np.cumsum(np.bincount(users, minlength=stop - start), out=indptr[1:])
        return indptr, self.item_rows[lo:hi]

    def csr(self) -> tuple[np.ndarray, np.ndarray]:
        """The CSR pair over all users (see :meth:`block`)."""
        return self.block(0, self.n_users)


def flatten_id_lists(path: str, lists: pa.Array, row0: int) -> tuple[pa.Array, np.ndarray]:
    """A column of item-id lists (rows ``row0`` on of ``path``) as (flat ids, list lengths); InputError naming the
    row of a null inside a list."""
    lengths = np.diff(lists.offsets.to_numpy()) if not pa.types.is_fixed_size_list(lists.type) else \
        np.full(len(lists), lists.type.list_size, np.int64)
    flat = lists.flatten()
    if flat.null_count:
        pos = _first(flat.is_null().to_numpy(zero_copy_only=False))
        list_row = int(np.searchsorted(np.cumsum(lengths), pos, side="right"))
        raise InputError(f"{path}: row {row0 + list_row} has a null inside its item_ids list")
    return flat, lengths


def _lookup(values: pa.Array | pa.ChunkedArray, ids: np.ndarray) -> np.ndarray:
    """Row position of each value in ``ids``, -1 where absent (a hash lookup in Arrow, no Python loop)."""
    value_set = pa.array(ids, type=pa.string() if ids.dtype == object else pa.int64())
    pos = pc.index_in(values, value_set=value_set).fill_null(-1)
    if isinstance(pos, pa.ChunkedArray):
        return np.asarray(pos.to_numpy(), dtype=np.int64) if pos.num_chunks else np.zeros(0, np.int64)
    return pos.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _match_type(path: str, col: str, values: pa.Array, ids: np.ndarray, whose: str, row0: int = 0) -> pa.Array:
    """``values`` cast to the type of ``ids`` (int64 or string); InputError when integer meets string."""
    t = values.type
    if pa.types.is_dictionary(t):
        values, t = values.dictionary_decode(), t.value_type
    want_str = ids.dtype == object
    if want_str and (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
        return values.cast(pa.string())
    if not want_str and pa.types.is_integer(t):
        if pa.types.is_uint64(t):
            big = pc.greater(values, pa.scalar(_INT64_MAX, pa.uint64())).to_numpy(zero_copy_only=False)
            if big.any():
                pos = _first(big)
                raise InputError(f"{path}: row {row0 + pos} has {col} {values[pos].as_py()}, beyond the int64 range")
        return values.cast(pa.int64())
    kind = "strings" if want_str else "integers"
    raise InputError(f"{path}: column {col!r} has type {t}, but the {whose} ids are {kind}")


def _exclusion_item_column(pf: pq.ParquetFile, path: str) -> str:
    """"item_id" or "item_ids": which form an exclusions file has. InputError naming found and expected columns."""
    schema = pf.schema_arrow
    names = set(schema.names)
    has_pair, has_list = "item_id" in names, "item_ids" in names
    if "user_id" not in names or has_pair == has_list:
        raise InputError(
            f"{path}: exclusion columns are {_column_names(schema)}; expected 'user_id' with 'item_id' "
            f"(one pair per row) or 'user_id' with 'item_ids' (a list per row)"
        )
    if has_list:
        t = schema.field("item_ids").type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
            raise InputError(f"{path}: column 'item_ids' has type {t}, expected a list of item ids")
    return "item_id" if has_pair else "item_ids"


def inspect_exclusions(path: str | os.PathLike) -> str:
    """Open an exclusions file and check its columns without reading rows; returns "item_id" or "item_ids".

    Raises
    ------
    InputError
        Unreadable or not Parquet; columns other than the two accepted forms (see :func:`load_exclusions`).
    """
    path = os.fspath(path)
    return _exclusion_item_column(open_parquet(path, "exclusions"), path)


def load_exclusions(path: str | os.PathLike, user_ids: np.ndarray, item_ids: np.ndarray) -> ExclusionPairs:
    """Read an exclusions Parquet file and map its ids to user and item row positions.

    The file holds ``user_id``, ``item_id`` pairs (one per row), or ``user_id``, ``item_ids`` (a list per row).
    Other columns are ignored. Id types must match the embeddings' (integers with integers, strings with strings).

    Parameters
    ----------
    path : str or PathLike
    user_ids : np.ndarray, shape (n_users,)
        The users' ids in file order (int64 or object/str), as :func:`read_ids` returns them.
    item_ids : np.ndarray, shape (n_items,)
        The items' ids in file order.

    Returns
    -------
    ExclusionPairs
        Pairs whose user id or item id is unknown are not kept; ``n_unknown`` counts them so the caller can warn.

    Raises
    ------
    InputError
        Bad file; neither or both of ``item_id`` / ``item_ids``, or no ``user_id`` (the message names the columns
        found and expected); a null id or list; id types that do not match the embeddings'.
    """
    path = os.fspath(path)
    user_ids, item_ids = np.asarray(user_ids), np.asarray(item_ids)
    pf = open_parquet(path, "exclusions")
    item_col = _exclusion_item_column(pf, path)
    has_list = item_col == "item_ids"

    # Ids are validated batch by batch but looked up once per column at the end: building the hash table of a
    # million ids costs ~50 ms, once per lookup call.
    user_parts, item_parts, length_parts = [], [], []
    row = 0
    for batch in _iter_batches(pf, path, ["user_id", item_col], READ_BATCH_ROWS):
        users, items = batch.column(0), batch.column(1)
        for col, name in ((users, "user_id"), (items, item_col)):
            if col.null_count:
                pos = _first(col.is_null().to_numpy(zero_copy_only=False))
                raise InputError(f"{path}: row {row + pos} has a null {name}")
        users = _match_type(path, "user_id", users, user_ids, "users'", row)
        if has_list:
            items, lengths = flatten_id_lists(path, items, row)
            length_parts.append(lengths)
        items = _match_type(path, item_col, items, item_ids, "items'", row)
        user_parts.append(users)
        item_parts.append(items)
        row += batch.num_rows

    if user_parts:
        user_rows = _lookup(pa.chunked_array(user_parts), user_ids)
        if has_list:
            user_rows = np.repeat(user_rows, np.concatenate(length_parts))
        item_rows = _lookup(pa.chunked_array(item_parts), item_ids)
    else:
        user_rows = item_rows = np.zeros(0, np.int64)
    known = (user_rows >= 0) & (item_rows >= 0)
    n_pairs = int(user_rows.size)
    user_rows, item_rows = user_rows[known], item_rows[known]
    order = np.lexsort((item_rows, user_rows))
    user_rows, item_rows = user_rows[order], item_rows[order]
    if user_rows.size > 1:
        # A pair listed twice excludes once; the engine wants item rows unique within a user.
        keep = np.ones(user_rows.size, bool)
        keep[1:] = (user_rows[1:] != user_rows[:-1]) | (item_rows[1:] != item_rows[:-1])
        user_rows, item_rows = user_rows[keep], item_rows[keep]
    return ExclusionPairs(user_rows, item_rows, int(user_ids.size), n_pairs, n_pairs - int(known.sum()))


def read_exclusions(path: str | os.PathLike, user_ids: np.ndarray,
                    item_ids: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], int]:
    """Read an exclusions file as the CSR pair ``Engine.search(exclude=...)`` takes.

    Parameters
    ----------
    path : str or PathLike
        ``user_id``, ``item_id`` pairs, or ``user_id``, ``item_ids`` lists.
    user_ids : np.ndarray, shape (n_users,)
        The ids of the users about to be searched, in search order.
    item_ids : np.ndarray, shape (n_items,)
        The engine's item ids, in item row order.

    Returns
    -------
    (indptr, item_rows) : tuple of np.ndarray of int64, shapes (n_users + 1,) and (nnz,)
        User ``u`` excludes item rows ``item_rows[indptr[u]:indptr[u + 1]]``.
    n_unknown : int
        Pairs ignored because their user or item id is unknown; the caller should warn with this count.

    Raises
    ------
    InputError
        See :func:`load_exclusions`.
    """
    pairs = load_exclusions(path, user_ids, item_ids)
    return pairs.csr(), pairs.n_unknown
