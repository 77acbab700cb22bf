"""Selection by 64-bit keys: a (score, item row) pair packed so that one integer order is the tie rule.

High 32 bits: the float32 score mapped to an unsigned integer that sorts like the float (-0.0 folded into +0.0, so
that equal scores are decided by the row alone); low 32 bits: ``~row``, so that the lower row of a tie gives the
larger key. Key 0 marks an empty slot. The GPU kernels (``recall/backends/cupy/kernels/*.cu``) pack the same way, so
a selection here and one there give the same answer. Works on any array module (NumPy or CuPy: ``xp``).
"""
from __future__ import annotations

from typing import Any

import numpy as np


def pack(xp: Any, scores: Any, rows: Any) -> Any:
    """uint64 keys of (scores, rows), same shape; 0 where ``rows`` < 0."""
    scores = xp.where(scores == 0, xp.float32(0), scores).astype(xp.float32, copy=False)
    bits = xp.ascontiguousarray(scores).view(xp.uint32)
    ordered = xp.where(bits & xp.uint32(0x80000000), ~bits, bits | xp.uint32(0x80000000)).astype(xp.uint64)
    keys = (ordered << xp.uint64(32)) | (~rows.astype(xp.uint32)).astype(xp.uint64)
    return xp.where(rows < 0, xp.uint64(0), keys)


def unpack(xp: Any, keys: Any) -> tuple[Any, Any]:
    """(scores float32, rows int64) of uint64 keys; (-inf, -1) for key 0."""
    hi = (keys >> xp.uint64(32)).astype(xp.uint32)
    vals = xp.ascontiguousarray(xp.where(hi & xp.uint32(0x80000000), hi & xp.uint32(0x7FFFFFFF), ~hi)).view(xp.float32)
    rows = (~(keys & xp.uint64(0xFFFFFFFF)).astype(xp.uint32)).astype(xp.int64)
    empty = keys == 0
    return xp.where(empty, xp.float32(-np.inf), vals).astype(xp.float32), xp.where(empty, -1, rows)


def select(xp: Any, scores: Any, rows: Any, k: int) -> tuple[Any, Any]:
    """The best k (score desc, lower row first) of each row of a candidate block, padded with (-inf, -1).

    Parameters
    ----------
    xp : module
        numpy or cupy, the module of the arrays.
    scores : array of float32, shape (n, width)
    rows : array of int64, shape (n, width)
        Item rows, -1 for an empty slot; no row twice within a row of the block.
    k : int

    Returns
    -------
    (scores (n, k) float32, rows (n, k) int64), best first.
    """
    n, width = rows.shape
    keys = pack(xp, scores, rows)
    if width > k:
        keys = xp.partition(keys, width - k, axis=1)[:, width - k:]
    keys = xp.sort(keys, axis=1)[:, ::-1]
    if keys.shape[1] < k:
        keys = xp.concatenate([keys, xp.zeros((n, k - keys.shape[1]), xp.uint64)], axis=1)
    return unpack(xp, xp.ascontiguousarray(keys))


def concat(xp: Any, parts: list[tuple[Any, Any, int]]) -> tuple[Any, Any]:
    """(scores, rows) of result parts side by side, each part's rows shifted by its offset (padding stays -1)."""
    scores = [p[0] for p in parts]
    rows = [xp.where(p[1] >= 0, p[1] + p[2], -1) if p[2] else p[1] for p in parts]
    if len(parts) == 1:
        return scores[0], rows[0]
    return xp.concatenate(scores, axis=1), xp.concatenate(rows, axis=1)
