"""The exact float64 oracle and tie-aware recall@k: correctness beside every time.

The oracle scores a sample of users against every item in float64, item chunk by item chunk, keeping a running
top-k, so its memory stays under a budget whatever the workload's size: on the host for host data, on the GPU (CuPy
float64 matmuls, with only the items that can still enter a user's top-k carried from chunk to chunk) when the items
live there. A contender's answer for those users is then judged item by item against the true scores:

    an item counts when its true score >= (true k-th best score) - tol,    tol = min(rtol * scale, cap)

where ``scale`` is, per user, the largest magnitude among its true top-k scores (the size of the scores that decide
the ranking) and ``rtol`` defaults to 1e-4. Why that tolerance: a float32 dot product of length d carries an error of
up to about d * 2**-24 * ||u|| * ||v||, i.e. ~1e-5 of the score scale for d = 256 on typical data, so an exact float32
engine may legitimately swap items whose true scores differ by less than that. 1e-4 admits those swaps and nothing
coarser: bf16 (8-bit mantissa, error ~4e-3) and TF32 (~5e-4) answers show up as recall < 1. Ties are therefore free:
any of several items with the k-th score counts. Under ``ip`` and ``cosine`` the tolerance is also capped by that
rounding bound itself (``cap`` = (4 d + 16) 2**-24 ||u|| max ||v||: both items' sums, any order of summation, and the
normalisation's rounding, with room to spare): on data far from the origin (``offset=``) the scores are many times the
gaps between them, and 1e-4 of the scores would admit items ranked hundreds deep. Where even that bound spans a
user's whole top k (float32 cannot tell its items apart: cosine on data far from the origin), the check cannot
either: ``Check.users_within_rounding`` counts those users, so that a recall of 1 there is not read as a proof.

Each returned item is counted once (duplicates do not count twice), padding (-1) and out-of-range rows count as
misses, and recall is hits / min(k, n_items).

Exclusions: the oracle never ranks a user's excluded items (their true score is -inf), so a user with fewer than k
allowed items has a shorter true list (``Truth.k_user``) and recall is hits / that. A returned excluded item is never
a hit and counts against the user (``Check.excluded_returned``): such an answer is not exact even where its other
items are right, and a user all of whose items are excluded is exact only with an answer of padding.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace, field
from typing import Any

import numpy as np

from recall import InputError

DEFAULT_RTOL = 1e-4
"""Default tolerance of recall@k, relative to each user's score scale (see the module docstring)."""
DEFAULT_BUDGET = 256 << 20
"""Default bytes of float64 scratch the oracle may hold at once (on the host)."""
DEVICE_BUDGET = 2 << 30
"""Bytes of float64 scores per item chunk when the oracle runs on the GPU (it holds about three times that)."""
DEVICE_FIRST_CHUNK = 65_536
"""Items of the first chunk on the GPU: everything in it is a candidate, so it is sorted whole; later chunks only
contribute the items that beat the running k-th score."""


def to_host(arr: Any) -> np.ndarray:
    """A NumPy view or copy of a NumPy, CuPy (``.get()``) or torch (``.cpu()``) array."""
    if isinstance(arr, np.ndarray):
        return arr
    if hasattr(arr, "detach") and hasattr(arr, "cpu"):  # torch: bf16 has no NumPy dtype, so widen first
        t = arr.detach()
        if t.is_floating_point():
            t = t.float()
        return t.cpu().numpy()
    get = getattr(arr, "get", None)
    if callable(get):
        return get()
    return np.asarray(arr)


def _rows_f64(vecs: Any, rows: np.ndarray) -> np.ndarray:
    """``vecs[rows]`` as host float64, gathered on the array's own device so only the rows cross."""
    if isinstance(vecs, np.ndarray):
        return vecs[rows].astype(np.float64)
    mod = type(vecs).__module__.split(".")[0]
    if mod == "cupy":
        import cupy

        return cupy.asnumpy(vecs[cupy.asarray(rows)]).astype(np.float64)
    return to_host(vecs[rows]).astype(np.float64)


def _slice_f64(vecs: Any, start: int, stop: int) -> np.ndarray:
    return to_host(vecs[start:stop]).astype(np.float64)


def _is_cupy(arr: Any) -> bool:
    return type(arr).__module__.split(".")[0] == "cupy"


def _metric_users(metric: str, u: np.ndarray) -> np.ndarray:
    if metric == "cosine":
        return u / np.linalg.norm(u, axis=1, keepdims=True)
    return u


def _metric_scores(metric: str, u: Any, v: Any, xp: Any = np) -> Any:
    """True scores (n_u, n_v) in float64 of prepared users ``u`` against raw item rows ``v`` (both on ``xp``)."""
    if metric == "cosine":
        return u @ (v / xp.linalg.norm(v, axis=1, keepdims=True)).T
    s = u @ v.T
    if metric == "l2":
        s *= 2.0
        s -= xp.einsum("ij,ij->i", u, u)[:, None]
        s -= xp.einsum("ij,ij->i", v, v)[None, :]
    return s


def _pair_scores(metric: str, u: Any, v: Any, xp: Any = np) -> Any:
    """True scores (b, k) in float64 of prepared users ``u`` (b, dim) against their own items ``v`` (b, k, dim)."""
    if metric == "cosine":
        v = v / xp.maximum(xp.linalg.norm(v, axis=2, keepdims=True), 1e-300)
    s = xp.einsum("bkd,bd->bk", v, u)
    if metric == "l2":
        s = 2.0 * s - xp.einsum("bd,bd->b", u, u)[:, None] - xp.einsum("bkd,bkd->bk", v, v)
    return s


@dataclass
class Truth:
    """The exact answer for a sample of users.

    Attributes
    ----------
    rows : array of int64, shape (n_sample,)
        The sampled user rows.
    user_vecs : array of float64, shape (n_sample, dim)
        Those users' vectors (normalised for cosine), on the host.
    k : int
        Requested k; the oracle keeps ``k_eff = min(k, n_items)``.
    top_scores : array of float64, shape (n_sample, k_eff)
        True best scores, descending; -inf past a user's ``k_user``.
    top_items : array of int64, shape (n_sample, k_eff)
        One valid exact answer, best first, equal scores by item row (among items tied at the k-th score, not
        necessarily the lowest rows); -1 past a user's ``k_user``.
    kth : array of float64, shape (n_sample,)
        True k-th best score (the ``k_user``-th; -inf for a user with no allowed item).
    scale : array of float64, shape (n_sample,)
        Per-user score scale: max |true top-k score| (1 where that is 0).
    metric : str
    n_items : int
    k_user : array of int64, shape (n_sample,), optional
        Items each user can get: min(k, allowed items). None: ``k_eff`` for every user (no exclusions).
    excl_indptr, excl_items : arrays of int64, optional
        The sampled users' exclusions as host CSR over ``rows`` (None without exclusions).
    allowed : array of int64, optional
        The rows of a shared allow-set (increasing): an item outside it is no answer (None: every item).
    tol_cap : array of float64, shape (n_sample,), optional
        Per user, the float32 rounding bound that caps the tolerance (see the module docstring); None: no cap
        (``l2``, whose engines round by the vectors' norms, not the distances).
    """

    rows: np.ndarray
    user_vecs: np.ndarray
    k: int
    top_scores: np.ndarray
    top_items: np.ndarray
    kth: np.ndarray
    scale: np.ndarray
    metric: str
    n_items: int
    k_user: np.ndarray | None = None
    excl_indptr: np.ndarray | None = None
    excl_items: np.ndarray | None = None
    allowed: np.ndarray | None = None
    tol_cap: np.ndarray | None = None

    @property
    def k_eff(self) -> int:
        return self.top_scores.shape[1]

    def wanted(self) -> np.ndarray:
        """(n_sample,) int64: how many items each sampled user's full answer has (``k_user`` or ``k_eff``)."""
        if self.k_user is not None:
            return self.k_user
        return np.full(self.rows.size, self.k_eff, dtype=np.int64)


@dataclass
class Check:
    """How one answer compares with the truth.

    Attributes
    ----------
    recall : float
        Mean tie-aware recall@k over the sampled users, in [0, 1].
    min_recall : float
        The worst sampled user's recall.
    users_short : int
        Sampled users with recall < 1.
    invalid : int
        Returned slots that are padding, out of range, duplicates or excluded items (among the sampled users).
    max_score_error : float or None
        Largest |returned score - true score| / scale over valid returned items; None without scores.
    rtol : float
        The tolerance used, relative to each user's scale.
    n_sample : int
    per_user : array of float64, shape (n_sample,)
    excluded_returned : int
        Returned slots holding an item excluded for that user (0 without exclusions).
    users_within_rounding : int
        Sampled users whose true top k holds different scores that all lie within the tolerance of their k-th: the
        check accepts any item of that window, so their recall proves nothing (see the module docstring).
    """

    recall: float
    min_recall: float
    users_short: int
    invalid: int
    max_score_error: float | None
    rtol: float
    n_sample: int
    per_user: np.ndarray = field(repr=False)
    excluded_returned: int = 0
    users_within_rounding: int = 0

    @property
    def exact(self) -> bool:
        """True when every sampled user got a full, correct top-k (within the tolerance) and no excluded item."""
        return self.users_short == 0 and self.excluded_returned == 0

    def as_dict(self) -> dict[str, Any]:
        return {"recall": self.recall, "min_recall": self.min_recall, "users_short": self.users_short,
                "invalid": self.invalid, "max_score_error": self.max_score_error, "rtol": self.rtol,
                "n_sample": self.n_sample, "exact": self.exact, "excluded_returned": self.excluded_returned,
                "users_within_rounding": self.users_within_rounding}


def sample_rows(n_users: int, n_sample: int, seed: int = 0) -> np.ndarray:
    """``min(n_sample, n_users)`` distinct user rows, sorted, drawn with ``seed``.

    Raises
    ------
    InputError
        If ``n_sample`` < 1.
    """
    if not isinstance(n_sample, (int, np.integer)) or n_sample < 1:
        raise InputError(f"sample size must be an integer >= 1, got {n_sample!r}")
    if n_sample >= n_users:
        return np.arange(n_users, dtype=np.int64)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x0AC1E]))
    return np.sort(rng.choice(n_users, size=n_sample, replace=False)).astype(np.int64)


def _merge(best_s: np.ndarray, best_i: np.ndarray, s: np.ndarray, start: int,
           k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best of (kept scores ``best_s`` with item rows ``best_i``) and (a new chunk ``s`` of rows start...)."""
    kept = best_s.shape[1]
    cand = np.concatenate([best_s, s], axis=1)
    if cand.shape[1] <= k:
        return cand, np.concatenate([best_i, np.broadcast_to(np.arange(start, start + s.shape[1]), s.shape)], axis=1)
    # argpartition keeps some k best; with ties at the k-th score it may keep any of the tied items, which the
    # tie-aware check does not mind.
    part = np.argpartition(-cand, k - 1, axis=1)[:, :k]
    # Map positions back to item rows without materialising a (n, kept + chunk) index array.
    from_kept = part < kept
    rows = np.where(from_kept, np.take_along_axis(best_i, np.minimum(part, max(kept - 1, 0)), axis=1)
                    if kept else 0, start + part - kept)
    return np.take_along_axis(cand, part, axis=1), rows.astype(np.int64)


def _sampled_exclusions(exclude: Any, rows: np.ndarray, n_users: int,
                        n_items: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The sampled users' exclusions as host CSR over ``rows``: sorted, unique, in range; None for no exclusions.

    ``exclude``: None, an object with ``for_rows(rows)`` (``recall.bench.exclusions.Exclusions``), or a host CSR
    pair (indptr (n_users + 1,), item rows) over every user."""
    if exclude is None:
        return None
    if hasattr(exclude, "for_rows"):
        indptr, items = exclude.for_rows(rows)
    else:
        try:
            full_ptr, full_items = (np.asarray(a, dtype=np.int64) for a in exclude)
        except (TypeError, ValueError):
            raise InputError("exclude must be None, an Exclusions or a CSR pair (indptr, item rows)") from None
        if full_ptr.shape != (n_users + 1,) or full_ptr[0] != 0 or np.any(np.diff(full_ptr) < 0) \
                or full_ptr[-1] != full_items.size:
            raise InputError(f"exclude: indptr must have n_users + 1 = {n_users + 1} entries, start at 0, never "
                             "decrease and end at len(item rows)")
        lists = [full_items[full_ptr[r]:full_ptr[r + 1]] for r in rows]
        indptr = np.zeros(rows.size + 1, dtype=np.int64)
        np.cumsum([x.size for x in lists], out=indptr[1:])
        items = np.concatenate(lists) if lists else np.zeros(0, np.int64)
    if items.size and (items.min() < 0 or items.max() >= n_items):
        raise InputError(f"exclude: item rows must be in [0, {n_items})")
    # Sorted and unique within each user, whatever the source: the allowed count is then n_items - list length.
    owner = np.repeat(np.arange(rows.size), np.diff(indptr))
    keys = np.unique(owner * np.int64(n_items) + items)
    owner = keys // n_items
    indptr = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner, minlength=rows.size), out=indptr[1:])
    return indptr, keys - owner * n_items


def _module_of(arr: Any) -> Any:
    """NumPy, or CuPy for a CuPy array."""
    if _is_cupy(arr):
        import cupy

        return cupy
    return np


def exact_topk(user_vecs: Any, item_vecs: Any, k: int, rows: np.ndarray, metric: str = "ip",
               memory_budget: int = DEFAULT_BUDGET, exclude: Any = None, allowed: np.ndarray | None = None) -> Truth:
    """Exact float64 top-k of the users ``rows`` against every item, chunked over items.

    Parameters
    ----------
    user_vecs : array, shape (n_users, dim)
        Users; NumPy, or CuPy/torch on the device (only the sampled rows are copied to the host).
    item_vecs : array, shape (n_items, dim)
        Items; NumPy (scored on the host), or CuPy (scored on the GPU in float64, chunk by chunk).
    k : int
        Items per user, >= 1.
    rows : array of int, shape (n_sample,)
        Which users to answer for (see :func:`sample_rows`).
    metric : {"ip", "cosine", "l2"}
    memory_budget : int
        Bytes of float64 scratch (scores and item chunk) held at once on the host.
    exclude : Exclusions or (indptr, item rows), optional
        Items never to rank for a user (``recall.bench.exclusions.Exclusions``, or a host CSR pair over every
        user, indptr of shape (n_users + 1,)).
    allowed : array of int64, optional
        A shared allow-set (item rows, increasing): the answer over those items only (without exclusions).

    Returns
    -------
    Truth

    Raises
    ------
    InputError
        k < 1, unknown metric, mismatched dimensions, or malformed exclusions.
    """
    if metric not in ("ip", "cosine", "l2"):
        raise InputError(f"unknown metric {metric!r}: expected ip, cosine or l2")
    if allowed is not None:
        if exclude is not None:
            raise InputError("the oracle takes a shared allow-set or per-user exclusions, not both")
        # The answer over the allowed items is the answer of their own catalogue, its rows mapped back (increasing,
        # so ties still go to the lower row).
        xp = _module_of(item_vecs)
        sub = exact_topk(user_vecs, item_vecs[xp.asarray(allowed)], k, rows, metric, memory_budget)
        table = np.asarray(allowed, np.int64)
        top = np.where(sub.top_items >= 0, table[np.maximum(sub.top_items, 0)], -1)
        return replace(sub, top_items=top, n_items=int(item_vecs.shape[0]), allowed=table)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise InputError(f"k must be an integer >= 1, got {k!r}")
    n_items, dim = int(item_vecs.shape[0]), int(item_vecs.shape[1])
    if int(user_vecs.shape[1]) != dim:
        raise InputError(f"users have dimension {user_vecs.shape[1]}, items {dim}")
    rows = np.asarray(rows, dtype=np.int64)
    excl = _sampled_exclusions(exclude, rows, int(user_vecs.shape[0]), n_items)
    u = _metric_users(metric, _rows_f64(user_vecs, rows))
    k_eff = min(int(k), n_items)
    # (row in the sample, item) of every exclusion: the entries a chunk's scores are set to -inf at.
    ex_rows = np.repeat(np.arange(rows.size), np.diff(excl[0])) if excl else np.zeros(0, np.int64)
    ex_items = excl[1] if excl else np.zeros(0, np.int64)
    if _is_cupy(item_vecs):
        best_s, best_i = _topk_device(u, item_vecs, k_eff, metric, ex_rows, ex_items)
    else:
        best_s, best_i = _topk_host(u, item_vecs, k_eff, metric, ex_rows, ex_items, memory_budget)
    order = np.lexsort((best_i, -best_s), axis=1)
    best_s = np.take_along_axis(best_s, order, axis=1)
    best_i = np.take_along_axis(best_i, order, axis=1)
    k_user = None
    if excl is not None:
        k_user = np.minimum(k_eff, n_items - np.diff(excl[0])).astype(np.int64)
        past = np.arange(k_eff)[None, :] >= k_user[:, None]
        best_s[past] = -np.inf  # only excluded items (-inf) can sit there; they are no answer
        best_i[past] = -1
        kth = np.where(k_user > 0, best_s[np.arange(rows.size), np.maximum(k_user - 1, 0)], -np.inf)
    else:
        kth = best_s[:, -1].copy()
    with np.errstate(invalid="ignore"):
        scale = np.maximum(np.abs(best_s[:, 0]), np.where(np.isfinite(kth), np.abs(kth), 0.0))
    scale[~(np.isfinite(scale) & (scale > 0))] = 1.0
    tol_cap = None
    if metric != "l2":
        # The float32 rounding bound of a score (module docstring): the normalised vectors' norms are 1.
        largest = 1.0 if metric == "cosine" else _largest_norm(item_vecs)
        tol_cap = (4 * dim + 16) * 2.0 ** -24 * np.linalg.norm(u, axis=1) * largest
    return Truth(rows=rows, user_vecs=u, k=int(k), top_scores=best_s, top_items=best_i, kth=kth, scale=scale,
                 metric=metric, n_items=n_items, k_user=k_user,
                 excl_indptr=None if excl is None else excl[0], excl_items=None if excl is None else excl[1],
                 tol_cap=tol_cap)


def _largest_norm(item_vecs: Any) -> float:
    """The largest norm of the items (float64), host or device, a chunk of rows at a time."""
    n = int(item_vecs.shape[0])
    chunk = max(1, DEFAULT_BUDGET // (8 * max(1, int(item_vecs.shape[1]))))
    largest = 0.0
    for a in range(0, n, chunk):
        part = item_vecs[a:a + chunk]
        largest = max(largest, float(to_host((part.astype(np.float64) ** 2).sum(axis=1).max())))
    return largest ** 0.5


def _topk_host(u: np.ndarray, item_vecs: Any, k_eff: int, metric: str, ex_rows: np.ndarray, ex_items: np.ndarray,
               memory_budget: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, item rows) (n, k_eff) of the k_eff best items per user, in no particular order, on the host."""
    n, dim = u.shape
    n_items = int(item_vecs.shape[0])
    # Scratch per item row: one float64 score per sampled user plus the row itself in float64 (and its float32 copy).
    per_item = 8 * n + 12 * dim
    chunk = int(max(k_eff, min(n_items, memory_budget // max(per_item, 1))))
    best_s = np.full((n, 0), -np.inf)
    best_i = np.zeros((n, 0), dtype=np.int64)
    # Selection (argpartition) is single-threaded in NumPy but releases the GIL: split the users over threads. The
    # float64 GEMM is already multi-threaded by BLAS.
    workers = max(1, min(os.cpu_count() or 1, n // 64))
    blocks = [(a, min(a + -(-n // workers), n)) for a in range(0, n, -(-n // workers))]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for start in range(0, n_items, chunk):
            stop = min(start + chunk, n_items)
            s = _metric_scores(metric, u, _slice_f64(item_vecs, start, stop))
            here = (ex_items >= start) & (ex_items < stop)
            s[ex_rows[here], ex_items[here] - start] = -np.inf
            parts = list(pool.map(lambda ab: _merge(best_s[ab[0]:ab[1]], best_i[ab[0]:ab[1]], s[ab[0]:ab[1]],
                                                    start, k_eff), blocks))
            best_s = np.concatenate([p[0] for p in parts])
            best_i = np.concatenate([p[1] for p in parts])
    return best_s, best_i


def _topk_device(u: np.ndarray, item_vecs: Any, k_eff: int, metric: str, ex_rows: np.ndarray,
                 ex_items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """As :func:`_topk_host`, on the GPU: CuPy float64 matmuls over item chunks, a running top-k per user.

    After the first chunk, only the items scoring at least the user's running k-th score can still enter its top-k:
    those are compacted into a narrow (n, survivors) block and merged (a sort of k + survivors per user), instead of
    sorting k + chunk entries per user. Where most of a chunk survives, the chunk is merged whole. Chunks go from the
    last items to the first: the order does not change the answer, and on data whose scores rise along the items
    (adversarial) the best items come first, so the threshold is high from the start."""
    import cupy as cp

    n, dim = u.shape
    n_items = int(item_vecs.shape[0])
    uu = cp.asarray(u)
    chunk = int(max(k_eff, min(n_items, DEVICE_BUDGET // max(1, 8 * n))))
    first = int(min(n_items, max(2 * k_eff, DEVICE_FIRST_CHUNK), chunk))
    er, ei = cp.asarray(ex_rows), cp.asarray(ex_items)
    best_s = cp.full((n, 0), -cp.inf)
    best_i = cp.zeros((n, 0), dtype=cp.int64)
    bounds = [(max(0, n_items - first), n_items)]
    bounds += [(max(0, b - chunk), b) for b in range(bounds[0][0], 0, -chunk)]
    for start, stop in bounds:
        s = _metric_scores(metric, uu, item_vecs[start:stop].astype(cp.float64), cp)
        if ei.size:
            here = (ei >= start) & (ei < stop)
            s[er[here], ei[here] - start] = -cp.inf
        width = stop - start
        if best_s.shape[1] == k_eff:
            thr = best_s[:, -1]
            surv = (s >= thr[:, None]) & (s > -cp.inf)
            counts = surv.sum(axis=1)
            m = int(counts.max())
            if m == 0:
                continue
            if 4 * m <= width:
                r, c = cp.nonzero(surv)  # row-major: each row's survivors are contiguous
                pos = cp.arange(r.size) - (cp.cumsum(counts) - counts)[r]
                cand_s = cp.full((n, m), -cp.inf)
                cand_i = cp.full((n, m), -1, dtype=cp.int64)
                cand_s[r, pos] = s[r, c]
                cand_i[r, pos] = c + start
                s = None
            else:
                cand_s, cand_i = s, cp.broadcast_to(cp.arange(start, stop, dtype=cp.int64), s.shape)
        else:
            cand_s, cand_i = s, cp.broadcast_to(cp.arange(start, stop, dtype=cp.int64), s.shape)
        all_s = cp.concatenate([best_s, cand_s], axis=1)
        all_i = cp.concatenate([best_i, cand_i], axis=1)
        del s, cand_s, cand_i
        # Kept sorted best first, so the running k-th score is the last column. Ties at the k-th may keep any of
        # the tied items, which the tie-aware check does not mind.
        order = cp.argsort(-all_s, axis=1)[:, :k_eff]
        best_s = cp.take_along_axis(all_s, order, axis=1)
        best_i = cp.take_along_axis(all_i, order, axis=1)
        del all_s, all_i, order
    return cp.asnumpy(best_s), cp.asnumpy(best_i)


def check(truth: Truth, item_vecs: Any, indices: Any, scores: Any = None, rtol: float = DEFAULT_RTOL,
          rows_are_sampled: bool = False) -> Check:
    """Tie-aware recall@k of an answer against the truth.

    Parameters
    ----------
    truth : Truth
        From :func:`exact_topk`.
    item_vecs : array, shape (n_items, dim)
        The items (NumPy, or CuPy: the returned items are then scored on the GPU); only the returned rows are read.
    indices : array of int, shape (n_users, >= 1) or (n_sample, >= 1)
        The answer's item rows, best first; -1 = padding. Host or device.
    scores : array of float, same shape as ``indices``, optional
        The answer's scores, to measure their error against the true ones.
    rtol : float
        Tolerance relative to each user's score scale (see the module docstring).
    rows_are_sampled : bool
        True when ``indices`` already holds only the sampled users' rows, in ``truth.rows`` order.

    Returns
    -------
    Check

    Raises
    ------
    InputError
        If the answer has another number of rows than expected.
    """
    idx = to_host(indices if rows_are_sampled else indices[_index_rows(indices, truth.rows)])
    idx = np.asarray(idx).astype(np.int64, copy=False)
    sc = None
    if scores is not None:
        sc = to_host(scores if rows_are_sampled else scores[_index_rows(scores, truth.rows)]).astype(np.float64)
    n, k_ret = idx.shape
    if n != truth.rows.size:
        raise InputError(f"answer has {n} rows, expected {truth.rows.size}")
    valid = answer_validity(idx, truth.n_items)
    excluded = excluded_slots(truth, idx, valid)
    safe = np.where(valid, idx, 0)
    true_s = _returned_scores(truth, item_vecs, safe)
    return check_from_true_scores(truth, valid, true_s, sc, rtol, excluded=excluded)


def _returned_scores(truth: Truth, item_vecs: Any, safe: np.ndarray) -> np.ndarray:
    """(n, k_returned) true float64 scores of the returned item rows ``safe`` (all in range), scored where the
    items live, a block of users at a time so (block, k, dim) float64 stays bounded."""
    n, k_ret = safe.shape
    dim = truth.user_vecs.shape[1]
    if _is_cupy(item_vecs):
        import cupy as cp

        out = cp.empty((n, k_ret))
        uu, ii = cp.asarray(truth.user_vecs), cp.asarray(safe)
        block = max(1, int(DEVICE_BUDGET // 4 // max(1, 8 * k_ret * dim)))
        for a in range(0, n, block):
            b = min(a + block, n)
            v = item_vecs[ii[a:b]].astype(cp.float64)
            out[a:b] = _pair_scores(truth.metric, uu[a:b], v, cp)
        return cp.asnumpy(out)
    true_s = np.empty((n, k_ret))
    block = max(1, int(DEFAULT_BUDGET // max(1, 8 * k_ret * dim)))
    for a in range(0, n, block):
        b = min(a + block, n)
        uniq, inv = np.unique(safe[a:b].ravel(), return_inverse=True)
        v = _rows_f64(item_vecs, uniq)[inv.ravel()].reshape(b - a, k_ret, dim)
        true_s[a:b] = _pair_scores(truth.metric, truth.user_vecs[a:b], v)
    return true_s


def excluded_slots(truth: Truth, idx: np.ndarray, valid: np.ndarray) -> np.ndarray | None:
    """(n, k_returned) bool: the slot holds an item excluded for that user (or outside the allow-set); None when the
    truth has neither."""
    if truth.allowed is not None:
        return valid & ~np.isin(np.where(valid, idx, -1), truth.allowed)
    if truth.excl_items is None:
        return None
    n = idx.shape[0]
    stride = np.int64(truth.n_items) + 1
    owner = np.repeat(np.arange(n, dtype=np.int64), np.diff(truth.excl_indptr))
    banned = owner * stride + truth.excl_items
    asked = np.arange(n, dtype=np.int64)[:, None] * stride + np.where(valid, idx, 0)
    return valid & np.isin(asked, banned)


def answer_validity(idx: np.ndarray, n_items: int) -> np.ndarray:
    """(n, k) bool: the slot holds an item row in range that the row has not returned before (a repeated item counts
    once: only its first occurrence is valid)."""
    valid = (idx >= 0) & (idx < n_items)
    order = np.argsort(idx, axis=1, kind="stable")
    sorted_idx = np.take_along_axis(idx, order, axis=1)
    first_sorted = np.ones_like(sorted_idx, dtype=bool)
    first_sorted[:, 1:] = sorted_idx[:, 1:] != sorted_idx[:, :-1]
    first = np.empty_like(first_sorted)
    np.put_along_axis(first, order, first_sorted, axis=1)
    return valid & first


def check_from_true_scores(truth: Truth, valid: np.ndarray, true_s: np.ndarray, sc: np.ndarray | None,
                           rtol: float, excluded: np.ndarray | None = None) -> Check:
    """Tie-aware recall@k of an answer from the true (float64) scores of its slots; see :func:`check`.

    valid: (n, k_returned) bool from :func:`answer_validity`; true_s: (n, k_returned) true scores; sc: the scores
    the contender reported (float64), or None; excluded: (n, k_returned) bool from :func:`excluded_slots`, or None.
    Only the first ``truth.k`` slots are the answer: an answer wider than k (right items after wrong ones) is judged
    by its top k, as a caller would read it."""
    width = truth.k
    valid, true_s = valid[:, :width], true_s[:, :width]
    sc = None if sc is None else sc[:, :width]
    excluded = None if excluded is None else excluded[:, :width]
    n, k_ret = valid.shape
    ok = valid if excluded is None else valid & ~excluded
    true_s = np.where(ok, true_s, -np.inf)
    tol = rtol * truth.scale
    if truth.tol_cap is not None:
        tol = np.minimum(tol, truth.tol_cap)
    wanted = truth.wanted()
    with np.errstate(invalid="ignore"):  # kth - tol is -inf - tol for a user with nothing allowed
        hits = (ok & (true_s >= (truth.kth - tol)[:, None])).sum(axis=1)
    per_user = np.where(wanted > 0, np.minimum(hits, wanted) / np.maximum(wanted, 1), 1.0)
    n_excl = np.zeros(n, dtype=np.int64) if excluded is None else excluded.sum(axis=1)
    if n_excl.any():
        # A returned excluded item is a wrong answer even when the rest is right (a user with fewer allowed items
        # than k would otherwise pass with excluded items in its padding slots).
        per_user = np.where(n_excl > 0, np.minimum(per_user, np.maximum(wanted - n_excl, 0) / np.maximum(wanted, 1)),
                            per_user)
    # Slots past a user's wanted count are padding by contract; only the first ``wanted`` can be wrong (and any
    # excluded item, wherever it is).
    first = np.arange(k_ret)[None, :] < wanted[:, None]
    invalid = int((~ok & first).sum()) + int(np.maximum(0, wanted - k_ret).sum())
    if excluded is not None:
        invalid += int((excluded & ~first).sum())
    max_err = None
    if sc is not None:
        good = ok & np.isfinite(sc)
        if good.any():
            scale = np.broadcast_to(truth.scale[:, None], valid.shape)
            max_err = float(np.max(np.abs(sc[good] - true_s[good]) / scale[good]))
        elif ok.any():
            max_err = float("inf")
    # Users whose top k holds different scores that all lie within the tolerance (not exact ties, which the check
    # tells from the rest as well as any score): any item of that window passes.
    with np.errstate(invalid="ignore"):  # a user with nothing allowed: -inf - -inf
        spread = truth.top_scores[:, 0] - truth.kth
        within = int(((spread > 0) & (spread <= tol)).sum())
    return Check(recall=float(per_user.mean()), min_recall=float(per_user.min()),
                 users_short=int((per_user < 1).sum()), invalid=invalid, max_score_error=max_err, rtol=rtol,
                 n_sample=n, per_user=per_user, excluded_returned=int(n_excl.sum()), users_within_rounding=within)


def _index_rows(arr: Any, rows: np.ndarray) -> Any:
    """``rows`` in a form that indexes ``arr`` on its own device (CuPy needs a device index array)."""
    mod = type(arr).__module__.split(".")[0]
    if mod == "cupy":
        import cupy

        return cupy.asarray(rows)
    if mod == "torch":
        import torch

        return torch.as_tensor(rows, device=arr.device)
    return rows
