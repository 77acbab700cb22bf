"""Parquet files of (user id, item id) pairs -> CSR over user rows: exclusions and re-scoring candidates, one reader.

A pairs file has a ``user_id`` column and either an ``item_id`` column (one pair per row) or an ``item_ids`` list
column (a user's items on one row; a user may have several rows). Other columns are ignored. Id types must match the
embeddings' (integers with integers, strings with strings). Ids are checked batch by batch and looked up once per
column (one hash table of the embeddings' ids, in Arrow, no per-row Python); pairs naming an id that is not in the
embedding files are skipped and counted. The pairs are then grouped by user with a linear counting sort
(:func:`recall.core.exclusions.group`): for exclusions each user's rows sorted and unique, for candidates in file
order (the engine counts a duplicate once).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..core import exclusions
from ..core.errors import InputError
from .parquet import (INT64_MAX, READ_BATCH_ROWS, as_text, column_names, first_invalid_utf8, first_true,
                      flatten_id_lists, has_column, is_text, is_utf8, iter_batches, lookup, match_type, open_parquet)


LOOKUP_GROUP_VALUES = 1 << 22
"""Least number of id values mapped to rows in one lookup (see :func:`read_pairs`)."""


@dataclass(frozen=True)
class IdPairs:
    """Pairs mapped to rows, as CSR over the users' rows.

    Attributes
    ----------
    indptr : np.ndarray of int64, shape (n_users + 1,)
    item_rows : np.ndarray of int32 (int64 for more than 2^31 - 1 users or items), shape (nnz,)
        User ``u``'s items are ``item_rows[indptr[u]:indptr[u + 1]]`` (sorted and unique for exclusions, file order
        for candidates).
    named : np.ndarray of bool, shape (n_users,)
        Users the file names with a known user id (a candidates file gives each of them an output row, even when
        none of its item ids is known).
    n_pairs : int
        Pairs in the file (list form: list elements).
    n_unknown : int
        Of those, pairs skipped because their user id or item id is not in the embedding files.
    """

    indptr: np.ndarray
    item_rows: np.ndarray
    named: np.ndarray
    n_pairs: int
    n_unknown: int

    @property
    def n_users(self) -> int:
        return int(self.indptr.size - 1)

    def block(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """The CSR ``(indptr, item_rows)`` of users ``start:stop``, re-based so user ``start`` is row 0: the form
        ``Engine.search(exclude=...)`` and ``Engine.rescore`` take."""
        ptr = self.indptr[start:stop + 1]
        return ptr - ptr[0], self.item_rows[ptr[0]:ptr[-1]]

    def csr(self) -> tuple[np.ndarray, np.ndarray]:
        """The CSR pair over all users (see :meth:`block`)."""
        return self.indptr, self.item_rows

    def take(self, rows: np.ndarray) -> "IdPairs":
        """The pairs of user rows ``rows`` (-1: a user with none), as CSR over them, in that order."""
        indptr, items = exclusions.take(self.indptr, self.item_rows, rows)
        named = np.where(rows >= 0, self.named[np.maximum(rows, 0)], False) if self.named.size else \
            np.zeros(rows.size, bool)
        return IdPairs(indptr, items, named, int(items.size), 0)


def pairs_column(pf: pq.ParquetFile, path: str, what: str) -> str:
    """"item_id" (one pair per row) or "item_ids" (a list per row): which form a pairs file has. InputError naming
    the columns found and expected."""
    schema = pf.schema_arrow
    has_user, has_pair, has_list = (has_column(schema, path, col) for col in ("user_id", "item_id", "item_ids"))
    if not has_user or has_pair == has_list:
        raise InputError(
            f"{path}: {what} columns are {column_names(schema)}; expected 'user_id' with 'item_id' "
            f"(one pair per row) or 'user_id' with 'item_ids' (a list of item ids per row)"
        )
    if has_list:
        t = schema.field("item_ids").type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
            raise InputError(f"{path}: column 'item_ids' has type {t}, expected a list of item ids")
    return "item_id" if has_pair else "item_ids"


def inspect_pairs(path: str | os.PathLike, what: str = "exclusion") -> str:
    """Open a pairs file and check its columns without reading rows; returns "item_id" or "item_ids".

    Raises
    ------
    InputError
        Unreadable or not Parquet; columns other than the two accepted forms.
    """
    path = os.fspath(path)
    return pairs_column(open_parquet(path, f"{what}s"), path, what)


def read_pairs(path: str | os.PathLike, user_ids: np.ndarray, item_ids: np.ndarray, *, what: str = "exclusion",
               sort_unique: bool = True) -> IdPairs:
    """Read a pairs Parquet file and map its ids to user and item rows, as CSR over the users.

    Parameters
    ----------
    path : str or PathLike
    user_ids : np.ndarray, shape (n_users,)
        The users' ids in file order (int64 or object/str), as ``read_ids`` returns them.
    item_ids : np.ndarray, shape (n_items,)
        The items' ids in file order.
    what : str
        "exclusion" or "candidate": how messages name the file's rows.
    sort_unique : bool
        Sort each user's item rows and drop repeats (exclusions); False keeps file order (candidates).

    Raises
    ------
    InputError
        Bad file; neither or both of ``item_id`` / ``item_ids``, or no ``user_id`` (the message names the columns
        found and expected); a null id, list or list element (naming the row); id types that do not match the
        embeddings'.
    """
    path = os.fspath(path)
    user_ids, item_ids = np.asarray(user_ids), np.asarray(item_ids)
    pf = open_parquet(path, f"{what}s")
    col = pairs_column(pf, path, what)
    has_list = col == "item_ids"
    # Ids are mapped to rows a group of batches at a time, so the file's id columns are never all held at once: a
    # group holds at least four times as many values as the larger id table, which bounds the cost of building the
    # lookup's hash table once per group to a quarter of the lookups themselves. Rows are kept as int32 when they fit.
    row_type = np.int32 if max(user_ids.size, item_ids.size) < 2 ** 31 - 1 else np.int64
    group_values = max(4 * max(user_ids.size, item_ids.size), LOOKUP_GROUP_VALUES)
    user_rows, item_rows, pending_users, pending_items, pending_lengths = [], [], [], [], []
    named = np.zeros(user_ids.size, bool)
    pending = 0

    def flush() -> None:
        nonlocal pending
        if pending_users:
            rows = lookup(pa.chunked_array(pending_users), user_ids, row_type)
            named[rows[rows >= 0]] = True  # a user named with an empty list still counts as named
            user_rows.append(np.repeat(rows, np.concatenate(pending_lengths)) if has_list else rows)
            item_rows.append(lookup(pa.chunked_array(pending_items), item_ids, row_type))
        for part in (pending_users, pending_items, pending_lengths):
            part.clear()
        pending = 0

    row = 0
    for batch in iter_batches(pf, path, ["user_id", col], READ_BATCH_ROWS):
        users, items = batch.column(0), batch.column(1)
        if users.null_count or items.null_count:
            # The first row with a null in either column (user_id where both are): not the user column's first.
            user_null = users.is_null().to_numpy(zero_copy_only=False)
            pos = first_true(user_null | items.is_null().to_numpy(zero_copy_only=False))
            raise InputError(f"{path}: row {row + pos} has a null {'user_id' if user_null[pos] else col}")
        pending_users.append(match_type(path, "user_id", users, user_ids, "users'", row))
        if has_list:
            items, lengths = flatten_id_lists(path, items, row)
            pending_lengths.append(lengths)
        pending_items.append(match_type(path, col, items, item_ids, "items'", row))
        pending += len(items)
        row += batch.num_rows
        if pending >= group_values:
            flush()
    flush()
    if row == 0:  # no row to check the id types on: the schema's, so that an empty file of the wrong types is refused
        _empty_of(pf, path, "user_id", user_ids, "users'")
        _empty_of(pf, path, col, item_ids, "items'")
    empty = np.zeros(0, row_type)
    pair_users = np.concatenate(user_rows) if user_rows else empty
    pair_items = np.concatenate(item_rows) if item_rows else empty
    user_rows.clear()  # the parts go before the grouping allocates its output
    item_rows.clear()
    n_pairs = int(pair_users.size)
    n_known = int(np.count_nonzero((pair_users >= 0) & (pair_items >= 0)))
    indptr, rows = exclusions.group(pair_users, pair_items, int(user_ids.size), sort_unique)
    return IdPairs(indptr, rows, named, n_pairs, n_pairs - n_known)


def _empty_of(pf: pq.ParquetFile, path: str, col: str, ids: np.ndarray, whose: str) -> None:
    """``match_type`` on no values of column ``col``'s type (a list column's values): a file without rows still
    has to hold ids of the type of ``ids``."""
    t = pf.schema_arrow.field(col).type
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    match_type(path, col, pa.array([], type=t), ids, whose)


def read_item_filter(allow_path: str | os.PathLike | None, deny_path: str | os.PathLike | None,
                     item_ids: np.ndarray) -> tuple[ItemSet | None, ItemSet | None]:
    """A job's allow and deny files (either may be None), read and mapped to item rows (:func:`read_item_set`).

    Raises
    ------
    InputError
        What :func:`read_item_set` raises; and where the deny file leaves none of the items the allow file passes
        (or, without one, of the items file): every user would get no candidates.
    """
    allow = read_item_set(allow_path, item_ids, "allow") if allow_path is not None else None
    deny = read_item_set(deny_path, item_ids, "deny") if deny_path is not None else None
    if deny is not None:
        # Both hold unique rows of the items file.
        passing = len(item_ids) if allow is None else int(allow.rows.size)
        denied = deny.rows.size if allow is None else int(np.isin(allow.rows, deny.rows, assume_unique=True).sum())
        if denied < passing:
            return allow, deny
        what = f"every item the allow file {os.fspath(allow_path)} passes" if allow is not None else \
            "every item of the items file"
        raise InputError(f"{os.fspath(deny_path)}: the deny file names {what} ({passing:,}): every user would get "
                         f"no candidates")
    return allow, deny


def distinct_users(path: str | os.PathLike, want_strings: bool) -> np.ndarray:
    """The distinct user ids a pairs file names, as int64 or object (str): the keys of a pairs index that needs no
    users file (the batch job's exclusions, cut per shard). An unreadable file or a type mismatch gives no keys:
    :func:`read_pairs` then reads the file again and names the problem (file, row, column)."""
    empty = np.zeros(0, object if want_strings else np.int64)
    # Batch by batch, each batch's distinct ids kept: the column is never held whole (10^9 pairs at night).
    parts = []
    try:
        pf = open_parquet(path, "exclusion")
        for batch in iter_batches(pf, os.fspath(path), ["user_id"], 1 << 20):
            col = batch.column(0)
            if pa.types.is_dictionary(col.type):
                col = col.dictionary_decode()
            parts.append(pc.unique(col.drop_null()))
    except (pa.ArrowException, OSError, KeyError, ValueError, InputError):
        return empty
    if not parts:
        return empty
    col = pc.unique(pa.chunked_array(parts).combine_chunks())
    t = col.type
    if want_strings and is_text(t):
        col = as_text(col)
        if first_invalid_utf8(col) is not None:  # values that are not UTF-8 name no user: as unknown as any other
            col = col.filter(pa.array([is_utf8(raw) for raw in col.cast(pa.binary()).to_pylist()]))
        return col.to_numpy(zero_copy_only=False).astype(object)
    if not want_strings and pa.types.is_integer(t):
        if pa.types.is_uint64(t):
            col = col.filter(pc.less_equal(col, pa.scalar(INT64_MAX, pa.uint64())))
        return col.cast(pa.int64()).to_numpy(zero_copy_only=False)
    return empty


def rows_of(keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The position of each of ``ids`` in ``keys`` (-1 where absent): a hash lookup in Arrow."""
    if keys.size == 0 or ids.size == 0:
        return np.full(ids.size, -1, np.int64)
    return lookup(pa.array(ids, type=pa.string() if keys.dtype == object else pa.int64()), keys)


@dataclass(frozen=True)
class ItemSet:
    """An item filter file (``--allow`` / ``--deny``) mapped to item rows.

    Attributes
    ----------
    rows : np.ndarray of int64
        The rows of the known item ids, increasing, each once.
    n_ids : int
        Ids in the file.
    n_unknown : int
        Of those, ids the items file does not have (ignored).
    """

    rows: np.ndarray
    n_ids: int
    n_unknown: int


def inspect_item_set(path: str | os.PathLike, what: str = "allow") -> None:
    """Check an item filter file's columns without reading rows: an ``item_id`` column.

    Raises
    ------
    InputError
        Unreadable or not Parquet; no ``item_id`` column (naming the columns there are).
    """
    _open_item_set(os.fspath(path), what)


def _open_item_set(path: str, what: str) -> pq.ParquetFile:
    pf = open_parquet(path, f"{what} items")
    if not has_column(pf.schema_arrow, path, "item_id"):
        raise InputError(f"{path}: {what} file columns are {column_names(pf.schema_arrow)}; expected an 'item_id' "
                         f"column")
    return pf


def read_item_set(path: str | os.PathLike, item_ids: np.ndarray, what: str = "allow") -> ItemSet:
    """Read an item filter Parquet file (an ``item_id`` column; other columns ignored) and map its ids to rows.

    Parameters
    ----------
    path : str or PathLike
    item_ids : np.ndarray, shape (n_items,)
        The items' ids in file order.
    what : {"allow", "deny"}
        For messages.

    Raises
    ------
    InputError
        Bad file or columns; a null id (naming the row); ids of another type than the items'; an allow file with no
        id of the items file (empty, or every id unknown).
    """
    path = os.fspath(path)
    item_ids = np.asarray(item_ids)
    pf = _open_item_set(path, what)
    parts, row = [], 0
    for batch in iter_batches(pf, path, ["item_id"], READ_BATCH_ROWS):
        col = batch.column(0)
        if col.null_count:
            raise InputError(f"{path}: row {row + first_true(col.is_null().to_numpy(zero_copy_only=False))} has a "
                             f"null item_id")
        parts.append(match_type(path, "item_id", col, item_ids, "items'", row))
        row += batch.num_rows
    if not parts:
        _empty_of(pf, path, "item_id", item_ids, "items'")
    found = lookup(pa.chunked_array(parts), item_ids) if parts else np.zeros(0, np.int64)
    known = found[found >= 0]
    if what == "allow" and known.size == 0:
        # Every user would get an empty list: a filter of the day that does not match the catalogue is a mistake
        # to stop on, not candidates to serve.
        raise InputError(f"{path}: the allow file names no item of the items file ({found.size:,} ids, "
                         f"{found.size:,} unknown): every user would get no candidates")
    return ItemSet(np.unique(known), int(found.size), int(found.size - known.size))
