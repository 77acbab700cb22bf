"""Exact running top-k on the CPU: a per-user bounded heap fed by a threshold filter.

Selection must cost next to nothing beside the GEMM: after the first tiles almost no score beats a user's k-th best,
so each row is scanned in chunks whose "any score above the threshold?" test vectorises, and only chunks that pass
are walked element by element into the heap. The kernels release the GIL: the CPU backend runs one user block per
core, each on a tile small enough to stay in that core's L2 between the GEMM that writes it and the scan that reads it.

Ordering: (score descending, item row ascending). The heap's root is the worst kept pair. Items arrive in increasing
row order, so a new item with a score equal to the root's never displaces it; a strict ``>`` is the tie rule.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_CHUNK = 64


@njit(inline="always")
def _worse(va, ia, vb, ib):
    """True when pair a ranks below pair b."""
    return va < vb or (va == vb and ia > ib)


@njit(cache=True)
def _replace_root(vals, idx, v, i):
    """Put (v, i) at the root of the min-heap ``vals/idx`` and sift it down."""
    k = vals.shape[0]
    pos = 0
    while True:
        child = 2 * pos + 1
        if child >= k:
            break
        right = child + 1
        if right < k and _worse(vals[right], idx[right], vals[child], idx[child]):
            child = right
        if _worse(vals[child], idx[child], v, i):
            vals[pos] = vals[child]
            idx[pos] = idx[child]
            pos = child
        else:
            break
    vals[pos] = v
    idx[pos] = i


@njit(nogil=True, cache=True)
def heap_update(scores, item_start, n_items, heap_vals, heap_idx, excl_indptr, excl_items):
    """Merge a score tile (n_tiles, n_users, width) into per-user heaps (n_users, k)."""
    n_tiles, n_users, width = scores.shape
    for u in range(n_users):
        hv = heap_vals[u]
        hi = heap_idx[u]
        thr = hv[0]
        e = excl_indptr[u]
        e_end = excl_indptr[u + 1]
        while e < e_end and excl_items[e] < item_start:
            e += 1
        for b in range(n_tiles):
            base = item_start + b * width
            stop = min(width, n_items - base)
            row = scores[b, u]
            for c0 in range(0, stop, _CHUNK):
                c1 = min(c0 + _CHUNK, stop)
                above = 0
                for t in range(c0, c1):
                    above += row[t] > thr
                if above == 0:
                    continue
                for t in range(c0, c1):
                    s = row[t]
                    if s > thr:
                        j = base + t
                        while e < e_end and excl_items[e] < j:
                            e += 1
                        if e < e_end and excl_items[e] == j:
                            continue
                        _replace_root(hv, hi, s, j)
                        thr = hv[0]


@njit(nogil=True, cache=True)
def heap_sort_rows(heap_vals, heap_idx, out_vals, out_idx):
    """Heaps -> rows sorted best first; padding (-inf, -1) ends each row."""
    n_users, k = heap_vals.shape
    for u in range(n_users):
        order = np.argsort(heap_idx[u], kind="mergesort")
        vals = heap_vals[u][order]
        order2 = np.argsort(-vals, kind="mergesort")
        for r in range(k):
            out_vals[u, r] = vals[order2[r]]
            out_idx[u, r] = heap_idx[u][order[order2[r]]]
        for r in range(k):
            if out_idx[u, r] < 0:
                out_vals[u, r] = -np.inf


def topk_rows(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of each row of a (n, m) array by (score desc, column asc): a stable reference, for tests and
    small inputs. Returns (values (n, min(k, m)), columns int64)."""
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, axis=1), order.astype(np.int64)
