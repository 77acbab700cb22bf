"""An exact float64 reference for top-k search, written independently of ``recall`` (no imports from it).

Ordering everywhere: score descending, then item row ascending. Padding where fewer than k items qualify:
row -1, score -inf, always at the end of a row.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

METRICS = ("ip", "cosine", "l2")


def score_matrix(user_vecs: Any, item_vecs: Any, metric: str = "ip") -> np.ndarray:
    """Every user against every item in float64: (n_users, n_items).

    ``ip``: u·v; ``cosine``: u·v / (|u| |v|); ``l2``: -||u - v||². All in float64, where the expanded l2 form
    ``2u·v - ||u||² - ||v||²`` is exact on small-integer data and within ~1e-15 relative elsewhere, far below the
    float32 rounding under test; the difference form would need (n_users, n_items, dim) memory.
    """
    users = np.asarray(user_vecs, dtype=np.float64)
    items = np.asarray(item_vecs, dtype=np.float64)
    if metric == "ip":
        return users @ items.T
    if metric == "cosine":
        un = users / np.linalg.norm(users, axis=1, keepdims=True)
        vn = items / np.linalg.norm(items, axis=1, keepdims=True)
        return un @ vn.T
    if metric == "l2":
        usq = np.einsum("ij,ij->i", users, users)
        vsq = np.einsum("ij,ij->i", items, items)
        return 2.0 * (users @ items.T) - usq[:, None] - vsq[None, :]
    raise ValueError(f"oracle: unknown metric {metric!r}")


def exclusion_mask(exclude: Any, n_users: int, n_items: int) -> np.ndarray:
    """``exclude`` (None, {user: rows} or (indptr, rows)) as a boolean (n_users, n_items) matrix, True = excluded."""
    mask = np.zeros((n_users, n_items), dtype=bool)
    if exclude is None:
        return mask
    if isinstance(exclude, Mapping):
        for user, rows in exclude.items():
            rows = np.asarray(list(rows), dtype=np.int64)
            mask[int(user), rows] = True
        return mask
    indptr, rows = (np.asarray(a, dtype=np.int64) for a in exclude)
    users = np.repeat(np.arange(n_users), np.diff(indptr))
    mask[users, rows] = True
    return mask


def ranked(scores: np.ndarray, exclude: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every allowed item of every user, best first: (order (n_users, n_items) int64, sorted scores float64,
    n_allowed (n_users,)). Positions at and past ``n_allowed[u]`` hold excluded items and must be ignored."""
    scores = np.asarray(scores, dtype=np.float64)
    n_users, n_items = scores.shape
    banned = exclusion_mask(exclude, n_users, n_items)
    # Scores are finite, so +inf on the negated key sends excluded items after every allowed one; a stable sort on
    # -score keeps equal scores in item row order (the tie rule).
    key = np.where(banned, np.inf, -scores)
    order = np.argsort(key, axis=1, kind="stable").astype(np.int64)
    return order, np.take_along_axis(scores, order, axis=1), n_items - banned.sum(axis=1)


def topk_from_scores(scores: np.ndarray, k: int, exclude: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of each row of ``scores`` (n_users, n_items) by (score desc, row asc), exclusions removed.

    Returns (indices int64 (n_users, k), scores float64 (n_users, k)), padded with (-1, -inf): the shape of a
    backend's running top-k (``Engine.search`` returns min(k, n_items) columns: see :func:`topk`).
    """
    order, vals, n_allowed = ranked(scores, exclude)
    n_users, n_items = order.shape
    idx = np.full((n_users, k), -1, dtype=np.int64)
    val = np.full((n_users, k), -np.inf, dtype=np.float64)
    take = min(k, n_items)
    idx[:, :take] = order[:, :take]
    val[:, :take] = vals[:, :take]
    pad = np.arange(k)[None, :] >= n_allowed[:, None]
    idx[pad] = -1
    val[pad] = -np.inf
    return idx, val


def topk(user_vecs: Any, item_vecs: Any, k: int, metric: str = "ip", exclude: Any = None
         ) -> tuple[np.ndarray, np.ndarray]:
    """Exact float64 top-k: (indices (n_users, min(k, n_items)) int64, scores float64), padded with (-1, -inf)."""
    users = np.asarray(user_vecs, dtype=np.float64)
    k = min(k, np.asarray(item_vecs).shape[0])  # as Engine.search: never wider than the catalogue
    if users.shape[0] == 0:
        return np.full((0, k), -1, np.int64), np.full((0, k), -np.inf)
    return topk_from_scores(score_matrix(users, item_vecs, metric), k, exclude)


def filtered_topk(users: Any, items: Any, k: int, metric: str = "ip", passing: Any = None,
                  exclude: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(rows (n, min(k, n_items)), float64 scores) of the oracle with a shared item mask ``passing`` (n_items,) and
    exclusions: as wide as an unfiltered search, padded with (-1, -inf) where fewer items pass; ties to the lower
    row."""
    k = min(k, len(items))
    scores = score_matrix(users, items, metric)
    banned = exclusion_mask(exclude, len(users), len(items))
    if passing is not None:
        banned |= ~passing[None, :]
    rows = np.full((len(users), k), -1, np.int64)
    vals = np.full((len(users), k), -np.inf)
    for u in range(len(users)):
        ok = np.flatnonzero(~banned[u])
        order = ok[np.lexsort((ok, -scores[u, ok]))][:k]
        rows[u, :order.size] = order
        vals[u, :order.size] = scores[u, order]
    return rows, vals


def score_scale(user_vecs: Any, item_vecs: Any, metric: str = "ip") -> np.ndarray:
    """Per-user magnitude of the terms a float32 score is built from: (n_users,) float64.

    float32 rounding error in a score is a few ulps of this, not of the score itself (l2 cancels ||u||² against
    2u·v - ||v||²; ip cancels positive against negative products).
    """
    users = np.asarray(user_vecs, dtype=np.float64)
    items = np.asarray(item_vecs, dtype=np.float64)
    if metric == "cosine":
        return np.ones(users.shape[0])
    un = np.linalg.norm(users, axis=1)
    vmax = np.linalg.norm(items, axis=1).max() if items.shape[0] else 0.0
    if metric == "l2":
        return un**2 + 2 * un * vmax + vmax**2
    return un * vmax


def assert_topk_close(got_idx: Any, got_val: Any, user_vecs: Any, item_vecs: Any, k: int, metric: str = "ip",
                      exclude: Any = None, rtol: float = 1e-4) -> None:
    """Check a float32 result against the float64 oracle, allowing for near-ties.

    - padding (-1 / -inf) exactly where the oracle pads;
    - every score within ``rtol * scale`` of the oracle's score at the same rank (``scale`` from ``score_scale``);
    - every returned item's true score within that tolerance of the score at its rank (so a swapped near-tie
      passes, a wrong item does not), every row's items unique and never excluded;
    - where the oracle's rank-r score is clearly separated from its neighbours, the index is identical.
    """
    got_idx = as_numpy(got_idx)
    got_val = as_numpy(got_val).astype(np.float64)
    users = np.asarray(user_vecs, dtype=np.float64)
    n_items = np.asarray(item_vecs).shape[0]
    k = min(k, n_items)  # the engine's results have min(k, n_items) columns
    want_shape = (users.shape[0], k)
    assert got_idx.shape == want_shape, f"indices have shape {got_idx.shape}, expected {want_shape}"
    assert got_val.shape == want_shape, f"scores have shape {got_val.shape}, expected {want_shape}"
    if users.shape[0] == 0:
        return
    full = score_matrix(users, item_vecs, metric)
    want_idx, want_val = topk_from_scores(full, k, exclude)
    pad = want_idx < 0
    np.testing.assert_array_equal(got_idx < 0, pad, err_msg="padding (-1) in the wrong places")
    assert np.all(np.isneginf(got_val[pad])), "padded scores must be -inf"
    real = ~pad
    tol = rtol * np.maximum(score_scale(users, item_vecs, metric), 1e-30)[:, None] + 1e-6
    tol_b = np.broadcast_to(tol, want_shape)
    np.testing.assert_array_less(np.abs(got_val[real] - want_val[real]), tol_b[real],
                                 err_msg="scores differ from the float64 oracle at the same rank")
    rows = np.where(real, got_idx, 0)
    assert np.all(rows < n_items), "an index past the last item"
    true_of_got = np.take_along_axis(full, rows, axis=1)
    np.testing.assert_array_less(np.abs(true_of_got[real] - want_val[real]), 2 * tol_b[real],
                                 err_msg="a returned item's true score does not belong at its rank")
    banned = exclusion_mask(exclude, users.shape[0], n_items)
    assert not np.any(np.take_along_axis(banned, rows, axis=1) & real), "an excluded item was returned"
    srt = np.sort(np.where(real, got_idx, -1 - np.arange(k)[None, :]), axis=1)
    assert not np.any(srt[:, 1:] == srt[:, :-1]), "an item appears twice in a user's row"
    # A rank whose oracle score is more than 4 tol away from the scores just above and just below it (the first
    # item past the cut included) cannot be swapped by float32 rounding: its index must match exactly.
    _, sorted_vals, n_allowed = ranked(full, exclude)
    pos = np.arange(n_items)[None, :]
    gaps = sorted_vals[:, :-1] - sorted_vals[:, 1:]
    inf_col = np.full((users.shape[0], 1), np.inf)
    above = np.concatenate([inf_col, gaps], axis=1)
    below = np.concatenate([gaps, inf_col], axis=1)
    below[pos + 1 >= n_allowed[:, None]] = np.inf
    clear = (pos < n_allowed[:, None]) & (np.minimum(above, below) > 4 * tol)
    take = min(k, n_items)
    clear = clear[:, :take]
    np.testing.assert_array_equal(got_idx[:, :take][clear], want_idx[:, :take][clear],
                                  err_msg="an item at a clearly separated rank differs from the oracle")


def recall_at_k(got_idx: Any, user_vecs: Any, item_vecs: Any, k: int, metric: str = "ip", exclude: Any = None,
                atol: float = 0.0) -> float:
    """Tie-aware recall@k against the float64 oracle.

    A returned item is a hit when it is allowed for its user and its true score is at least the oracle's k-th best
    score minus ``atol``: an item tied with the k-th best counts, so a different but equally valid tie-break scores
    1.0. Padding, duplicates and excluded items never count. Divides by the number of items the oracle returns.
    """
    got_idx = np.asarray(got_idx)
    users = np.asarray(user_vecs, dtype=np.float64)
    want_idx, want_val = topk(users, item_vecs, k, metric, exclude)
    full = score_matrix(users, item_vecs, metric) if users.shape[0] else None
    banned = exclusion_mask(exclude, users.shape[0], np.asarray(item_vecs).shape[0])
    hits = total = 0
    for u in range(got_idx.shape[0]):
        n_want = int((want_idx[u] >= 0).sum())
        total += n_want
        if n_want == 0:
            continue
        kth = want_val[u, n_want - 1]
        seen: set[int] = set()
        for j in got_idx[u, :k].tolist():
            if j < 0 or j in seen or banned[u, j]:
                continue
            seen.add(j)
            hits += bool(full[u, j] >= kth - atol)
    return 1.0 if total == 0 else hits / total


def as_numpy(arr: Any) -> np.ndarray:
    """A host NumPy copy of a NumPy or CuPy array (results are CuPy only when the users were device arrays)."""
    get = getattr(arr, "get", None)
    return get() if callable(get) and not isinstance(arr, np.ndarray) else np.asarray(arr)


def int_matrix(rng: np.random.Generator, n: int, dim: int, lo: int = -3, hi: int = 4) -> np.ndarray:
    """Small-integer float32 vectors: their float32 scores are exact in any summation order, and tie often."""
    return rng.integers(lo, hi, size=(n, dim)).astype(np.float32)


def assert_same_result(a: Any, b: Any) -> None:
    """Two search results with bit-for-bit equal rows and scores (host or device arrays)."""
    np.testing.assert_array_equal(as_numpy(a.indices), as_numpy(b.indices))
    np.testing.assert_array_equal(as_numpy(a.scores), as_numpy(b.scores))
