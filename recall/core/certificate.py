"""Fast mode's arithmetic: half-precision inputs, and the rigorous error bound that proves the exact top-k.

Vectors are scaled by powers of two (exact) and rounded to float16; the GEMM multiplies them with float32
accumulation (tensor cores on a GPU; on the CPU the same arithmetic is emulated, for testing). For every user the
engine keeps the ``k + m + 1`` best *approximate* scores (in no order), re-scores them in float32, and takes their
exact top k. The answer is certified when the exact k-th score beats an upper bound of the float32
score of every item left out: no item outside the candidates can then reach the top k. Users whose certificate
fails are searched again (``recall.engine.fast``), so the result is always the exact-mode answer.

The float16 form
----------------
A prepared vector (``recall.core.metrics``) has *dot* columns and, for augmented metrics (``l2``), one *bias*
column (``metrics.bias_column``) where every user holds exactly 1 and item v holds a constant c_v (l2: -|v|²/2),
zeros after it. The score is ``s = y·x + c`` with y, x the dot parts (c = 0 without a bias). Each part is scaled
and rounded on its own, so that the bias, which under l2 is far larger than the components, never costs the dot
part its precision (issue 18: one scale for the augmented vectors did, and the bound r·|u|·|v| of the augmented
vectors was dominated by |v|²/2). The float16 columns, W of them, are:

- dot: ``ỹ = fl16(α·y)`` with a power of two α per user, ``x̃ = fl16(β·x)`` with a power of two β for the item
  matrix, each from the dot part's own largest |component| (which lands in [2^13, 2^14));
- shift: items hold 2^15, users ``σ_u = fl16(-S_u·αβ/2^15)`` for a score S_u of their choice (``prepare_users``'
  ``shift``, 0 by default): every score of the user moves by the same, exactly known, amount, so the order of its
  items is unchanged (α is lowered where σ_u would not fit float16);
- bias: items hold two float16 parts ``h₁ = fl16(β_b·c)``, ``h₂ = fl16(β_b·c - h₁)`` (β_b a power of two), so that
  c̃ = (h₁ + h₂)/β_b is within about 2^-22·|c| of c; users hold ``e_u = α·β/β_b`` in both, an exact power of two
  (α is lowered where e_u would exceed 2^13; where e_u would be below float16's smallest subnormal 2^-24 the bias
  is dropped for that user, e_u = 0). Rows of at least ``_BIAS_WIDE`` columns give the bias the shift column's
  range: β_b·max|c| in [2^14, 2^15) and e_u up to 2^15, so that the users whose α the bias caps (under l2, those of
  small norm against items of widely spread norms) keep 8 times the scale;
- per-item bound columns (with a bias, and wherever the largest item norm is over ``_NORM_SPREAD`` times the
  median, so that a bound through the largest item would be loose for the items that matter): items hold, rounded
  up, n_v = |x_v|, r_v = |δx_v| (below) and, with a bias, κ_v (below), each scaled by its own power of two; users
  hold the matching factors P_u, Q_u (and 1), rounded up, so that the GEMM adds to each score the item's *own*
  error bound, ``L_uv >= P_u·n_v + Q_u·r_v (+ κ_v)``;
- zeros, up to a multiple of 8 columns (rows of 16 bytes, as tensor-core GEMMs prefer).

The GEMM's float32 result for user u and item v is t; in the users' units ``t/(αβ) ≈ a·b + A_u + c̃_v + L_uv``, with
``A_u = σ_u·2^15/(αβ) ≈ -S_u`` the applied shift (``FastUsers.offset``, exact in float64).

The bound
---------
Write a = ỹ/α, b = x̃/β (the float16 values, unscaled), δy = a - y and δx = b - x (the rounding *residuals*,
computed exactly in float64 when the vectors are prepared: float16 subnormals included). Then, exactly,
``a·b - y·x = δy·x + y·δx + δy·δx``, and by Cauchy-Schwarz on the residual vectors::

    |a·b - y·x| <= |δy|·n_v + |y|·r_v + |δy|·r_v                                     (input rounding)

Products of float16 values are exact in float32 (11 + 11 significant bits; every factor is 0 or at least 2^-24),
so the GEMM's only other error is its float32 accumulation of W terms::

    |t/(αβ) - (a·b + A_u + c̃_v + L_uv)| <= γ₁₆·(|a|·|b_v| + |A_u| + H_v + L_uv),   γ₁₆ = W·2^-22   (accumulation)

with |b_v| <= n_v + r_v and H_v = (|h₁| + |h₂|)/β_b. γ₁₆ is four times the classical W·u of round-to-nearest
accumulation (u = 2^-24, float32's unit roundoff), so that accumulators that truncate, and multi-term adders that
align their addends to the largest one without guard bits (tensor cores: each block of n terms then loses less than
n + 1 units of 2^-23 of its largest magnitude), are covered too. The float32 score f_v that exact mode computes (and
the re-scoring, for the candidates) differs from s_v by at most ``γ₃₂·(|y|·n_v + |c_v|) + φ·n_v + F_u`` for the
prepared width D (the last two terms: below float32's normal range, next section): those sums are float32
operations that round to nearest, in whatever order the kernel or BLAS takes them, so the classical
γ₃₂ = D·u/(1 - D·u) holds (``gamma32``; it was taken twice that, D·2^-23, before 2026-12-07). Collecting the terms::

    f_v <= t/(αβ) - A_u - L_uv + P_u·n_v + Q_u·r_v + κ_v + γ₁₆·(|A_u| + L_uv) + F_u
      P_u = |δy| + γ₁₆·|a| + γ₃₂·|y| + φ,   Q_u = |y| + |δy| + γ₁₆·|a|,
      κ_v = |c̃_v - c_v| + γ₁₆·H_v + γ₃₂·|c_v|                            (0 without a bias)

(where the bias is dropped for a user, κ_v becomes max |c|·(1 + γ₃₂)). With the per-item columns, L_uv covers
(P_u·n_v + Q_u·r_v + κ_v)·1.01 (the users' factors are taken 1% larger, below), so that L_uv·(1 - γ₁₆) still covers
P_u·n_v + Q_u·r_v + κ_v with room for the float64 arithmetic wherever γ₁₆ <= (1 - 1/1.01)/2 (rows of at most 20,000
float16 columns; wider ones take no bound columns): the bound columns pay for their own accumulation term γ₁₆·L_uv,
and::

    f_v <= t/(αβ) - A_u + R_u,   R_u = γ₁₆·|A_u| + F_u

so every item's score carries its own bound and what is left, R_u, is tiny (it used to hold γ₁₆·max_v L_uv, the
accumulation term of the catalogue's largest bound column: under l2 with a few items of norms 10,000 times the
median, larger than the gaps between a user's scores). Without them (or for a user whose factors would not fit
float16's range, or whose bias is dropped), L = 0 and n_v, r_v, κ_v are replaced by their maxima X, ΔX, K over the
items: ``E_u = P_u·X + Q_u·ΔX + K + γ₁₆·|A_u| + F_u``. ``FastUsers.bound`` holds R_u or E_u, taken 1% larger
(the factors P_u, Q_u too, before rounding up), which covers the float64 arithmetic of the bound and of the test
below (relative errors near 2^-50, against terms never below 2^-30 of the magnitudes involved).

Below float32's normal range
----------------------------
The GPU's own kernels are built with ``-ftz=true`` (CuPy builds every kernel so): a float32 operation reads an
input below 2^-126 in magnitude as 0 and writes a result below it as 0, where the CPU and cuBLAS keep subnormals.
Exact mode's f_v may lose, besides γ₃₂'s relative error, at most 2^-126 at each of its at most 2D operations (a
product and a sum apiece where they are not fused; half a subnormal spacing where subnormals are kept), and the
products of flushed inputs: y_i·x_i with |x_i| < 2^-126 loses at most |y_i|·2^-126, one with |y_i| < 2^-126 at most
|x_i|·2^-126, and over the dot columns Σ|y_i| <= √D₀·|y| (Cauchy-Schwarz, D₀ dot columns), the bias column at most
2^-126 (the user holds 1). So::

    |f_v - s_v| <= γ₃₂·(|y|·n_v + |c_v|) + φ·n_v + F_u,   φ = √D₀·2^-126,   F_u = (2D + 1)·2^-126 + φ·|y|

(``float32_floor``, ``flush_factor``; φ taken 1% larger). Rows of ordinary scale never feel these terms (for |y|
near 1, φ is about 2^-100 of γ₃₂·|y|); they keep the proof a proof for vectors whose scores, or whose components,
are that small. The float16 GEMM never leaves float32's normal range: its inputs are scaled float16 values, whose
products are exact multiples of 2^-48, and so are their sums.

Items far from the origin
-------------------------
Where a catalogue without a bias lies far from the origin (``metrics.far_centre``, l2's rule: its mean more than 8
times its spread from it; ``recall.bench.workloads``' ``offset=``), the rows' own rounding, 2^-11 of |x|, swamps the
spread that orders a user's scores, and no bound through |x| certifies anyone. The dot part is then rounded about c:
``x̃ = fl16(β·(x - c))`` (c in float32, x - c in float64, within 2^-53 of each component), and n'_v = |x - c|, r'_v
= |δx'_v| (that 2^-53·n'_v added) take the places of n_v and r_v in the input-rounding and accumulation terms. Since
y·x = y·(x - c) + y·c, with y·c the same for every item of the user, its scores keep their order, and::

    f_v <= t/(αβ) - (A_u - y·c) + P'_u·n'_v + Q_u·r'_v + (γ₃₂·|y| + φ)·n_v + γ₁₆·(|A_u| + L_uv) + F_u + ε_u
      P'_u = |δy| + γ₁₆·|a|,   ε_u = D₀·2^-52·Σ|y_i c_i| + 2^-50·(|A_u| + |y·c|)

where the float32 scores' own error (with φ) still goes with the vectors' norms n_v (the float32 search multiplies
x, not x - c), and ε_u covers y·c computed in float64 (D₀ terms) and the float64 steps of the offset and of the test at
y·c's magnitude. ``FastUsers.offset`` holds A_u - y·c; a shift S_u is applied as S_u - y·c. The bound columns, where
there are any, hold n'_v, r'_v and n_v against the users' P'_u, Q_u and γ₃₂·|y| + φ; through the maxima, X', ΔX'
and X.

Users along the centre
----------------------
Users of such data often lie along c too (vectors that share one direction), and then their own rounding δy, about
2^-12 of |y|, and the items' r'_v against |y| dominate the bound (cosine, 30 from the origin in every coordinate:
2.6e-5 against gaps of 4e-5 between a user's 10th and 27th scores). So each user is split along ĉ = c/|c| (float64):
p = y·ĉ, summed column by column in float64, and y' = y - p·ĉ, each step rounded on its own, so that y' is within
2^-52·(|p| + |y'|) of y - p·ĉ *whatever p is*. The dot part holds ỹ' = fl16(α·y') (α from y''s largest component),
and with ``w_v = ĉ·(x_v - c)`` (float64; within (D₀ + 2)·2^-52·n'_v of its exact value), y·(x - c) = y'·(x - c) +
p·w_v up to that error. The items hold w_v in two float16 parts W₁ = fl16(β_w·w_v), W₂ = fl16(β_w·w_v - W₁) (β_w a
power of two), in three columns (W₁, W₁, W₂) against the user's (P₁, P₂, P₁), the two float16 parts of
``P = p·αβ/β_w`` (α lowered where |P| would exceed 2^13, as for the bias). The three products sum to
P̃·(W₁ + W₂) - P₂·W₂, which in the users' units is p̃·w̃_v - P₂·W₂/(αβ), with p̃ = (P₁ + P₂)·β_w/(αβ) and
w̃_v = (W₁ + W₂)/β_w, so that::

    |p̃·w̃_v - P₂·W₂/(αβ) - p·w_v| <= |p̃ - p|·max|w̃| + |p|·ω + |P₂|·max|W₂|/(αβ)
      ω = max_v (|w̃_v - w_v| + (D₀ + 2)·2^-52·n'_v)

The input-rounding and accumulation terms of the dot part take |y'|, |δy'|, |a'| in place of |y|, |δy|, |a|
(P'_u = |δy'| + γ₁₆·|a'| + 2^-52·(|p| + |y'|), Q_u = |y'| + |δy'| + γ₁₆·|a'|); the float32 scores' own error still
goes with |y|·n_v; the three columns' accumulation, γ₁₆·(|P₁| + |P₂|)·(max|W₁| + max|W₂|)/(αβ), and the line above
join R_u. Users along c have |y'| far below |y| (their spread about c's direction over their distance from the
origin), and both rounding terms shrink with it: on that cosine data the bound fell from 2.6e-5 to 4.6e-6 (γ₃₂·|y|
the most of it). A user not along c loses nothing (|y'| <= |y|) but three float16 columns, which the rounding of
rows up to a multiple of 8 columns often pays for already.

The float16 score tiles
-----------------------
Where the backend keeps its score tiles in float16 (the GPU's cuBLAS path: half the bytes written by the GEMM and
read by the selection; the search's stats say ``score_dtype``), the GEMM multiplies its float32 result by
``g = output_scale(W)`` (a power of two that keeps every score inside float16's range) and stores ``z = fl16(g·t)``,
with |z - g·t| <= 2^-10·|g·t| + 2^-24 (a full float16 ulp and the subnormal spacing, so rounding that truncates is
covered too). Selection runs on z: every item left out has ``z_v <= z_out``, the best stored score left out.
Solving the rounding bound for the largest g·t that can store at or below z_out gives
``g·t_v <= q(z_out) = (z_out + 2^-24)/(1 ∓ 2^-10)`` (minus where z_out + 2^-24 >= 0, else plus), so the stored
scores' rounding costs a relative 2^-10 of the score *left out*: the shift, S_u near the user's k-th score, brings
that near 0. Where scores stay float32 (the GPU's fused kernel, which compares the tensor cores' float32 sums with
the thresholds in its registers; the CPU's tiles), t_v <= t_out directly.

The certificate
---------------
With T_out that bound on t of every item left out, the user is certified when the exact (float32) k-th score of the
candidates satisfies ``f_k > T_out/(αβ) - A_u + bound_u``, strictly (an item left out that tied f_k with a lower
row would win the tie), or when no item is left out (z_out = -inf: every item that qualifies is a candidate).

The pass that keeps the candidates may start a user at an *estimate* of its last candidate's score rather than a
lower bound (``Backend.run_blocks``' ``left_out``): it then keeps only items whose t (or stored z) lies above that
start, so that every item it left out lies at or below the larger of its last kept score and its start, and that
larger value is z_out. Where the estimate was too high the user holds fewer candidates than asked, z_out is its start
(finite: items were left out), and the test above decides as before; with fewer than k candidates f_k is -inf and
the user is never certified.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

_TOP_EXP = 13  # scale so the largest |component| lies in [2^13, 2^14): far below float16's 65504
_SAFETY = 1.01
_BIAS_PARTS = 2  # float16 columns that carry the bias (c to about 2^-22 relative: below float32's own error)
_PROJ_PARTS = 3  # float16 columns of the users' part along the centre: (P₁, P₂, P₁) against the items' (W₁, W₁, W₂)
_PROJ_USER_MAX = 2.0 ** _TOP_EXP  # |P| at most this (α is lowered so that it fits), as the bias's e_u
_BIAS_USER_MAX = 2.0 ** _TOP_EXP  # e_u at most this: a bias product then stays within the scaled components' range
# From this many float16 columns the bias's products may reach the shift column's 2^30 (h₁ up to 2^15, e_u up to
# 2^15): output_scale's bound still holds (its docstring).
_BIAS_WIDE = 32
_AUX_USER_MAX = 2.0 ** (_TOP_EXP + 1)  # bound factors at most this (else that user takes the bound through maxima)
_SHIFT_ITEM = 2.0 ** 15  # what every item holds in the shift column
_SHIFT_USER_MAX = 2.0 ** 15  # |σ_u| at most this (α is lowered so that it fits): the shift product is at most 2^30
_NORM_SPREAD = 2.0  # per-item bound columns where max |x| > this x median |x| (and always for augmented metrics)
_F16_TINY = 2.0 ** -24  # float16's smallest subnormal (and subnormal spacing)
_F16_MAX = 65504.0
_F32_FLUSH = 2.0 ** -126  # float32's smallest normal: the GPU's own kernels (-ftz=true) flush anything below it to 0
_OUT_ULP = 2.0 ** -10  # a full float16 ulp, relative
_ACC16 = 2.0 ** -22  # γ₁₆ per float16 column
_U32 = 2.0 ** -24  # float32's unit roundoff (round to nearest): γ₃₂ = gamma32(D)
_BLOCK_VALUES = 1 << 23  # values per float64 block: each transient copy stays at 64 MiB however many rows
_MEDIAN_SAMPLE = 65_536  # item norms the median of the spread test is taken over (evenly spaced)


def gamma32(width: int) -> float:
    """γ₃₂: a float32 sum of ``width`` products, in any order, each step rounded to nearest (or fused), is within
    γ₃₂·Σ|products| of the exact sum (outside float32's subnormal range): the classical n·u/(1 - n·u), u = 2^-24."""
    return width * _U32 / (1 - width * _U32)


def float32_floor(width: int) -> float:
    """What a float32 sum of ``width`` products may lose besides γ₃₂'s relative error, absolutely: each of its at most
    2·width operations (a product and a sum apiece where they are not fused) may flush a result below float32's
    normal range (2^-126) to 0, as the GPU's own kernels do (CuPy builds them with ``-ftz=true``), or round it by
    half the subnormal spacing where subnormals are kept (the CPU, cuBLAS): 2·width·2^-126 covers both."""
    return 2 * width * _F32_FLUSH


def flush_factor(width: int) -> float:
    """φ: what a float32 sum of ``width`` products loses to inputs flushed to 0, per unit of the rows' norms. The
    GPU's kernels read a component below 2^-126 as 0, so a product y_i·x_i loses at most 2^-126·(|y_i| + |x_i|), and
    over the row Σ|y_i| <= √width·|y|: at most φ·(|y| + |x|), φ = √width·2^-126 (taken 1% larger, for the rounding of
    the square root and of the norms it multiplies). ``fast16.cu`` takes it (``user_terms``' ``flush``);
    ``topk.cu``'s ``recall_seed_margin`` computes the same from its rows' width."""
    return _SAFETY * math.sqrt(width) * _F32_FLUSH


def output_scale(width: int) -> float:
    """g: the power of two that scales float32 GEMM results of scaled float16 inputs (``width`` columns) into
    float16's range.

    Every product of scaled components is at most 2^(2·_TOP_EXP + 2)·(1 + 2^-8) (bound columns are rounded up by at
    most 2^-9), and the shift column's at most 2^30, so, as widths are multiples of 8,
    |t| <= (width + 3)·2^28·(1 + 2^-8)(1 + γ) <= 1.375·width·2^28·(1 + 2^-7); g brings that under
    1.375·2^15·(1 + 2^-7) < 45,400, inside float16's 65,504. From ``_BIAS_WIDE`` (32) columns the two bias columns'
    products may reach 2^30 too: |t| <= (width + 11)·2^28·(...), and width + 11 <= 1.375·width there."""
    return 2.0 ** (15 - 2 * (_TOP_EXP + 1) - max(0, int(width - 1).bit_length()))


def margin(k: int) -> int:
    """Extra candidates kept beyond k (m): k/4, measured to certify fp16 scores for nearly every user."""
    return max(16, k // 4)


def seed_margin(width: int, half_vectors: bool, half_tiles: bool) -> tuple[float, float, float]:
    """(A, R, Z): a search's own score of an item may lie below a threshold sample's score s of the same item
    (another GEMM: the sums in another order) by at most A·P + R·|s| + Z, with P >= Σ|u_i v_i| over the columns of
    the user's and the item's prepared vectors (``width`` of them, the ones the GEMMs multiply: float16 for
    ``half_vectors``). ``recall_seed`` lowers each sampled score by that much before it takes their k-th best, so
    that the seed stays a lower bound of the search's k-th best whichever items the sample holds (an item's own
    terms, not the largest: under l2 a few far items have norms far above the rest). P = |u|·|v| by Cauchy-Schwarz;
    where every item holds the same value c in a column (fast mode's shift column, 2^15: ``FastItems.constant_column``),
    P = |u'|·|v'| + |u_c|·c, the norms of the rows without that column and its product on its own: through the
    whole rows the shift column multiplied the user's whole norm (on 200k x 100k x 32 l2 with heavy-tailed item norms,
    fast mode's users started below 93% of the items where their sampled estimate lay near the 1,700th best).

    - Two sums of the same ``width`` products differ by at most 2·γ·Σ|u_i v_i| <= 2·γ·P, with γ =
      width·γ₃₂ for float32 vectors and width·γ₁₆ for float16 ones (exact products, the tensor cores' sums), each
      losing :func:`float32_floor` besides (results below float32's normal range flushed or rounded): Z holds twice
      that. Where one GEMM flushes float32 inputs below 2^-126 to 0 and the other keeps them, they differ by
      φ·(|u| + |v|) more (:func:`flush_factor`), which the GPU's select adds for float32 vectors (float16 ones, and
      the products and sums of their scaled values, never leave float32's normal range).
    - Score tiles of float16 (``half_tiles``, scaled by ``output_scale(width)``) round each score to nearest: two
      roundings of values that differ by δ differ by at most δ plus one float16 ulp of the larger, 2^-9·|s| with room
      to spare, or 2^-24 below float16's normal range."""
    gamma = width * _ACC16 if half_vectors else gamma32(width)
    scale = output_scale(width) if half_tiles else 1.0
    a = 2 * gamma * scale * _SAFETY
    r = 2 * _OUT_ULP if half_tiles else 0.0
    z = 2 * float32_floor(width) * scale + (_F16_TINY if half_tiles else 0.0)
    return a, r, z


def _pow2_scale(xp: Any, maxabs: Any) -> Any:
    """2^(13 - floor(log2(maxabs))) elementwise (float64), 1 where maxabs is 0: exactly a power of two, from the
    exponent (``exp2`` of ``log2``'s floor on a GPU may land an ulp off one)."""
    safe = xp.where(maxabs > 0, maxabs, 1.0)
    _, e = xp.frexp(safe)  # safe = m 2^e, m in [0.5, 1): floor(log2(safe)) = e - 1
    return xp.where(maxabs > 0, xp.ldexp(xp.ones_like(safe), _TOP_EXP + 1 - e), 1.0)


def _floor_log2(x: float) -> int:
    """floor(log2(x)) of a positive float, exactly."""
    return math.frexp(x)[1] - 1


def _up16(xp: Any, vals: Any) -> Any:
    """float16 values >= ``vals`` (float64, >= 0; 0 stays 0; beyond float16's range 65504, which callers refuse):
    round to nearest after lifting by more than the rounding can take off (2^-11 relative in float16's normal range,
    2^-25 below it)."""
    lifted = xp.minimum(vals * (1 + 2.0 ** -10) + _F16_TINY, _F16_MAX)  # past float16's range: its largest
    return xp.where(vals > 0, lifted, 0.0).astype(xp.float16)


def _blocks(n: int, width: int) -> list[tuple[int, int]]:
    """Row ranges of ``n`` rows of ``width`` values, ``_BLOCK_VALUES`` a block (131,072 rows of 64): on the GPU each
    block costs its launches, so 1M users are prepared in 8 blocks, not 16."""
    rows = max(1, _BLOCK_VALUES // max(1, width))
    return [(start, min(start + rows, n)) for start in range(0, n, rows)]


def _norms(xp: Any, vecs: Any) -> Any:
    # A product and a sum (two launches on the GPU; CuPy's einsum costs 0.2 ms a call, three calls a block).
    return xp.sqrt((vecs * vecs).sum(axis=1))


def _round16(xp: Any, vecs32: Any, scale: Any, out16: Any) -> tuple[Any, Any, Any]:
    """Write fl16(scale·vecs) into ``out16`` and return per row (|v|, |δv|, |a|) in float64, a = fl16(scale·v)/scale,
    δv = a - v (exact in float64: both are floats on nearby grids)."""
    v64 = vecs32.astype(xp.float64)
    rounded = (v64 * scale).astype(xp.float16)
    out16[...] = rounded
    a = rounded.astype(xp.float64) / scale
    return _norms(xp, v64), _norms(xp, a - v64), _norms(xp, a)


def _width(dot_dim: int, aux: int) -> int:
    return dot_dim if aux == 0 else (dot_dim + aux + 7) // 8 * 8


@dataclass(frozen=True)
class FastItems:
    """The item matrix in float16 and what the error bound needs of it (symbols of the module docstring)."""

    vecs16: Any  # (n_items, W) float16, on the backend
    dot_dim: int  # columns of the dot part
    prepared_width: int  # D: columns of the prepared float32 vectors
    scale: float  # β
    max_norm: float  # X = max n_v
    max_resid: float  # ΔX = max r_v
    shift_at: int | None = None  # float16 column of the shift (items hold _SHIFT_ITEM); None: no shift column
    bias_at: int | None = None  # float16 column of h₁ (h₂ next to it); None: no bias
    bias_scale: float = 1.0  # β_b
    bias_user_max: float = _BIAS_USER_MAX  # e_u at most this (2^15 in rows of at least _BIAS_WIDE columns)
    bias_max: float = 0.0  # max |c|
    bias_err_max: float = 0.0  # K = max κ_v
    norms_at: int | None = None  # float16 column of n_v (then r_v, then κ_v with a bias); None: no bound columns
    aux_scales: tuple[float, ...] = ()  # β_n, β_r (, β_κ): the bound columns' scales
    # Items far from the origin: c, (dot_dim,) float32 on the host, the point the dot part is rounded about (its
    # columns hold fl16(β·(x - c))); None: about the origin. Then max_norm and max_resid are X' and ΔX' of x - c,
    # full_max_norm is X (of x itself), and the bound columns, where there are any, hold n'_v, r'_v and n_v.
    centre: Any = None
    centre64: Any = None  # c in float64, an array of the items' module, made once (read by every block of users)
    full_max_norm: float = 0.0
    # Users split along the centre's direction ĉ (module docstring, "Users along the centre"): the float16 column of
    # W₁ (W₁, then W₂ next to it); None: no split (not centred, or a centre at the origin).
    proj_at: int | None = None
    proj_dir: Any = None  # ĉ = c/|c|, (dot_dim,) float64, an array of the items' module
    proj_scale: float = 1.0  # β_w
    proj_err: float = 0.0  # ω = max ω_v
    proj_max: float = 0.0  # max |w̃_v|
    proj_w1_max: float = 0.0  # max |W₁| (scaled, as stored)
    proj_w2_max: float = 0.0  # max |W₂| (scaled, as stored)

    @property
    def width(self) -> int:
        return int(self.vecs16.shape[1])

    @property
    def constant_column(self) -> tuple[int, float] | None:
        """(column, value): the shift column, which every item holds at 2^15 (``Backend.load_items``)."""
        return None if self.shift_at is None else (self.shift_at, _SHIFT_ITEM)

    @property
    def bias_columns(self) -> tuple[int, int] | None:
        """(first, end): the columns of the bias parts h₁, h₂, where every user holds one value (``Backend.load_items``:
        a threshold sample's margin bounds their products on their own), or None without a bias."""
        return None if self.bias_at is None else (self.bias_at, self.bias_at + _BIAS_PARTS)

    @property
    def unshifted_width(self) -> int:
        """The columns users hold values in when their scores are not shifted: the dot part alone (rounded up to 8)
        where the items have no bias and no bound columns, else every column."""
        if self.bias_at is None and self.norms_at is None and self.proj_at is None:
            return min(self.width, -(-self.dot_dim // 8) * 8)
        return self.width


def prepare_items(xp: Any, items: Any, bias_col: int | None = None, centre: Any = None) -> FastItems:
    """items: (n_items, D) float32 prepared vectors (arrays of module ``xp``) -> FastItems.

    bias_col: the column where items hold a bias c_v and users 1 (``metrics.bias_column``), every column after it
    zero; None: every column is a dot column. centre: None, or (without a bias) a host float32 point of the dot part
    to round the rows about (``metrics.far_centre`` of a catalogue far from the origin: the module docstring's
    "Items far from the origin"); any point keeps the bound, a near one keeps it tight."""
    n, width = int(items.shape[0]), int(items.shape[1])
    dot_dim = width if bias_col is None else int(bias_col)
    dot = items[:, :dot_dim]
    norms = xp.empty(n, dtype=xp.float64)
    maxabs = 0.0
    for a, b in _blocks(n, dot_dim):
        norms[a:b] = _norms(xp, dot[a:b].astype(xp.float64))
        if centre is None:  # (centred, the rows rounded are x - c: their largest component is taken below)
            maxabs = max(maxabs, float(xp.abs(dot[a:b]).max()))
    max_norm = float(norms.max())
    median = float(xp.median(norms[::max(1, n // _MEDIAN_SAMPLE)]))
    biased = bias_col is not None
    if centre is not None:
        if biased:
            raise ValueError("a centre is for rows without a bias column")
        centre = np.asarray(centre, dtype=np.float32).reshape(dot_dim)
    full = norms  # n_v of the vectors themselves (the float32 scores' error); the rounded rows' own where centred
    n_proj = 0
    if centre is not None:
        # The rows rounded are x - c: their norms n'_v, largest component and spread replace the rows' own; and,
        # where c is not the origin, w_v = ĉ·(x_v - c) in float64, within (D₀ + 2)·2^-52·n'_v of its exact value
        # (the difference's rounding and the dot's), for the users' split along ĉ.
        c64 = xp.asarray(centre, dtype=xp.float64)
        c_len = math.sqrt(float(c64 @ c64))
        n_proj = _PROJ_PARTS if c_len > 0 else 0
        chat = c64 / c_len if n_proj else None
        w = xp.empty(n, dtype=xp.float64) if n_proj else None
        norms = xp.empty(n, dtype=xp.float64)
        maxabs = 0.0
        for a, b in _blocks(n, dot_dim):
            part = dot[a:b].astype(xp.float64) - c64
            norms[a:b] = _norms(xp, part)
            maxabs = max(maxabs, float(xp.abs(part).max()))
            if n_proj:
                w[a:b] = part @ chat
    centred_max = float(norms.max())  # X' (X where not centred)
    per_item = biased or max_norm > _NORM_SPREAD * median or (
        centre is not None and centred_max > _NORM_SPREAD * float(xp.median(norms[::max(1, n // _MEDIAN_SAMPLE)])))
    n_aux = (2 + biased + (centre is not None)) if per_item else 0
    if _width(dot_dim, 1 + (_BIAS_PARTS if biased else 0) + n_proj + n_aux) * _ACC16 > (1 - 1 / _SAFETY) / 2:
        n_aux = 0  # columns so many that half the bound columns' 1% would not pay for their own accumulation
    per_item = n_aux > 0
    aux = 1 + (_BIAS_PARTS if biased else 0) + n_proj + n_aux
    scale = float(_pow2_scale(xp, xp.asarray(maxabs)))
    w16 = _width(dot_dim, aux)  # W: the float16 columns
    vecs16 = xp.zeros((n, w16), dtype=xp.float16)
    resids = xp.empty(n, dtype=xp.float64)
    for a, b in _blocks(n, dot_dim):
        if centre is None:
            _, resids[a:b], _ = _round16(xp, dot[a:b], scale, vecs16[a:b, :dot_dim])
        else:
            # x - c in float64 may round (float32 values whose exponents lie more than 29 apart): by at most 2^-53
            # of each component, so the residual of the exact difference is within 2^-53·n'_v of the one computed.
            _, resid, _ = _round16(xp, dot[a:b].astype(xp.float64) - c64, scale, vecs16[a:b, :dot_dim])
            resids[a:b] = resid + 2.0 ** -52 * norms[a:b]
    max_resid = float(resids.max())
    fields: dict[str, Any] = {"vecs16": vecs16, "dot_dim": dot_dim, "prepared_width": width, "scale": scale,
                              "max_norm": centred_max, "max_resid": max_resid, "shift_at": dot_dim}
    if centre is not None:
        fields.update(centre=centre, centre64=c64, full_max_norm=max_norm)
    vecs16[:, dot_dim] = _SHIFT_ITEM
    col = dot_dim + 1
    if n_proj:
        # w_v in two float16 parts of β_w·w_v.
        w_scale = float(_pow2_scale(xp, xp.abs(w).max()))
        w1 = (w * w_scale).astype(xp.float16)
        w2 = (w * w_scale - w1.astype(xp.float64)).astype(xp.float16)
        vecs16[:, col], vecs16[:, col + 1], vecs16[:, col + 2] = w1, w1, w2
        w1, w2 = w1.astype(xp.float64), w2.astype(xp.float64)
        w_t = (w1 + w2) / w_scale
        omega = xp.abs(w_t - w) + (dot_dim + 2) * 2.0 ** -52 * norms
        fields.update(proj_at=col, proj_dir=chat, proj_scale=w_scale, proj_err=float(omega.max()),
                      proj_max=float(xp.abs(w_t).max()), proj_w1_max=float(xp.abs(w1).max()),
                      proj_w2_max=float(xp.abs(w2).max()))
        col += n_proj
    aux_vals = [norms, resids] + ([full] if centre is not None else [])
    if biased:
        bias = items[:, bias_col].astype(xp.float64)
        bias_max = float(xp.abs(bias).max())
        wide = w16 >= _BIAS_WIDE  # (the shift column's range: h₁ in [2^14, 2^15), e_u up to _SHIFT_USER_MAX)
        bias_scale = float(_pow2_scale(xp, xp.asarray(bias_max))) * (2.0 if wide else 1.0)
        h1 = (bias * bias_scale).astype(xp.float16)
        h2 = (bias * bias_scale - h1.astype(xp.float64)).astype(xp.float16)
        vecs16[:, col], vecs16[:, col + 1] = h1, h2
        h1, h2 = h1.astype(xp.float64), h2.astype(xp.float64)
        # κ_v: the bias's own rounding, its share of the float16 accumulation, and of the float32 scores' error.
        gamma16, g32 = w16 * _ACC16, gamma32(width)
        kappa = (xp.abs((h1 + h2) / bias_scale - bias) + gamma16 * (xp.abs(h1) + xp.abs(h2)) / bias_scale
                 + g32 * xp.abs(bias))
        fields.update(bias_at=col, bias_scale=bias_scale, bias_max=bias_max, bias_err_max=float(kappa.max()),
                      bias_user_max=_SHIFT_USER_MAX if wide else _BIAS_USER_MAX)
        aux_vals.append(kappa)
        col += _BIAS_PARTS
    if per_item:
        scales = []
        for j, vals in enumerate(aux_vals):
            sc = float(_pow2_scale(xp, xp.asarray(float(vals.max()))))
            vecs16[:, col + j] = _up16(xp, vals * sc)
            scales.append(sc)
        fields.update(norms_at=col, aux_scales=tuple(scales))
    return FastItems(**fields)


@dataclass(frozen=True)
class FastUsers:
    """Users in float16 and what the certificate needs of each (symbols of the module docstring): the scale α, the
    applied shift A_u, the bound, and whether the scores are stored in float16 (``half_scores``)."""

    vecs16: Any  # (n, W) float16
    alpha: Any  # (n,) float64 powers of two
    offset: Any  # (n,) float64: A_u, what the shift column adds to t/(αβ)
    bound: Any  # (n,) float64: R_u where the user's scores carry their per-item bounds, else E_u
    half_scores: bool

    def take(self, rows: Any) -> "FastUsers":
        """The users at ``rows`` (an index array of the arrays' module): each user is prepared on its own, so these
        are what ``prepare_users`` gives for those users alone."""
        return FastUsers(self.vecs16[rows], self.alpha[rows], self.offset[rows], self.bound[rows], self.half_scores)


def prepare_users(xp: Any, users: Any, items: FastItems, half_scores: bool = False, shift: Any = None) -> FastUsers:
    """users: (n, D) float32 prepared vectors (module ``xp``) -> FastUsers (arrays of module ``xp``).

    ``half_scores``: the GEMM's scores are rounded to float16 after scaling by ``output_scale(W)``. ``shift``: (n,)
    a score per user (module ``xp``) to take off every score in the GEMM (about; the certificate knows exactly what
    was taken): near the scores the certificate compares, it keeps the float16 score tiles' rounding small.

    The arithmetic of record (array operations, a block of users at a time); a backend may do the same in one pass
    (``Backend.fast_users``, with :func:`user_terms`)."""
    n = int(users.shape[0])
    vecs16 = xp.zeros((n, items.width), dtype=xp.float16)
    alpha, offset, bound = (xp.empty(n, dtype=xp.float64) for _ in range(3))
    for a, b in _blocks(n, items.width):
        sh = None if shift is None else shift[a:b]
        alpha[a:b], offset[a:b], bound[a:b] = _prepare_block(xp, users[a:b], items, vecs16[a:b], sh)
    return FastUsers(vecs16, alpha, offset, bound, half_scores)


def user_terms(items: FastItems) -> dict[str, float]:
    """The scalars :func:`prepare_users`' arithmetic takes from ``items`` and from this module's constants, by the
    module docstring's names where it has them: γ₁₆ and γ₃₂, the underflow term every user's ``rest`` starts at
    ((2D + 1)·2^-126), φ (``flush``), α's cap for the bias (inf without one), the safety factor, the largest
    bound-column factor a user may hold, the shift column's values and log2(_SHIFT_USER_MAX·_SHIFT_ITEM / β)
    (``shift_room``, an integer); the items' β, β_b, X, ΔX, K and max |c|; with users split along the centre, β_w,
    ω, max |w̃|, max |W₁|, max |W₂| and log2(_PROJ_USER_MAX·β_w/β) (``proj_room``, an integer: |P| = |p|·αβ/β_w
    fits where α <= 2^proj_room/|p|)."""
    return {"beta": items.scale, "bias_scale": items.bias_scale,
            "cap_bias": items.bias_user_max * items.bias_scale / items.scale if items.bias_at is not None else np.inf,
            "gamma16": items.width * _ACC16, "gamma32": gamma32(items.prepared_width),
            "rest0": float32_floor(items.prepared_width) + _F32_FLUSH, "flush": flush_factor(items.dot_dim),
            "max_norm": items.max_norm, "max_resid": items.max_resid,
            "bias_err_max": items.bias_err_max, "bias_max": items.bias_max, "safety": _SAFETY,
            "aux_user_max": _AUX_USER_MAX, "shift_item": _SHIFT_ITEM, "shift_user_max": _SHIFT_USER_MAX,
            "shift_room": _floor_log2(_SHIFT_USER_MAX * _SHIFT_ITEM) - _floor_log2(items.scale),
            "proj_scale": items.proj_scale, "proj_err": items.proj_err, "proj_max": items.proj_max,
            "proj_w1_max": items.proj_w1_max, "proj_w2_max": items.proj_w2_max,
            "proj_room": _floor_log2(_PROJ_USER_MAX * items.proj_scale) - _floor_log2(items.scale)}


def _prepare_block(xp: Any, users: Any, items: FastItems, out16: Any, shift: Any) -> tuple[Any, Any, Any]:
    """Fill ``out16`` (n, W) with a block of users in float16; return their (α, A_u, bound)."""
    terms = user_terms(items)
    gamma16, g32 = terms["gamma16"], terms["gamma32"]
    dot = users[:, :items.dot_dim]
    rows = dot  # what the dot columns hold: y, or y' = y - p·ĉ where users are split along the centre
    yc = proj = None
    if items.centre is not None:
        # The dot part was rounded about c: the GEMM scores y·(x - c), and y·c, the same for every item, comes back
        # through the offset; a shift asked for in scores of y·x is one of y·(x - c) less y·c.
        c64 = items.centre64
        y64 = dot.astype(xp.float64)
        yc, yc_abs = y64 @ c64, xp.abs(y64) @ xp.abs(c64)
        if shift is not None:
            shift = shift.astype(xp.float64) - yc
    if items.proj_at is not None:
        # p = y·ĉ column by column (a fixed order, which the GPU's kernel repeats), y' = y - p·ĉ (each step rounded
        # on its own): y' is within 2^-52·(|p| + |y'|) of y - p·ĉ, whatever p is.
        chat = items.proj_dir
        proj = xp.zeros(y64.shape[0], dtype=xp.float64)
        for i in range(items.dot_dim):
            proj += y64[:, i] * chat[i]
        rows = y64 - proj[:, None] * chat[None, :]
    alpha = _pow2_scale(xp, xp.abs(rows).max(axis=1).astype(xp.float64))
    if items.bias_at is not None:
        alpha = xp.minimum(alpha, terms["cap_bias"])
    if proj is not None:
        alpha = xp.minimum(alpha, _room_cap(xp, proj, terms["proj_room"]))
    if shift is not None:
        # σ_u = -S_u·αβ/_SHIFT_ITEM must fit float16: lower α (a power of two, like the cap) where it would not, to
        # 2^floor(log2(_SHIFT_USER_MAX·_SHIFT_ITEM / β) - log2(m)), m = max(|S_u|, 2^-900) (so that a shift of 0 sets
        # no cap; the clip below keeps σ_u in range whatever the cap), from the exponents: the first two terms are
        # powers of two, and floor(j - log2(m)) = j - ceil(log2(m)).
        alpha = xp.minimum(alpha, _room_cap(xp, shift, terms["shift_room"]))
    ab = alpha * items.scale
    norm, resid, norm16 = _round16(xp, rows, alpha[:, None], out16[:, :items.dot_dim])
    full = norm if proj is None else _norms(xp, y64)  # |y| (norm: |y'| where split)
    # The factor of n_v; centred, of n'_v (the float32 scores' γ₃₂·|y| + φ goes with n_v: g below).
    p = resid + gamma16 * norm16
    phi = terms["flush"]
    if yc is None:
        p = p + (g32 * norm + phi)
    if proj is not None:
        p = p + 2.0 ** -52 * (xp.abs(proj) + norm)  # y' - (y - p·ĉ)
    q = norm + resid + gamma16 * norm16  # the factor of r_v
    # Float32 scores of tiny vectors underflow: the GPU's kernels flush results and inputs below 2^-126 to 0
    # (module docstring, "Below float32's normal range").
    rest = terms["rest0"] + phi * full
    offset = xp.zeros_like(norm)
    if items.shift_at is not None and shift is not None:
        sigma = xp.clip(-shift.astype(xp.float64) * ab / _SHIFT_ITEM, -_SHIFT_USER_MAX, _SHIFT_USER_MAX)
        sigma = sigma.astype(xp.float16)
        out16[:, items.shift_at] = sigma
        offset = sigma.astype(xp.float64) * _SHIFT_ITEM / ab
        rest = rest + gamma16 * xp.abs(offset)
    if yc is not None:
        # y·c in float64 is within D·2^-53·Σ|y_i c_i| of its value (taken twice); A_u - y·c, and the certificate's
        # float64 steps at the magnitude of y·c, round by a few 2^-53 of |A_u| + |y·c| (taken 2^-50).
        rest = rest + items.dot_dim * 2.0 ** -52 * yc_abs + 2.0 ** -50 * (xp.abs(offset) + xp.abs(yc))
        offset = offset - yc
    if proj is not None:
        # P = p·αβ/β_w in two float16 parts, in the columns (P₁, P₂, P₁) against the items' (W₁, W₁, W₂): the GEMM
        # adds p̃·w̃_v - P₂·W₂/(αβ) for p·w_v (module docstring, "Users along the centre").
        big = proj * ab / items.proj_scale
        p1 = big.astype(xp.float16)
        p2 = (big - p1.astype(xp.float64)).astype(xp.float16)
        at = items.proj_at
        out16[:, at], out16[:, at + 1], out16[:, at + 2] = p1, p2, p1
        p1, p2 = p1.astype(xp.float64), p2.astype(xp.float64)
        missed = xp.abs(p1 + p2 - big) * items.proj_scale / ab  # |p̃ - p|
        rest = rest + (missed * terms["proj_max"] + xp.abs(proj) * terms["proj_err"]
                       + (xp.abs(p2) * terms["proj_w2_max"]
                          + gamma16 * (xp.abs(p1) + xp.abs(p2)) * (terms["proj_w1_max"] + terms["proj_w2_max"])) / ab)
    kept = xp.ones(norm.shape, dtype=bool)
    if items.bias_at is not None:
        e_u = ab / items.bias_scale
        kept = e_u >= _F16_TINY
        e16 = xp.where(kept, e_u, 0.0).astype(xp.float16)
        out16[:, items.bias_at], out16[:, items.bias_at + 1] = e16, e16
        # Where the bias is dropped, the whole of it is error: c_v + γ₃₂|c_v| <= max |c|·(1 + γ₃₂).
        through_bias = xp.where(kept, items.bias_err_max, items.bias_max * (1 + g32))
    else:
        through_bias = g32 * items.bias_max  # 0: no bias
    g = None if yc is None else g32 * full + phi  # centred: the factor of n_v (X through the maxima)
    through = p * items.max_norm + q * items.max_resid + through_bias + rest
    if g is not None:
        through = through + g * items.full_max_norm
    through_max = _SAFETY * through
    if items.norms_at is None:
        return alpha, offset, through_max
    factors = [p, q] + ([xp.ones_like(p)] if items.bias_at is not None else []) + ([] if g is None else [g])
    cols = [_up16(xp, _SAFETY * f * ab / sc) for f, sc in zip(factors, items.aux_scales)]
    fits = kept
    for c in cols:
        fits = fits & (c <= _AUX_USER_MAX)  # False for inf too
    for j, c in enumerate(cols):
        out16[:, items.norms_at + j] = xp.where(fits, c, 0).astype(xp.float16)
    # The columns' 1% pays for their own accumulation term (the module docstring): R_u is rest alone.
    return alpha, offset, xp.where(fits, _SAFETY * rest, through_max)


def _room_cap(xp: Any, value: Any, room: int) -> Any:
    """Per row: 2^floor(room - log2 m), m = max(|value|, 2^-900) (float64, exactly: from the exponents, since
    floor(j - log2 m) = j - ceil(log2 m)), at most 2^1000: the largest power of two α with α·m <= 2^room."""
    frac, e = xp.frexp(xp.maximum(xp.abs(value.astype(xp.float64)), 2.0 ** -900))
    exponent = xp.minimum(room - (e - (frac == 0.5).astype(e.dtype)), 1000)
    return xp.ldexp(xp.ones(value.shape, dtype=xp.float64), exponent)


def _stored_upper(xp: Any, stored: Any) -> Any:
    """q(z): the largest g·t whose float16 rounding can be at most ``stored`` (float64)."""
    lifted = stored + _F16_TINY
    return xp.where(lifted >= 0, lifted / (1 - _OUT_ULP), lifted / (1 + _OUT_ULP))


def outside_bound(xp: Any, outside: Any, users: FastUsers, items: FastItems) -> Any:
    """Per user: an upper bound of the exact-mode float32 score of every item left out.

    outside: (n,) the best approximate score left out, as the GEMM's score tiles hold it (scaled by
    ``output_scale`` where ``users.half_scores``); -inf gives -inf."""
    z = outside.astype(xp.float64)
    t = _stored_upper(xp, z) / output_scale(items.width) if users.half_scores else z
    return t / (xp.asarray(users.alpha) * items.scale) - xp.asarray(users.offset) + xp.asarray(users.bound)


def certified(xp: Any, exact_kth: Any, outside: Any, users: FastUsers, items: FastItems) -> Any:
    """Per user: True when no item outside the candidates can enter the exact top k.

    exact_kth: (n,) the exact float32 k-th score among the candidates; outside: (n,) the best approximate score
    left out, as the score tiles hold it (-inf when every qualifying item is a candidate)."""
    upper = outside_bound(xp, outside, users, items)
    return xp.isneginf(outside) | (exact_kth.astype(xp.float64) > upper)
