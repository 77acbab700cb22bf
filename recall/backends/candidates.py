"""Per-user candidate scoring by gather + strided-batched GEMM + selection: the CPU's re-scoring path, and the GPU's
where its fused kernel does not apply (a k beyond its shared memory; ``EngineOptions(rescore="gemm")``).

Users sorted by list length are cut into blocks whose padded ``(users, longest list, dim)`` gather fits the memory
budget; the block's candidate vectors are gathered, scored with ONE strided-batched GEMM (batch = users, one user
row each: ``backend.gemm_strided_batched``), and each row's best k are selected by ``backend.select`` (64-bit keys
that order like the tie rule). A list longer than a whole block is de-duplicated and scored in chunks.

A backend that calls :func:`rescore_gemm` provides ``xp``, ``asarray``, ``gemm_strided_batched`` and ``select``.
``dots`` replaces the GEMM where each score must be one given float32 sum (``Backend.rescore``'s ``ordered``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# Workspace per padded candidate slot: the gathered vector (4 * dim, counted apart), its score, its row (and the
# sorted copy of the rows), and the 64-bit keys of the selection with the copy the sort makes.
_SLOT_BYTES_FIXED = 4 + 8 + 8 + 16


#: users (n, dim), gathered vectors (n, width, dim) -> scores (n, width) float32, backend arrays.
Dots = Callable[[Any, Any], Any]


def list_width(indptr: Any) -> int | None:
    """The one length of every list where ``Backend.rescore``'s ``indptr`` is an int w, else None (CSR offsets)."""
    return int(indptr) if isinstance(indptr, (int, np.integer)) else None


def csr_indptr(indptr: Any, n_users: int) -> np.ndarray:
    """``Backend.rescore``'s ``indptr`` as a host int64 (n_users + 1,) array: an int w is every user's list w rows
    long."""
    width = list_width(indptr)
    return indptr if width is None else np.arange(n_users + 1, dtype=np.int64) * width


def rescore_gemm(backend: Any, users: Any, items: Any, indptr: np.ndarray | int, rows: Any, k: int, budget: int,
                 out_vals: Any, out_rows: Any, dots: Dots | None = None) -> None:
    """Fill ``out_vals`` / ``out_rows`` ((n, k) backend arrays, padded on entry) with each user's best ``k`` among
    ``rows[indptr[u]:indptr[u + 1]]``.

    users : (n, dim) float32, host or backend; items : (n_items, dim) float32 on the backend; indptr : host int64
    (n + 1,), or an int w (:func:`csr_indptr`); rows : int64 item rows, host or backend, duplicates allowed (counted
    once); budget : bytes; dots: the scores of a block (default: one strided-batched GEMM).
    """
    xp = backend.xp
    dim = int(items.shape[1])
    users_b = backend.asarray(users)
    indptr = csr_indptr(indptr, int(users.shape[0]))
    lengths = np.diff(indptr)
    rxp = np if isinstance(rows, np.ndarray) else xp
    slot_bytes = 4 * dim + _SLOT_BYTES_FIXED
    user_bytes = 4 * dim + 40 * k  # the user's row, its results and their selection scratch
    cap = max(1, budget // slot_bytes)
    max_users = max(1, min(budget // user_bytes, 65_535))  # also within every cuBLAS's batch-count limit
    # Short lists first: a block's users then have similar lengths, so padding to the block's longest costs little.
    nonempty = np.flatnonzero(lengths > 0)
    order = nonempty[np.argsort(lengths[nonempty], kind="stable")]
    ls = lengths[order]
    i = 0
    while i < order.size:
        if ls[i] > cap:
            for u in order[i:]:  # every user from here on has more candidates than one block holds
                _long_user(backend, users_b, items, rows, indptr, int(u), k, cap, out_vals, out_rows, dots)
            return
        # The largest block [i, j) whose padded size (j - i) * ls[j - 1] fits: ls is sorted, so bisect.
        lo, hi = i + 1, min(order.size, i + max_users)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (mid - i) * int(ls[mid - 1]) <= cap:
                lo = mid
            else:
                hi = mid - 1
        j = lo
        block = order[i:j]
        width = int(ls[j - 1])
        rows_pad = backend.asarray(_padded_rows(rxp, rows, indptr[block], lengths[block], width))
        rows_pad = _drop_duplicate_rows(xp, rows_pad)
        sel = backend.asarray(block)
        vals, found = _score_block(backend, users_b[sel], items, rows_pad, k, dots)
        out_vals[sel] = vals
        out_rows[sel] = found
        i = j


def _padded_rows(rxp: Any, rows: Any, starts: np.ndarray, lengths: np.ndarray, width: int) -> Any:
    """(len(starts), width) int64 of module ``rxp``: row ``i`` holds ``rows[starts[i]:starts[i] + lengths[i]]``,
    then -1."""
    offs = np.arange(width, dtype=np.int64)
    pos = starts[:, None] + offs[None, :]
    valid = offs[None, :] < lengths[:, None]
    pos = np.where(valid, pos, 0)
    if rxp is not np:
        pos, valid = rxp.asarray(pos), rxp.asarray(valid)
    return rxp.where(valid, rows[pos], -1)


def _drop_duplicate_rows(xp: Any, rows_pad: Any) -> Any:
    """Sort each row of a padded (n, width) block and blank (-1) every repeat of an item row: a duplicate must count
    once, and it is removed before scoring because BLAS may score two copies of a row at different positions of a
    block with different rounding (edge kernels), which would defeat a de-duplication by score."""
    rows_pad.sort(axis=1)
    if rows_pad.shape[1] > 1:
        tail = rows_pad[:, 1:]
        rows_pad[:, 1:] = xp.where((tail == rows_pad[:, :-1]) & (tail >= 0), -1, tail)
    return rows_pad


def _score_block(backend: Any, users: Any, items: Any, rows_pad: Any, k: int,
                 dots: Dots | None = None) -> tuple[Any, Any]:
    """The best k of each user's padded candidate block: gather, one strided-batched GEMM (or ``dots``), select."""
    xp = backend.xp
    n, width = rows_pad.shape
    dim = int(items.shape[1])
    gathered = items[xp.maximum(rows_pad, 0)]  # (n, width, dim): padding gathers row 0 and is ignored below
    if dots is not None:
        return backend.select(dots(users, gathered), rows_pad, k)
    scores = xp.empty((n, 1, width), dtype=xp.float32)
    backend.gemm_strided_batched(users.reshape(n, 1, dim), gathered, scores)
    return backend.select(scores.reshape(n, width), rows_pad, k)


def _long_user(backend: Any, users_b: Any, items: Any, rows: Any, indptr: np.ndarray, u: int, k: int, cap: int,
               out_vals: Any, out_rows: Any, dots: Dots | None = None) -> None:
    """A user whose list alone exceeds a block: de-duplicate it whole, then score it in chunks, merging the best k."""
    xp = backend.xp
    lo, hi = int(indptr[u]), int(indptr[u + 1])
    mine = xp.unique(backend.asarray(rows[lo:hi]))  # sorted and unique: chunks cannot share a row
    best_v = best_r = None
    for c0 in range(0, int(mine.size), cap):
        chunk = mine[c0:c0 + cap].reshape(1, -1)
        v, r = _score_block(backend, users_b[u:u + 1], items, chunk, k, dots)
        if best_v is not None:
            v, r = backend.select(xp.concatenate([best_v, v], axis=1), xp.concatenate([best_r, r], axis=1), k)
        best_v, best_r = v, r
    out_vals[u] = best_v[0]
    out_rows[u] = best_r[0]
