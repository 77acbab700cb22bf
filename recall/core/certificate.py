"""Fast mode's arithmetic: half-precision inputs, and the rigorous error bound that proves the exact top-k.

Vectors are scaled by powers of two (exact) and rounded to float16; the GEMM multiplies them with float32
accumulation (tensor cores on a GPU; on the CPU the same arithmetic is emulated, for testing). For every user the
engine keeps the ``k + m + 1`` best *approximate* scores, re-scores the first ``k + m`` candidates in float32, and
takes their exact top k. The answer is certified when the exact k-th score beats the best approximate score left
out plus the error bound ``E_u``: no item outside the candidates can then reach the top k. Users whose certificate
fails are searched again in exact mode (the fallback), so the result is always the exact-mode answer.

The bound, for user u against any item v, with float16 unit roundoff r = 2^-11, half the float16 subnormal spacing
η = 2^-25 (absolute rounding error of tiny components), float32 accumulation error γ = d·2^-23 (twice the rounding
unit, so it also covers accumulators that truncate), user scale α and item scale β (powers of two)::

    |s̃ - s| <= (2r + r² + γ(1 + r)²)·|u|·|v| + η(1 + r)(1 + γ)(|u|₁/β + |v|₁/α) + dη²(1 + γ)/(αβ)

(each rounded input is x(1 + δ) + a with |δ| <= r, |a| <= η; products of float16 values are exact in float32; the
sum of |u_i v_i| is at most |u|·|v| by Cauchy-Schwarz). The float32 re-scoring itself may differ from the real
score by γ·|u|·|v|; that term is added too, and the whole bound is taken 1% larger. |v| and |v|₁ are bounded by the
item matrix's largest norms, so ``E_u`` is one number per user.

Where the backend keeps its score tiles in float16 (the GPU: half the bytes written by the GEMM and read by the
selection), the GEMM multiplies its float32 result by ``g = output_scale(dim)`` (a power of two that keeps every score
inside float16's range) before rounding it to float16, which adds at most ``2^-10·|s̃| + 2^-24/(g·α·β)`` (a full
float16 ulp, and the subnormal spacing, so rounding that truncates is covered too) with ``|s̃| <= |u|·|v| + E``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

_R16 = 2.0 ** -11
_ETA16 = 2.0 ** -25
_TOP_EXP = 13  # scale so the largest |component| lies in [2^13, 2^14): far below float16's 65504
_SAFETY = 1.01


def output_scale(dim: int) -> float:
    """g: the power of two that scales float32 GEMM results of scaled float16 inputs into float16's range.

    Scaled components are below 2^(_TOP_EXP + 1), so |s̃| <= dim·2^(2·_TOP_EXP + 2)(1 + γ); g brings that under
    2^15·(1 + γ) < 65504."""
    return 2.0 ** (15 - 2 * (_TOP_EXP + 1) - max(0, int(dim - 1).bit_length()))


def margin(k: int) -> int:
    """Extra candidates kept beyond k (m): k/4, measured to certify fp16 scores for nearly every user."""
    return max(16, k // 4)


def _pow2_scale(xp: Any, maxabs: Any) -> Any:
    """2^(13 - floor(log2(maxabs))) elementwise, 1 where maxabs is 0."""
    safe = xp.where(maxabs > 0, maxabs, 1.0)
    return xp.where(maxabs > 0, xp.exp2(_TOP_EXP - xp.floor(xp.log2(safe))), 1.0)


@dataclass(frozen=True)
class FastItems:
    """The item matrix in float16, scaled by ``scale``, and the norms the error bound needs."""

    vecs16: Any  # (n_items, dim) float16, on the backend
    scale: float  # β
    max_norm: float  # max |v|
    max_l1: float  # max |v|₁


def prepare_items(xp: Any, items: Any) -> FastItems:
    """items: (n_items, dim) float32 -> FastItems (arrays of module ``xp``)."""
    items64 = items.astype(xp.float64)
    scale = float(_pow2_scale(xp, xp.abs(items64).max()))
    vecs16 = (items * np.float32(scale)).astype(xp.float16)
    norms = xp.sqrt((items64 * items64).sum(axis=1))
    return FastItems(vecs16, scale, float(norms.max()), float(xp.abs(items64).sum(axis=1).max()))


def prepare_users(xp: Any, users: Any, items: FastItems, half_scores: bool = False) -> tuple[Any, Any, Any]:
    """users: (n, dim) float32 -> (float16 scaled users, per-user scale α (n,), per-user error bound E_u (n,)).

    ``half_scores``: the GEMM's scores are rounded to float16 after scaling by ``output_scale(dim)``."""
    users64 = users.astype(xp.float64)
    alpha = _pow2_scale(xp, xp.abs(users64).max(axis=1))
    users16 = (users * alpha[:, None].astype(xp.float32)).astype(xp.float16)
    dim = users.shape[1]
    gamma = dim * 2.0 ** -23
    norm = xp.sqrt((users64 * users64).sum(axis=1))
    l1 = xp.abs(users64).sum(axis=1)
    bound = ((2 * _R16 + _R16 ** 2 + gamma * (1 + _R16) ** 2 + gamma) * norm * items.max_norm
             + _ETA16 * (1 + _R16) * (1 + gamma) * (l1 / items.scale + items.max_l1 / alpha)
             + dim * _ETA16 ** 2 * (1 + gamma) / (alpha * items.scale))
    if half_scores:
        bound = bound + 2.0 ** -10 * (norm * items.max_norm + bound) \
            + 2.0 ** -24 / (output_scale(dim) * alpha * items.scale)
    return users16, alpha, _SAFETY * bound


def certified(xp: Any, exact_kth: Any, outside_scaled: Any, alpha: Any, item_scale: float, bound: Any) -> Any:
    """Per user: True when no item outside the candidates can enter the exact top k.

    exact_kth: the exact k-th score among the candidates; outside_scaled: the best approximate score left out, in
    the scaled space of the GEMM (-inf when every qualifying item is a candidate)."""
    outside = outside_scaled.astype(xp.float64) / (alpha * item_scale)
    return xp.isneginf(outside_scaled) | (exact_kth.astype(xp.float64) > outside + bound)
