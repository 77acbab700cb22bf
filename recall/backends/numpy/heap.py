"""Exact running top-k on the CPU: a per-user bounded heap of packed keys, fed by a threshold filter.

Selection must cost next to nothing beside the GEMM: after the first tiles almost no score beats a user's k-th best,
so each row is scanned in chunks of 64 whose "which scores beat the threshold?" bit mask vectorises, and only the
set bits are visited and pushed into the heap. The kernels release the GIL: the CPU backend runs one user block per
core, each on a tile small enough to stay in that core's cache between the GEMM that writes it and the scan that
reads it.

A kept pair is one ``uint64`` key: the score's float32 bits mapped to an unsigned integer of the same order in the
high half, ``0xFFFFFFFF - row`` in the low half. One integer comparison then ranks (score descending, item row
ascending), and an entry is 8 bytes in one array rather than 12 in two: a block's heaps take less of the cache
the score tile needs (cpu-small, skewed data: 1.35 s -> 1.18 s for the whole search; docs/benchmarks.md). Rows go
up to ``MAX_ROWS``; ``-0.0`` is keyed as ``+0.0`` (they are equal scores, so rows order them), and comes out as
``+0.0``.

Each user's heap is 4-ary (children of node i at 4i + 1 .. 4i + 4): half the levels of a binary heap for a sift to
walk, with the four children in one 32-byte run (k=1,000: 3.32 -> 2.89 s on cpu-small; an 8-ary heap measured the
same as the 4-ary). The root is the worst kept pair; each user's threshold is the root's score, as a float32 beside
the heap.
Items arrive in increasing row order, so a new item with a score equal to the root's never displaces it; a strict
``>`` is the tie rule.

From ``BUFFER_MIN_K`` on, a user keeps a buffer of 2k keys instead (:func:`buffer_update`): pairs above its
threshold are appended, and a full buffer is cut back to its k best, whose worst score becomes the threshold. The
same keys, so the same pairs and tie rule; cheaper than sifting once a heap outgrows L1.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_CHUNK = 64
#: The largest item row a key holds (0xFFFFFFFF marks an empty slot).
MAX_ROWS = 0xFFFFFFFE
_LOW = np.uint64(0xFFFFFFFF)
_SIGN = np.uint64(0x80000000)
_SHIFT = np.uint64(32)
#: An empty slot: score -inf, row 0xFFFFFFFF; below the key of any pair a search can keep.
EMPTY_KEY = np.uint64(0x007FFFFF) << _SHIFT

# The position of a 64-bit mask's lowest set bit by a de Bruijn sequence: its isolated bit times the sequence puts
# a distinct pattern in the top 6 bits, which this table maps back to the position.
_DE_BRUIJN = 0x03F79D71B4CB0A89
_BIT_OF = np.zeros(64, np.int64)
for _bit in range(64):
    _BIT_OF[((_DE_BRUIJN << _bit) & 0xFFFFFFFFFFFFFFFF) >> 58] = _bit
assert sorted(_BIT_OF.tolist()) == list(range(64))
_DE_BRUIJN = np.uint64(_DE_BRUIJN)


def new_heaps(n_users: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Empty heaps for ``n_users`` users: keys (n_users, k) uint64 and thresholds (n_users,) float32."""
    keys, thr = np.empty((n_users, k), np.uint64), np.empty(n_users, np.float32)
    reset_heaps(keys, thr)
    return keys, thr


def reset_heaps(keys: np.ndarray, thr: np.ndarray) -> None:
    keys[...] = EMPTY_KEY
    thr[...] = -np.inf


#: From this k on, users keep buffers of 2k keys cut back to k when full, not heaps (:func:`buffer_update`).
BUFFER_MIN_K = 640


def new_buffers(n_users: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Empty buffers for ``n_users`` users: keys (n_users, 2k) uint64, thresholds (n_users,) float32, counts."""
    keys, thr, counts = np.empty((n_users, 2 * k), np.uint64), np.empty(n_users, np.float32), np.empty(n_users,
                                                                                                     np.int64)
    reset_buffers(counts, thr)
    return keys, thr, counts


def reset_buffers(counts: np.ndarray, thr: np.ndarray) -> None:
    counts[...] = 0
    thr[...] = -np.inf


def keys_of(vals: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The keys of (score, row) pairs, as the kernels make them; a row of -1 is an empty slot (for tests)."""
    bits = np.asarray(vals, np.float32).view(np.uint32).astype(np.uint64)
    bits[bits == _SIGN] = 0
    high = np.where(bits >> np.uint64(31), bits ^ _LOW, bits ^ _SIGN)
    keys = (high << _SHIFT) | (_LOW - (np.asarray(rows).astype(np.uint64) & _LOW))
    return np.where(np.asarray(rows) < 0, EMPTY_KEY, keys).astype(np.uint64)


@njit(inline="always")
def _key(bits, row):
    """The key of score bits (uint32 of a float32) and an item row."""
    x = np.uint64(bits)
    if x == _SIGN:  # -0.0 ranks as +0.0
        x = np.uint64(0)
    x ^= _LOW if x >> np.uint64(31) else _SIGN
    return (x << _SHIFT) | (_LOW - np.uint64(row))


@njit(inline="always")
def _score_bits(key):
    """The float32 bits of a key's score."""
    x = key >> _SHIFT
    x ^= _SIGN if x >> np.uint64(31) else _LOW
    return np.uint32(x)


@njit(inline="always")
def _replace_root(keys, key):
    """Put ``key`` at the root of the 4-ary min-heap ``keys`` and sift it down."""
    k = keys.shape[0]
    pos = 0
    child = 1
    while child < k:
        best = child
        low = keys[child]
        for c in range(child + 1, min(child + 4, k)):
            v = keys[c]
            if v < low:
                low = v
                best = c
        if low >= key:
            break
        keys[pos] = low
        pos = best
        child = 4 * pos + 1
    keys[pos] = key


@njit(inline="always")
def lowest_bit(m):
    """The position of the lowest set bit of ``m`` (uint64, not 0)."""
    return _BIT_OF[((m & (~m + np.uint64(1))) * _DE_BRUIJN) >> np.uint64(58)]


@njit(inline="always")
def _above(row, c0, n, thr):
    """Bit t set where ``row[c0 + t] > thr``, for t < n <= 64."""
    m = np.uint64(0)
    for t in range(n):
        m |= np.uint64(row[c0 + t] > thr) << np.uint64(t)
    return m


@njit(nogil=True, cache=True)
def heap_update(scores, item_start, n_items, heap_keys, heap_thr, excl_indptr, excl_items):
    """Merge a score tile (n_tiles, n_users, width) into per-user heaps: keys (n_users, k), thresholds (n_users,)."""
    _update(scores, item_start, n_items, heap_keys, np.zeros(0, np.int64), heap_thr, heap_keys.shape[1],
            excl_indptr, excl_items, False)


@njit(nogil=True, cache=True)
def buffer_update(scores, item_start, n_items, bufs, counts, thrs, k, excl_indptr, excl_items):
    """:func:`heap_update` for large k: each user's pairs above the threshold are appended to a buffer of keys
    (n_users, capacity > k) holding ``counts[u]``; a full buffer is cut back to its k best (``np.partition``),
    whose worst score becomes the threshold. An append costs a store where a heap insertion sifts through
    log4(k) levels of a heap too large for L1 (k=8,192 on cpu-small's items: 1.24 s against 2.11 s)."""
    _update(scores, item_start, n_items, bufs, counts, thrs, k, excl_indptr, excl_items, True)


@njit(nogil=True, cache=True)
def _update(scores, item_start, n_items, keys, counts, thrs, k, excl_indptr, excl_items, buffered):
    n_tiles, n_users, width = scores.shape
    cap = keys.shape[1]
    bits = scores.view(np.uint32)
    scratch = np.empty(1, np.uint32)
    as_float = scratch.view(np.float32)
    for u in range(n_users):
        own = keys[u]
        n = counts[u] if buffered else k
        thr = thrs[u]
        e = excl_indptr[u]
        e_end = excl_indptr[u + 1]
        while e < e_end and excl_items[e] < item_start:
            e += 1
        for b in range(n_tiles):
            base = item_start + b * width
            stop = min(width, n_items - base)
            row = scores[b, u]
            row_bits = bits[b, u]
            n_chunks = (stop + _CHUNK - 1) // _CHUNK
            for c in range(n_chunks):
                # Chunks by their number, not ``range(0, stop, _CHUNK)``: LLVM vectorises the mask of a loop of
                # constant length, and not one nested in a stepped range (0.04 against 0.35 ns a score). Only the
                # set bits are visited: a low threshold (large k, the first tiles) costs per score that beats it,
                # not per score of a chunk that holds one.
                c0 = c * _CHUNK
                if c0 + _CHUNK <= stop:
                    m = _above(row, c0, _CHUNK, thr)
                else:
                    m = _above(row, c0, stop - c0, thr)
                while m:
                    t = c0 + lowest_bit(m)
                    m &= m - np.uint64(1)
                    if row[t] <= thr:  # the threshold may have risen since the mask was taken
                        continue
                    j = base + t
                    while e < e_end and excl_items[e] < j:
                        e += 1
                    if e < e_end and excl_items[e] == j:
                        continue
                    key = _key(row_bits[t], j)
                    if not buffered:
                        _replace_root(own, key)
                        scratch[0] = _score_bits(own[0])
                        thr = as_float[0]
                        continue
                    own[n] = key
                    n += 1
                    if n == cap:
                        best = np.partition(own[:n], n - k)
                        scratch[0] = _score_bits(best[n - k])  # the k-th best: the new threshold
                        thr = as_float[0]
                        own[:k] = best[n - k:]
                        n = k
        if buffered:
            counts[u] = n
        thrs[u] = thr


@njit(nogil=True, cache=True)
def seed_buffers(scores, rows, item_norms, user_norms, a, z, k, excl_indptr, excl_items, thrs):
    """Each user's threshold from its scores of a threshold sample (n_users, size) float32, item rows ``rows``
    (sorted) of norms ``item_norms``: below the k-th best of the sampled scores, each first lowered by
    a·|u|·|v_j| + z (``certificate.seed_margin``: the search's own score of an item, another GEMM, may lie below
    the sample's by that much) and rounded down to float32, excluded items left out. Those k items are real, so
    the final k-th best is above the threshold; a user with fewer than k sampled items left keeps -inf.

    The k-th best is bracketed by a radix select on the lowered scores' order-preserving keys, 12 + 12 of their 32
    bits (a histogram each): the threshold is the float32 below the smallest key of the bucket that holds it, at
    most 2^8 float32 steps under the k-th best itself, and a user costs a few passes over its row, not a sort. For
    :func:`buffer_update`'s buffers (empty: the threshold only rises, at each cut, to the k-th best of more than k
    items above it), and for heaps with :func:`seed_heaps`."""
    n_users, size = scores.shape
    low = np.empty(size, np.float32)
    bits = low.view(np.uint32)
    keys = np.empty(size, np.uint32)
    hist = np.empty(4096, np.int64)
    out = np.empty(1, np.uint32)
    as_float = out.view(np.float32)
    for u in range(n_users):
        au = a * user_norms[u]
        for j in range(size):
            x = np.float64(scores[u, j]) - (au * item_norms[j] + z)
            # Rounded to nearest from below: float32 rounding moves x by at most |x|·2^-24 (or half the smallest
            # subnormal), less than is taken off first.
            low[j] = np.float32(x - (abs(x) * 2.0 ** -23 + 2.0 ** -149))
        for e in range(excl_indptr[u], excl_indptr[u + 1]):
            at = np.searchsorted(rows, excl_items[e])
            if at < size and rows[at] == excl_items[e]:
                low[at] = np.float32(np.nan)
        m = 0
        for j in range(size):
            if low[j] > -np.inf:  # NaN (excluded) and -inf left out
                b = bits[j]
                keys[m] = b ^ np.uint32(0xFFFFFFFF) if b >> np.uint32(31) else b ^ np.uint32(0x80000000)
                m += 1
        if m < k:
            thrs[u] = -np.inf
            continue
        hist[:] = 0
        for j in range(m):
            hist[keys[j] >> np.uint32(20)] += 1
        want = k
        top = 4095
        while hist[top] < want:
            want -= hist[top]
            top -= 1
        hist[:] = 0
        for j in range(m):
            if keys[j] >> np.uint32(20) == top:
                hist[(keys[j] >> np.uint32(8)) & np.uint32(0xFFF)] += 1
        mid = 4095
        while hist[mid] < want:
            want -= hist[mid]
            mid -= 1
        edge = (np.uint32(top) << np.uint32(20)) | (np.uint32(mid) << np.uint32(8))  # k keys or more are >= it
        if edge < np.uint32(0x00800000):  # below the key of -FLT_MAX: no finite float32 to stand for it
            thrs[u] = -np.inf
            continue
        out[0] = _step_down(edge ^ np.uint32(0x80000000) if edge >> np.uint32(31) else edge ^ np.uint32(0xFFFFFFFF))
        thrs[u] = as_float[0]


@njit(nogil=True, cache=True)
def seed_heaps(heap_keys, heap_thr):
    """Fill each seeded user's (empty) heap with keys of its threshold's score and the row no item has: they rank
    below every item of that score or more, so the first k items above the threshold replace them, and the root's
    score, the threshold, never falls below the seed; any left at the end are padding (``heap_sort_rows``)."""
    scratch = np.empty(1, np.float32)
    as_bits = scratch.view(np.uint32)
    for u in range(heap_keys.shape[0]):
        if heap_thr[u] > -np.inf:
            scratch[0] = heap_thr[u]
            key = _key(as_bits[0], np.uint64(0xFFFFFFFF))
            for j in range(heap_keys.shape[1]):
                heap_keys[u, j] = key


@njit(inline="always")
def _step_down(bits):
    """The float32 bits of the next float32 below the (finite) float32 of ``bits``."""
    if bits == np.uint32(0):  # +0.0 -> the negative subnormal nearest 0
        return np.uint32(0x80000001)
    if bits >> np.uint32(31):  # negative: larger magnitude
        return bits + np.uint32(1)
    return bits - np.uint32(1)


@njit(nogil=True, cache=True)
def heap_sort_rows(heap_keys, out_vals, out_idx):
    """Heaps -> rows sorted best first; padding (-inf, -1) ends each row."""
    n_users, k = heap_keys.shape
    buffer_sort_rows(heap_keys, np.full(n_users, k, np.int64), out_vals, out_idx)


@njit(nogil=True, cache=True)
def buffer_sort_rows(bufs, counts, out_vals, out_idx):
    """The best ``k = out_vals.shape[1]`` of each user's first ``counts[u]`` keys as rows sorted best first;
    padding (-inf, -1) ends each row (and stands for a heap's empty slots)."""
    n_users, k = out_vals.shape
    scratch = np.empty(1, np.uint32)
    as_float = scratch.view(np.float32)
    for u in range(n_users):
        n = counts[u]
        order = np.sort(bufs[u, :n])
        for r in range(k):
            row = np.int64(-1)
            key = EMPTY_KEY
            if r < n:
                key = order[n - 1 - r]
                row = np.int64(_LOW - (key & _LOW))
            if 0 <= row <= MAX_ROWS:
                scratch[0] = _score_bits(key)
                out_vals[u, r] = as_float[0]
                out_idx[u, r] = row
            else:
                out_vals[u, r] = -np.inf
                out_idx[u, r] = -1


def topk_rows(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of each row of a (n, m) array by (score desc, column asc): a stable reference, for tests and
    small inputs. Returns (values (n, min(k, m)), columns int64)."""
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, axis=1), order.astype(np.int64)
