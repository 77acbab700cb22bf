"""The fused exact kernel's float32 sums, emulated on the CPU: ``fma(u_0, v_0, 0)``, then ``fma(u_d, v_d, s)`` for
every further dimension in order, each rounded once to float32 (round to nearest even), as ``fmaf`` does.

NumPy has no fused multiply-add. A product of two float32 values is exact in float64 (24 + 24 significant bits), but
the sum with the running float32 ``s`` may round in float64 and then again to float32, which can land on the wrong
side of a float32 midpoint. So the float64 sum is rounded *to odd* (the exact sum truncated toward zero, its last bit
set where anything was cut off, from TwoSum's exact error term): with 53 >= 24 + 2 bits, rounding that to float32
gives the correctly rounded sum (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved
algorithms using rounding to odd", IEEE Trans. Computers 57(4), 2008).
"""
from __future__ import annotations

import numpy as np


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``fmaf(a, b, c)`` elementwise: float32 ``a``, ``b``, ``c`` (broadcast) -> float32, rounded once."""
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)  # exact
    c64 = np.asarray(c, np.float32).astype(np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # TwoSum: p + c == s + err exactly
    # The exact sum truncated toward zero: s where err points away from zero (or is 0), else s's neighbour towards 0.
    # (A float64 sum that rounds to 0 is exact, so s != 0 wherever err != 0.)
    trunc = np.where((err == 0) | ((err > 0) == (s > 0)), s, np.nextafter(s, 0.0))
    odd = (trunc.view(np.int64) & 1) == 1
    ro = np.where((err == 0) | odd, trunc, np.nextafter(trunc, np.copysign(np.inf, trunc)))
    with np.errstate(over="ignore"):
        return ro.astype(np.float32)


def ordered_dots(users: np.ndarray, vecs: np.ndarray) -> np.ndarray:
    """users (n, D) float32, vecs (n, w, D) float32 -> (n, w) float32: each user's float32 sum with each of its w
    vectors, the products added in order of dimension by :func:`fma32` from 0."""
    n, w, dim = vecs.shape
    acc = np.zeros((n, w), np.float32)
    for d in range(dim):
        acc = fma32(users[:, d, None], vecs[:, :, d], acc)
    return acc + np.float32(0.0)  # -0.0 -> +0.0: the kernels' keys fold the two
