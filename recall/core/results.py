"""The result of a search: per-user top-k item rows, ids and scores, best first."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import numba
from numba import njit, prange

from . import keys
from .errors import InputError

_MAX_LIST_VALUES = 1 << 30
#: Gathers of at least this many ids run on every core (:func:`take_ids`); smaller ones by NumPy, whose single call
#: costs less than starting the threads (an embedded engine's few users).
PARALLEL_TAKE = 1 << 16


def to_numpy(arr: Any) -> np.ndarray:
    """``arr`` on the host: a NumPy array as it is, a device (CuPy) array copied, anything else through
    ``np.asarray``."""
    get = getattr(arr, "get", None)
    return get() if callable(get) and not isinstance(arr, np.ndarray) else np.asarray(arr)


def pad(xp: Any, found_vals: Any, found_rows: Any, k: int) -> tuple[Any, Any]:
    """(n, k) results from (n, k_sel) ones, k_sel <= k, arrays of module ``xp``: padded with -inf scores and -1 rows."""
    n_users, k_sel = found_vals.shape
    if k_sel == k:
        return found_vals, found_rows
    vals = xp.full((n_users, k), -np.inf, dtype=np.float32)
    rows = xp.full((n_users, k), -1, dtype=np.int64)
    vals[:, :k_sel], rows[:, :k_sel] = found_vals, found_rows
    return vals, rows


def merge_topk(xp: Any, parts: list[tuple[Any, Any]], k: int) -> tuple[Any, Any]:
    """The exact top-k per user of top-k lists computed over consecutive item ranges (the item shards of
    ``recall batch --item-shards``): the best ``k`` by score, equal scores to the lower item row, padding (-inf, -1)
    last; arrays of module ``xp``.

    Parameters
    ----------
    xp : module
        numpy or cupy, the module of the arrays.
    parts : list of (scores (n, w_i) float32, rows (n, w_i) int64)
        One part per item range, in increasing row order: every row of a part lies above every row of the parts
        before it. Each part's lists are best first (score descending, equal scores lower row first), in the space
        the selection ranks in (inner-product space, before ``metrics.finish_scores``), with global item rows and
        padding (-inf, -1) at the end. Widths may differ (a range smaller than k).
    k : int
        Columns of the result (padded where the parts hold fewer items).

    Returns
    -------
    (scores (n, k) float32, rows (n, k) int64)
        Each score keeps the bits it had in its part (-0.0 stays -0.0, which a key folds into +0.0), so the merged
        lists are the ones a search of the whole catalogue returns, bit for bit, when each part's scores are.
    """
    scores = xp.concatenate([p[0] for p in parts], axis=1) if len(parts) > 1 else parts[0][0]
    rows = xp.concatenate([p[1] for p in parts], axis=1) if len(parts) > 1 else parts[0][1]
    if rows.shape[1] == 0:  # no part holds an item (a filter that passes none)
        return pad(xp, scores.astype(xp.float32), rows.astype(xp.int64), k)
    # Within a part equal scores come by increasing row, and each part's rows lie above the previous part's: the
    # position in the concatenation orders ties exactly as the rows do. Selecting on (score, position) with the one
    # select-k (recall.core.keys) and gathering the parts' own values keeps every score's bits.
    positions = xp.where(rows >= 0, xp.arange(rows.shape[1], dtype=xp.int64)[None, :], -1)
    _, best = keys.select(xp, scores, positions, k)
    found = best >= 0
    safe = xp.maximum(best, 0)
    out_scores = xp.where(found, xp.take_along_axis(scores, safe, axis=1), xp.float32(-np.inf)).astype(xp.float32)
    out_rows = xp.where(found, xp.take_along_axis(rows, safe, axis=1), -1).astype(xp.int64)
    return out_scores, out_rows


def _take_kernel(ids: np.ndarray, rows: np.ndarray, pad: Any, out: np.ndarray) -> tuple[int, int]:
    """``out[i] = ids[rows[i]]``, ``pad`` where ``rows[i] < 0``, without the GIL: (rows below 0, rows beyond ``ids``,
    left unset)."""
    n = ids.shape[0]
    below = 0
    beyond = 0
    for i in prange(rows.shape[0]):
        r = rows[i]
        if r < 0:
            out[i] = pad
            below += 1
        elif r >= n:
            beyond += 1
        else:
            out[i] = ids[r]
    return below, beyond


def _threadsafe_pool() -> bool:
    """Whether numba's parallel kernels may run from two threads at once here (a job's writer and searching threads):
    under OpenMP or TBB, not under its fallback, the workqueue, which aborts the process then. OpenMP where it loads
    (TBB only where asked for by name: an installed TBB of another version is passed over for the workqueue)."""
    layer = numba.config.THREADING_LAYER
    if layer in ("workqueue", "forksafe"):  # forksafe may take the workqueue
        return False
    if layer in ("tbb", "safe", "threadsafe"):  # thread-safe layers by numba's own choice (or none at all)
        return True
    try:
        importlib.import_module("numba.np.ufunc.omppool")
        return True
    except ImportError:
        return False


#: On every core where numba's threads may be shared by a job's threads, else on one, still without the GIL (that
#: build not cached: numba's cache keys a function by its source, not by ``parallel``, and would hand one build to
#: the other).
_take = (njit(parallel=True, nogil=True, cache=True) if _threadsafe_pool() else njit(nogil=True))(_take_kernel)


def take_ids(ids: np.ndarray, rows: np.ndarray, pad: Any = None) -> np.ndarray:
    """Item ids of item rows: ``ids[rows]`` for a numeric host ``ids`` (n_items,) and host int64 ``rows`` of any
    shape, with ``pad`` where a row is negative (None: no row is). Large gathers run on every core without the GIL
    (a Parquet job's writer maps each batch's millions of rows while the searching thread runs Python; on one core
    where numba's threading layer cannot be shared between threads); small ones, and id dtypes numba does not take
    (another byte order, float16), by NumPy. A row beyond ``ids`` raises NumPy's IndexError."""
    compiled = ids.dtype.isnative and (ids.dtype.kind in "iu" or ids.dtype in (np.float32, np.float64))
    if rows.size < PARALLEL_TAKE or not compiled or rows.dtype != np.int64:
        if pad is None:
            return ids[rows]
        out = ids[np.maximum(rows, 0)]
        out[rows < 0] = pad
        return out
    flat = np.ascontiguousarray(rows).reshape(-1)
    out = np.empty(flat.size, ids.dtype)
    below, beyond = _take(ids, flat, ids.dtype.type(0 if pad is None else pad), out)
    if beyond or (below and pad is None):
        return ids[rows]  # NumPy's own answer: its IndexError, or its negative indexing
    return out.reshape(rows.shape)


def id_lookup(ids: np.ndarray) -> np.ndarray | pa.Array:
    """Item ids, shape (n_items,), int64 or object (str), in the form :meth:`SearchResult.to_arrow` maps rows through
    fastest: integers as they are (a NumPy gather), strings as one Arrow array (Arrow's take copies the bytes without
    the GIL, 3x faster than gathering Python strings and converting them)."""
    return pa.array(ids, type=pa.string()) if ids.dtype == object else ids


@dataclass(frozen=True)
class SearchResult:
    """Exact top-k per user.

    Attributes
    ----------
    indices : array of int64, shape (n_users, k)
        Item row positions, best first; -1 where fewer than k items qualify (padding is always at the end of a row).
        ``Engine`` results have ``k = min(k asked, n_items)`` columns: a k beyond the catalogue is never allocated.
    scores : array of float32, shape (n_users, k)
        Scores in the engine's metric, best first; -inf where padded.
    ids : array, shape (n_users, k)
        ``item_ids[indices]``; the row positions themselves when the engine has no ids. Padded slots hold -1 for
        signed integer ids, the dtype's maximum for unsigned ones and ``None`` for string ids: test ``indices < 0``
        to find them.

    ``indices`` and ``scores`` are CuPy arrays when the users were given as device arrays, NumPy arrays otherwise.
    """

    indices: Any
    scores: Any
    ids: Any

    @property
    def n_users(self) -> int:
        return int(self.indices.shape[0])

    @property
    def k(self) -> int:
        return int(self.indices.shape[1])

    def to_arrow(self, user_ids: Any = None, item_ids: Any = None) -> pa.Table:
        """The result as a table ``(user_id, item_ids: list, scores: list<float32>)``, one row per user, padding dropped.

        Parameters
        ----------
        user_ids : array-like, shape (n_users,), optional
            The users' ids, in the order of the searched rows; row positions when omitted.
        item_ids : np.ndarray or pa.Array, shape (n_items,), optional
            The items' ids, for a result of an engine built without them (whose ``ids`` are rows): the item column
            then maps ``indices`` through these, on the host (see :func:`id_lookup` for the fastest form). The
            Parquet jobs work this way, so that the gather runs on their writer thread, not the searching one.

        Raises
        ------
        InputError
            If ``user_ids`` is not one-dimensional with one entry per user.
        """
        n = self.n_users
        if user_ids is None:
            user_col = pa.array(np.arange(n, dtype=np.int64))
        else:
            if isinstance(user_ids, (pa.Array, pa.ChunkedArray)):
                user_col = user_ids
            else:
                host = to_numpy(user_ids)
                if host.ndim != 1:
                    raise InputError(f"to_arrow: user_ids must be one-dimensional, got shape {host.shape}")
                user_col = pa.array(host)
            if len(user_col) != n:
                raise InputError(f"to_arrow: got {len(user_col)} user ids for {n} result rows")
        indices = to_numpy(self.indices)
        # The item lists' values: the result's ids, or its rows when they are mapped through item_ids below.
        if item_ids is not None:
            values = indices
        else:
            values = self.ids if isinstance(self.ids, np.ndarray) else to_numpy(self.ids)
        scores = to_numpy(self.scores)
        rows_per_chunk = max(1, _MAX_LIST_VALUES // max(1, self.k))
        if n > rows_per_chunk:
            # Arrow list offsets are 32-bit: build the table in row ranges that each stay under 2^31 values.
            parts = [SearchResult(indices[s:s + rows_per_chunk], scores[s:s + rows_per_chunk],
                                  values[s:s + rows_per_chunk]).to_arrow(user_col.slice(s, rows_per_chunk), item_ids)
                     for s in range(0, n, rows_per_chunk)]
            return pa.concat_tables(parts)
        keep = indices >= 0
        if keep.all():
            # The common case (no padding): the row-major arrays are the list values as they are, no masking copy.
            offsets = np.arange(0, n * self.k + 1, self.k, dtype=np.int32) if n else np.zeros(1, np.int32)
            flat_values, flat_scores = values.reshape(-1), scores.reshape(-1).astype(np.float32, copy=False)
        else:
            offsets = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(keep.sum(axis=1), out=offsets[1:])
            flat_values, flat_scores = values[keep], scores[keep].astype(np.float32, copy=False)
        if isinstance(item_ids, pa.Array):
            flat_ids = item_ids.take(pa.array(flat_values))
        elif item_ids is not None:
            flat_ids = take_ids(np.asarray(item_ids), flat_values)
        else:
            flat_ids = flat_values
        if isinstance(flat_ids, np.ndarray) and flat_ids.dtype == object:
            flat_ids = pa.array(flat_ids, type=pa.string())
        item_col = pa.ListArray.from_arrays(pa.array(offsets), flat_ids)
        score_col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_scores, type=pa.float32()))
        return pa.table({"user_id": user_col, "item_ids": item_col, "scores": score_col})
