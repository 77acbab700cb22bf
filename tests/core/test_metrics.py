"""``recall.metrics``: every metric as a vector transform, so that an inner product of the prepared vectors ranks
items as the metric does, and ``finish_scores`` reports the metric's own score."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from recall import InputError
from recall.core import metrics


def _prepared_scores(metric, users, items):
    pu = metrics.prepare_users(metric, np, users)
    pi = metrics.prepare_items(metric, np, items)
    assert pu.dtype == np.float32 and pi.dtype == np.float32
    assert pu.shape[1] == pi.shape[1]
    return pu.astype(np.float64) @ pi.astype(np.float64).T


def test_check_metric():
    for m in ("ip", "cosine", "l2"):
        assert metrics.check_metric(m) == m
    for bad in ("IP", "dot", "", "euclidean", None):
        with pytest.raises(InputError, match="expected one of ip, cosine, l2"):
            metrics.check_metric(bad)


def test_ip_is_the_identity(make_normal):
    users, items = make_normal(5, 7, 3, seed=0)
    np.testing.assert_array_equal(metrics.prepare_users("ip", np, users), users)
    np.testing.assert_array_equal(metrics.prepare_items("ip", np, items), items)
    s = (users @ items.T).astype(np.float32)
    np.testing.assert_array_equal(metrics.finish_scores("ip", np, s.copy(), users), s)


def test_cosine_unit_rows_same_direction(make_clustered):
    users, items = make_clustered(20, 50, 16, seed=1)
    for prep, vecs in ((metrics.prepare_users, users), (metrics.prepare_items, items)):
        out = prep("cosine", np, vecs)
        norms = np.linalg.norm(out.astype(np.float64), axis=1)
        np.testing.assert_allclose(norms, 1.0, atol=1e-6)
        # Same direction: parallel to the input, positive factor.
        ratio = vecs.astype(np.float64) / out.astype(np.float64)
        want = np.broadcast_to(np.linalg.norm(vecs.astype(np.float64), axis=1)[:, None], ratio.shape)
        np.testing.assert_allclose(ratio, want, rtol=1e-5)
    np.testing.assert_allclose(_prepared_scores("cosine", users, items),
                               oracle.score_matrix(users, items, "cosine"), atol=1e-6)


def test_cosine_norm_is_accurate_for_long_small_vectors():
    # 100k entries of 1e-3: a float32 running sum of squares drifts; the norm must still come out right.
    vec = np.full((1, 100_000), 1e-3, np.float32)
    out = metrics.prepare_items("cosine", np, vec)
    np.testing.assert_allclose(np.linalg.norm(out.astype(np.float64)), 1.0, atol=1e-6)
    np.testing.assert_allclose(out, 1.0 / np.sqrt(100_000), rtol=1e-6)


def test_cosine_power_of_two_scalings_tie_exactly():
    v = np.array([[3.0, -1.0, 2.0, 0.5]], np.float32)
    out = metrics.prepare_items("cosine", np, np.concatenate([v, 2 * v, 0.25 * v, 1024 * v]))
    assert np.all(out == out[0])


@pytest.mark.parametrize("block_rows, block_values", [(10, 1), (10, 9 * 25), (1000, 1)], ids=["rows", "values", "one"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_norms_in_blocks_equal_the_whole_computation(monkeypatch, block_rows, block_values, dtype):
    """Blocks of rows (bounded transient memory; by rows, or by values for narrow rows) give the same bits as one
    float64 pass over every row."""
    vecs = np.random.default_rng(3).standard_normal((103, 9)).astype(dtype)
    monkeypatch.setattr(metrics, "_NORM_BLOCK_ROWS", block_rows)
    monkeypatch.setattr(metrics, "_NORM_BLOCK_VALUES", block_values)
    wide = vecs.astype(np.float64)
    whole = np.sqrt((wide * wide).sum(axis=1))
    got = metrics.row_norms(np, vecs)
    assert got.dtype == np.float64 and got.shape == (103,)
    np.testing.assert_array_equal(got, whole)
    assert metrics.row_norms(np, vecs[:0]).shape == (0,)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cosine_scaling_rounds_the_float64_quotient(dtype):
    """Below the compiled loop's size, cosine's float32 rows are the float64 quotients v / |v| rounded once, bit for
    bit (float32 / float64).astype(float32)."""
    vecs = (np.random.default_rng(8).standard_normal((40, 7)) * 1e3).astype(dtype)
    got = metrics.prepare_users("cosine", np, vecs)
    want = (vecs / metrics.row_norms(np, vecs)[:, None]).astype(np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def _counting(monkeypatch, name):
    calls = []
    real = getattr(metrics, name)
    monkeypatch.setattr(metrics, name, lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("dim", [1, 3, 4, 5, 64, 257])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["C", "F", "strided"])
def test_row_norms_compiled_loop_against_float64(monkeypatch, dim, dtype, layout):
    """Host arrays past the size threshold take the compiled loop: the float64 norm of each row, NaN and Inf rows as
    such, whatever the array's layout."""
    monkeypatch.setattr(metrics, "_HOST_LOOP_VALUES", 1)
    calls = _counting(monkeypatch, "_host_norms")
    rng = np.random.default_rng(dim)
    base = (rng.standard_normal((50, 2 * dim)) * np.exp(3 * rng.standard_normal((50, 1)))).astype(dtype)
    base[7, 0] = np.nan
    base[11, 0] = np.inf
    base[13] = 0.0
    vecs = {"C": np.ascontiguousarray(base[:, :dim]), "F": np.asfortranarray(base[:, :dim]),
            "strided": base[:, ::2]}[layout]
    got = metrics.row_norms(np, vecs)
    assert calls and got.dtype == np.float64 and got.shape == (50,)
    wide = vecs.astype(np.float64)
    want = np.sqrt((wide * wide).sum(axis=1))
    assert np.isnan(got[7]) and got[11] == np.inf and got[13] == 0.0
    np.testing.assert_allclose(got, want, rtol=1e-14)


def test_cosine_compiled_loop_rounds_like_numpy(monkeypatch):
    """The compiled loop's float32(v / |v|) is NumPy's (float32 / float64).astype(float32), bit for bit, from the
    same norms."""
    monkeypatch.setattr(metrics, "_HOST_LOOP_VALUES", 1)
    calls = _counting(monkeypatch, "_host_scale")
    vecs = (np.random.default_rng(5).standard_normal((300, 37)) * 1e3).astype(np.float32)
    got = metrics.prepare_users("cosine", np, vecs)
    assert calls and got.dtype == np.float32
    want = (vecs / metrics.row_norms(np, vecs)[:, None]).astype(np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("which", ["users", "items"])
def test_cosine_zero_vector_names_the_row(which):
    vecs = np.ones((5, 3), np.float32)
    vecs[2] = 0.0
    prep = metrics.prepare_users if which == "users" else metrics.prepare_items
    with pytest.raises(InputError, match=rf"{which[:-1]}_vecs: row 2 is a zero vector"):
        prep("cosine", np, vecs)


@pytest.mark.parametrize("dim", [1, 2, 3, 4, 5, 7, 8, 64])
def test_l2_augmentation_width_and_layout(dim):
    rng = np.random.default_rng(dim)
    users = rng.integers(-3, 4, (4, dim)).astype(np.float32)
    items = rng.integers(-3, 4, (6, dim)).astype(np.float32)
    pu = metrics.prepare_users("l2", np, users)
    pi = metrics.prepare_items("l2", np, items)
    width = pu.shape[1]
    assert width == pi.shape[1] and width % 4 == 0 and dim + 1 <= width < dim + 5
    np.testing.assert_array_equal(pu[:, :dim], users)
    np.testing.assert_array_equal(pi[:, :dim], items)
    np.testing.assert_array_equal(pu[:, dim], 1.0)
    np.testing.assert_array_equal(pi[:, dim], -0.5 * (items.astype(np.float64) ** 2).sum(axis=1))
    assert not pu[:, dim + 1:].any() and not pi[:, dim + 1:].any()
    assert pu.flags.c_contiguous and pi.flags.c_contiguous


def test_l2_prepared_scores_rank_like_distance_and_finish_exactly(make_ties):
    users, items = make_ties(12, 40, 6, seed=2)
    inner = _prepared_scores("l2", users, items)
    want = oracle.score_matrix(users, items, "l2")
    # u·v - ||v||²/2 differs from -||u-v||²/2 by a per-user constant: same ranking, ties included.
    np.testing.assert_array_equal(2 * inner - (users.astype(np.float64) ** 2).sum(axis=1)[:, None], want)
    got = metrics.finish_scores("l2", np, inner.astype(np.float32), users)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_finish_scores_keeps_padding():
    users = np.array([[1.0, 2.0], [0.0, 0.0]], np.float32)
    s = np.array([[3.0, -np.inf], [-np.inf, -np.inf]], np.float32)
    for metric in metrics.METRICS:
        out = metrics.finish_scores(metric, np, s.copy(), users)
        assert out.dtype == np.float32
        np.testing.assert_array_equal(np.isneginf(out), np.isneginf(s))
    np.testing.assert_array_equal(metrics.finish_scores("l2", np, s.copy(), users)[0, 0], 2 * 3.0 - 5.0)


def test_l2_lists_keep_the_order_of_the_distances_where_reported_scores_round_equal():
    # One user at (10000, 0): items (0, 2) and (0, 0) are 1e8 + 4 and 1e8 away, and float32 reports both as -1e8.
    # The list is in the order of the distances (the nearer first, though its row is higher): the same whether k is
    # 1 or 2, and the same as the exact order.
    from recall import Engine

    items = np.array([[-10.0, 0.0]] * 100 + [[0.0, 2.0], [0.0, 0.0]], np.float32)  # rows 0-99 farther
    users = np.array([[10000.0, 0.0]], np.float32)
    engine = Engine(items, metric="l2", device="cpu")
    one, two = engine.search(users, 1), engine.search(users, 3)
    assert one.indices.tolist() == [[101]] and two.indices.tolist()[0][:2] == [101, 100]
    assert two.scores[0, 0] == two.scores[0, 1] == np.float32(-1e8)


def test_finish_scores_for_zero_users():
    users = np.zeros((0, 3), np.float32)
    for metric in metrics.METRICS:
        assert metrics.finish_scores(metric, np, np.zeros((0, 4), np.float32), users).shape == (0, 4)


@given(dim=st.integers(1, 9), seed=st.integers(0, 2**32 - 1), metric=st.sampled_from(metrics.METRICS))
@settings(max_examples=60)
def test_property_prepared_inner_product_ranks_like_the_metric(dim, seed, metric):
    rng = np.random.default_rng(seed)
    users = rng.integers(-3, 4, (5, dim)).astype(np.float32)
    items = rng.integers(-3, 4, (30, dim)).astype(np.float32)
    users[~users.any(axis=1), 0] = 1
    items[~items.any(axis=1), 0] = 1
    got = _prepared_scores(metric, users, items)
    want = oracle.score_matrix(users, items, metric)
    if metric == "cosine":
        np.testing.assert_allclose(got, want, atol=1e-6)
        return
    # ip and l2 on small integers are exact: the stable orders agree, ties included.
    np.testing.assert_array_equal(np.argsort(-got, axis=1, kind="stable"), np.argsort(-want, axis=1, kind="stable"))


def test_l2_centre_only_far_from_the_origin():
    rng = np.random.default_rng(0)
    near = rng.standard_normal((500, 8)).astype(np.float32)
    assert metrics.far_centre(near) is None
    assert metrics.far_centre(near + 2.0) is None  # |mean| = 5.7, spread 2.8: no digits lost that matter
    far = near + np.float32(300.0)
    c = metrics.far_centre(far)
    assert c is not None and c.dtype == np.float32 and c.shape == (8,)
    # Each coordinate within half its quantum of the mean: the largest power of two not above its spread.
    rows = far.astype(np.float64)
    quantum = np.exp2(np.floor(np.log2(rows.std(axis=0))))
    assert (np.abs(c - rows.mean(axis=0)) <= quantum / 2).all()
    np.testing.assert_array_equal(c / quantum, np.round(c / quantum))
    assert metrics.far_centre(np.zeros((0, 8), np.float32)) is None
    bad = far.copy()
    bad[3, 2] = np.nan
    assert metrics.far_centre(bad) is None  # the engine's checks name the row


@pytest.mark.parametrize("offset", [3e3, 1e5, 1e6, 1e7, 3e7])
def test_l2_centre_keeps_integer_data_far_from_the_origin_integer_valued(offset):
    # Small integers around the offset: the centre is an integer (each coordinate's spread is about 2), so the
    # centred vectors are the small integers again, and their distances exact in float32 whatever the offset (a
    # centre rounded to 12 significant bits left 10^7 about 1,200 from it: every list of a search wrong).
    rng = np.random.default_rng(10)
    items = (rng.integers(-3, 4, (2000, 16)) + offset).astype(np.float32)
    c = metrics.far_centre(items)
    np.testing.assert_array_equal(c, np.round(c))
    assert np.abs(c.astype(np.float64) - offset).max() <= 1
    np.testing.assert_array_equal((items - c).astype(np.float64), items.astype(np.float64) - c.astype(np.float64))


def test_l2_centre_of_a_coordinate_every_row_holds_alike_is_that_value():
    items = np.full((100, 3), 5e6, np.float32)
    items[:, 0] += np.arange(100, dtype=np.float32) % 7
    c = metrics.far_centre(items)
    assert c[1] == c[2] == np.float32(5e6)


def test_l2_centre_is_taken_from_the_first_rows_only():
    rng = np.random.default_rng(1)
    head = (rng.standard_normal((metrics.CENTRE_ROWS, 4)) + 100).astype(np.float32)
    tail = (rng.standard_normal((50, 4)) - 5000).astype(np.float32)
    np.testing.assert_array_equal(metrics.far_centre(np.vstack([head, tail])), metrics.far_centre(head))


def test_a_float64_row_that_rounds_to_zero_in_float32_is_named_as_such() -> None:
    """A cosine user of float64 values below float32's smallest was refused as "a zero vector": the caller gave
    none."""
    from recall import Engine

    engine = Engine(np.eye(3, dtype=np.float32), metric="cosine", device="cpu")
    users = np.array([[1.0, 0.0, 0.0], [1e-50, 2e-50, 0.0]])
    with pytest.raises(InputError, match=r"user_vecs: row 1 is a zero vector in float32 \(every value 0, or too "
                                         r"small for float32\)"):
        engine.search(users, 2)


@pytest.mark.parametrize("centre", [False, True])
def test_l2_items_rank_by_their_distance_to_the_centroid(centre):
    # metrics.centroid_ranks: under l2 each item's score against a user at the items' centroid, in the order of its
    # distance to it (nearest first), from the prepared vectors (the engine's centre taken off or not); None where
    # the norms rank the items (ip) or nothing does (cosine).
    from recall.core import metrics

    rng = np.random.default_rng(3)
    items = (rng.standard_normal((3000, 7)) * rng.lognormal(0, 1, (3000, 1)) + 2.0).astype(np.float32)
    shift = items.mean(axis=0) if centre else None
    prepared = metrics.prepare_items("l2", np, items, centre=shift)
    got = metrics.centroid_ranks(np, prepared, "l2", 7)
    x = items.astype(np.float64)
    dist = ((x - x.mean(axis=0)) ** 2).sum(axis=1)
    assert got.shape == (3000,) and got.dtype == np.float64
    np.testing.assert_array_equal(np.argsort(-got, kind="stable")[:300], np.argsort(dist, kind="stable")[:300])
    assert metrics.centroid_ranks(np, items, "ip", 7) is None
    assert metrics.centroid_ranks(np, items, "cosine", 7) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [1, 9, 64])
def test_gpu_row_norms_and_cosine_rows_in_one_pass(monkeypatch, dim):
    """On the device the norms square while widening and sum into their place, and cosine divides in float64 into
    its float32 rows: the bits of the float64 copy, squared, summed and divided (the earlier array operations), in
    blocks or whole, NaN and zero rows as such."""
    from recall.backends import cuda_status

    usable, reason = cuda_status()
    if not usable:
        pytest.skip(f"no usable GPU: {reason}")
    import cupy

    rng = np.random.default_rng(dim)
    host = (rng.standard_normal((5_000, dim)) * np.exp(3 * rng.standard_normal((5_000, 1)))).astype(np.float32)
    host[7, 0] = np.nan
    vecs = cupy.asarray(host)
    wide = vecs.astype(cupy.float64)
    want = cupy.sqrt((wide * wide).sum(axis=1))
    for rows, values in ((65_536, 1 << 23), (100, 1)):
        monkeypatch.setattr(metrics, "_NORM_BLOCK_ROWS", rows)
        monkeypatch.setattr(metrics, "_NORM_BLOCK_VALUES", values)
        got = metrics.row_norms(cupy, vecs)
        assert isinstance(got, cupy.ndarray) and got.dtype == cupy.float64
        cupy.testing.assert_array_equal(got, want)
    assert bool(cupy.isnan(got[7]))
    np.testing.assert_allclose(cupy.asnumpy(got)[8:], np.linalg.norm(host[8:].astype(np.float64), axis=1),
                               rtol=1e-14)
    host[7, 0] = 1.0
    vecs = cupy.asarray(host)
    scaled = metrics.prepare_users("cosine", cupy, vecs)
    assert isinstance(scaled, cupy.ndarray) and scaled.dtype == cupy.float32
    cupy.testing.assert_array_equal(scaled, (vecs / metrics.row_norms(cupy, vecs)[:, None]).astype(cupy.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [0, 1, 31, 33, 64, 300])
def test_gpu_backend_row_norms_in_one_launch(dim):
    """``CupyBackend.row_norms`` (one warp a row, recall_row_norms): each row's float64 norm within a few ulps of the
    float64 oracle (its own summation order), NaN and zero rows as such, rows of another stride (a slice of wider
    rows) and host arrays taken too; cosine's users scaled by them and l2's finished scores as the array
    operations' up to those ulps."""
    from recall.backends import cuda_status

    usable, reason = cuda_status()
    if not usable:
        pytest.skip(f"no usable GPU: {reason}")
    import cupy

    from recall.backends.cupy.backend import CupyBackend

    backend = CupyBackend()
    rng = np.random.default_rng(dim + 1)
    host = (rng.standard_normal((20_011, dim)) * np.exp(3 * rng.standard_normal((20_011, 1)))).astype(np.float32)
    want = np.sqrt((host.astype(np.float64) ** 2).sum(axis=1))
    if dim:
        host[7, 0], host[8] = np.nan, 0.0
        want[7], want[8] = np.nan, 0.0
    got = backend.row_norms(cupy.asarray(host))
    assert isinstance(got, cupy.ndarray) and got.dtype == cupy.float64 and got.shape == (20_011,)
    np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=4e-16 * max(dim, 1) ** 0.5 + 1e-16, equal_nan=True)
    assert backend.row_norms(cupy.zeros((0, dim), cupy.float32)).shape == (0,)
    np.testing.assert_array_equal(backend.row_norms(host), metrics.row_norms(np, host))  # host rows: NumPy's
    if dim < 2:
        return
    wide = cupy.asarray(host)[:, : dim - 1]  # rows strided past their columns
    np.testing.assert_allclose(cupy.asnumpy(backend.row_norms(wide)),
                               np.linalg.norm(host[:, : dim - 1].astype(np.float64), axis=1), rtol=1e-14,
                               equal_nan=True)
    host[7, 0], host[8] = 1.0, 0.5
    vecs = cupy.asarray(host)
    assert backend.largest_norm(vecs) == float(backend.row_norms(vecs).max())  # the users' check sums the same way
    scaled = metrics.prepare_users("cosine", cupy, vecs, backend.row_norms)
    np.testing.assert_allclose(cupy.asnumpy(scaled), cupy.asnumpy(metrics.prepare_users("cosine", cupy, vecs)),
                               rtol=2e-7, atol=0)
    scores = cupy.asarray(rng.standard_normal((20_011, 5)).astype(np.float32))
    got = cupy.asnumpy(metrics.finish_scores("l2", cupy, scores.copy(), vecs, backend.row_norms))
    old = cupy.asnumpy(metrics.finish_scores("l2", cupy, scores.copy(), vecs))
    sq = (host.astype(np.float64) ** 2).sum(axis=1)[:, None]
    assert (np.abs(got - old) <= 2.4e-7 * sq).all()  # |u|² rounded to float32 a unit apart at most


def _l2_cases(rng):
    """(n, k) float32 inner-product scores over magnitudes 2^-20 to 2^40, with -inf padding, zeros of both signs and
    values whose difference with the squared norm is exact or rounds; (n,) float32 squared norms."""
    scores = (rng.standard_normal((300, 37)) * np.exp2(rng.integers(-20, 40, (300, 1)))).astype(np.float32)
    scores[3, 30:] = -np.inf
    scores[4] = -np.inf
    scores[5, :4] = (0.0, -0.0, 1.0, -1.0)
    sq = (rng.standard_normal(300) ** 2 * np.exp2(rng.integers(-20, 40, 300))).astype(np.float32)
    sq[5] = 0.0
    sq[6] = 2.0 * scores[6, 0]  # 2·s - |u|² exactly 0 for one item
    return scores, sq


def test_l2_finished_is_the_float32_arithmetic_through_either_seam():
    """``finish_scores``' l2 arithmetic (``l2_finished``: 2·s exact, one float32 rounding) is what the CPU backend's
    ``finish_l2`` computes, and what ``finish_scores`` returns through it; -inf padding stays -inf."""
    from recall.backends.numpy.backend import NumpyBackend

    scores, sq = _l2_cases(np.random.default_rng(5))
    want = np.subtract(np.multiply(scores, np.float32(2.0)), sq[:, None], dtype=np.float32)  # float32 operations
    got = metrics.l2_finished(np, scores, sq)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    finite = np.isfinite(scores)
    exact = 2.0 * scores.astype(np.float64) - sq.astype(np.float64)[:, None]
    assert (np.abs(got[finite] - exact[finite]) <= np.spacing(np.abs(got[finite])) / 2 + 1e-45).all()  # one rounding
    assert np.isneginf(got[4]).all() and np.isneginf(got[3, 30:]).all() and got[6, 0] == 0.0
    np.testing.assert_array_equal(NumpyBackend().finish_l2(scores, sq), want)
    users = np.random.default_rng(6).standard_normal((300, 5)).astype(np.float32)
    np.testing.assert_array_equal(metrics.finish_scores("l2", np, scores, users, l2_of=NumpyBackend().finish_l2),
                                  metrics.finish_scores("l2", np, scores, users))


@pytest.mark.gpu
def test_gpu_backend_finish_l2_is_the_array_arithmetic_bit_for_bit():
    """``CupyBackend.finish_l2`` (one elementwise kernel) gives the bits of the array operations it replaces
    (``2.0 * s - sq[:, None]``) on device scores, strided too, and takes host arrays as NumPy would."""
    from recall.backends import cuda_status, resolve

    usable, reason = cuda_status()
    if not usable:
        pytest.skip(f"no usable GPU: {reason}")
    import cupy

    backend = resolve("gpu")
    scores, sq = _l2_cases(np.random.default_rng(7))
    want = metrics.l2_finished(np, scores, sq)
    got = backend.finish_l2(cupy.asarray(scores), cupy.asarray(sq))
    assert isinstance(got, cupy.ndarray) and got.dtype == cupy.float32
    np.testing.assert_array_equal(cupy.asnumpy(got), want)
    np.testing.assert_array_equal(np.signbit(cupy.asnumpy(got)), np.signbit(want))
    wide = cupy.asarray(np.concatenate([scores, scores], axis=1))
    np.testing.assert_array_equal(cupy.asnumpy(backend.finish_l2(wide[:, ::2], cupy.asarray(sq))),
                                  metrics.l2_finished(np, np.concatenate([scores, scores], axis=1)[:, ::2], sq))
    np.testing.assert_array_equal(backend.finish_l2(scores, sq), want)
