"""Embedding Parquet files -> arrays: ids and vectors, read row group by row group and validated on the way in; one
vector per user (or item), or several per user (multi-interest users)."""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..core.errors import InputError
from .parquet import (READ_BATCH_ROWS, at, column_names, first_true, fmt_id, has_column, id_type_of,
                      ids_from_arrow, iter_batches, open_parquet, prefetched, row_group_starts)


@dataclass(frozen=True)
class Embeddings:
    """Ids and vectors read from an embedding Parquet file.

    Attributes
    ----------
    ids : np.ndarray, shape (n,)
        int64 for integer id columns; object (Python ``str``) for string id columns.
    vectors : np.ndarray of float32, shape (n, dim)
        C-contiguous, on the host (on the device for :func:`read_embeddings` given a ``target``).
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


def check_columns(pf: pq.ParquetFile, path: str, id_col: str, vec_col: str) -> tuple[pa.DataType, int | None]:
    schema = pf.schema_arrow
    for col, role, option in ((id_col, "id", "--id-col"), (vec_col, "vector", "--vec-col")):
        if not has_column(schema, path, col):
            raise InputError(
                f"{path}: no {role} column {col!r}; the columns are {column_names(schema)} "
                f"(choose another with {option})"
            )
    id_type = id_type_of(path, id_col, schema.field(id_col).type)
    vt = schema.field(vec_col).type
    ok_list = pa.types.is_fixed_size_list(vt) or pa.types.is_list(vt) or pa.types.is_large_list(vt)
    if not ok_list or not pa.types.is_floating(vt.value_type):
        raise InputError(
            f"{path}: vector column {vec_col!r} has type {vt}, expected fixed_size_list<float16|float32|float64>[dim] "
            f"or list<float16|float32|float64>"
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
    id_type, dim = check_columns(pf, path, id_col, vec_col)
    return EmbeddingFileInfo(path, pf.metadata.num_rows, pf.metadata.num_row_groups, id_type, dim)


def vectors_from_arrow(path: str, col: pa.Array, ids: np.ndarray, row0: int, dim: int | None,
                        dim_source: str | None) -> np.ndarray:
    """A batch's vector column as an (n, dim) array of its own float dtype (a view where Arrow allows).

    ``dim`` is the dimension every row must have (None: the batch's first row sets it).
    """
    n = len(col)
    if col.null_count:
        pos = first_true(col.is_null().to_numpy(zero_copy_only=False))
        raise InputError(f"{at(path, row0 + pos, ids, pos)} has a null vector")
    if pa.types.is_fixed_size_list(col.type):
        got = col.type.list_size
        lengths = None
    else:
        offsets = col.offsets.to_numpy()
        lengths = np.diff(offsets)
        got = int(lengths[0]) if n else (dim or 0)
    if dim is not None and got != dim:
        where = f" ({dim_source})" if dim_source else ""
        raise InputError(f"{at(path, row0, ids, 0)} has dimension {got}, expected {dim}{where}")
    if n and got == 0:
        raise InputError(f"{at(path, row0, ids, 0)} has an empty vector (dimension 0)")
    if lengths is not None and n:
        bad = lengths != got
        if bad.any():
            pos = first_true(bad)
            ref = dim_source if dim is not None and dim_source else f"the length of row {row0}"
            raise InputError(
                f"{at(path, row0 + pos, ids, pos)} has {int(lengths[pos])} values, expected {got} "
                f"(ragged vectors: every row must have {ref})"
            )
    # flatten() honours the array's slice offset, unlike .values, and there are no null lists left to skip.
    flat = col.flatten()
    if flat.null_count:
        pos = first_true(flat.is_null().to_numpy(zero_copy_only=False)) // got
        raise InputError(f"{at(path, row0 + pos, ids, pos)} has a null value inside its vector")
    vecs = flat.to_numpy(zero_copy_only=False).reshape(n, got)
    finite = np.isfinite(vecs).all(axis=1)
    if not finite.all():
        pos = first_true(~finite)
        raise InputError(f"{at(path, row0 + pos, ids, pos)} has a NaN or infinite value in its vector")
    return vecs


def to_float32(path: str, vecs: np.ndarray, ids: np.ndarray, row0: int, out: np.ndarray | None = None) -> np.ndarray:
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
            pos = first_true(~finite)
            raise InputError(f"{at(path, row0 + pos, ids, pos)} has a value beyond the float32 range")
    return out


def check_unique_ids(path: str, ids: np.ndarray, what: str = "id") -> None:
    """Raise InputError naming the first duplicated id and two rows holding it."""
    if ids.size < 2:
        return
    arr = pa.array(ids, type=pa.string() if ids.dtype == object else pa.int64())
    # Arrow's sort is stable and runs in C++ for strings too, where np.argsort would compare Python objects.
    order = pc.array_sort_indices(arr).to_numpy()
    sorted_ids = ids[order]
    same = sorted_ids[1:] == sorted_ids[:-1]
    if same.any():
        j = first_true(same)
        rows = sorted(order[j:j + 2].tolist())
        raise InputError(
            f"{path}: duplicate {what} {fmt_id(sorted_ids[j])} at rows {rows[0]} and {rows[1]}; ids must be unique"
        )


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
        check_columns(pf, path, id_col, vec_col)
    else:
        if not has_column(pf.schema_arrow, path, id_col):
            raise InputError(f"{path}: no id column {id_col!r}; the columns are {column_names(pf.schema_arrow)}")
        id_type_of(path, id_col, pf.schema_arrow.field(id_col).type)
    parts, row = [], 0
    for batch in iter_batches(pf, path, [id_col], READ_BATCH_ROWS):
        parts.append(ids_from_arrow(path, batch.column(0), row))
        row += batch.num_rows
    id_type = id_type_of(path, id_col, pf.schema_arrow.field(id_col).type)
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int64 if id_type == pa.int64() else object)
    if check_unique:
        check_unique_ids(path, ids)
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
    _, fixed_dim = check_columns(pf, path, id_col, vec_col)
    if fixed_dim is not None and dim is not None and fixed_dim != dim:
        where = f" ({dim_source})" if dim_source else ""
        raise InputError(f"{path}: vectors have dimension {fixed_dim}, expected {dim}{where}")
    if check_unique:
        read_ids(path, id_col, vec_col)
    return _stream(pf, path, int(batch_size), id_col, vec_col, dim, dim_source)


def _stream(pf: pq.ParquetFile, path: str, batch_size: int, id_col: str, vec_col: str, dim: int | None,
            dim_source: str | None) -> Iterator[Embeddings]:
    row = 0
    for batch in iter_batches(pf, path, [id_col, vec_col], batch_size):
        ids = ids_from_arrow(path, batch.column(0), row)
        vecs = vectors_from_arrow(path, batch.column(1), ids, row, dim, dim_source)
        if dim is None and len(ids):
            # The file's first row fixes the dimension of every later batch.
            dim, dim_source = vecs.shape[1], f"the dimension of row 0 of {path}"
        yield Embeddings(ids, to_float32(path, vecs, ids, row), row)
        row += batch.num_rows


def read_embeddings(path: str | os.PathLike, id_col: str = "id", vec_col: str = "embedding", *,
                    allow_empty: bool = True, target: Any = None,
                    on_rows: Callable[[Any, int], None] | None = None) -> Embeddings:
    """Read a whole embedding Parquet file into host arrays, row group by row group.

    Parameters
    ----------
    path : str or PathLike
        A Parquet file with an id column (integers, or strings) and a vector column
        (``fixed_size_list<float16|float32|float64>[dim]`` or ``list<float16|float32|float64>``, every row the
        same length; read as float32, float64 values rounded).
    id_col, vec_col : str
        Column names.
    allow_empty : bool
        When False, a file without rows is an error (items are required; users may be none).
    target : backend, optional
        Where the vectors go instead of a host array: an array of ``target.empty_out((n_rows, dim), float32,
        False)``, each decoded batch copied into its rows as it comes (``target.store_rows``), so a GPU job never
        assembles (nor pages in) the whole matrix on the host.
    on_rows : callable ``(vectors, rows) -> None``, optional
        Called after each batch with the vectors' array and the number of rows filled so far (and converted: a
        later batch may still turn out bad), e.g. to start work on the first rows while the rest are decoded.

    Returns
    -------
    Embeddings
        ``ids`` (n,) int64 or object (str); ``vectors`` (n, dim) float32, C-contiguous (on the device with
        ``target``). An empty file gives ``vectors`` of shape (0, dim) (dim 0 for a variable-size list column).

    Raises
    ------
    InputError
        Naming the file, and the row and id where there is one: missing or unreadable file, not Parquet or truncated,
        missing column (listing the columns there are), wrong column type, null id, null vector, ragged vector
        lengths, NaN/Inf, float64 values beyond float32, duplicate ids, no rows when ``allow_empty`` is False.
    """
    path = os.fspath(path)
    pf = open_parquet(path, "embeddings")
    id_type, fixed_dim = check_columns(pf, path, id_col, vec_col)
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
        for batch in prefetched(iter_batches(pf, path, [id_col, vec_col], READ_BATCH_ROWS)):
            ids = ids_from_arrow(path, batch.column(0), row)
            vecs = vectors_from_arrow(path, batch.column(1), ids, row, dim, None if row == 0 else
                                       f"the dimension of row 0 of {path}")
            if out is None and len(ids):
                dim = vecs.shape[1]
                # One float32 buffer for the whole file, filled batch by batch: peak memory is the result plus one
                # batch.
                out = np.empty((n_rows, dim), np.float32) if target is None else \
                    target.empty_out((n_rows, dim), np.float32, False)
            if len(ids):
                if row + len(ids) > n_rows:
                    raise InputError(f"{path}: holds more rows than its footer declares ({n_rows}); corrupt file")
                if target is None:
                    to_float32(path, vecs, ids, row, out[row:row + len(ids)])
                else:
                    target.store_rows(out, row, to_float32(path, vecs, ids, row))
                if on_rows is not None:
                    on_rows(out, row + len(ids))
            id_parts.append(ids)
            row += batch.num_rows
        if row != n_rows:
            raise InputError(f"{path}: read {row} rows but the footer declares {n_rows}; corrupt or truncated file")
        if row == 0 and not allow_empty:
            raise InputError(f"{path}: the file has no rows, at least one is required")
        unique.result()
    pa.default_memory_pool().release_unused()  # (as iter_batches does: the batches of both threads are gone now)
    ids = np.concatenate(id_parts) if id_parts else np.zeros(0, np.int64 if id_type == pa.int64() else object)
    if ids.size == 0:
        ids = ids.astype(np.int64 if id_type == pa.int64() else object)
    if out is None:
        out = np.zeros((0, dim or 0), np.float32) if target is None else target.empty_out((0, dim or 0), np.float32,
                                                                                           False)
    return Embeddings(ids, out)


def embedding_dim(path: str | os.PathLike, id_col: str = "id", vec_col: str = "embedding") -> int | None:
    """The dimension of an embedding file's vectors: the schema's for a fixed-size list column, else the length of
    row 0's vector (one row read). None when the file has no rows or row 0 has no usable vector (a reader of row 0
    reports that).

    Raises
    ------
    InputError
        As :func:`inspect_embeddings`.
    """
    path = os.fspath(path)
    pf = open_parquet(path, "embeddings")
    _, dim = check_columns(pf, path, id_col, vec_col)
    if dim is not None or pf.metadata.num_rows == 0:
        return dim
    # Row 0 is the first row of the first row group that holds any (a streaming writer may begin with an empty one).
    first = next(g for g in range(pf.metadata.num_row_groups) if pf.metadata.row_group(g).num_rows)
    for batch in iter_batches(pf, path, [vec_col], 1, [first]):
        col = batch.column(0)
        if len(col) and col.null_count == 0:
            got = len(col[0].as_py())
            return got or None
        return None
    return None


def read_embedding_rows(path: str | os.PathLike, start: int, stop: int, id_col: str = "id",
                        vec_col: str = "embedding", *, dim: int | None = None, keep: np.ndarray | None = None,
                        on_batch: Callable[[np.ndarray, np.ndarray, int], None] | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Read and validate rows ``start:stop`` of an embedding file, decoding only the row groups that hold them: the
    reader of one item shard (``recall batch --item-shards``), which never holds the rest of the file.

    Every row of the range is validated as :func:`read_embeddings` validates it, with the same messages (rows
    counted over the whole file); ids are not checked for duplicates (the caller checks the whole id column once,
    with :func:`read_ids`).

    Parameters
    ----------
    path : str or PathLike
    start, stop : int
        The row range, ``0 <= start <= stop <= n_rows``.
    id_col, vec_col : str
    dim : int, optional
        The file's dimension (:func:`embedding_dim`), so that a range not starting at row 0 checks its rows against
        row 0's; default: the range's first row sets it.
    keep : np.ndarray of int64, optional
        Increasing positions in ``[0, stop - start)``: only these rows' vectors are returned (e.g. the items an
        item filter passes); every row is still read and validated.
    on_batch : callable ``(ids, vectors, row) -> None``, optional
        Called with each validated part of the range (float32 vectors, before ``keep``) and the file row of its
        first row: e.g. the largest item norm over every row.

    Returns
    -------
    ids : np.ndarray, shape (stop - start,)
        The ids of every row of the range (int64, or object for strings).
    vectors : np.ndarray of float32, shape (len(keep) or stop - start, dim)
        C-contiguous, on the host.

    Raises
    ------
    InputError
        As :func:`read_embeddings`, naming the file, row and id; a range outside the file.
    """
    path = os.fspath(path)
    pf = open_parquet(path, "embeddings")
    id_type, fixed_dim = check_columns(pf, path, id_col, vec_col)
    n_rows = pf.metadata.num_rows
    if not 0 <= start <= stop <= n_rows:
        raise InputError(f"{path}: rows {start}:{stop} are not within its {n_rows:,} rows")
    dim = fixed_dim if fixed_dim is not None else dim
    keep = None if keep is None else np.asarray(keep, np.int64)
    n_out = stop - start if keep is None else int(keep.size)
    starts = row_group_starts(pf)
    groups = [g for g in range(pf.metadata.num_row_groups) if starts[g] < stop and starts[g + 1] > start]
    out: np.ndarray | None = None
    id_parts: list[np.ndarray] = []
    row, taken = (int(starts[groups[0]]) if groups else start), 0
    batches = iter_batches(pf, path, [id_col, vec_col], READ_BATCH_ROWS, groups) if groups else iter(())
    for batch in prefetched(batches):
        lo, hi = max(start, row), min(stop, row + batch.num_rows)
        if hi > lo:
            part = batch.slice(lo - row, hi - lo)
            ids = ids_from_arrow(path, part.column(0), lo)
            # Row 0 sets the dimension, as in read_embeddings; later rows are held to it.
            vecs = vectors_from_arrow(path, part.column(1), ids, lo, dim if lo else None,
                                       f"the dimension of row 0 of {path}" if lo else None)
            vecs = to_float32(path, vecs, ids, lo)
            dim = dim or vecs.shape[1]
            if on_batch is not None:
                on_batch(ids, vecs, lo)
            if keep is not None:
                a, b = np.searchsorted(keep, [lo - start, hi - start])
                vecs = vecs[keep[a:b] - (lo - start)]
            if out is None:
                out = np.empty((n_out, dim), np.float32)
            out[taken:taken + vecs.shape[0]] = vecs
            taken += vecs.shape[0]
            id_parts.append(ids)
        row += batch.num_rows
        if row >= stop:
            break
    read = sum(p.size for p in id_parts)
    if read != stop - start:
        raise InputError(f"{path}: read {read} of rows {start}:{stop} but the footer declares {n_rows}; corrupt or "
                         f"truncated file")
    ids = np.concatenate(id_parts) if id_parts else np.zeros(0, np.int64 if id_type == pa.int64() else object)
    if out is None:
        out = np.zeros((0, dim or 0), np.float32)
    return ids, out


# ------------------------------------------------------------------------------------------------------------------
# Users with several vectors (multi-interest)


@dataclass(frozen=True)
class InterestUsers:
    """Users with one or more vectors each, read from Parquet.

    Attributes
    ----------
    ids : np.ndarray, shape (n_users,)
        int64, or object (str); unique, in order of first appearance in the file.
    vectors : np.ndarray of float32, shape (n_vectors, dim)
        Every user's interest vectors, contiguous per user, in file order within a user.
    indptr : np.ndarray of int64, shape (n_users + 1,)
        User ``i`` has ``vectors[indptr[i]:indptr[i + 1]]`` (at least one).
    file_rows : np.ndarray of int64, shape (n_vectors,)
        The file row each vector came from (for messages).
    """

    ids: np.ndarray
    vectors: np.ndarray
    indptr: np.ndarray
    file_rows: np.ndarray

    def __len__(self) -> int:
        return int(self.ids.size)

    @property
    def max_interests(self) -> int:
        return int(np.diff(self.indptr).max()) if len(self) else 0

    def batch(self, start: int, stop: int) -> Any:
        """Users ``start:stop`` as ``Engine.search`` takes them: a 3-d array when they all have the same number of
        vectors, else a list of (n_i, dim) views."""
        counts = np.diff(self.indptr[start:stop + 1])
        lo, hi = int(self.indptr[start]), int(self.indptr[stop])
        if counts.size and bool((counts == counts[0]).all()):
            return self.vectors[lo:hi].reshape(counts.size, int(counts[0]), self.vectors.shape[1])
        return [self.vectors[self.indptr[i]:self.indptr[i + 1]] for i in range(start, stop)]


def _list_like(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def inspect_interest_users(path: str | os.PathLike, id_col: str = "id", vec_col: str = "embedding") -> bool:
    """Check a multi-interest users file's columns without reading rows; True for the nested layout (a list of
    vectors per row), False for one vector per row (ids repeated).

    Raises
    ------
    InputError
        Unreadable or not Parquet; a missing column (listing those there are) or a column of the wrong type.
    """
    path = os.fspath(path)
    schema = open_parquet(path, "embeddings").schema_arrow
    for col, role, option in ((id_col, "id", "--id-col"), (vec_col, "vector", "--vec-col")):
        if not has_column(schema, path, col):
            raise InputError(f"{path}: no {role} column {col!r}; the columns are {column_names(schema)} "
                             f"(choose another with {option})")
    id_type_of(path, id_col, schema.field(id_col).type)
    vt = schema.field(vec_col).type
    nested = _list_like(vt) and _list_like(vt.value_type)
    inner = vt.value_type.value_type if nested else (vt.value_type if _list_like(vt) else None)
    if inner is None or not pa.types.is_floating(inner):
        raise InputError(f"{path}: vector column {vec_col!r} has type {vt}, expected fixed_size_list<float>[dim] "
                         f"(one interest per row, user ids repeated) or list<fixed_size_list<float>[dim]> (a list "
                         f"of interests per row; float: float16, float32 or float64)")
    return nested


def read_interest_users(path: str | os.PathLike, id_col: str = "id", vec_col: str = "embedding", *,
                        dim: int | None = None, dim_source: str | None = None) -> InterestUsers:
    """Read users with several vectors each from Parquet.

    Two layouts: one vector per row with the user id repeated on each of its rows (the rows of a user need not be
    adjacent), or one row per user whose vector column is a list of vectors (``list<fixed_size_list<float32>[d]>``
    or ``list<list<float>>``). The whole file is read.

    Parameters
    ----------
    path : str or PathLike
    id_col, vec_col : str
    dim : int, optional
        The dimension every vector must have (the items'); default: the first vector's.
    dim_source : str, optional
        Where ``dim`` comes from, for messages.

    Raises
    ------
    InputError
        Naming the file, the row and the id: bad file or columns, null ids, lists or vectors, a user without vectors,
        a wrong or ragged dimension, NaN/Inf or float32 overflow, and (nested layout) a user id on two rows.
    """
    path = os.fspath(path)
    nested = inspect_interest_users(path, id_col, vec_col)
    pf = open_parquet(path, "embeddings")
    id_parts, vec_parts, row_parts = [], [], []
    row = 0
    for batch in iter_batches(pf, path, [id_col, vec_col], READ_BATCH_ROWS):
        ids = ids_from_arrow(path, batch.column(0), row)
        col = batch.column(1)
        if not nested:
            vecs = vectors_from_arrow(path, col, ids, row, dim, dim_source)
            vec_parts.append(to_float32(path, vecs, ids, row))
            id_parts.append(ids)
            row_parts.append(np.arange(row, row + len(ids), dtype=np.int64))
        else:
            if col.null_count:
                pos = first_true(col.is_null().to_numpy(zero_copy_only=False))
                raise InputError(f"{at(path, row + pos, ids, pos)} has a null list of vectors")
            lengths = (np.full(len(col), col.type.list_size, np.int64) if pa.types.is_fixed_size_list(col.type)
                       else np.diff(col.offsets.to_numpy()).astype(np.int64))
            if (lengths == 0).any():
                pos = first_true(lengths == 0)
                raise InputError(f"{at(path, row + pos, ids, pos)} has no interest vectors; every user needs one")
            outer = np.repeat(np.arange(len(col), dtype=np.int64), lengths)
            inner_ids = np.repeat(ids, lengths)
            try:
                vecs = vectors_from_arrow(path, col.flatten(), inner_ids, 0, dim, dim_source)
                vecs = to_float32(path, vecs, inner_ids, 0)
            except InputError as exc:
                # The vector reader counts vectors, not rows: name the row that holds the bad vector instead.
                m = re.match(re.escape(path) + r": row (\d+)", str(exc))
                if m is None:
                    raise
                i = int(m.group(1))
                detail = str(exc)[len(at(path, i, inner_ids, i)):].strip()
                pos = int(outer[i])
                raise InputError(f"{at(path, row + pos, ids, pos)}: vector {i - int(np.searchsorted(outer, pos))} "
                                 f"of its list {detail}") from None
            vec_parts.append(vecs)
            id_parts.append(ids)
            row_parts.append(row + outer)
        if dim is None and vec_parts and vec_parts[-1].shape[0]:
            dim, dim_source = vec_parts[-1].shape[1], f"the dimension of the first vector of {path}"
        row += batch.num_rows
    # (a file without rows: ids of its schema's type, as read_ids gives them)
    empty = np.int64 if id_type_of(path, id_col, pf.schema_arrow.field(id_col).type) == pa.int64() else object
    ids = np.concatenate(id_parts) if id_parts else np.zeros(0, empty)
    vectors = np.concatenate(vec_parts) if vec_parts else np.zeros((0, dim or 0), np.float32)
    file_rows = np.concatenate(row_parts) if row_parts else np.zeros(0, np.int64)
    if nested:
        check_unique_ids(path, ids, "user id")
        counts = np.diff(np.append(np.flatnonzero(np.r_[True, file_rows[1:] != file_rows[:-1]]), file_rows.size))
        indptr = np.zeros(ids.size + 1, np.int64)
        np.cumsum(counts, out=indptr[1:])
        return InterestUsers(ids, np.ascontiguousarray(vectors), indptr, file_rows)
    # One vector per row: group the rows of each id, users in order of first appearance (Arrow's dictionary
    # encoding numbers distinct values in that order), rows in file order within a user.
    arr = pa.array(ids, type=pa.string() if ids.dtype == object else pa.int64())
    enc = pc.dictionary_encode(arr)
    codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    uniq = enc.dictionary.to_numpy(zero_copy_only=False)
    uniq = uniq.astype(object) if ids.dtype == object else uniq.astype(np.int64)
    order = np.argsort(codes, kind="stable")
    indptr = np.zeros(uniq.size + 1, np.int64)
    np.cumsum(np.bincount(codes, minlength=uniq.size), out=indptr[1:])
    return InterestUsers(uniq, np.ascontiguousarray(vectors[order]), indptr, file_rows[order])
