"""Per-user exclusions ("never return this item to this user") as CSR over user rows."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InputError


@dataclass(frozen=True)
class Exclusions:
    """CSR of excluded item rows: user ``u`` excludes ``items[indptr[u]:indptr[u+1]]``, sorted and unique."""

    indptr: np.ndarray  # (n_users + 1,) int64
    items: np.ndarray  # (nnz,) int64

    @classmethod
    def empty(cls, n_users: int) -> "Exclusions":
        return cls(np.zeros(n_users + 1, np.int64), np.zeros(0, np.int64))

    def block(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """The CSR of users ``start:stop``, re-based to start at 0."""
        ptr = self.indptr[start:stop + 1]
        return ptr - ptr[0], self.items[ptr[0]:ptr[-1]]

    def subset(self, users: np.ndarray) -> "Exclusions":
        """The exclusions of the given user rows, in that order, as CSR over them."""
        counts = self.indptr[users + 1] - self.indptr[users]
        indptr = np.zeros(users.size + 1, np.int64)
        np.cumsum(counts, out=indptr[1:])
        if not self.items.size:
            return Exclusions(indptr, self.items)
        take = np.concatenate([self.items[self.indptr[u]:self.indptr[u + 1]] for u in users]) if users.size \
            else self.items[:0]
        return Exclusions(indptr, take)

    def count(self, user: int) -> int:
        return int(self.indptr[user + 1] - self.indptr[user])


def _int_array(values: Any, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise InputError(f"exclude: {what} must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False).ravel()


def normalise(exclude: Any, n_users: int, n_items: int) -> Exclusions:
    """Turn ``exclude`` into sorted, de-duplicated CSR.

    Parameters
    ----------
    exclude : None, mapping {user_row: iterable of item rows}, or (indptr, item_rows)
        ``indptr`` has shape (n_users + 1,); both are integer arrays on the host.

    Raises
    ------
    InputError
        On a user or item row out of range, or a malformed CSR pair.
    """
    if exclude is None:
        return Exclusions.empty(n_users)
    if isinstance(exclude, Mapping):
        users, items = [], []
        for user, rows in exclude.items():
            if isinstance(user, (bool, np.bool_)) or not isinstance(user, (int, np.integer)):
                raise InputError(f"exclude: user key {user!r} is not an integer row position")
            if not 0 <= user < n_users:
                raise InputError(f"exclude: user row {user} is out of range for {n_users} users")
            rows = _int_array(list(rows) if not isinstance(rows, np.ndarray) else rows, f"items of user row {user}")
            users.append(np.full(rows.size, user, np.int64))
            items.append(rows)
        user_of = np.concatenate(users) if users else np.zeros(0, np.int64)
        item_rows = np.concatenate(items) if items else np.zeros(0, np.int64)
    elif isinstance(exclude, tuple) and len(exclude) == 2:
        indptr = _int_array(exclude[0], "indptr")
        item_rows = _int_array(exclude[1], "item rows")
        if indptr.shape != (n_users + 1,):
            raise InputError(f"exclude: indptr has {indptr.size} entries, expected n_users + 1 = {n_users + 1}")
        if indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] != item_rows.size:
            raise InputError("exclude: indptr must start at 0, never decrease and end at len(item_rows)")
        user_of = np.repeat(np.arange(n_users, dtype=np.int64), np.diff(indptr))
    else:
        raise InputError(
            f"exclude must be None, a mapping {{user_row: item rows}} or a CSR pair (indptr, item_rows); "
            f"got {type(exclude).__name__}"
        )
    bad = (item_rows < 0) | (item_rows >= n_items)
    if bad.any():
        pos = int(np.argmax(bad))
        raise InputError(
            f"exclude: item row {int(item_rows[pos])} (user row {int(user_of[pos])}) is out of range for "
            f"{n_items} items"
        )
    order = np.lexsort((item_rows, user_of))
    user_of, item_rows = user_of[order], item_rows[order]
    if item_rows.size:
        keep = np.ones(item_rows.size, bool)
        keep[1:] = (user_of[1:] != user_of[:-1]) | (item_rows[1:] != item_rows[:-1])
        user_of, item_rows = user_of[keep], item_rows[keep]
    indptr = np.zeros(n_users + 1, np.int64)
    np.cumsum(np.bincount(user_of, minlength=n_users), out=indptr[1:])
    return Exclusions(indptr, item_rows)
