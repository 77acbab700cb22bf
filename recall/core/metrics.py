"""Metrics as vector transforms, so that every metric is an inner product below the backend seam.

- ``ip``: score = u·v.
- ``cosine``: both sides normalised to unit length, then u·v.
- ``l2``: ranked by -||u - v||², which for a fixed user orders items like u·v - ||v||²/2. Items become
  ``[v, -||v||²/2, 0…]`` and users ``[u, 1, 0…]`` (zero-padded to a multiple of 4 so rows stay 16-byte aligned);
  the reported score is recovered as ``2·s - ||u||²``. Vectors far from the origin are first moved near it, both
  sides by the same point (:func:`far_centre`, applied by the engine): the distances are unchanged.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit

from . import host_threads
from .errors import InputError

METRICS = ("ip", "cosine", "l2")


def check_metric(metric: str) -> str:
    """Return ``metric`` if it is known, else raise InputError."""
    if metric not in METRICS:
        raise InputError(f"unknown metric {metric!r}: expected one of {', '.join(METRICS)}")
    return metric


#: Rows per float64 block of :func:`row_norms`: this many, or as many as hold _NORM_BLOCK_VALUES values where that is
#: more (narrow rows: fewer, fuller launches). The transient squares stay at 64 MiB up to dim 128 however many rows
#: there are.
_NORM_BLOCK_ROWS = 65_536
_NORM_BLOCK_VALUES = 1 << 23
#: Host arrays of at least this many values take the compiled loops below: one pass over the rows and no float64
#: copy (NumPy's way makes one, squares it and sums it: 1M users x 64, 0.14-0.18 s -> 0.02-0.03 s on 2 cores,
#: docs/benchmarks.md). Without the GIL, split by rows across ``host_threads``' few threads (a thread's loop took
#: 55 ms for 1M x 64 on the GPU machine's host, more than the search it checked): callers on other threads (a job's
#: reader, a search) run beside it.
_HOST_LOOP_VALUES = 1 << 16


@njit(cache=True, nogil=True)
def _host_norms(vecs: np.ndarray, out: np.ndarray) -> None:
    # Each square exact in float64 (a float32's is), summed in float64 in four interleaved partial sums (one chain of
    # dependent adds would be bound by their latency), then together.
    d = vecs.shape[1]
    for i in range(vecs.shape[0]):
        a0 = a1 = a2 = a3 = 0.0
        j = 0
        while j + 4 <= d:
            x0, x1 = np.float64(vecs[i, j]), np.float64(vecs[i, j + 1])
            x2, x3 = np.float64(vecs[i, j + 2]), np.float64(vecs[i, j + 3])
            a0 += x0 * x0
            a1 += x1 * x1
            a2 += x2 * x2
            a3 += x3 * x3
            j += 4
        while j < d:
            x0 = np.float64(vecs[i, j])
            a0 += x0 * x0
            j += 1
        out[i] = np.sqrt((a0 + a1) + (a2 + a3))


@njit(cache=True, nogil=True)
def _host_scale(vecs: np.ndarray, norms: np.ndarray, out: np.ndarray) -> None:
    # float32(v / |v|) with the division in float64: what NumPy's (float32 / float64).astype(float32) gives.
    for i in range(vecs.shape[0]):
        n = norms[i]
        for j in range(vecs.shape[1]):
            out[i, j] = np.float32(np.float64(vecs[i, j]) / n)


def _host_loop(xp: Any, vecs: Any) -> bool:
    return (xp is np and vecs.ndim == 2 and vecs.size >= _HOST_LOOP_VALUES
            and vecs.dtype in (np.float32, np.float64))


def row_norms(xp: Any, vecs: Any) -> Any:
    """Euclidean norms of the rows of ``vecs`` (n, dim), as float64 (n,), on the module ``xp`` of ``vecs``."""
    # Norms in float64: a float32 sum of squares loses digits that cosine and l2 then carry into every score.
    # Block by block: a whole float64 copy of a million items at dim 64 is 512 MiB of fresh pages, and faulting them
    # in took seconds of engine start-up; each row's sum is the same either way.
    out = xp.empty(vecs.shape[0], dtype=xp.float64)
    if _host_loop(xp, vecs):
        host_threads.by_rows(_host_norms, vecs, out)
        return out
    # Squared while widened (one launch writes the float64 squares; CuPy's einsum costs 0.2 ms a call) and summed
    # straight into ``out``: two launches a block, in blocks of at least 8M values.
    rows = max(_NORM_BLOCK_ROWS, _NORM_BLOCK_VALUES // max(vecs.shape[1], 1))
    for start in range(0, vecs.shape[0], rows):
        block = xp.square(vecs[start:start + rows], dtype=xp.float64)
        block.sum(axis=1, out=out[start:start + block.shape[0]])
    return xp.sqrt(out, out=out)


def largest_row_norm(xp: Any, vecs: Any) -> float:
    """The largest of :func:`row_norms` as a float: 0.0 without rows, NaN or inf where a row is not finite."""
    return float(row_norms(xp, vecs).max()) if vecs.shape[0] else 0.0


#: Why cosine refuses a row (after "row N "): every value is 0 once in float32, where a float64 value below float32's
#: smallest (about 1.4e-45) becomes 0 too.
ZERO_VECTOR = ("is a zero vector in float32 (every value 0, or too small for float32), which has no direction for "
               "metric 'cosine'")


def _normalise(xp: Any, vecs: Any, what: str, first_row: int = 0, norms_of: Callable | None = None) -> Any:
    norms = row_norms(xp, vecs) if norms_of is None else norms_of(vecs)
    zero = norms == 0
    if bool(zero.any()):
        row = first_row + int(xp.argmax(zero))
        raise InputError(f"{what}: row {row} {ZERO_VECTOR}")
    if _host_loop(xp, vecs):
        out = np.empty(vecs.shape, dtype=np.float32)
        host_threads.by_rows(_host_scale, vecs, norms, out)
        return out
    # Divided in float64 and rounded once into the float32 result: no float64 copy of the rows.
    return xp.divide(vecs, norms[:, None], out=xp.empty(vecs.shape, dtype=xp.float32), dtype=xp.float64)


#: The centre (:func:`far_centre`) is taken from the catalogue's first rows, at most this many: a function of the
#: rows every engine over a part of the catalogue can be given, and cheap.
CENTRE_ROWS = 4096
#: Items whose mean lies more than this many times their spread (root mean square distance to the mean) from the
#: origin are centred under l2: there the float32 products u·v and |v|²/2 are that ratio squared times larger than
#: the distances that tell the items apart, and lose their digits (at 1,000 times, every list is wrong). Fast mode
#: rounds ip and cosine items so far out about the same point (their float16 rows lose the digits far sooner).
FAR = 8.0


def far_centre(items: np.ndarray, far: float = FAR) -> np.ndarray | None:
    """The point ``l2`` subtracts from items and users before scoring, and fast mode's float16 rows of ``ip`` and
    ``cosine`` items are rounded about (``recall.core.certificate``, "Items far from the origin"), from the first
    CENTRE_ROWS rows of host ``items`` (n, dim): their mean, where it lies more than ``far`` times the rows' spread
    from the origin (l2: FAR; fast mode: ``fast.FAST_FAR``); None where it does not (or a row is not finite: the
    checks name it).

    -||u - v||² is the same for (u - c, v - c): the ranking and the scores are the metric's, with the digits of
    the distances kept. Each coordinate of the mean is rounded to a multiple of the largest power of two not above
    that coordinate's spread (its standard deviation over the rows; a coordinate every row holds alike keeps its
    value): the vectors then lie within about their spread of the centre whatever their distance from the origin, a
    vector near the centre minus it is exact, and integer-valued data spread by 1 or more stays integer-valued (its
    ties exact). A rounding to a fixed number of significant bits would leave a catalogue 10^7 from the origin
    about 1,200 from the centre, where float32's products lose its distances again."""
    rows = np.asarray(items[:CENTRE_ROWS], dtype=np.float64)
    if rows.size == 0 or not np.isfinite(rows).all():
        return None
    mean = rows.mean(axis=0)
    spread = np.sqrt(((rows - mean) ** 2).sum(axis=1).mean())
    if not np.linalg.norm(mean) > far * spread:
        return None
    std = rows.std(axis=0)
    quantum = np.ones_like(std)
    spread_d = std > 0
    quantum[spread_d] = np.exp2(np.floor(np.log2(std[spread_d])))
    centre = np.where(spread_d, np.round(mean / quantum) * quantum, rows[0])
    return centre.astype(np.float32)


def bias_column(metric: str, dim: int) -> int | None:
    """The column of prepared vectors (of ``dim`` input dimensions) where every item holds a constant of its own and
    every user holds exactly 1, all later columns zero: ``dim`` for ``l2`` (-||v||²/2), None where there is none.
    Fast mode rounds that column apart from the others (``recall.core.certificate``)."""
    return dim if metric == "l2" else None


def norms_rank(metric: str) -> bool:
    """Whether a prepared item's norm bounds its score against every user of a given norm (the inner product: the
    items of the largest norms are the ones most users rank high); not under cosine (all norms 1) nor l2 (a far item
    has a large norm and scores low)."""
    return metric == "ip"


def centroid_ranks(xp: Any, prepared: Any, metric: str, dim: int) -> Any:
    """Per item (n,) float64 of module ``xp``: its score against a user at the items' centroid c, from its
    ``prepared`` vector (of ``dim`` input dimensions; l2: c·v - |v|²/2, the order of -|c - v|²), or None where the
    norms rank the items (``norms_rank``) or no centre does (cosine). Under l2, on a small catalogue
    (``fast.CENTROID_MAX_ITEMS``), the items near the centre are the ones most users rank high, as the largest norms
    are under the inner product: a threshold sample half of them starts
    fast mode's float16 pass of k = 10 on 4,096 items with 48 scores a user above it, where its estimate over evenly
    spaced rows let 138 through (skewed norms, ``scripts/lab/need_counts.py``, docs/benchmarks.md)."""
    col = bias_column(metric, dim)
    if col is None:
        return None
    n = int(prepared.shape[0])
    centre = xp.zeros(int(prepared.shape[1]), dtype=xp.float64)
    for a in range(0, n, _RANK_BLOCK):
        centre[:col] += prepared[a:a + _RANK_BLOCK, :col].astype(xp.float64).sum(axis=0)
    centre[:col] /= max(n, 1)
    centre[col] = 1.0
    out = xp.empty(n, dtype=xp.float64)
    for a in range(0, n, _RANK_BLOCK):
        out[a:a + _RANK_BLOCK] = prepared[a:a + _RANK_BLOCK].astype(xp.float64) @ centre
    return out


#: Rows a block of ``centroid_ranks``' float64 copies: 64 MiB at 128 columns.
_RANK_BLOCK = 1 << 16


def _augmented_width(dim: int) -> int:
    return (dim + 1 + 3) // 4 * 4


def scored_width(metric: str, dim: int) -> int:
    """The width of the prepared vectors of ``dim``-dimensional inputs (l2 adds its norm column and padding)."""
    return _augmented_width(dim) if metric == "l2" else dim


def _copy_into(xp: Any, dest: Any, src: Any) -> None:
    """``dest[...] = src``: host arrays by ``host_threads`` (1M users x 64 into l2's wider rows: one thread's copy
    is a third of a GPU search's host time)."""
    if xp is np:
        host_threads.copy_rows(dest, src)
    else:
        dest[...] = src


def prepare_items(metric: str, xp: Any, item_vecs: Any, first_row: int = 0, centre: Any = None) -> Any:
    """Item vectors (n_items, dim) float32 -> the float32 matrix the backend scores against (a zero vector under
    cosine is named by its row, counted from ``first_row``). ``centre`` (l2; module ``xp``): subtracted first, in the
    prepared matrix itself (no copy of the items)."""
    if metric == "cosine":
        return _normalise(xp, item_vecs, "item_vecs", first_row)
    if metric == "l2":
        n, dim = item_vecs.shape
        out = xp.zeros((n, _augmented_width(dim)), dtype=xp.float32)
        _copy_into(xp, out[:, :dim], item_vecs)
        if centre is not None:
            out[:, :dim] -= centre
        with np.errstate(over="ignore"):  # an overflowing norm is refused by the engine, naming the row
            out[:, dim] = (-0.5 * row_norms(xp, out[:, :dim]) ** 2).astype(xp.float32)
        return out
    return item_vecs


def prepare_users(metric: str, xp: Any, user_vecs: Any, norms_of: Callable | None = None) -> Any:
    """User vectors (n_users, dim) float32 -> the float32 matrix scored against the prepared items. ``norms_of``: what
    computes cosine's row norms (``Backend.row_norms``; default :func:`row_norms`)."""
    if metric == "cosine":
        return _normalise(xp, user_vecs, "user_vecs", norms_of=norms_of)
    if metric == "l2":
        n, dim = user_vecs.shape
        out = xp.zeros((n, _augmented_width(dim)), dtype=xp.float32)
        _copy_into(xp, out[:, :dim], user_vecs)
        out[:, dim] = 1.0
        return out
    return user_vecs


def finish_scores(metric: str, xp: Any, scores: Any, user_vecs: Any, norms_of: Callable | None = None,
                  l2_of: Callable | None = None) -> Any:
    """Turn selected inner-product scores (n_users, k) back into the metric's scores, in place where possible
    (``user_vecs`` as scored: under l2, less the engine's centre; ``norms_of``: what computes their norms,
    ``Backend.row_norms``, default :func:`row_norms`; ``l2_of``: what computes :func:`l2_finished`,
    ``Backend.finish_l2``, whose GPU kernel reads and writes the scores once).

    Under ``l2`` the reported score ``2·s - ||u||²`` rounds: two items of different distances can report the same
    score. The lists stay in the order of ``s`` (the distance before that rounding, ties to the lower row): a list
    of k is the first k of a longer one, and of two equal reported scores the nearer item comes first."""
    if metric == "l2":
        sq = ((row_norms(xp, user_vecs) if norms_of is None else norms_of(user_vecs)) ** 2).astype(xp.float32)
        scores = l2_finished(xp, scores, sq) if l2_of is None else l2_of(scores, sq)
    return scores.astype(xp.float32, copy=False)


def l2_finished(xp: Any, scores: Any, sq: Any) -> Any:
    """``2·s - sq[:, None]`` in float32 (``2·s`` exact, one rounding): l2's reported scores from inner-product
    ``scores`` (n, k) and squared user norms ``sq`` (n,); -inf padding stays -inf (2·(-inf) - finite)."""
    return 2.0 * scores - sq[:, None]
