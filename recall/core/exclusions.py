"""Per-user exclusions ("never return this item to this user") as CSR over user rows, and the grouping of
(user, item) pairs into CSR that every pair source shares (exclusion files, candidate files, API mappings).

Grouping is a counting sort (linear in the pairs, compiled with numba, no per-pair Python), and the item rows of
each user are sorted and de-duplicated in parallel where the consumer needs them so (the selection kernels walk a
user's exclusions in row order); input that is already sorted and unique is recognised and kept as it is.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit, prange

from .errors import InputError
from .results import to_numpy


@njit(cache=True)
def _group(users: np.ndarray, items: np.ndarray, n_users: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs -> CSR (indptr (n_users + 1,), items grouped by user, each user's items in input order); a pair with a
    negative user or item row (an unknown id) is skipped."""
    indptr = np.zeros(n_users + 1, np.int64)
    for i in range(users.size):
        if users[i] >= 0 and items[i] >= 0:
            indptr[users[i] + 1] += 1
    for u in range(n_users):
        indptr[u + 1] += indptr[u]
    pos = indptr[:-1].copy()
    out = np.empty(indptr[n_users], items.dtype)
    for i in range(users.size):
        u = users[i]
        if u >= 0 and items[i] >= 0:
            out[pos[u]] = items[i]
            pos[u] += 1
    return indptr, out


@njit(parallel=True, cache=True)
def _sort_unique(indptr: np.ndarray, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each user's item rows sorted and de-duplicated: a new (indptr, items)."""
    n_users = indptr.size - 1
    keep = np.zeros(n_users + 1, np.int64)
    for u in prange(n_users):
        lo, hi = indptr[u], indptr[u + 1]
        if hi - lo > 32:
            items[lo:hi] = np.sort(items[lo:hi])
        else:  # a user's few rows (the common case): insertion sort, no call or copy
            for j in range(lo + 1, hi):
                v = items[j]
                i = j - 1
                while i >= lo and items[i] > v:
                    items[i + 1] = items[i]
                    i -= 1
                items[i + 1] = v
        n = 0
        for j in range(lo, hi):
            if j == lo or items[j] != items[j - 1]:
                n += 1
        keep[u + 1] = n
    for u in range(n_users):
        keep[u + 1] += keep[u]
    out = np.empty(keep[n_users], items.dtype)
    for u in prange(n_users):
        w = keep[u]
        for j in range(indptr[u], indptr[u + 1]):
            if j == indptr[u] or items[j] != items[j - 1]:
                out[w] = items[j]
                w += 1
    return keep, out


@njit(parallel=True, cache=True)
def _scan(indptr: np.ndarray, items: np.ndarray, n_items: int) -> tuple[int, bool]:
    """One parallel pass over a CSR's item rows: (position of the first row outside ``0..n_items-1``, or -1;
    whether every user's rows are strictly increasing)."""
    n_users = indptr.size - 1
    first_bad = np.full(n_users, -1, np.int64)
    unsorted = np.zeros(n_users, np.bool_)
    for u in prange(n_users):
        lo, hi = indptr[u], indptr[u + 1]
        bad = -1
        rising = True
        for j in range(lo, hi):
            v = items[j]
            if bad < 0 and (v < 0 or v >= n_items):
                bad = j
            if j > lo and v <= items[j - 1]:
                rising = False
        first_bad[u] = bad
        unsorted[u] = not rising
    bad = -1
    for u in range(n_users):
        if first_bad[u] >= 0:
            bad = first_bad[u]
            break
    return bad, not unsorted.any()


def _is_sorted_unique(indptr: np.ndarray, items: np.ndarray) -> bool:
    """Whether every user's item rows are strictly increasing."""
    return bool(_scan(indptr, items, np.iinfo(np.int64).max)[1])


def group(users: np.ndarray, items: np.ndarray, n_users: int, sort_unique: bool) -> tuple[np.ndarray, np.ndarray]:
    """(indptr (n_users + 1,) int64, item rows) of pairs ``users[i], items[i]`` (integer rows of any width, users
    below ``n_users``; a pair with a negative row on either side is skipped, without a filtered copy): each user's
    items in input order, or sorted and unique. The item rows are int32 where both inputs are (a job's pairs: 4
    bytes a pair, in memory and in a batch job's mapped files, rather than 8), else int64."""
    users, items = np.ascontiguousarray(users), np.ascontiguousarray(items)
    if users.dtype != items.dtype or users.dtype not in (np.int32, np.int64):
        users, items = users.astype(np.int64), items.astype(np.int64)
    indptr, grouped = _group(users, items, int(n_users))
    if sort_unique and not _is_sorted_unique(indptr, grouped):
        indptr, grouped = _sort_unique(indptr, grouped)
    return indptr, grouped


@dataclass(frozen=True)
class Exclusions:
    """CSR of excluded item rows: user ``u`` excludes ``items[indptr[u]:indptr[u+1]]``, sorted and unique."""

    indptr: np.ndarray  # (n_users + 1,) int64
    items: np.ndarray  # (nnz,) int64, or int32 as given (a job's pairs, a CSR pair of int32 rows)

    @classmethod
    def empty(cls, n_users: int) -> "Exclusions":
        """No pairs, for ``n_users`` users. The indptr's zeros take no memory (a read-only view of one zero): a
        search without exclusions wrote 8 MB of them for 1M users, and then read them back block by block (1-3 ms
        of such a search's host time, docs/benchmarks.md)."""
        return cls(np.broadcast_to(np.zeros(1, np.int64), (n_users + 1,)), np.zeros(0, np.int64))

    def block(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """The CSR of users ``start:stop``, re-based to start at 0."""
        ptr = self.indptr[start:stop + 1]
        return ptr - ptr[0], self.items[ptr[0]:ptr[-1]]

    def subset(self, users: np.ndarray) -> "Exclusions":
        """The exclusions of the given user rows, in that order, as CSR over them."""
        indptr, items = take(self.indptr, self.items, users)
        return Exclusions(indptr, items)

    def count(self, user: int) -> int:
        return int(self.indptr[user + 1] - self.indptr[user])

    def window(self, lo: int, hi: int) -> "Exclusions":
        """The exclusions of item rows ``lo:hi``, as rows of that range (``row - lo``): for a search of a segment of
        the items."""
        if self.items.size == 0:
            return self
        keep = (self.items >= lo) & (self.items < hi)
        kept = np.zeros(keep.size + 1, np.int64)  # kept[j]: how many of the first j pairs are in the range
        np.cumsum(keep, out=kept[1:])
        return Exclusions(kept[self.indptr], self.items[keep] - lo)


def take(indptr: np.ndarray, items: np.ndarray, users: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The CSR rows ``users`` (int64, any order, -1 for "none") of a CSR, as a CSR over them (vectorised)."""
    users = np.asarray(users, np.int64)
    has = users >= 0
    if indptr.size < 2:  # a CSR of no rows: nobody has anything
        return np.zeros(users.size + 1, np.int64), items[:0]
    safe = np.where(has, users, 0)
    starts = np.where(has, indptr[safe], 0)
    counts = np.where(has, indptr[safe + 1] - starts, 0)
    out_ptr = np.zeros(users.size + 1, np.int64)
    np.cumsum(counts, out=out_ptr[1:])
    total = int(out_ptr[-1])
    if total == 0:
        return out_ptr, items[:0]
    # Position j of the output takes items[starts[u] + (j - first output position of u)].
    return out_ptr, items[np.repeat(starts - out_ptr[:-1], counts) + np.arange(total, dtype=np.int64)]


def _int_array(values: Any, what: str, keep_int32: bool = False) -> np.ndarray:
    """``values`` on the host as int64, or as they are where ``keep_int32`` and they are int32 (item rows: a job's
    pairs are int32, and widening them cost each search a copy of them all, 4 more bytes a pair)."""
    arr = to_numpy(values)  # device arrays (CuPy) come to the host once: the blocks are staged from there
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise InputError(f"exclude: {what} must be integers, got dtype {arr.dtype}")
    if keep_int32 and arr.dtype == np.int32:
        return arr.ravel()
    return arr.astype(np.int64, copy=False).ravel()


def normalise(exclude: Any, n_users: int, n_items: int) -> Exclusions:
    """Turn ``exclude`` into sorted, de-duplicated CSR.

    Parameters
    ----------
    exclude : None, Exclusions, mapping {user_row: iterable of item rows}, or (indptr, item_rows)
        ``indptr`` has shape (n_users + 1,); both are integer arrays, on the host or the device (copied to the
        host once). Within a user, rows may come in any order and repeat; already sorted and unique rows are kept
        as they are (checked in one vectorised pass).

    Raises
    ------
    InputError
        On a user or item row out of range, or a malformed CSR pair.
    """
    if exclude is None:
        return Exclusions.empty(n_users)
    if isinstance(exclude, Exclusions):
        if exclude.indptr.shape != (n_users + 1,):
            raise InputError(f"exclude: covers {exclude.indptr.size - 1} users, expected {n_users}")
        return exclude
    if isinstance(exclude, Mapping):
        users, items, given = [], [], []
        for user, rows in exclude.items():
            if isinstance(user, (bool, np.bool_)) or not isinstance(user, (int, np.integer)):
                raise InputError(f"exclude: user key {user!r} is not an integer row position")
            if not 0 <= user < n_users:
                raise InputError(f"exclude: user row {user} is out of range for {n_users} users")
            if not isinstance(rows, np.ndarray):
                try:
                    rows = list(rows)
                except TypeError:
                    raise InputError(f"exclude: the items of user row {user} must be an iterable of item rows, got "
                                     f"{type(rows).__name__}") from None
            given.append(rows)
            rows = _int_array(rows, f"items of user row {user}")
            users.append(np.full(rows.size, user, np.int64))
            items.append(rows)
        user_of = np.concatenate(users) if users else np.zeros(0, np.int64)
        item_rows = np.concatenate(items) if items else np.zeros(0, np.int64)

        def as_given(pos: int) -> int:
            # The users' rows were concatenated in order: the position within the bad row's own user.
            starts = np.cumsum([0] + [part.size for part in items])
            part = int(np.searchsorted(starts, pos, side="right") - 1)
            return _as_given(given[part], pos - int(starts[part]))

        _check_items(item_rows, n_items, lambda pos: int(user_of[pos]), as_given)
        return Exclusions(*group(user_of, item_rows, n_users, sort_unique=True))
    if isinstance(exclude, tuple) and len(exclude) == 2:
        indptr = _int_array(exclude[0], "indptr")
        item_rows = _int_array(exclude[1], "item rows", keep_int32=True)
        if indptr.shape != (n_users + 1,):
            raise InputError(f"exclude: indptr has {indptr.size} entries, expected n_users + 1 = {n_users + 1}")
        if indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] != item_rows.size:
            raise InputError("exclude: indptr must start at 0, never decrease and end at len(item_rows)")
        # Range and order in one parallel pass: a search with millions of pairs pays milliseconds for it.
        bad, sorted_unique = _scan(indptr, item_rows, int(n_items))
        if bad >= 0:
            user = int(np.searchsorted(indptr, bad, side="right") - 1)
            raise InputError(f"exclude: item row {_as_given(exclude[1], bad)} (user row {user}) is out of range "
                             f"for {n_items} items")
        if sorted_unique:
            return Exclusions(indptr, item_rows)
        return Exclusions(*_sort_unique(indptr, item_rows.copy()))
    raise InputError(
        f"exclude must be None, a mapping {{user_row: item rows}} or a CSR pair (indptr, item_rows); "
        f"got {type(exclude).__name__}"
    )


def _check_items(item_rows: np.ndarray, n_items: int, user_at: Any, given_at: Any) -> None:
    """InputError naming the first item row out of range (as the caller gave it: ``given_at(pos)``) and its
    user."""
    if not item_rows.size:
        return
    bad = (item_rows < 0) | (item_rows >= n_items)
    if bad.any():
        pos = int(np.argmax(bad))
        raise InputError(f"exclude: item row {given_at(pos)} (user row {user_at(pos)}) is out of range for "
                         f"{n_items} items")


def _as_given(values: Any, pos: int) -> int:
    """Entry ``pos`` of the caller's integer rows ``values`` as the caller gave it: a uint64 row beyond the int64
    range is negative once cast, and a message must not name a row the caller never gave."""
    return int(to_numpy(values).ravel()[pos])
