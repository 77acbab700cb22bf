"""Helpers for the I/O, pipeline and CLI tests: seeded embedding files in each accepted layout, and a float64 oracle.

Imported as a plain module (``tests/`` is on ``sys.path`` under pytest's default import mode).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

LAYOUTS = ("fixed32", "list32", "list64", "fixed64", "large_list32")


def vector_array(vecs: np.ndarray, layout: str = "fixed32") -> pa.Array:
    """``vecs`` (n, dim) as an Arrow vector column of the given layout."""
    vecs = np.asarray(vecs)
    n, dim = vecs.shape
    dtype = pa.float64() if layout.endswith("64") else pa.float32()
    flat = pa.array(vecs.ravel().astype(np.float64 if dtype == pa.float64() else np.float32), dtype)
    if layout.startswith("fixed"):
        return pa.FixedSizeListArray.from_arrays(flat, dim)
    offsets = pa.array(np.arange(n + 1, dtype=np.int64 if layout.startswith("large") else np.int32) * dim)
    cls = pa.LargeListArray if layout.startswith("large") else pa.ListArray
    return cls.from_arrays(offsets, flat)


def write_embeddings(path: Path, ids: Any, vecs: Any = None, layout: str = "fixed32", row_group_size: int | None = None,
                     id_col: str = "id", vec_col: str = "embedding", vec_array: pa.Array | None = None,
                     id_array: pa.Array | None = None) -> Path:
    """Write an embedding file; ``vec_array`` / ``id_array`` override the columns (for deliberately bad files)."""
    ids_col = id_array if id_array is not None else pa.array(ids)
    vec = vec_array if vec_array is not None else vector_array(vecs, layout)
    pq.write_table(pa.table({id_col: ids_col, vec_col: vec}), path, row_group_size=row_group_size)
    return path


def int_data(n_users: int, n_items: int, dim: int, seed: int = 0, low: int = -3, high: int = 3
             ) -> tuple[np.ndarray, np.ndarray]:
    """Small-integer-valued float32 vectors: scores are exact in float32 and float64, so comparisons can be exact
    and ties are common (the tie rule, lower item row first, decides)."""
    rng = np.random.default_rng(seed)
    return (rng.integers(low, high + 1, (n_users, dim)).astype(np.float32),
            rng.integers(low, high + 1, (n_items, dim)).astype(np.float32))


def oracle_topk(users: np.ndarray, items: np.ndarray, k: int, metric: str = "ip",
                banned: np.ndarray | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Exact float64 top-k: per user, (item rows, scores), best first, ties to the lower row, banned items removed.

    Lists, not a padded matrix: a user keeps min(k, allowed items) entries, as in the candidates file.
    """
    u, v = users.astype(np.float64), items.astype(np.float64)
    if metric == "ip":
        scores = u @ v.T
    elif metric == "cosine":
        scores = (u / np.linalg.norm(u, axis=1, keepdims=True)) @ (v / np.linalg.norm(v, axis=1, keepdims=True)).T
    elif metric == "l2":
        scores = -((u[:, None, :] - v[None, :, :]) ** 2).sum(axis=2)
    else:
        raise ValueError(metric)
    rows_out, scores_out = [], []
    for i in range(len(u)):
        allowed = np.flatnonzero(~banned[i]) if banned is not None else np.arange(len(v))
        # lexsort: last key is primary -> score descending, then row ascending.
        order = allowed[np.lexsort((allowed, -scores[i, allowed]))][:k]
        rows_out.append(order)
        scores_out.append(scores[i, order])
    return rows_out, scores_out
