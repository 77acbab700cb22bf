"""Fast mode's error bound (recall.core.certificate): it must hold for every (user, item) pair, and be tight.

The GEMM is emulated as the CPU backend runs it (float16 inputs, exact products, float32 accumulation); with
``half_scores`` its result is also scaled by ``output_scale`` and rounded to float16, as the GPU's score tiles are.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from recall.core import certificate, metrics


def _gemm(fu: certificate.FastUsers, fi: certificate.FastItems) -> np.ndarray:
    """The score tiles the backend would select from: (n_users, n_items) float32."""
    raw = fu.vecs16.astype(np.float32) @ fi.vecs16.astype(np.float32).T
    if not fu.half_scores:
        return raw
    stored = (raw * np.float32(certificate.output_scale(fi.width))).astype(np.float16)
    assert np.isfinite(stored).all(), "a score left float16's range"
    return stored.astype(np.float32)


def _upper(fu: certificate.FastUsers, fi: certificate.FastItems, tiles: np.ndarray) -> np.ndarray:
    """For every pair: the bound the certificate would put on the exact score of an item whose tile score this is."""
    return np.stack([certificate.outside_bound(np, tiles[:, j], fu, fi) for j in range(tiles.shape[1])], axis=1)


def _ftz32(pu: np.ndarray, pi: np.ndarray, fused: bool) -> np.ndarray:
    """The float32 scores of a GPU kernel built with ``-ftz=true``, columns in order: inputs and results below
    float32's normal range (2^-126) read and written as 0; with ``fused`` each step one fused multiply-add (the
    product exact in float64, the sum rounded to float32 through float64), else a rounded product and a rounded
    sum."""
    tiny = np.float32(2.0 ** -126)

    def flush(a):
        return np.where(np.abs(a) < tiny, np.float32(0), a).astype(np.float32)

    u, v = flush(pu.astype(np.float32)), flush(pi.astype(np.float32))
    s = np.zeros((u.shape[0], v.shape[0]), np.float32)
    with np.errstate(under="ignore"):
        for i in range(u.shape[1]):
            if fused:
                s = flush((s + np.outer(u[:, i].astype(np.float64), v[:, i])).astype(np.float32))
            else:
                s = flush(s + flush(np.outer(u[:, i], v[:, i])))
    return s.astype(np.float64)


def _prepare(metric: str, users: np.ndarray, items: np.ndarray, half: bool, shift: np.ndarray | None = None,
             centre: np.ndarray | None = None):
    pi, pu = metrics.prepare_items(metric, np, items), metrics.prepare_users(metric, np, users)
    fi = certificate.prepare_items(np, pi, metrics.bias_column(metric, items.shape[1]), centre)
    fu = certificate.prepare_users(np, pu, fi, half_scores=half, shift=shift)
    return pu, pi, fu, fi


@pytest.mark.parametrize("half_scores", [False, True])
@pytest.mark.parametrize("metric", ["ip", "l2"])
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-30, 1e-20, 1e-6, 1.0, 1e3, 1e6, 1e18]),
       dim=st.integers(1, 70), spread=st.sampled_from([0.0, 1.0, 3.0]), shifted=st.booleans(),
       user_ratio=st.sampled_from([1.0, 1e-8, 1e12]))
def test_bound_holds_for_every_pair(metric, half_scores, seed, scale, dim, spread, shifted, user_ratio):
    # The certificate is only as good as the bound: for every (user, item), the exact score (float64) and the
    # float32 score exact mode computes (by BLAS, and as the GPU's kernels do, flushing what falls below float32's
    # normal range) must lie at or below the bound derived from that item's tile score, across magnitudes (float16
    # subnormals after scaling, float32 underflow: scores near 10^-40 at scale 10^-20), dimensions, item norm
    # spreads (which switch the per-item bound columns on), l2's bias columns (dropped for users far larger than the
    # items), and shifted scores.
    if metric == "l2" and scale > 1e6:
        scale = 1e6  # |v|²/2 must stay inside float32, as the engine's input checks require
    rng = np.random.default_rng(seed)
    items = (rng.standard_normal((200, dim)) * scale * np.exp(spread * rng.standard_normal((200, 1))))
    users = rng.standard_normal((30, dim)) * scale * user_ratio
    items[rng.random(items.shape) < 0.1] *= 1e-4  # tiny components next to large ones
    items[0] = np.abs(items).max()  # one item at the top of the range in every component: the largest score
    users[0] = np.abs(users).max()
    items, users = items.astype(np.float32), users.astype(np.float32)
    # Scores must fit float32, as the engine's input checks require.
    assume(np.linalg.norm(users.astype(np.float64), axis=1).max()
           * np.linalg.norm(items.astype(np.float64), axis=1).max() < 1e36)
    pu, pi, fu0, fi = _prepare(metric, users, items, half_scores)
    _assert_bound_holds(rng, pu, pi, fu0, fi, half_scores, shifted)


def _assert_bound_holds(rng, pu, pi, fu0, fi, half_scores, shifted):
    """Every (user, item)'s float64 and float32 score at or below the bound from its tile score, unshifted (``fu0``)
    or shifted as the engine shifts: by a real score of each user (here one of a random item's)."""
    shift = None
    if shifted:
        shift = (pu.astype(np.float64) @ pi[rng.integers(0, pi.shape[0], pu.shape[0])].astype(np.float64).T)
        shift = shift.diagonal().copy()
    fu = certificate.prepare_users(np, pu, fi, half_scores=half_scores, shift=shift) if shifted else fu0
    upper = _upper(fu, fi, _gemm(fu, fi))
    exact64 = pu.astype(np.float64) @ pi.astype(np.float64).T
    exact32 = (pu @ pi.T).astype(np.float64)
    assert np.all(exact64 <= upper)
    assert np.all(exact32 <= upper)
    for fused in (False, True):
        assert np.all(_ftz32(pu, pi, fused) <= upper)


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("half_scores", [False, True])
@pytest.mark.parametrize("kind", ["subnormal items", "tiny rows"])
def test_bound_holds_where_the_gpu_flushes_float32_subnormals(metric, half_scores, kind):
    # The GPU's kernels read float32 inputs below 2^-126 as 0 and write results below it as 0 (-ftz=true). A
    # catalogue of subnormal components (scaled up into float16's range like any other) scores 0 there against users
    # of norm 10^20 whose exact scores are near 10^-18: a loss of |y_i|·2^-126 a component, which no term of |y|·|x|
    # covers. Users and items near 10^-20 have products near 10^-40, each flushed: a loss of up to 2^-126 a step,
    # where subnormal rounding loses 2^-150. The bound must hold against those scores too
    # (certificate.float32_floor, flush_factor).
    rng = np.random.default_rng(5)
    dim = 24
    items = rng.standard_normal((300, dim)) * np.exp(rng.standard_normal((300, 1)))
    users = rng.standard_normal((40, dim))
    if kind == "subnormal items":
        items *= 1e-39
        users[:20] *= 1e20
    else:
        items *= 1e-20
        users *= 1e-20
    items, users = items.astype(np.float32), users.astype(np.float32)
    pu, pi, fu0, fi = _prepare(metric, users, items, half_scores)
    lost = np.abs(_ftz32(pu, pi, False) - pu.astype(np.float64) @ pi.astype(np.float64).T)
    assert lost.max() > (1e-25 if kind == "subnormal items" else 1e-40)  # far above subnormal rounding's 2^-150
    _assert_bound_holds(rng, pu, pi, fu0, fi, half_scores, shifted=False)
    _assert_bound_holds(rng, pu, pi, fu0, fi, half_scores, shifted=True)


@pytest.mark.parametrize("half_scores", [False, True])
@pytest.mark.parametrize("metric", ["ip", "cosine"])
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), offset=st.sampled_from([2.0, 30.0, -300.0, 3e4, 1e7]),
       scale=st.sampled_from([1e-20, 1e-3, 1.0, 1e3]), dim=st.integers(1, 70), spread=st.sampled_from([0.0, 2.0]),
       shifted=st.booleans(), user_offset=st.sampled_from([0.0, 1.0, -0.5]),
       centre_kind=st.sampled_from(["rule", "mean", "off"]))
def test_bound_holds_for_items_far_from_the_origin(metric, half_scores, seed, offset, scale, dim, spread, shifted,
                                                   user_offset, centre_kind):
    # Items far from the origin are rounded about a centre c (the GEMM scores y·(x - c), the offset gives y·c back):
    # the bound must hold for every pair against the float64 and float32 scores of y·x itself, the float32 scores'
    # error going with |x|, not |x - c|, whatever c (metrics.far_centre's rounded mean, the plain mean, or a point
    # well off it); with users near c, near the origin or opposite it, item norms spread (the bound columns n'_v,
    # r'_v, n_v) or not, and shifted scores (S_u - y·c in the shift column).
    rng = np.random.default_rng(seed)
    items = rng.standard_normal((200, dim)) * np.exp(spread * rng.standard_normal((200, 1))) + offset
    users = rng.standard_normal((30, dim)) + user_offset * offset
    items[rng.random(items.shape) < 0.05] = offset * (1 + 2.0 ** -30)  # components a hair off the centre's
    items, users = (items * scale).astype(np.float32), (users * scale).astype(np.float32)
    assume(np.linalg.norm(users.astype(np.float64), axis=1).max()
           * np.linalg.norm(items.astype(np.float64), axis=1).max() < 1e36)
    assume(metric != "cosine" or (np.abs(users).max(axis=1) > 0).all())
    pi = metrics.prepare_items(metric, np, items)
    centre = {"rule": metrics.far_centre(pi), "mean": pi.astype(np.float64).mean(axis=0).astype(np.float32),
              "off": (pi.mean(axis=0) + pi.std(axis=0) * rng.standard_normal(dim) * 3).astype(np.float32)}[centre_kind]
    assume(centre is not None and np.isfinite(centre).all())
    pu, pi, fu0, fi = _prepare(metric, users, items, half_scores, centre=centre)
    assert fi.centre is not None
    _assert_bound_holds(rng, pu, pi, fu0, fi, half_scores, shifted)


def test_items_far_from_the_origin_are_rounded_about_their_centre():
    # 300 from the origin in every coordinate, against a spread of about 1: rounded about the origin, a float16
    # step of the components (1/8 near 300) is larger than most of the gaps between a user's scores; about the
    # centre, the bound shrinks by the ratio of |x| to |x - c| (less the float32 scores' own error, which stays).
    # Fast mode takes metrics.far_centre's point; no data kind of the bench about the origin has one.
    from recall.bench.workloads import generate

    users, items = generate("normal:offset=300", 50, 4000, 64, seed=0)
    centre = metrics.far_centre(items)
    assert centre is not None
    pu, pi, fu, fi = _prepare("ip", users, items, False, centre=centre)
    _, _, fu_origin, fi_origin = _prepare("ip", users, items, False)
    assert fi_origin.centre is None and fi.centre.dtype == np.float32
    assert fi.max_norm < 12 < 2000 < fi.full_max_norm  # X' about |x - c|, X about |x|
    exact = pu.astype(np.float64) @ pi.astype(np.float64).T
    kth = -np.sort(-exact, axis=1)
    gaps = np.median(kth[:, 9] - kth[:, 99])
    assert np.median(_upper(fu, fi, _gemm(fu, fi)) - exact) < 0.25 * gaps  # well inside the top 100's gaps
    assert np.median(_upper(fu_origin, fi_origin, _gemm(fu_origin, fi_origin)) - exact) > gaps  # about the origin
    for kind in ("normal", "clustered", "skewed", "popular", "int8", "ties", "adversarial"):
        for metric in ("ip", "cosine"):
            _, items = generate(kind, 10, 3000, 32, seed=1)
            assert metrics.far_centre(metrics.prepare_items(metric, np, items)) is None, (kind, metric)


@pytest.mark.parametrize("half_scores", [False, True])
def test_the_bound_columns_pay_for_their_own_accumulation(half_scores):
    # l2 with a few items 20,000 times the others' norm: their bound columns (|v|²/2's error above all) are the
    # catalogue's largest. Each item's score carries its own bound, 1% over, which pays for the accumulation of
    # those columns too: what is left per user (R_u) holds no term of the largest column (it used to be γ₁₆ times
    # it, here more than the gaps between a user's scores), and the bound still holds for every pair.
    rng = np.random.default_rng(11)
    items = rng.standard_normal((3000, 24)).astype(np.float32)
    items[rng.choice(3000, 5, replace=False)] *= np.float32(20000)
    users = rng.standard_normal((40, 24)).astype(np.float32)
    pu, pi, fu, fi = _prepare("l2", users, items, half_scores)
    assert fi.norms_at is not None
    # F_u = (2D + 1)·2^-126 + φ·|y|: what float32 may lose below its normal range
    tiny = (certificate.float32_floor(fi.prepared_width) + 2.0 ** -126
            + certificate.flush_factor(fi.dot_dim) * np.linalg.norm(pu[:, :fi.dot_dim].astype(np.float64), axis=1))
    assert np.all(fu.bound <= 1.01 * tiny * 1.0001)  # unshifted: R_u = 1.01·F_u
    upper = _upper(fu, fi, _gemm(fu, fi))
    exact64 = pu.astype(np.float64) @ pi.astype(np.float64).T
    assert np.all(exact64 <= upper) and np.all((pu @ pi.T).astype(np.float64) <= upper)
    shift = exact64.max(axis=1)  # shifted: R_u = 1.01·(γ₁₆·|A_u| + F_u)
    fs = certificate.prepare_users(np, pu, fi, half_scores=half_scores, shift=shift)
    assert np.all(fs.bound <= 1.01 * (fi.width * 2.0 ** -22 * np.abs(fs.offset) + tiny) * 1.0001)
    assert np.all(exact64 <= _upper(fs, fi, _gemm(fs, fi)))


def test_l2_bias_does_not_crush_the_dot_part():
    # Issue 18: l2's -|v|²/2 column used to set the one item scale, so the vectors' own components were rounded on
    # a coarse grid and the bound was r·|u|·|v| of the augmented vectors. Now the bias has its own scale and two
    # float16 parts: the dot part keeps full float16 precision and the bias is nearly exact.
    rng = np.random.default_rng(0)
    items = (rng.standard_normal((500, 16)) * 30).astype(np.float32)  # |v|²/2 ~ 7,000 against components ~ 30
    pi = metrics.prepare_items("l2", np, items)
    fi = certificate.prepare_items(np, pi, metrics.bias_column("l2", 16))
    dot = fi.vecs16[:, :16].astype(np.float64) / fi.scale
    assert np.abs(dot - items).max() <= 2.0 ** -11 * np.abs(items).max()
    c = fi.vecs16[:, fi.bias_at:fi.bias_at + 2].astype(np.float64).sum(axis=1) / fi.bias_scale
    bias = pi[:, 16].astype(np.float64)
    assert np.abs(c - bias).max() <= 2.0 ** -21 * np.abs(bias).max()


def test_bound_is_tight_at_rounding_midpoints():
    # Scores planted at the bound's edge: every item component sits just below a float16 rounding midpoint, so each
    # rounds down by almost half an ulp, and the residual vector is parallel to the user, where Cauchy-Schwarz is an
    # equality. The approximate score then falls short of the exact one by nearly the whole bound (the dangerous
    # direction: an item left out that is better than it looks), and never by more. With float16 tiles the bound
    # adds the stored score's rounding, a full float16 ulp of it, whatever the rounding actually was.
    dim = 7
    users = np.ones((1, dim), np.float32)  # exact in float16: the user side has no residual
    planted = np.float32(1 + 2.0 ** -11 - 2.0 ** -20)  # rounds down to 1 at the item scale 2^13
    items = np.vstack([np.full((1, dim), planted), np.ones((5, dim)), -np.ones((5, dim))]).astype(np.float32)
    pu, pi, fu, fi = _prepare("ip", users, items, False)
    assert fi.norms_at is None  # every norm alike: the bound goes through the maxima, E_u
    tiles = _gemm(fu, fi)
    upper = _upper(fu, fi, tiles)[0, 0]
    exact = float(pu[0].astype(np.float64) @ pi[0].astype(np.float64))
    approx = float(tiles[0, 0]) / (fu.alpha[0] * fi.scale)
    assert approx < exact <= upper
    assert exact - approx >= 0.97 * (upper - approx)
    fu_half = certificate.prepare_users(np, pu, fi, half_scores=True)
    upper_half = _upper(fu_half, fi, _gemm(fu_half, fi))[0, 0]
    assert exact <= upper <= upper_half <= upper + 1.01 * 2.0 ** -10 * exact


def test_certificate_is_strict_at_the_edge():
    # Equal to the bound is not enough: an item left out that scores exactly the k-th with a lower row would win.
    rng = np.random.default_rng(3)
    users, items = rng.standard_normal((8, 12)).astype(np.float32), rng.standard_normal((50, 12)).astype(np.float32)
    _, _, fu, fi = _prepare("ip", users, items, True)
    outside = _gemm(fu, fi)[:, 7]
    upper = certificate.outside_bound(np, outside, fu, fi)
    at = upper.astype(np.float32)
    at = np.where(at.astype(np.float64) > upper, np.nextafter(at, np.float32(-np.inf)), at)  # largest <= upper
    above = np.nextafter(at, np.float32(np.inf))
    assert not certificate.certified(np, at, outside, fu, fi).any()
    assert certificate.certified(np, above, outside, fu, fi).all()
    none_left = np.full(8, -np.inf, np.float32)
    assert certificate.certified(np, at, none_left, fu, fi).all()  # nothing left out: nothing to prove


def test_shift_keeps_float16_tiles_fine_near_the_kth_score():
    # With float16 score tiles the rounding costs 2^-10 of the score left out; shifted by about the k-th score,
    # the scores the certificate compares are near 0 and the bound over the tile score shrinks accordingly.
    rng = np.random.default_rng(4)
    centre = rng.standard_normal(64)
    items = (centre + 0.2 * rng.standard_normal((2000, 64))).astype(np.float32)
    users = (centre + 0.2 * rng.standard_normal((20, 64))).astype(np.float32)
    pu, pi, fu, fi = _prepare("cosine", users, items, True)
    exact = pu.astype(np.float64) @ pi.astype(np.float64).T
    kth = np.sort(exact, axis=1)[:, -10]
    fu_shift = certificate.prepare_users(np, pu, fi, half_scores=True, shift=kth)
    loose = _upper(fu, fi, _gemm(fu, fi)) - exact
    tight = _upper(fu_shift, fi, _gemm(fu_shift, fi)) - exact
    near = np.abs(exact - kth[:, None]) < 0.02
    assert np.all(tight >= 0) and np.all(loose >= 0)
    assert np.median(tight[near]) < 0.5 * np.median(loose[near])


def test_output_scale_keeps_every_tile_score_finite():
    # The widest products: every component at the top of its range, the bound columns rounded up, the shift column
    # at its largest.
    for width in (8, 16, 24, 32, 40, 72, 264, 1024):
        g = certificate.output_scale(width)
        worst = (width - 1) * (2.0 ** 14 * (1 + 2.0 ** -9)) ** 2 + 2.0 ** 30
        if width >= certificate._BIAS_WIDE:  # the two bias columns' products up to 2^30 too (h₁, e_u at most 2^15)
            worst = (width - 3) * (2.0 ** 14 * (1 + 2.0 ** -9)) ** 2 + 3 * 2.0 ** 30
        assert np.isfinite(np.float16(worst * g)) and worst * g * (1 + width * 2.0 ** -22) < 65504


@pytest.mark.parametrize("dim", [18, 19, 64])
def test_the_bias_takes_the_shift_column_s_range_in_rows_of_32_columns(dim):
    # l2 with item norms over three orders of magnitude (biases over six) and users of small norm, whose α the bias
    # caps: from 32 float16 columns the bias's parts lie in [2^14, 2^15) and e_u reaches 2^15, 8 times the scale of
    # narrower rows; the tiles stay finite and the bound holds for every pair.
    rng = np.random.default_rng(dim)
    items = rng.standard_normal((3000, dim)).astype(np.float32) * np.exp(rng.normal(0, 1.5, (3000, 1))).astype(
        np.float32)
    users = (rng.standard_normal((200, dim)) * np.exp(rng.normal(-2, 2, (200, 1)))).astype(np.float32)
    pu, pi, fu, fi = _prepare("l2", users, items, True, shift=np.zeros(200))
    wide = fi.width >= certificate._BIAS_WIDE
    assert wide == (dim >= 19)  # the dot columns, the bias's 2, the shift and 3 bound columns, up to 8: 24 at d = 18
    h1 = np.abs(fi.vecs16[:, fi.bias_at].astype(np.float64)).max()
    assert (2.0 ** 14 <= h1 < 2.0 ** 15) if wide else (2.0 ** 13 <= h1 < 2.0 ** 14)
    e_u = np.abs(fu.vecs16[:, fi.bias_at].astype(np.float64))
    assert e_u.max() == (2.0 ** 15 if wide else 2.0 ** 13)  # the cap, reached by the users of small norm
    tiles = _gemm(fu, fi)
    assert np.all(np.isfinite(tiles))
    exact = pu.astype(np.float64) @ pi.astype(np.float64).T
    assert np.all(exact <= _upper(fu, fi, tiles))


def test_users_along_the_centre_are_split_along_it():
    # Cosine, users and items 30 from the origin in every coordinate: the items are rounded about their centre c and
    # each user is split along c's direction (y = y' + p·ĉ, the dot part holding y', p·ĉ·(x - c) through three
    # columns): both rounding terms then go with |y'|, about |y|/30, and the bound falls well inside the gaps between
    # a user's 10th and 27th scores (fast mode's candidates at k = 10), where it lay across most of them unsplit.
    from recall.bench.workloads import generate

    users, items = generate("normal:offset=30", 300, 4096, 64, seed=1)
    pu, pi, fu, fi = _prepare("cosine", users, items, False, centre=metrics.far_centre(
        metrics.prepare_items("cosine", np, items)))
    assert fi.proj_at is not None and fi.width == 72  # 64 + shift + 3 split columns, rounded up to 8: no wider
    exact = pu.astype(np.float64) @ pi.astype(np.float64).T
    top = -np.sort(-exact, axis=1)
    gaps = top[:, 9] - top[:, 26]
    upper = _upper(fu, fi, _gemm(fu, fi))
    assert np.all(exact <= upper) and np.all((pu @ pi.T).astype(np.float64) <= upper)
    assert np.median(fu.bound) < 0.2 * np.median(gaps)
    # Unsplit (the same items without the split columns' help: every user's p = 0 as if it lay across c), the
    # users' own rounding comes back.
    far = dataclasses.replace(fi, proj_at=None, proj_dir=None)
    unsplit = certificate.prepare_users(np, pu, far)
    assert np.median(unsplit.bound) > 0.5 * np.median(gaps) > 2.5 * np.median(fu.bound)


@pytest.mark.gpu
@pytest.mark.parametrize("metric, items_kind", [("ip", "spread"), ("ip", "normal"), ("l2", "spread"),
                                                ("cosine", "normal"), ("ip", "exact16"), ("ip", "far"),
                                                ("cosine", "far"), ("ip", "far-spread")])
@pytest.mark.parametrize("dim", [3, 50, 64, 300])
@pytest.mark.parametrize("shift_kind", [None, "scores", "wild"])
def test_gpu_fast_users_are_the_arithmetic_of_record(metric, items_kind, dim, shift_kind):
    # The GPU's one-launch preparation of fast mode's users (Backend.fast_users, kernels/fast16.cu) against
    # certificate.prepare_users' array operations on the same users: the same float16 columns (dot part, shift,
    # bias), alpha and offset bit for bit; the bound columns within one float16 step and the bound within float64's
    # order of the norms' sums. Items with spread norms (bound columns), without (none), l2 (a bias, dropped for users
    # too small to carry it), items exact in float16 (no user's residual factor fits); users: a zero row, rows of
    # 1e-25 and 1e30 scale, a subnormal-free spread of magnitudes, a strided view; shifts near the scores, zero, and
    # far beyond them (alpha capped so that sigma fits). Items far from the origin, rounded about their centre (with
    # and without bound columns): the kernel's y·c is a warp's sum, in another order than the array form's, so the
    # offsets agree within a few float64 steps of |y|·|c| and the shift column within one float16 step; half the users
    # lie along the centre too, split along it (p = y·ĉ in the array form's order: the dot part, which holds y - p·ĉ,
    # and the split columns P₁, P₂ bit for bit).
    from recall.backends import cuda_status, resolve

    usable, reason = cuda_status()
    if not usable:
        pytest.skip(f"no usable GPU: {reason}")
    import cupy

    rng = np.random.default_rng(dim + 7 * len(metric))
    n_items, n = 3000, 600
    if items_kind == "exact16":
        items = (rng.integers(-100, 101, (n_items, dim)) * 2.0 ** rng.integers(-3, 4, (n_items, 1))).astype(np.float32)
    else:
        spread = rng.lognormal(0, 1.5, (n_items, 1)) if items_kind.endswith("spread") else 1.0
        items = (rng.standard_normal((n_items, dim)) * spread).astype(np.float32)
        if items_kind.startswith("far"):
            items += np.float32(300 if items_kind == "far-spread" else 30)
    raw = (rng.standard_normal((n, dim)) * 10.0 ** rng.uniform(-4, 4, (n, 1))).astype(np.float32)
    if items_kind.startswith("far"):  # half the users along the items' centre too: split along it (P columns)
        far_rows = rng.standard_normal((n // 2, dim)) + (300 if items_kind == "far-spread" else 30)
        raw[n // 2:] = (far_rows * 10.0 ** rng.uniform(-4, 4, (n // 2, 1))).astype(np.float32)
    raw[0] = 0 if metric != "cosine" else raw[0]  # (cosine refuses a zero row)
    raw[1] *= np.float32(1e-25)
    raw[2] *= np.float32(1e30) / np.abs(raw[2]).max()
    pi = metrics.prepare_items(metric, np, items).astype(np.float32)
    pu = metrics.prepare_users(metric, np, raw).astype(np.float32)
    centre = metrics.far_centre(pi) if items_kind.startswith("far") else None
    assert (centre is not None) == items_kind.startswith("far")
    fi = certificate.prepare_items(cupy, cupy.asarray(pi), metrics.bias_column(metric, dim), centre)
    if items_kind == "far-spread":
        assert fi.norms_at is not None
    assert (fi.proj_at is not None) == items_kind.startswith("far")
    wide = cupy.zeros((n, pu.shape[1] + 3), cupy.float32)
    wide[:, :pu.shape[1]] = cupy.asarray(pu)
    shift = None
    if shift_kind == "scores":
        shift = cupy.asarray((pu.astype(np.float64) @ pi[:50].T.astype(np.float64)).max(axis=1))
        shift[5] = 0
    elif shift_kind == "wild":
        shift = cupy.asarray(rng.standard_normal(n) * 10.0 ** rng.uniform(-30, 30, n))
    backend = resolve("gpu")
    for users in (cupy.asarray(pu), wide[:, :pu.shape[1]]):
        want = certificate.prepare_users(cupy, users, fi, half_scores=True, shift=shift)
        got = backend.fast_users(users, fi, half_scores=True, shift=shift)
        assert got.half_scores
        g16, w16 = (cupy.asnumpy(x.vecs16).view(np.uint16).astype(np.int64) for x in (got, want))
        aux = fi.norms_at if fi.norms_at is not None else fi.width
        one_step = [fi.shift_at] if centre is not None else []
        same = [c for c in range(aux) if c not in one_step]
        assert (g16[:, same] == w16[:, same]).all()
        assert (np.abs(g16[:, aux:] - w16[:, aux:]) <= 1).all()
        assert (np.abs(g16[:, one_step] - w16[:, one_step]) <= 1).all()
        assert (cupy.asnumpy(got.alpha) == cupy.asnumpy(want.alpha)).all()
        if centre is None:
            assert (cupy.asnumpy(got.offset) == cupy.asnumpy(want.offset)).all()
        else:
            yc_abs = np.abs(pu[:, :fi.dot_dim].astype(np.float64)) @ np.abs(centre.astype(np.float64))
            assert (np.abs(cupy.asnumpy(got.offset) - cupy.asnumpy(want.offset)) <= 2.0 ** -40 * yc_abs
                    + 1e-12 * np.abs(cupy.asnumpy(want.offset))).all()
        np.testing.assert_allclose(cupy.asnumpy(got.bound), cupy.asnumpy(want.bound), rtol=1e-9, atol=0)
    # (l2 caps alpha for the bias: such a row rounds to 0 there, its residual its whole norm; split along a centre,
    # a row along it leaves y' = y - p·ĉ of a few components' rounding)
    if fi.bias_at is None and fi.proj_at is None:
        # A row of float32 subnormals is scaled up like any other, not flushed to 0 (the kernel widens exactly).
        tiny = backend.fast_users(cupy.full((1, pu.shape[1]), np.float32(1e-40)), fi)
        assert float(tiny.alpha[0]) >= 2.0 ** 140 and (cupy.asnumpy(tiny.vecs16[:, :fi.dot_dim]) != 0).all()


def test_scales_are_exact_powers_of_two():
    # alpha and beta from the exponent: exactly 2^(13 - floor(log2 x)), so that every scaled largest component lies
    # in [2^13, 2^14), at powers of two themselves, just below them and far from 1; 1 for 0. And the shift's cap:
    # with shifts of every magnitude, alpha stays a power of two and sigma_u within float16's range.
    rng = np.random.default_rng(5)
    x = np.concatenate([2.0 ** np.arange(-140, 120), np.nextafter(2.0 ** np.arange(-120, 120), 0),
                        rng.lognormal(0, 30, 2000)])
    s = certificate._pow2_scale(np, x)
    assert (np.frexp(s)[0] == 0.5).all()
    assert ((x * s >= 2.0 ** 13) & (x * s < 2.0 ** 14)).all()
    assert certificate._pow2_scale(np, np.zeros(3)).tolist() == [1.0, 1.0, 1.0]
    items = rng.standard_normal((500, 16)).astype(np.float32)
    fi = certificate.prepare_items(np, items)
    users = rng.standard_normal((400, 16)).astype(np.float32)
    shift = rng.standard_normal(400) * 10.0 ** rng.uniform(-40, 40, 400)
    shift[:3] = [0.0, 2.0 ** 20, -(2.0 ** 20) * (1 + 2.0 ** -52)]
    fu = certificate.prepare_users(np, users, fi, half_scores=True, shift=shift)
    assert (np.frexp(fu.alpha)[0] == 0.5).all()
    assert np.isfinite(fu.vecs16.astype(np.float64)).all()
    assert (np.abs(fu.vecs16[:, fi.shift_at].astype(np.float64)) <= 2.0 ** 15).all()
