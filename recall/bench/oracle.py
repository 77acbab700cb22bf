"""The exact float64 oracle and tie-aware recall@k: correctness beside every time.

The oracle scores a sample of users against every item in float64 on the host, item chunk by item chunk, keeping a
running top-k, so its memory stays under a budget whatever the workload's size. A contender's answer for those users
is then judged item by item against the true scores:

    an item counts when its true score >= (true k-th best score) - tol,    tol = rtol * scale

where ``scale`` is, per user, the largest magnitude among its true top-k scores (the size of the scores that decide
the ranking) and ``rtol`` defaults to 1e-4. Why that tolerance: a float32 dot product of length d carries an error of
up to about d * 2**-24 * ||u|| * ||v||, i.e. ~1e-5 of the score scale for d = 256 on typical data, so an exact float32
engine may legitimately swap items whose true scores differ by less than that. 1e-4 admits those swaps and nothing
coarser: bf16 (8-bit mantissa, error ~4e-3) and TF32 (~5e-4) answers show up as recall < 1. Ties are therefore free:
any of several items with the k-th score counts.

Each returned item is counted once (duplicates do not count twice), padding (-1) and out-of-range rows count as
misses, and recall is hits / min(k, n_items).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.errors import InputError

DEFAULT_RTOL = 1e-4
"""Default tolerance of recall@k, relative to each user's score scale (see the module docstring)."""
DEFAULT_BUDGET = 256 << 20
"""Default bytes of float64 scratch the oracle may hold at once."""


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


def _metric_users(metric: str, u: np.ndarray) -> np.ndarray:
    if metric == "cosine":
        return u / np.linalg.norm(u, axis=1, keepdims=True)
    return u


def _metric_scores(metric: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """True scores (n_u, n_v) in float64 of prepared users ``u`` against raw item rows ``v``."""
    if metric == "cosine":
        return u @ (v / np.linalg.norm(v, axis=1, keepdims=True)).T
    s = u @ v.T
    if metric == "l2":
        s *= 2.0
        s -= np.einsum("ij,ij->i", u, u)[:, None]
        s -= np.einsum("ij,ij->i", v, v)[None, :]
    return s


def _pair_scores(metric: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """True scores (b, k) in float64 of prepared users ``u`` (b, dim) against their own items ``v`` (b, k, dim)."""
    if metric == "cosine":
        v = v / np.maximum(np.linalg.norm(v, axis=2, keepdims=True), 1e-300)
    s = np.einsum("bkd,bd->bk", v, u)
    if metric == "l2":
        s = 2.0 * s - np.einsum("bd,bd->b", u, u)[:, None] - np.einsum("bkd,bkd->bk", v, v)
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
        True best scores, descending.
    top_items : array of int64, shape (n_sample, k_eff)
        One valid exact answer, best first, equal scores by item row (among items tied at the k-th score, not
        necessarily the lowest rows).
    kth : array of float64, shape (n_sample,)
        True k-th best score.
    scale : array of float64, shape (n_sample,)
        Per-user score scale: max |true top-k score| (1 where that is 0).
    metric : str
    n_items : int
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

    @property
    def k_eff(self) -> int:
        return self.top_scores.shape[1]


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
        Returned slots that are padding, out of range or duplicates (among the sampled users).
    max_score_error : float or None
        Largest |returned score - true score| / scale over valid returned items; None without scores.
    rtol : float
        The tolerance used, relative to each user's scale.
    n_sample : int
    per_user : array of float64, shape (n_sample,)
    """

    recall: float
    min_recall: float
    users_short: int
    invalid: int
    max_score_error: float | None
    rtol: float
    n_sample: int
    per_user: np.ndarray = field(repr=False)

    @property
    def exact(self) -> bool:
        """True when every sampled user got a full, correct top-k (within the tolerance)."""
        return self.users_short == 0

    def as_dict(self) -> dict[str, Any]:
        return {"recall": self.recall, "min_recall": self.min_recall, "users_short": self.users_short,
                "invalid": self.invalid, "max_score_error": self.max_score_error, "rtol": self.rtol,
                "n_sample": self.n_sample, "exact": self.exact}


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


def exact_topk(user_vecs: Any, item_vecs: Any, k: int, rows: np.ndarray, metric: str = "ip",
               memory_budget: int = DEFAULT_BUDGET) -> Truth:
    """Exact float64 top-k of the users ``rows`` against every item, chunked over items.

    Parameters
    ----------
    user_vecs : array, shape (n_users, dim)
        Users; NumPy, or CuPy/torch on the device (only the sampled rows are copied to the host).
    item_vecs : array, shape (n_items, dim)
        Items; NumPy or device array (copied to the host one chunk at a time).
    k : int
        Items per user, >= 1.
    rows : array of int, shape (n_sample,)
        Which users to answer for (see :func:`sample_rows`).
    metric : {"ip", "cosine", "l2"}
    memory_budget : int
        Bytes of float64 scratch (scores and item chunk) held at once.

    Returns
    -------
    Truth

    Raises
    ------
    InputError
        k < 1, unknown metric, or mismatched dimensions.
    """
    if metric not in ("ip", "cosine", "l2"):
        raise InputError(f"unknown metric {metric!r}: expected ip, cosine or l2")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise InputError(f"k must be an integer >= 1, got {k!r}")
    n_items, dim = int(item_vecs.shape[0]), int(item_vecs.shape[1])
    if int(user_vecs.shape[1]) != dim:
        raise InputError(f"users have dimension {user_vecs.shape[1]}, items {dim}")
    rows = np.asarray(rows, dtype=np.int64)
    u = _metric_users(metric, _rows_f64(user_vecs, rows))
    n = u.shape[0]
    k_eff = min(int(k), n_items)
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
            parts = list(pool.map(lambda ab: _merge(best_s[ab[0]:ab[1]], best_i[ab[0]:ab[1]], s[ab[0]:ab[1]],
                                                    start, k_eff), blocks))
            best_s = np.concatenate([p[0] for p in parts])
            best_i = np.concatenate([p[1] for p in parts])
    order = np.lexsort((best_i, -best_s), axis=1)
    best_s = np.take_along_axis(best_s, order, axis=1)
    best_i = np.take_along_axis(best_i, order, axis=1)
    kth = best_s[:, -1].copy()
    scale = np.maximum(np.abs(best_s[:, 0]), np.abs(kth))
    scale[~(scale > 0)] = 1.0
    return Truth(rows=rows, user_vecs=u, k=int(k), top_scores=best_s, top_items=best_i, kth=kth, scale=scale,
                 metric=metric, n_items=n_items)


def check(truth: Truth, item_vecs: Any, indices: Any, scores: Any = None, rtol: float = DEFAULT_RTOL,
          rows_are_sampled: bool = False) -> Check:
    """Tie-aware recall@k of an answer against the truth.

    Parameters
    ----------
    truth : Truth
        From :func:`exact_topk`.
    item_vecs : array, shape (n_items, dim)
        The items (NumPy or device); only the returned rows are gathered.
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

    # Gather and score the returned rows a block of users at a time, so (block, k, dim) float64 stays bounded.
    true_s = np.full(idx.shape, -np.inf)
    safe = np.where(valid, idx, 0)
    dim = truth.user_vecs.shape[1]
    block = max(1, int(DEFAULT_BUDGET // max(1, 8 * k_ret * dim)))
    for a in range(0, n, block):
        b = min(a + block, n)
        uniq, inv = np.unique(safe[a:b].ravel(), return_inverse=True)
        v = _rows_f64(item_vecs, uniq)[inv.ravel()].reshape(b - a, k_ret, dim)
        true_s[a:b] = _pair_scores(truth.metric, truth.user_vecs[a:b], v)
    return check_from_true_scores(truth, valid, true_s, sc, rtol)


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
                           rtol: float) -> Check:
    """Tie-aware recall@k of an answer from the true (float64) scores of its slots; see :func:`check`.

    valid: (n, k_returned) bool from :func:`answer_validity`; true_s: (n, k_returned) true scores; sc: the scores
    the contender reported (float64), or None."""
    n, k_ret = valid.shape
    true_s = np.where(valid, true_s, -np.inf)
    tol = rtol * truth.scale
    hits = (valid & (true_s >= (truth.kth - tol)[:, None])).sum(axis=1)
    per_user = np.minimum(hits, truth.k_eff) / truth.k_eff
    # Slots past k_eff (k > n_items) are padding by contract; only the first k_eff slots can be wrong.
    invalid = int((~valid[:, :truth.k_eff]).sum()) + n * max(0, truth.k_eff - k_ret)
    max_err = None
    if sc is not None:
        ok = valid & np.isfinite(sc)
        if ok.any():
            max_err = float(np.max(np.abs(sc - true_s)[ok] / np.broadcast_to(truth.scale[:, None], valid.shape)[ok]))
        else:
            max_err = float("inf")
    return Check(recall=float(per_user.mean()), min_recall=float(per_user.min()),
                 users_short=int((per_user < 1).sum()), invalid=invalid, max_score_error=max_err, rtol=rtol,
                 n_sample=n, per_user=per_user)


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
