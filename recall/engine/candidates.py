"""Per-user candidate lists (``Engine.rescore``): validated once, into CSR over user rows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.errors import InputError
from ..core.results import to_numpy


@dataclass(frozen=True)
class Candidates:
    """Candidate lists as CSR over user rows, validated (every row in range), duplicates still in.

    Attributes
    ----------
    indptr : np.ndarray of int64, shape (n_users + 1,)
        On the host: user ``u``'s candidates are ``rows[indptr[u]:indptr[u + 1]]``.
    rows : array of int64, shape (nnz,)
        Item rows; NumPy, or a device array when the caller passed device arrays to a GPU engine.
    """

    indptr: np.ndarray
    rows: Any

    @property
    def nnz(self) -> int:
        return int(self.indptr[-1])

    def filtered(self, passing: np.ndarray, xp: Any) -> "Candidates":
        """The candidates whose item passes (``passing``: host bool (n_items,)), per user in the same order;
        ``xp``: the array module of ``rows``."""
        if not self.nnz:
            return self
        keep = xp.asarray(passing)[self.rows]
        kept_before = np.concatenate([[0], np.cumsum(to_numpy(keep))]).astype(np.int64)
        return Candidates(kept_before[self.indptr], self.rows[keep])


def _int_rows(xp: Any, arr: Any, what: str) -> Any:
    """``arr`` as a 1-d int64 array of module ``xp``; InputError for anything but integers (empty is fine)."""
    arr = xp.asarray(arr) if xp is not np else np.asarray(to_numpy(arr))
    if arr.size == 0:
        return xp.zeros(0, xp.int64)
    if arr.dtype.kind not in "iu":
        raise InputError(f"candidates: {what} must be integer item rows, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise InputError(f"candidates: {what} must be 1-d, got shape {tuple(arr.shape)}")
    beyond = arr > np.iinfo(np.int64).max if arr.dtype == np.uint64 else None
    if beyond is not None and bool(beyond.any()):
        pos = int(xp.argmax(beyond))
        raise InputError(f"candidates: {what} has item row {int(arr[pos])} at position {pos}, beyond any item row")
    return xp.ascontiguousarray(arr.astype(xp.int64, copy=False))  # the GPU kernel reads it as flat memory


def normalise_candidates(candidates: Any, n_users: int, n_items: int, backend: Any) -> Candidates:
    """Turn ``candidates`` into validated CSR.

    Parameters
    ----------
    candidates : (indptr, item_rows) tuple, a sequence of ``n_users`` integer arrays, or an (n_users, width) matrix
        CSR: ``indptr`` (n_users + 1,) and ``item_rows`` (nnz,) integer arrays; or one array (or list) of item rows
        per user; or a 2-d integer matrix, one row of candidates per user, -1 where there is none (a search's
        ``indices``, padding included). Host arrays, or the backend's own device
        arrays (they then stay on the device).
    n_users, n_items : int
    backend : Backend
        The engine's backend: it tells which arrays are its own.

    Raises
    ------
    InputError
        A malformed CSR pair, a wrong number of lists, non-integer rows, or an item row out of range (the message
        names the user row, the position in its list and the row).
    """
    if isinstance(candidates, tuple) and len(candidates) == 2:
        indptr_in, rows_in = candidates
        xp = backend.module_of(rows_in)
        indptr = np.asarray(to_numpy(indptr_in))
        if indptr.dtype.kind not in "iu" or indptr.ndim != 1:
            raise InputError(f"candidates: indptr must be a 1-d integer array, got dtype {indptr.dtype} and shape "
                             f"{indptr.shape}")
        indptr = indptr.astype(np.int64)
        rows = _int_rows(xp, rows_in, "item_rows")
        if indptr.shape != (n_users + 1,):
            raise InputError(f"candidates: indptr has {indptr.size} entries, expected n_users + 1 = {n_users + 1}")
        if indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] != rows.size:
            raise InputError("candidates: indptr must start at 0, never decrease and end at len(item_rows)")
    elif getattr(candidates, "ndim", None) == 2:
        # A (n_users, width) matrix: every user has ``width`` candidates (a retriever's fixed-size output).
        xp = backend.module_of(candidates)
        arr = candidates if xp is not np else np.asarray(to_numpy(candidates))
        if arr.shape[0] != n_users:
            raise InputError(f"candidates: a matrix of {arr.shape[0]} rows for {n_users} users (one row per user)")
        rows = _int_rows(xp, xp.ascontiguousarray(arr).reshape(-1), "item_rows")
        indptr = np.arange(n_users + 1, dtype=np.int64) * int(arr.shape[1])
        # -1 is no candidate: a SearchResult's padding, so that a search's indices can be re-scored as they are.
        # Dropped once the rows are checked, so that an error names the matrix's own column.
        padded = rows == -1
        _check_range(xp, rows, indptr, n_items, padded)
        if rows.size and bool(padded.any()):
            kept = to_numpy((~padded).reshape(n_users, -1).sum(axis=1))
            indptr = np.zeros(n_users + 1, np.int64)
            np.cumsum(kept, out=indptr[1:])
            rows = rows[~padded]
        return Candidates(indptr, rows)
    elif isinstance(candidates, (list, tuple)) or (hasattr(candidates, "__len__") and not hasattr(candidates, "shape")):
        lists = list(candidates)
        if len(lists) != n_users:
            raise InputError(f"candidates: got {len(lists)} lists for {n_users} users (one list per user row)")
        on_device = len(lists) > 0 and all(backend.module_of(a) is not np for a in lists)
        xp = backend.xp if on_device else np
        parts = []
        for u, lst in enumerate(lists):
            lst = lst if on_device or hasattr(lst, "ndim") else np.asarray(lst)
            if getattr(lst, "ndim", 1) != 1:
                raise InputError(f"candidates: the list of user row {u} must be 1-d, got shape {tuple(lst.shape)}")
            parts.append(_int_rows(xp, lst, f"the list of user row {u}"))
        indptr = np.zeros(n_users + 1, np.int64)
        np.cumsum([p.size for p in parts], out=indptr[1:])
        rows = xp.concatenate(parts) if parts else xp.zeros(0, xp.int64)
    else:
        raise InputError(f"candidates must be a CSR pair (indptr, item_rows) or a list of item-row arrays, one per "
                         f"user; got {type(candidates).__name__}")
    _check_range(xp, rows, indptr, n_items)
    return Candidates(indptr, rows)


def _check_range(xp: Any, rows: Any, indptr: np.ndarray, n_items: int, allowed: Any = None) -> None:
    """InputError naming the user, the position in its list and the row of the first row outside the items (but
    where ``allowed``, a mask of rows that may be -1)."""
    if rows.size:
        bad = (rows < 0) | (rows >= n_items)
        if allowed is not None:
            bad &= ~allowed
        if bool(bad.any()):
            pos = int(xp.argmax(bad))
            user = int(np.searchsorted(indptr, pos, side="right") - 1)
            raise InputError(f"candidates: user row {user} has item row {int(rows[pos])} at position "
                             f"{pos - int(indptr[user])} of its list, out of range for {n_items} items")
