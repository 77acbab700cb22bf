"""Fast mode: half-precision scores with a certified exact re-rank must give exact mode's answer."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from conftest import clustered_data, emulated, normal_data, plateau_data, ties_data
from oracle import as_numpy
from recall import Engine, EngineOptions, InputError
from recall.core import certificate as fast
from recall.core.tiling import TilePlan


def first_margin(engine, k):
    """The margin a search of ``k`` on ``engine`` starts with where none is learned: the certificate's, or fewer
    below k = 64 where the backend starts its passes at the need (the GPU's; ``fast.NEED_MARGIN``)."""
    from recall.engine import fast as fast_search

    return fast_search._default_margin(engine, k)


def margin_engine(at_need, **fields):
    """A stand-in engine for fast mode's margin rules: a backend that starts its passes at the need (the GPU's) or
    at a bound (the CPU's), no options, and ``fields``."""
    from types import SimpleNamespace

    return SimpleNamespace(backend=SimpleNamespace(starts_at_need=lambda options: at_need), options=None, **fields)


def _ints(rng, n, dim):
    return rng.integers(-3, 4, size=(n, dim)).astype(np.float32)


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_fast_equals_exact_on_integer_data(device, metric):
    # Integer data: every float32 score is exact, so both modes must agree bit for bit (ties included), whether a
    # user was certified or fell back.
    rng = np.random.default_rng(0)
    items, users = _ints(rng, 3000, 12), _ints(rng, 300, 12)
    excl = {u: rng.choice(3000, 30, replace=False).tolist() for u in range(0, 300, 4)}
    excl[5] = list(range(3000))
    want = Engine(items, metric=metric, device=device).search(users, 40, exclude=excl)
    engine = Engine(items, metric=metric, device=device, precision="fast", options=emulated())
    got = engine.search(users, 40, exclude=excl)
    np.testing.assert_array_equal(as_numpy(got.indices), as_numpy(want.indices))
    np.testing.assert_array_equal(as_numpy(got.scores), as_numpy(want.scores))
    assert engine.stats["precision"] == "fast" and 0 <= engine.stats["fallback_users"] <= 300


@pytest.mark.parametrize("kind", ["normal", "clustered"])
def test_fast_is_exact_on_float_data(device, kind, make_normal, make_clustered):
    make = make_normal if kind == "normal" else make_clustered
    users, items = make(400, 6000, 32, seed=3)
    engine = Engine(items, device=device, precision="fast", options=emulated())
    res = engine.search(users, 50)
    idx, val = as_numpy(res.indices), as_numpy(res.scores)
    oracle.assert_topk_close(idx, val, users, items, 50)
    # Real-valued data certifies nearly everyone: the fallback is the exception, not the path.
    assert engine.stats["fallback_users"] <= 4


def test_fast_k_at_least_the_catalogue(device):
    rng = np.random.default_rng(1)
    items, users = _ints(rng, 50, 6), _ints(rng, 20, 6)
    for k in (40, 50, 70):
        want = Engine(items, device=device).search(users, k)
        got = Engine(items, device=device, precision="fast", options=emulated()).search(users, k)
        np.testing.assert_array_equal(as_numpy(got.indices), as_numpy(want.indices))


def test_failed_certificates_fall_back_to_exact(device, monkeypatch):
    # With no margin and heavy ties, most certificates fail: the answer must still be exact mode's.
    monkeypatch.setattr(fast, "margin", lambda k: 0)
    rng = np.random.default_rng(2)
    items = rng.integers(-1, 2, size=(2000, 4)).astype(np.float32)
    users = rng.integers(-1, 2, size=(200, 4)).astype(np.float32)
    engine = Engine(items, device=device, precision="fast", options=emulated())
    got = engine.search(users, 10)
    assert engine.stats["fallback_users"] > 100
    assert engine.stats["widened_users"] >= engine.stats["fallback_users"]
    want = Engine(items, device=device).search(users, 10)
    np.testing.assert_array_equal(as_numpy(got.indices), as_numpy(want.indices))


def test_failed_users_come_to_the_host_in_order_with_the_short_count(device):
    # The certificate's verdicts come back as a count (one small transfer) and, only where some failed, their rows.
    from recall.engine import fast as fast_search

    backend = Engine(np.eye(4, dtype=np.float32), device=device).backend
    xp = backend.xp
    rng = np.random.default_rng(7)
    for n, p in [(0, 0.5), (1, 1.0), (1, 0.0), (1000, 0.0), (1000, 0.01), (1000, 1.0), (70_001, 0.3)]:
        failed, short = rng.random(n) < p, rng.random(n) < 0.5
        rows, n_short = fast_search._failed_rows(backend, xp, xp.asarray(failed), xp.asarray(short))
        assert isinstance(rows, np.ndarray) and rows.dtype == np.int64
        np.testing.assert_array_equal(rows, np.flatnonzero(failed))
        assert n_short == int(short.sum())
        rows, n_short = fast_search._failed_rows(backend, xp, xp.asarray(failed))
        np.testing.assert_array_equal(rows, np.flatnonzero(failed))
        assert n_short is None


def test_failed_certificates_are_widened_before_falling_back(device, monkeypatch):
    # Items in groups of 7 near-duplicates (closer than float16 can tell apart): with k = 10 and a margin of 2, the
    # item left out is a near-twin of candidates inside the top k, so the first certificate fails; the widened pass
    # (40 x 2 extra candidates, scores shifted by each user's k-th) holds whole groups and certifies, with no exact
    # search.
    from recall.engine import fast as fast_search

    monkeypatch.setattr(fast, "margin", lambda k: 2)
    monkeypatch.setattr(fast_search, "WIDEN", 40)
    users, base = normal_data(200, 700, 32, seed=4)
    rng = np.random.default_rng(5)
    items = (np.repeat(base, 7, axis=0) * (1 + 1e-6 * rng.standard_normal((4900, 32)))).astype(np.float32)
    engine = Engine(items, device=device, precision="fast", options=emulated())
    res = engine.search(users, 10)
    oracle.assert_topk_close(as_numpy(res.indices), as_numpy(res.scores), users, items, 10)
    assert engine.stats["widened_users"] > 20
    assert engine.stats["fallback_users"] < engine.stats["widened_users"] / 4


def test_a_budget_that_holds_exact_mode_but_not_the_wider_passes(device):
    # Cosine on one dimension: every item ties with thousands of others, every certificate fails and the widened pass
    # keeps k + 4m + 1 candidates a user, more than a budget that holds exact mode's k. Fast mode must then answer as
    # exact mode does, not raise ResourceError.
    rng = np.random.default_rng(0)
    items = rng.choice(np.array([-2, -1, 1, 2], np.float32), size=(9201, 1))
    users = rng.choice(np.array([-2, -1, 1, 2], np.float32), size=(63, 1))
    # The budget holds the first pass (k + m + 1 candidates, one user against 256 items) and not one user against
    # one item of the widened pass, whatever the backend's top-k state costs (the GPU's is 18x the CPU's).
    state_bytes = Engine(items, metric="cosine", device=device).backend.state_bytes
    first, widened = 1000 + fast.margin(1000) + 1, 1000 + 4 * fast.margin(1000) + 1
    budget = TilePlan(1, 256, 1).workspace_bytes(1, first, state_bytes(first))
    assert TilePlan(1, 1, 1).workspace_bytes(1, widened, state_bytes(widened)) > budget
    want = Engine(items, metric="cosine", device=device, memory_budget=budget).search(users, 1000)
    engine = Engine(items, metric="cosine", device=device, precision="fast", memory_budget=budget, options=emulated())
    got = engine.search(users, 1000)
    np.testing.assert_array_equal(as_numpy(got.indices), as_numpy(want.indices))
    np.testing.assert_array_equal(as_numpy(got.scores), as_numpy(want.scores))
    # Every user failed the first pass; each was then certified by a widened pass that the budget held (the GPU's:
    # its widened pass of 2,001 candidates certifies them all) or searched exactly (the CPU's).
    assert engine.stats["widened_users"] == 63
    assert engine.stats["fallback_users"] + sum(p[2] for p in engine.stats["widened_passes"]) == 63


def test_a_pass_in_no_order_certifies_as_a_sorted_one(monkeypatch):
    # Fast mode asks its pass for its candidates in no order (Backend.run_blocks' best_first=False: the GPU's final
    # merge then skips its sort). A CPU backend whose pass shuffles each row where allowed must give the same
    # answer and the same certificates as one that keeps them sorted: the bound takes the least kept score, not a
    # column. A margin of 2 on small-integer ties leaves many certificates deciding on that bound.
    from recall.backends.numpy.backend import NumpyBackend

    monkeypatch.setattr(fast, "margin", lambda k: 2)
    rng = np.random.default_rng(21)
    items, users = _ints(rng, 2000, 8), _ints(rng, 120, 8)
    excl = {u: rng.choice(2000, 1990, replace=False).tolist() for u in range(0, 120, 9)}
    sorted_engine = Engine(items, device="cpu", precision="fast", options=emulated())
    want = sorted_engine.search(users, 12, exclude=excl)
    real = NumpyBackend.run_blocks
    asked = []

    def shuffled(self, plan, users, items, n_items, k, excl, out_vals, out_rows, options, floor=None,
                 left_out=None, best_first=True, need=0):
        stats = real(self, plan, users, items, n_items, k, excl, out_vals, out_rows, options, floor, left_out)()
        asked.append(best_first)
        if not best_first:
            for u in range(out_vals.shape[0]):
                order = rng.permutation(out_vals.shape[1])
                out_vals[u], out_rows[u] = out_vals[u, order], out_rows[u, order]
        return lambda: stats

    monkeypatch.setattr(NumpyBackend, "run_blocks", shuffled)
    engine = Engine(items, device="cpu", precision="fast", options=emulated())
    got = engine.search(users, 12, exclude=excl)
    assert False in asked and engine.stats["widened_users"] > 10
    oracle.assert_same_result(got, want)
    for key in ("widened_users", "fallback_users", "candidates"):
        assert engine.stats[key] == sorted_engine.stats[key], key


def test_unknown_precision_is_an_input_error():
    with pytest.raises(InputError, match="unknown precision 'half'"):
        Engine(np.ones((3, 2), np.float32), device="cpu", precision="half")


def _lognormal(n_users, n_items, dim, seed=0):
    users, items = normal_data(n_users, n_items, dim, seed)
    items *= np.random.default_rng(seed + 1).lognormal(0.0, 0.75, (n_items, 1)).astype(np.float32)
    return users, items


def _far(n_users, n_items, dim, offset, seed=0):
    """Normal users and items moved by ``offset`` in every coordinate: data far from the origin."""
    users, items = normal_data(n_users, n_items, dim, seed)
    return users + np.float32(offset), items + np.float32(offset)


# Each data kind of issue 18, on the CPU and (gpu-marked, through the device fixture) the GPU: the answer is exact
# mode's, and on continuous data fewer than 1% of the users fall back to an exact search. Far from the origin (ip 30
# and 300 from it in every coordinate, cosine 3 and 30) every user fell back before the items were rounded about
# their centre (certificate.prepare_items).
KINDS = {
    "far-ip": (lambda: _far(300, 8000, 64, 30.0, seed=13), "ip"),
    "far-ip-300": (lambda: _far(300, 8000, 32, 300.0, seed=14), "ip"),
    "far-cosine": (lambda: _far(300, 8000, 64, 3.0, seed=15), "cosine"),
    "far-cosine-30": (lambda: _far(300, 8000, 48, 30.0, seed=16), "cosine"),
    "normal": (lambda: normal_data(300, 8000, 64, seed=5), "ip"),
    "lognormal": (lambda: _lognormal(300, 8000, 64, seed=6), "ip"),
    "clustered": (lambda: clustered_data(300, 8000, 64, seed=7), "ip"),
    "l2-normal": (lambda: normal_data(300, 8000, 64, seed=8), "l2"),
    "l2-lognormal": (lambda: _lognormal(300, 8000, 64, seed=9), "l2"),
    "cosine-clustered": (lambda: clustered_data(300, 8000, 64, seed=10), "cosine"),
    "d256": (lambda: _lognormal(200, 4000, 256, seed=11), "ip"),
    "ties": (lambda: ties_data(300, 4000, 16, low=-1, high=1, seed=12), "ip"),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fast_on_each_data_kind(device, kind):
    make, metric = KINDS[kind]
    users, items = make()
    k = 50
    engine = Engine(items, metric=metric, device=device, precision="fast", options=emulated())
    got = engine.search(users, k)
    want = Engine(items, metric=metric, device=device).search(users, k)
    if kind == "ties":
        oracle.assert_same_result(got, want)  # integer scores: bit for bit, ties to the lower row
        return
    oracle.assert_topk_close(as_numpy(got.indices), as_numpy(got.scores), users, items, k, metric)
    np.testing.assert_allclose(as_numpy(got.scores), as_numpy(want.scores), rtol=1e-5, atol=1e-5)
    assert engine.stats["fallback_fraction"] < 0.01, engine.stats


def test_data_a_few_spreads_from_the_origin_is_centred(device):
    # Cosine clusters 10 from the origin in every coordinate lie 7.8 spreads out, under l2's rule of 8: rounded about
    # the origin every user widened (CPU's emulation, 3,000 x 30,000, docs/benchmarks.md). Fast mode centres from
    # fast.FAST_FAR spreads, and splits the users along the centre: no user widens, none falls back.
    from recall.bench.workloads import generate
    from recall.engine import fast as fast_engine

    users, items = generate("clustered:offset=10", 300, 8000, 128, seed=3)
    unit = items / np.linalg.norm(items, axis=1, keepdims=True)  # cosine's prepared rows
    ratio = np.linalg.norm(unit.mean(axis=0)) / np.sqrt(((unit - unit.mean(axis=0)) ** 2).sum(axis=1).mean())
    assert fast_engine.FAST_FAR < ratio < 8, ratio
    engine = Engine(items, metric="cosine", device=device, precision="fast", options=emulated(fast_sample=0))
    got = engine.search(users, 20)
    assert engine._fast.items.centre is not None and engine._fast.items.proj_at is not None
    oracle.assert_same_result(got, Engine(items, metric="cosine", device=device).search(users, 20))
    assert engine.stats["fallback_users"] == 0 and engine.stats["widened_users"] <= 3, engine.stats


@pytest.mark.parametrize("k", [50, 500])
def test_a_few_far_items_widen_no_one_under_l2(device, k):
    # Eight items 20,000 times the others' norm: the largest bound column's accumulation term used to be every user's
    # (about 1.7 of the squared distances here) and widened all 300; each column pays for its own now.
    users, items = normal_data(300, 8000, 48, seed=17)
    items[np.random.default_rng(17).choice(8000, 8, replace=False)] *= np.float32(20000)
    engine = Engine(items, metric="l2", device=device, precision="fast", options=emulated(fast_sample=0))
    got = engine.search(users, k)
    want = Engine(items, metric="l2", device=device).search(users, k)
    # Fast mode's float32 sums need not be exact mode's bit for bit on the GPU (the summation order differs): the
    # answer is checked as test_fast_on_each_data_kind checks it.
    oracle.assert_topk_close(as_numpy(got.indices), as_numpy(got.scores), users, items, k, "l2")
    np.testing.assert_allclose(as_numpy(got.scores), as_numpy(want.scores), rtol=1e-5, atol=1e-5)
    assert engine.stats["fallback_users"] == 0, engine.stats
    if device == "gpu" and not engine.stats["fused"]:
        # Known: the GPU's float16 score tiles (cuBLAS and a filter: its pass at k = 500 here) widened every user on
        # this catalogue (300, then 171 of them twice, on an H100: the far items' bias caps every user's scale, and
        # the tiles' absolute step is then wide against the gaps between scores); no user fell back. With the bias in
        # the shift column's range (certificate._BIAS_WIDE) the CPU's emulation of those tiles widens 9 (not yet
        # measured on a GPU).
        return
    assert engine.stats["widened_users"] == 0, engine.stats


@pytest.fixture
def float16_tiles(monkeypatch):
    """The CPU backend with the GPU's float16 score tiles (``NumpyBackend.float16_tiles``), so that fast mode runs
    its GPU arithmetic."""
    from recall.backends.numpy.backend import NumpyBackend

    monkeypatch.setattr(NumpyBackend, "float16_tiles", True)


def test_shift_rows_sample_about_as_many_items_as_lie_above_the_pass_s_last_candidate():
    from recall.engine.fast import SHIFT_ITEMS, shift_rows

    assert len(shift_rows(1_000_000, 126)) == SHIFT_ITEMS  # a pass of 126 in 1M: its 7,936 would be more
    assert shift_rows(20_000, 1251).tolist() == [i * 20_000 // 15 for i in range(15)]
    assert shift_rows(1, 1).tolist() == [0]
    assert shift_rows(5, 5).tolist() == [0] and shift_rows(3, 10).tolist() == [0]  # at least one
    rows = shift_rows(10_000, 7)
    assert len(rows) == SHIFT_ITEMS and rows.max() < 10_000 and np.all(np.diff(rows) > 0)


@pytest.mark.parametrize("kind, metric, n_users, n_items, dim, k", [
    # Popular items at k = 1,000 of 5,000: each user's best score over 1,024 sampled items lay far above the pass's
    # last candidate, whose stored score then rounded by 2^-10 of that distance (9 of 300 users widened); the best of
    # n_items // w sampled items lies near it (fast.shift_rows).
    ("popular", "ip", 300, 5000, 256, 1000),
    # l2, user norms log-normal (sigma 2) against items of widely spread norms: the bias caps the scale of the users
    # of small norm, and the tiles' smallest step was wider than the gaps between their scores (68 of 400 users
    # widened when the bias kept the dot columns' range); from 32 columns it takes the shift column's, 8 times it.
    ("skewed:user_sigma=2,item_sigma=1.5", "l2", 400, 10_000, 128, 20),
], ids=["shift-near-the-last-candidate", "bias-in-the-shift-range"])
def test_float16_tiles_widen_no_one(float16_tiles, kind, metric, n_users, n_items, dim, k):
    from recall.bench.workloads import generate

    users, items = generate(kind, n_users, n_items, dim, seed=0)
    engine = Engine(items, metric=metric, device="cpu", precision="fast", options=emulated())
    got = engine.search(users, k)
    assert engine.stats["widened_users"] == 0 and engine.stats["fallback_users"] == 0, engine.stats
    oracle.assert_same_result(got, Engine(items, metric=metric, device="cpu").search(users, k))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fast_on_each_data_kind_with_float16_tiles(float16_tiles, kind):
    # The same, on the CPU emulating the GPU's float16 score tiles (and so its shifted scores).
    make, metric = KINDS[kind]
    users, items = make()
    engine = Engine(items, metric=metric, device="cpu", precision="fast", options=emulated())
    got = engine.search(users, 50)
    want = Engine(items, metric=metric, device="cpu").search(users, 50)
    if kind == "ties":
        oracle.assert_same_result(got, want)
        return
    oracle.assert_topk_close(got.indices, got.scores, users, items, 50, metric)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5, atol=1e-5)
    assert engine.stats["fallback_fraction"] < 0.01, engine.stats


@pytest.mark.gpu
def test_fast_with_device_users(device):
    # GPU: users already on the device are prepared there (no host copy), sampled, shifted and answered there.
    if device != "gpu":
        pytest.skip("device arrays are the GPU's")
    import cupy

    users, items = clustered_data(6400, 20000, 64, seed=16)
    engine = Engine(items, device="gpu", precision="fast", options=EngineOptions(float16_min_scores=0))
    got = engine.search(cupy.asarray(users), 50)
    assert isinstance(got.indices, cupy.ndarray)
    want = Engine(items, device="gpu").search(cupy.asarray(users), 50)
    np.testing.assert_allclose(as_numpy(got.scores), as_numpy(want.scores), rtol=1e-5, atol=1e-5)
    oracle.assert_topk_close(as_numpy(got.indices)[:300], as_numpy(got.scores)[:300], users[:300], items, 50)
    assert engine.stats["precision"] == "fast" and engine.stats["fast_sample"] == 128
    assert engine.stats["fallback_fraction"] < 0.01, engine.stats


@pytest.mark.gpu
def test_fast_prepares_host_users_on_the_device(device, monkeypatch):
    # GPU: host users (a job's batches) go to the device before their float16 copies and certificates are made, as
    # the certified route's do: made by NumPy they took a second or more for 1M users.
    if device != "gpu":
        pytest.skip("the host and the device are one on the CPU")
    made_by = []
    prepare = fast.prepare_users

    def spy(xp, *args, **kwargs):
        made_by.append(xp.__name__)
        return prepare(xp, *args, **kwargs)

    monkeypatch.setattr(fast, "prepare_users", spy)
    users, items = clustered_data(6400, 20000, 64, seed=16)
    engine = Engine(items, device="gpu", precision="fast", options=EngineOptions(float16_min_scores=0))
    got = engine.search(users, 50)
    assert isinstance(got.indices, np.ndarray) and "numpy" not in made_by, made_by
    assert engine.stats["precision"] == "fast" and engine.stats["fast_sample"] == 128
    want = Engine(items, device="gpu").search(users, 50)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5, atol=1e-5)
    oracle.assert_topk_close(got.indices[:300], got.scores[:300], users[:300], items, 50)


@pytest.mark.gpu
def test_fast_declines_host_users_beyond_the_memory_budget(device):
    # GPU: host users more than the memory budget holds are not copied to the device at once; fast mode would make
    # their float16 copies on the host instead, so it declines to exact mode, which stages them block by block.
    if device != "gpu":
        pytest.skip("the host and the device are one on the CPU")
    users, items = clustered_data(40_000, 20_000, 64, seed=17)
    budget = 8 << 20
    assert users.nbytes > budget
    want = Engine(items, device="gpu", memory_budget=budget).search(users, 50)
    engine = Engine(items, device="gpu", precision="fast", memory_budget=budget)
    got = engine.search(users, 50)
    assert engine.stats["precision"] == "exact" and "host users" in engine.stats["fast_declined"], engine.stats
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.scores, want.scores)


def _planted(similar_norms: bool, n_decoys: int = 100):
    # One user direction (all ones, exact in float16). The planted item's components sit just below a float16
    # rounding midpoint: it rounds down by almost the whole error bound and its approximate score (8) falls below
    # the decoys (exact in float16: 8 + 2^-10), though its exact score (8 + 2^-8 - 2^-17) beats them all. Its row:
    # 100 + n_decoys.
    dim = 8
    users = np.ones((3, dim), np.float32)
    planted = np.full((1, dim), 1 + 2.0 ** -11 - 2.0 ** -20, np.float32)
    decoys = np.ones((n_decoys, dim), np.float32)
    decoys[:, 0] = 1 + 2.0 ** -10
    rng = np.random.default_rng(0)
    if similar_norms:  # fillers as long as the rest: no per-item bound columns, the bound goes through the maxima
        fillers = np.where(rng.random((200, dim)) < 0.5, 1.0, -1.0).astype(np.float32)
        fillers[:, 0] = -1.0
    else:  # short fillers: the norms spread, so every item carries its own bound in its score
        fillers = (rng.random((200, dim)) - 0.5).astype(np.float32)
    # The decoys' opposites last: the catalogue's mean stays near the origin, so that its rows are rounded about the
    # origin (certificate.prepare_items), as the planting assumes; about a centre near the decoys' the planted row
    # would stand out.
    return users, np.vstack([fillers[:100], decoys, planted, fillers[100:], -decoys])


@pytest.mark.parametrize("similar_norms, n_decoys", [(True, 100), (True, 300), (False, 100)])
def test_item_hidden_at_the_bounds_edge_is_found(device, similar_norms, n_decoys):
    from recall.engine import fast as fast_search

    users, items = _planted(similar_norms, n_decoys)
    engine = Engine(items, device=device, precision="fast", options=emulated())
    got = engine.search(users, 1)
    assert fast_search._state(engine).items.centre is None
    want = Engine(items, device=device).search(users, 1)
    oracle.assert_same_result(got, want)
    assert (as_numpy(got.indices) == 100 + n_decoys).all()  # the planted item's row
    m = first_margin(engine, 1)
    if similar_norms:
        # Its approximate score left it outside the candidates, and the bound knew it might be better than the
        # k-th: the certificate must fail. The first pass keeps 1 + m + 1 candidates, the widened one 1 + 4m + 1,
        # both fewer than the decoys; the second widened pass keeps 1 + 16m + 1 = 258: the planted item among 100
        # decoys, certified; behind 300, failed again, and the exact search finds it.
        hidden = n_decoys > 1 + 16 * m + 1
        assert engine.stats["widened_passes"] == [[4 * m, 3, 0], [16 * m, 3, 0 if hidden else 3]], engine.stats
        assert engine.stats["fallback_users"] == (3 if hidden else 0)
    else:
        # Its score carried its own error bound, which lifted it among the candidates: certified, no fallback.
        assert engine.stats["fallback_users"] == 0


def _dyadic(rng, n, dim, low, high, exp):
    return (rng.integers(low, high + 1, size=(n, dim)) * 2.0 ** exp).astype(np.float32)


_DYADIC = dict(seed=st.integers(0, 2**32 - 1), n_items=st.integers(30, 600), n_users=st.integers(1, 24),
               dim=st.integers(1, 24), k=st.integers(1, 60), metric=st.sampled_from(["ip", "l2"]),
               exp=st.integers(-20, 20), tie_range=st.sampled_from([1, 3, 100]), excluded=st.booleans())


def _fast_equals_exact_and_oracle(device, options, seed, n_items, n_users, dim, k, metric, exp, tie_range, excluded):
    """Small integers times a power of two: every float32 score is exact (in any order of summation) and so is the
    float64 oracle's, so fast mode on ``device``, exact mode and the oracle must agree bit for bit, ties to the lower
    row. Returns the fast engine."""
    rng = np.random.default_rng(seed)
    items = _dyadic(rng, n_items, dim, -tie_range, tie_range, exp)
    users = _dyadic(rng, n_users, dim, -tie_range, tie_range, exp)
    exclude = {u: rng.choice(n_items, int(rng.integers(0, n_items)), replace=False).tolist()
               for u in range(n_users) if rng.random() < 0.5} if excluded else None
    engine = Engine(items, metric=metric, device=device, precision="fast", options=options)
    got = engine.search(users, k, exclude=exclude)
    oracle.assert_same_result(got, Engine(items, metric=metric, device="cpu").search(users, k, exclude=exclude))
    idx, val = oracle.topk(users, items, k, metric, exclude)
    np.testing.assert_array_equal(as_numpy(got.indices), idx)
    np.testing.assert_array_equal(as_numpy(got.scores).astype(np.float64), val)
    return engine


@settings(max_examples=25, deadline=None)
@given(**_DYADIC)
def test_fast_equals_exact_and_the_oracle(seed, n_items, n_users, dim, k, metric, exp, tie_range, excluded):
    _fast_equals_exact_and_oracle("cpu", emulated(), seed, n_items, n_users, dim, k, metric, exp, tie_range, excluded)


@settings(max_examples=25, deadline=None)
@given(**_DYADIC)
def test_fast_with_float16_tiles_equals_exact_and_the_oracle(seed, n_items, n_users, dim, k, metric, exp, tie_range,
                                                            excluded):
    # The same with the GPU's float16 score tiles emulated (rows of 8 to 32 columns: the bias on both sides of
    # certificate._BIAS_WIDE).
    from recall.backends.numpy.backend import NumpyBackend

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NumpyBackend, "float16_tiles", True)
        _fast_equals_exact_and_oracle("cpu", emulated(), seed, n_items, n_users, dim, k, metric, exp, tie_range,
                                      excluded)


def _spy_fast_searches(monkeypatch):
    """Record the number of users of every fast-mode search of a set of users (sample, rest)."""
    from recall.engine import fast as fast_search

    calls = []
    real = fast_search._search_fast

    def spy(engine, users, k, excl, fast_users=None, ordered=False, margin=None, narrow=None):
        calls.append(int(users.shape[0]))
        if fast_users is not None:  # the sample's rows of every user's copies, or all of them
            assert fast_users.vecs16.shape[0] == users.shape[0]
        return real(engine, users, k, excl, fast_users, ordered, margin, narrow)

    monkeypatch.setattr(fast_search, "_search_fast", spy)
    return calls


def test_fast_declines_where_the_certificate_cannot_pay(device, monkeypatch):
    # Vectors of -1, 0, 1 in 6 dimensions: scores are integers in [-6, 6], so the k-th score ties with hundreds of
    # items left out and most certificates cannot hold (the second widened pass, 317 candidates of the 3,000,
    # holds some ties whole). k = 60: the certificate's margin of 16 on every backend (fast.NEED_MARGIN_MAX_K). The
    # sample (1/50 of the users) finds that out; the other users are searched in exact mode (every user: the sample
    # is a probe).
    calls = _spy_fast_searches(monkeypatch)
    users, items = ties_data(6400, 3000, 6, low=-1, high=1, seed=13)
    engine = Engine(items, device=device, precision="fast", options=emulated())
    got = engine.search(users, 60)
    oracle.assert_same_result(got, Engine(items, device=device).search(users, 60))
    stats = engine.stats
    assert stats["precision"] == "exact" and "fast_declined" in stats, stats
    assert stats["fast_sample"] == 128 and stats["sample_fallback_fraction"] > 0.1
    assert calls == [128]  # fast mode ran on the sample only


def test_fast_keeps_going_where_the_certificate_pays(device, monkeypatch):
    from recall.engine import fast as fast_search

    calls = _spy_fast_searches(monkeypatch)
    prepared = []
    real_prepare = fast_search._prepare
    monkeypatch.setattr(fast_search, "_prepare",
                        lambda engine, users, k, margin=None: prepared.append(int(users.shape[0]))
                        or real_prepare(engine, users, k, margin))
    users, items = normal_data(6400, 2000, 16, seed=14)
    exclude = {u: list(range(u % 7)) for u in range(0, 6400, 3)}
    engine = Engine(items, device=device, precision="fast", options=emulated())
    got = engine.search(users, 20, exclude=exclude)
    oracle.assert_topk_close(as_numpy(got.indices), as_numpy(got.scores), users, items, 20, exclude=exclude)
    want = Engine(items, device=device).search(users, 20, exclude=exclude)
    np.testing.assert_allclose(as_numpy(got.scores), as_numpy(want.scores), rtol=1e-5, atol=1e-5)
    stats = engine.stats
    assert stats["precision"] == "fast" and "fast_declined" not in stats, stats
    assert stats["fast_sample"] == 128 and stats["fallback_fraction"] < 0.01
    # The sample is a probe: then every user, the sampled ones too, in one pass (no users or exclusions cut apart).
    assert calls == [128, 6400]
    assert prepared == [6400]  # every user's float16 copy made once; the sample took its rows
    assert stats["probe"] == "sampled"
    # The next search of the same k skips the probe: the last one paid. Another k probes.
    prepared.clear()
    calls.clear()
    again = engine.search(users, 20, exclude=exclude)
    np.testing.assert_array_equal(as_numpy(again.indices), as_numpy(got.indices))
    assert calls == [6400] and prepared == [6400]
    assert engine.stats["probe"] == "skipped" and engine.stats["precision"] == "fast", engine.stats
    calls.clear()
    engine.search(users, 21, exclude=exclude)
    assert calls == [128, 6400] and engine.stats["probe"] == "sampled"
    # Above PREPARE_ALL_FIRST users the probe makes its own copies (a declined search would not use everyone's).
    prepared.clear()
    calls.clear()
    monkeypatch.setattr(fast_search, "PREPARE_ALL_FIRST", 6399)
    engine._fast.trusted.clear()
    again = engine.search(users, 20, exclude=exclude)
    np.testing.assert_array_equal(as_numpy(again.indices), as_numpy(got.indices))
    assert calls == [128, 6400] and prepared == [128, 6400]


def test_a_trusted_k_probes_again_once_a_search_does_not_pay(device, monkeypatch):
    # A search that skipped the probe (the last one of its k paid) and then fell back for most of its users hands
    # the next search back to the probe, which declines: a batch of tie-heavy users after continuous ones.
    calls = _spy_fast_searches(monkeypatch)
    # 0/1 vectors, integer scores: ties at the k-th place of most users (with -1..1 only a quarter of them fall back,
    # and the users the widened pass certified teach a wider first pass, at which fast mode still pays)
    ties, items = ties_data(6400, 3000, 12, low=0, high=1, seed=13)
    users = normal_data(6400, 10, 12, seed=17)[0]  # continuous scores against the same items
    engine = Engine(items, device=device, precision="fast", options=emulated())
    got = engine.search(users, 50)
    assert engine.stats["probe"] == "sampled" and engine.stats["precision"] == "fast", engine.stats
    oracle.assert_topk_close(as_numpy(got.indices)[::50], as_numpy(got.scores)[::50], users[::50], items, 50)
    calls.clear()
    got = engine.search(ties, 50)  # skips the probe; most certificates fail, those users are searched exactly
    oracle.assert_same_result(got, Engine(items, device=device).search(ties, 50))
    assert calls == [6400] and engine.stats["probe"] == "skipped", engine.stats
    from recall.engine import fast as fast_search

    from recall.backends.protocol import PASS_SHARE

    assert fast_search._cost(engine.stats, 6400, PASS_SHARE) > fast_search.DECLINE_COST, engine.stats
    calls.clear()
    engine.search(ties, 50)  # probes again, and declines
    assert calls == [128] and engine.stats["precision"] == "exact" and "fast_declined" in engine.stats


@pytest.mark.parametrize("precision", ["fast", "exact"])
def test_a_small_search_declines_where_the_last_one_of_its_k_did_not_pay(device, monkeypatch, precision):
    # 400 users are too few to sample (under 128 x 50): the first search of k = 50 on 0/1 vectors runs fast mode and
    # most of its users fall back; the next ones of that k search in exact mode at once, but for every
    # RECHECK_EVERY-th, which runs fast mode again. A recheck that pays (continuous users) forgets the debt; another
    # k, and an engine that never samples, keep running fast mode. Exact precision's certified route the same.
    from recall.backends.protocol import PASS_SHARE
    from recall.engine import fast as fast_search

    calls = _spy_fast_searches(monkeypatch)
    monkeypatch.setattr(fast_search, "RECHECK_EVERY", 3)
    monkeypatch.setattr(fast_search, "RECHECK_MOST", 6)
    ties, items = ties_data(400, 3000, 12, low=0, high=1, seed=13)
    users = normal_data(400, 10, 12, seed=17)[0]
    # (fused="force": the GPU's route stands in for the fused float32 search, which 400 users would not take)
    options = emulated() if precision == "fast" else EngineOptions(certified_exact="on", fused="force")
    engine = Engine(items, device=device, precision=precision, options=options)
    want = Engine(items, device=device).search(ties, 50)
    declined_key = "fast_declined" if precision == "fast" else "certified_declined"

    got = engine.search(ties, 50)
    oracle.assert_same_result(got, want)
    assert calls == [400] and fast_search._cost(engine.stats, 400, PASS_SHARE) > fast_search.DECLINE_COST, (
        engine.stats)
    for _ in range(2):  # declined: the last search of k = 50 did not pay
        calls.clear()
        got = engine.search(ties, 50)
        oracle.assert_same_result(got, want)
        assert calls == [] and engine.stats["precision"] == "exact", engine.stats
        assert "did not pay" in engine.stats[declined_key] and "400 users" in engine.stats[declined_key]
    calls.clear()
    other = engine.search(ties, 49)  # another k: no debt
    oracle.assert_same_result(other, Engine(items, device=device).search(ties, 49))
    assert calls == [400], engine.stats
    # The third search of k = 50 since: fast mode again. On ties it does not pay either: the next recheck comes after
    # twice as many (6), and each after that after RECHECK_MOST (6).
    for _ in range(3):
        calls.clear()
        got = engine.search(ties, 50)
        oracle.assert_same_result(got, want)
        assert calls == [400] and declined_key not in engine.stats, engine.stats
        for left in range(4, -1, -1):
            engine.search(ties, 50)
            assert calls == [400] and f"after {left} more" in engine.stats[declined_key], engine.stats
    calls.clear()
    got = engine.search(users, 50)  # a recheck, on continuous users: it pays, and the debt is forgotten
    oracle.assert_topk_close(as_numpy(got.indices), as_numpy(got.scores), users, items, 50)
    assert calls == [400] and declined_key not in engine.stats, engine.stats
    calls.clear()
    engine.search(users, 50)
    assert calls == [400] and declined_key not in engine.stats, engine.stats

    never = Engine(items, device=device, precision=precision, options=(
        emulated(fast_sample=0) if precision == "fast" else EngineOptions(certified_exact="on", fused="force",
                                                                          fast_sample=0)))
    calls.clear()
    never.search(ties, 50)
    never.search(ties, 50)
    assert calls == [400, 400], never.stats


@settings(max_examples=12, deadline=None)
@given(searches=st.lists(st.tuples(st.booleans(), st.sampled_from([20, 50]), st.integers(1, 300)), min_size=2,
                         max_size=7), recheck=st.integers(1, 3))
def test_the_small_search_memory_never_changes_an_answer(monkeypatch, searches, recheck):
    # Exact precision's certified route on one engine through any run of small searches, tie-heavy or continuous,
    # at two k, declined or not: every answer is exact mode's, bit for bit.
    from recall.engine import fast as fast_search

    monkeypatch.setattr(fast_search, "RECHECK_EVERY", recheck)
    monkeypatch.setattr(fast_search, "RECHECK_MOST", 2 * recheck)
    ties, items = ties_data(300, 3000, 12, low=0, high=1, seed=13)
    users = normal_data(300, 10, 12, seed=4)[0]
    engine = Engine(items, device="cpu", options=EngineOptions(certified_exact="on"))
    exact = Engine(items, device="cpu")
    routes = set()
    for tie, k, n in searches:
        q = (ties if tie else users)[:n]
        oracle.assert_same_result(engine.search(q, k), exact.search(q, k))
        routes.add(engine.stats["route"])
    assert routes <= {"certified", "float32"}, routes


def _assert_plateau_exact(res, users, items, k):
    # Against the float64 oracle to a millionth of |u|·|v|: a tenth of the plateau's spacing, so that a wrong item
    # fails while a swap of two scores a float32 rounding apart (fast mode's sums are in its own order) passes.
    oracle.assert_topk_close(as_numpy(res.indices), as_numpy(res.scores), users, items, k, rtol=1e-6)


def test_a_k_whose_users_were_widened_starts_wider(device):
    # k = 20: m = 16 (11 where passes start at the need: the GPU's), a first pass of 37 (32) candidates inside the
    # plateau of 60 fails for every user, the widened pass of 85 (65) certifies every one. The next search of k = 20
    # starts there (one float16 pass); another k does not.
    users, items = plateau_data(600, seed=31)
    engine = Engine(items, device=device, precision="fast", options=emulated())
    _assert_plateau_exact(engine.search(users, 20), users, items, 20)
    m = first_margin(engine, 20)
    assert engine.stats["first_margin"] == m and engine.stats["widened_users"] == 600, engine.stats
    assert engine.stats["fallback_users"] == 0 and engine._fast.margins == {20: 4 * m}
    _assert_plateau_exact(engine.search(users, 20), users, items, 20)
    stats = engine.stats
    assert stats["first_margin"] == 4 * m and stats["candidates"] == 20 + 4 * m + 1, stats
    assert stats["widened_users"] == 0 and stats["fallback_users"] == 0, stats
    engine.search(users, 21)  # another k starts at its own first margin (and learns its own)
    assert engine.stats["first_margin"] == first_margin(engine, 21) and engine.stats["widened_users"] == 600, (
        engine.stats)
    # Users whose scores are spread out again: a search that starts wider keeps its margin (only a search at the
    # first margin, a sample's probe among them, finds out afresh).
    spread = normal_data(600, 10, 16, seed=32)[0]
    engine.search(spread, 20)
    assert engine.stats["first_margin"] == 4 * m and engine._fast.margins[20] == 4 * m


def test_a_second_widened_pass_certifies_and_is_learned(device):
    # A plateau of 150 items: the first pass (37 candidates; 32 on the GPU) and the widened one (85; 65) fail for
    # every user, the second widened pass (20 + 16m + 1 = 277; 197) certifies every one; the next search of k = 20
    # starts there.
    users, items = plateau_data(600, seed=35, plateau=150)
    engine = Engine(items, device=device, precision="fast", options=emulated())
    _assert_plateau_exact(engine.search(users, 20), users, items, 20)
    m = first_margin(engine, 20)
    stats = engine.stats
    assert stats["widened_passes"] == [[4 * m, 600, 0], [16 * m, 600, 600]], stats
    assert stats["widened_users"] == 600 and stats["fallback_users"] == 0 and engine._fast.margins == {20: 16 * m}
    _assert_plateau_exact(engine.search(users, 20), users, items, 20)
    stats = engine.stats
    assert stats["first_margin"] == 16 * m and stats["widened_users"] == 0 and stats["widened_passes"] == [], stats


def test_a_second_widened_pass_stays_within_the_candidate_share():
    from types import SimpleNamespace

    from recall.engine import fast as fast_search

    m = fast.margin(100)  # 25: the second widened pass keeps 100 + 400 + 1 = 501 candidates
    engine = SimpleNamespace(n_items=100_000, _fast=SimpleNamespace(margins={}))
    assert not fast_search._within_share(engine, 100 + 16 * m + 1)  # 0.501% of 100,000
    engine.n_items = 100_200
    assert fast_search._within_share(engine, 100 + 16 * m + 1)
    stats = {"first_margin": m, "widened_users": 600, "fallback_users": 0,
             "widened_passes": [[4 * m, 600, 10], [16 * m, 590, 590]]}
    assert fast_search._learned_pass(engine, 100, stats, 600) == 1
    fast_search._learn_margin(engine, 100, stats, 600)
    assert engine._fast.margins == {100: 16 * m}
    engine.n_items = 100_000
    assert fast_search._learned_pass(engine, 100, stats, 600) is None


def test_no_second_widened_pass_beyond_the_candidate_share(monkeypatch):
    # The plateau of 150 against 65,536 items, with the share limit lowered to 0.4% (262 candidates): the second
    # widened pass (277) would pass it, so the users the widened pass left go to exact mode, and nothing is learned.
    from recall.engine import fast as fast_search

    monkeypatch.setattr(fast_search, "MIN_SCORES", 0)
    monkeypatch.setattr(fast_search, "MAX_CANDIDATE_SHARE_TILES16", 0.004)
    users, items = plateau_data(200, seed=35, n_items=65_536, plateau=150)
    engine = Engine(items, device="cpu", precision="fast", options=emulated())
    _assert_plateau_exact(engine.search(users, 20), users, items, 20)
    m = fast.margin(20)
    stats = engine.stats
    assert stats["widened_passes"] == [[4 * m, 200, 0]] and stats["fallback_users"] == 200, stats
    assert engine._fast.margins == {}


def test_the_probe_sets_the_first_margin_of_the_whole_search(device, monkeypatch):
    # 6,400 users: a sample of 128 probes at the first margin, every one of its users widened and certified; the
    # whole search then starts wider, and so does the next (the probe skipped: the last search paid).
    calls = _spy_fast_searches(monkeypatch)
    users, items = plateau_data(6400, seed=33)
    engine = Engine(items, device=device, precision="fast", options=emulated())
    # The fast pass modelled at a quarter of an exact search (as where both searches are GEMMs): the probe's 128
    # widened users cost a modelled 0.5 and fast mode runs. At the fused kernels' 0.5 it declines (1.0).
    monkeypatch.setattr(engine.backend, "float16_pass_share", lambda *args: 0.25)
    got = engine.search(users, 20)
    _assert_plateau_exact(got, users, items, 20)
    m = first_margin(engine, 20)
    stats = engine.stats
    assert calls == [128, 6400] and stats["probe"] == "sampled" and stats["precision"] == "fast", stats
    assert stats["first_margin"] == 4 * m and stats["widened_users"] == 0, stats
    calls.clear()
    again = engine.search(users, 20)
    np.testing.assert_array_equal(as_numpy(again.indices), as_numpy(got.indices))
    assert calls == [6400] and engine.stats["probe"] == "skipped" and engine.stats["first_margin"] == 4 * m


@pytest.mark.parametrize("widened, fell_back, n_items, learned", [
    (600, 0, 3000, True),  # every user certified by the widened pass
    (600, 400, 3000, False),  # widened, but most fell back: the wider pass would not have paid either
    (200, 0, 3000, False),  # a third widened: two passes for a third cost less than a wider pass for all
    (600, 0, 1_000_000, True),  # 85 candidates: 0.0085% of the items
    (600, 0, 65_536, True),  # 0.13%, within MAX_CANDIDATE_SHARE_TILES16's 0.5%
    (600, 0, 16_000, True),  # under SHARE_MIN_ITEMS: the share models do not act
])
@pytest.mark.parametrize("at_need", [False, True])
def test_learned_margin_rule(widened, fell_back, n_items, learned, at_need):
    from types import SimpleNamespace

    from recall.engine import fast as fast_search

    # A backend that keeps the certificate's margin at every k (the CPU's), or one that starts its passes at the need
    # (the GPU's): there the first margin at k = 20 is 11, and a search that started at it forgets a learned one.
    engine = margin_engine(at_need, n_items=n_items, _fast=SimpleNamespace(margins={}))
    m = first_margin(engine, 20)
    assert m == (11 if at_need else fast.margin(20))
    engine._fast.margins = {20: 4 * m}
    stats = {"first_margin": m, "widened_users": widened, "fallback_users": fell_back,
             "widened_passes": [[4 * m, widened, widened - fell_back]]}
    fast_search._learn_margin(engine, 20, stats, 600)
    assert engine._fast.margins == ({20: 4 * m} if learned else {})
    # A search that started wider leaves it as it is.
    engine._fast.margins = {20: 4 * m}
    fast_search._learn_margin(engine, 20, {**stats, "first_margin": 4 * m, "widened_users": 0, "widened_passes": []},
                              600)
    assert engine._fast.margins == {20: 4 * m}


def test_learned_margin_stays_within_the_candidate_share(monkeypatch):
    from types import SimpleNamespace

    from recall.engine import fast as fast_search

    m = fast.margin(1000)  # 250: a wider first pass of 2,001 candidates
    engine = SimpleNamespace(n_items=200_000, _fast=SimpleNamespace(margins={}))
    stats = {"first_margin": m, "widened_users": 600, "fallback_users": 0, "widened_passes": [[4 * m, 600, 600]]}
    fast_search._learn_margin(engine, 1000, stats, 600)  # 1.0% of the items, above 0.5%
    assert engine._fast.margins == {}
    engine.n_items = 400_200  # 0.49996%
    fast_search._learn_margin(engine, 1000, stats, 600)
    assert engine._fast.margins == {1000: 4 * m}


def test_the_samples_float16_copies_are_rows_of_everyones():
    # The probe takes its users' rows of every user's prepared copy (FastUsers.take) instead of preparing them
    # again: right only if each user is prepared on its own, whatever the other users are (scales, shifts, bounds).
    from recall.core import certificate, metrics
    from recall.engine import fast as fast_search

    rng = np.random.default_rng(21)
    users, items = normal_data(3000, 500, 24, seed=21)
    users = users * np.exp(rng.normal(0, 2, (3000, 1))).astype(np.float32)  # norms over many binades
    engine = Engine(items, metric="l2", device="cpu", precision="fast", options=emulated())
    prepared = metrics.prepare_users("l2", np, users)
    state = fast_search._state(engine)
    shift = rng.normal(0, 50, 3000)
    rows = np.arange(7, 3000, 37)
    for half in (False, True):
        every = certificate.prepare_users(np, prepared, state.items, half_scores=half, shift=shift)
        alone = certificate.prepare_users(np, prepared[rows], state.items, half_scores=half, shift=shift[rows])
        taken = every.take(rows)
        for name in ("vecs16", "alpha", "offset", "bound"):
            np.testing.assert_array_equal(getattr(taken, name), getattr(alone, name), err_msg=name)
        assert taken.half_scores == alone.half_scores == half


def test_fast_sample_option(monkeypatch):
    calls = _spy_fast_searches(monkeypatch)
    users, items = ties_data(6400, 500, 6, low=-1, high=1, seed=15)
    engine = Engine(items, device="cpu", precision="fast", options=emulated(fast_sample=0))
    got = engine.search(users, 10)
    oracle.assert_same_result(got, Engine(items, device="cpu").search(users, 10))
    assert engine.stats["precision"] == "fast" and "fast_sample" not in engine.stats
    assert calls == [6400]
    with pytest.raises(InputError, match="fast_sample"):
        EngineOptions(fast_sample=-1)


def test_declines_where_it_would_rescore_too_large_a_share_of_the_items(device: str, monkeypatch) -> None:
    # k + m + 1 candidates per user above MAX_CANDIDATE_SHARE of a large catalogue: exact mode for everyone, said so.
    from recall.engine import fast as fast_mode

    monkeypatch.setattr(fast_mode, "MIN_SCORES", 0)  # a search this small would decline for its size first
    rng = np.random.default_rng(11)
    n_items = fast_mode.SHARE_MIN_ITEMS + 1000
    items = rng.standard_normal((n_items, 4)).astype(np.float32)
    users = rng.standard_normal((40, 4)).astype(np.float32)
    exact = Engine(items, device=device)
    engine = Engine(items, device=device, precision="fast", options=emulated())
    share = fast_mode.MAX_CANDIDATE_SHARE * n_items
    big = next(k for k in range(1, 10_000) if k + fast.margin(k) + 1 > share)
    res = engine.search(users, big)
    assert engine.stats["precision"] == "exact" and "re-scored" in engine.stats["fast_declined"]
    oracle.assert_same_result(exact.search(users, big), res)
    engine.search(users, 10)
    assert engine.stats["precision"] == "fast" and "fast_declined" not in engine.stats


def test_the_share_limit_acts_on_a_small_catalogue_searched_by_many_users(device: str, monkeypatch) -> None:
    # Under SHARE_MIN_ITEMS items the share limit acts only on a search of at least the measured size rule's scores
    # (SMALL_CATALOGUE_MIN_SCORES at 4 dimensions, whatever float16_min_scores says; one score fewer: fast mode
    # runs, as the tests' small searches do), and only MAX_CANDIDATE_SHARE's (this GPU pass keeps float16 tiles:
    # fewer users than a fused kernel's tile).
    from recall.engine import fast as fast_mode

    rng = np.random.default_rng(15)
    n_items, n_users = 2000, 40
    assert n_items < fast_mode.SHARE_MIN_ITEMS
    items = rng.standard_normal((n_items, 4)).astype(np.float32)
    users = rng.standard_normal((n_users, 4)).astype(np.float32)
    big = next(k for k in range(1, 1000) if k + fast.margin(k) + 1 > fast_mode.MAX_CANDIDATE_SHARE * n_items)
    engine = Engine(items, device=device, precision="fast", options=emulated())
    monkeypatch.setattr(fast_mode, "SMALL_CATALOGUE_MIN_SCORES", n_users * n_items)
    res = engine.search(users, big)
    assert engine.stats["precision"] == "exact" and "re-scored" in engine.stats["fast_declined"], engine.stats
    oracle.assert_same_result(Engine(items, device=device).search(users, big), res)
    engine.search(users, big - 1)  # the largest k within the share
    assert engine.stats["precision"] == "fast" and "fast_declined" not in engine.stats, engine.stats
    monkeypatch.setattr(fast_mode, "SMALL_CATALOGUE_MIN_SCORES", n_users * n_items + 1)
    res = engine.search(users, big)
    assert engine.stats["precision"] == "fast" and "fast_declined" not in engine.stats, engine.stats
    oracle.assert_topk_close(res.indices, res.scores, users, items, big, "ip")
    # The rule's limit at 128 dimensions is half of it: the share limit acts from there.
    wide = Engine(rng.standard_normal((n_items, 128)).astype(np.float32), device=device, precision="fast",
                  options=emulated())
    monkeypatch.setattr(fast_mode, "SMALL_CATALOGUE_MIN_SCORES", 2 * n_users * n_items)
    wide.search(rng.standard_normal((n_users, 128)).astype(np.float32), big)
    assert wide.stats["precision"] == "exact" and "re-scored" in wide.stats["fast_declined"], wide.stats


@pytest.mark.parametrize("tiles", ["float16", "float32"])
def test_the_share_limit_is_lower_where_the_pass_keeps_float16_tiles(monkeypatch, tiles) -> None:
    # Between MAX_CANDIDATE_SHARE_TILES16 and MAX_CANDIDATE_SHARE of the items: declined where the backend says the
    # float16 pass keeps float16 score tiles (cuBLAS + filter), run where it compares float32 sums (a fused kernel).
    from recall.backends.numpy.backend import NumpyBackend
    from recall.engine import fast as fast_mode

    monkeypatch.setattr(fast_mode, "MIN_SCORES", 0)
    monkeypatch.setattr(NumpyBackend, "pass_score_dtype", lambda self, *a, **kw: np.dtype(tiles))
    rng = np.random.default_rng(13)
    n_items = fast_mode.SHARE_MIN_ITEMS + 1000
    items = rng.standard_normal((n_items, 4)).astype(np.float32)
    users = rng.standard_normal((40, 4)).astype(np.float32)
    low, high = fast_mode.MAX_CANDIDATE_SHARE_TILES16 * n_items, fast_mode.MAX_CANDIDATE_SHARE * n_items
    k = next(k for k in range(1, 10_000) if k + fast.margin(k) + 1 > low)
    assert k + fast.margin(k) + 1 <= high
    engine = Engine(items, device="cpu", precision="fast", options=emulated())
    res = engine.search(users, k)
    if tiles == "float16":
        assert engine.stats["precision"] == "exact" and "above 0.5%" in engine.stats["fast_declined"]
        oracle.assert_same_result(Engine(items, device="cpu").search(users, k), res)
    else:
        assert engine.stats["precision"] == "fast" and "fast_declined" not in engine.stats
        oracle.assert_topk_close(res.indices, res.scores, users, items, k, "ip")


@pytest.mark.parametrize("n_items, runs, declines", [
    # Above LARGE_K the re-scoring keeps twice the keys a user (the GPU's), and the route pays only within
    # MAX_CANDIDATE_SHARE_LARGE_K; beyond ONE_CHUNK_WIDE candidates (two chunks: one block an SM) within
    # MAX_CANDIDATE_SHARE_TWO_CHUNKS.
    (100_000, 2048, 2049),  # 2.56% of the items: within 3%, above 2%
    (400_000, 3276, 3277),  # 4,096 and 4,097 candidates, 1.02% of the items: within 2%, above 0.6%
])
def test_the_share_limit_is_lower_above_large_k(monkeypatch, n_items, runs, declines) -> None:
    from recall.engine import fast as fast_mode

    monkeypatch.setattr(fast_mode, "MIN_SCORES", 0)
    def wide(k):
        return k + fast.margin(k) + 1

    assert wide(runs) <= fast_mode._share_limit(runs, wide(runs)) * n_items
    limit = fast_mode._share_limit(declines, wide(declines))
    assert limit * n_items < wide(declines) <= fast_mode.MAX_CANDIDATE_SHARE * n_items
    rng = np.random.default_rng(14)
    items = rng.standard_normal((n_items, 4)).astype(np.float32)
    users = rng.standard_normal((8, 4)).astype(np.float32)
    engine = Engine(items, device="cpu", precision="fast", options=emulated())
    engine.search(users, runs)
    assert engine.stats["precision"] == "fast" and "fast_declined" not in engine.stats
    res = engine.search(users, declines)
    assert engine.stats["precision"] == "exact" and "re-scored" in engine.stats["fast_declined"]
    oracle.assert_same_result(Engine(items, device="cpu").search(users, declines), res)


@pytest.mark.parametrize("large", [True, False])
def test_declines_a_search_under_the_scores_a_float16_pass_pays_for(device: str, large: bool, monkeypatch) -> None:
    # Fewer user x item scores than fast.min_scores (MIN_SCORES on a catalogue of at least SHARE_MIN_ITEMS,
    # SMALL_CATALOGUE_MIN_SCORES on a smaller one): exact mode, said so; the same search at the limit runs fast mode;
    # the limit of the other size of catalogue does not act; EngineOptions.float16_min_scores replaces the rule.
    from recall.engine import fast as fast_mode

    rng = np.random.default_rng(12)
    n_items = fast_mode.SHARE_MIN_ITEMS + 100 if large else 1000
    own, other = ("MIN_SCORES", "SMALL_CATALOGUE_MIN_SCORES") if large else ("SMALL_CATALOGUE_MIN_SCORES", "MIN_SCORES")
    items = rng.standard_normal((n_items, 8)).astype(np.float32)
    users = rng.standard_normal((30, 8)).astype(np.float32)
    engine = Engine(items, device=device, precision="fast", options=emulated(float16_min_scores=None))
    res = engine.search(users, 10)
    assert engine.stats["precision"] == "exact" and "under" in engine.stats["fast_declined"], engine.stats
    oracle.assert_same_result(Engine(items, device=device).search(users, 10), res)
    monkeypatch.setattr(fast_mode, own, 30 * n_items + 1)
    monkeypatch.setattr(fast_mode, other, 0)
    engine.search(users, 10)
    assert engine.stats["precision"] == "exact"  # one score under
    monkeypatch.setattr(fast_mode, own, 30 * n_items)
    monkeypatch.setattr(fast_mode, other, 1 << 40)
    res = engine.search(users, 10)
    assert engine.stats["precision"] == "fast" and "fast_declined" not in engine.stats
    oracle.assert_same_result(Engine(items, device=device).search(users, 10), res)
    monkeypatch.setattr(fast_mode, own, 1 << 40)
    asked = Engine(items, device=device, precision="fast", options=emulated(float16_min_scores=30 * n_items))
    asked.search(users, 10)
    assert asked.stats["precision"] == "fast"
    asked.search(users[:29], 10)
    assert asked.stats["precision"] == "exact" and "under" in asked.stats["fast_declined"]
    for bad in (-1, 2.5, "many", True):
        with pytest.raises(InputError, match="float16_min_scores"):
            EngineOptions(float16_min_scores=bad)


def test_cpu_fast_mode_searches_in_exact_precision_unless_emulation_is_asked(caplog):
    # The CPU has no float16 arithmetic faster than its float32 search: fast precision there searches in exact
    # precision (the answer fast mode certifies, at exact mode's speed) and says why in its stats, for a plain
    # search, an asynchronous one and a filtered one alike; EngineOptions.fast_emulation runs the emulation.
    users, items = normal_data(300, 2000, 8, seed=21)
    exact = Engine(items, device="cpu")
    with caplog.at_level("WARNING", logger="recall"):
        engine = Engine(items, device="cpu", precision="fast")
    assert not caplog.records
    want = exact.search(users, 7)
    for search in (engine.search, lambda *args: engine.search_async(*args).result()):
        engine.stats = {}
        got = search(users, 7)
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.scores, want.scores)
        stats = engine.stats
        assert stats["precision"] == "exact" and stats["fallback_users"] == 0, stats
        assert "no faster than its float32 search" in stats["fast_declined"] and "fast_sample" not in stats, stats
    allow = np.arange(0, 2000, 3)
    got = engine.search(users, 7, allow=allow)
    want = exact.search(users, 7, allow=allow)
    np.testing.assert_array_equal(got.indices, want.indices)
    assert engine.stats["precision"] == "exact" and "fast_declined" in engine.stats, engine.stats
    emulating = Engine(items, device="cpu", precision="fast", options=emulated())
    got = emulating.search(users, 7)
    assert emulating.stats["precision"] == "fast" and "fast_declined" not in emulating.stats, emulating.stats
    oracle.assert_topk_close(got.indices, got.scores, users, items, 7)


# The GPU's fused float16 kernel (tensor cores, scores kept in float32 in its registers) on each data kind: forced on
# these small catalogues (which would take the cuBLAS path with float16 score tiles), in segments of 1,024 items so
# that thresholds rise between launches. The answer is exact mode's; the certificate reads float32 scores.
FUSED_H = EngineOptions(fused="force", fused_segment=1024, tiles=(256, 1024, 2), float16_min_scores=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fast_fused_kernel_on_each_data_kind(gpu_available, kind):
    if not gpu_available:
        pytest.skip("no usable GPU")
    make, metric = KINDS[kind]
    users, items = make()
    engine = Engine(items, metric=metric, device="gpu", precision="fast", options=FUSED_H)
    got = engine.search(users, 50)
    # d = 256 (264 float16 columns) is wider than the kernel takes (FUSED_H_MAX_WIDTH): cuBLAS and float16 tiles.
    fused = kind != "d256"
    assert engine.stats["fused"] == fused, engine.stats
    assert engine.stats["score_dtype"] == ("float32" if fused else "float16"), engine.stats
    want = Engine(items, metric=metric, device="cpu").search(users, 50)
    if kind == "ties":
        oracle.assert_same_result(got, want)
        return
    oracle.assert_topk_close(as_numpy(got.indices), as_numpy(got.scores), users, items, 50, metric)
    np.testing.assert_allclose(as_numpy(got.scores), want.scores, rtol=1e-5, atol=1e-5)
    assert engine.stats["fallback_fraction"] < 0.01, engine.stats


@pytest.mark.gpu
@settings(max_examples=15, deadline=None)
@given(**_DYADIC)
def test_fused_kernel_equals_exact_and_the_oracle(seed, n_items, n_users, dim, k, metric, exp, tie_range, excluded):
    # The same on the GPU's fused float16 kernel: the tensor cores' sums of exact products are exact too.
    engine = _fast_equals_exact_and_oracle("gpu", FUSED_H, seed, n_items, n_users, dim, k, metric, exp, tie_range,
                                           excluded)
    assert engine.stats["fused"], engine.stats


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_fast_fused_kernel_equals_exact_on_integer_data(gpu_available, metric):
    if not gpu_available:
        pytest.skip("no usable GPU")
    rng = np.random.default_rng(30)
    items, users = _ints(rng, 5000, 12), _ints(rng, 400, 12)
    excl = {u: rng.choice(5000, 60, replace=False).tolist() for u in range(0, 400, 3)}
    excl[7] = list(range(5000))
    engine = Engine(items, metric=metric, device="gpu", precision="fast", options=FUSED_H)
    got = engine.search(users, 40, exclude=excl)
    assert engine.stats["fused"] and engine.stats["precision"] == "fast"
    oracle.assert_same_result(got, Engine(items, metric=metric, device="cpu").search(users, 40, exclude=excl))


@pytest.mark.gpu
@pytest.mark.parametrize("similar_norms", [True, False])
def test_fused_kernel_finds_the_item_hidden_at_the_bounds_edge(gpu_available, similar_norms):
    if not gpu_available:
        pytest.skip("no usable GPU")
    users, items = _planted(similar_norms)
    engine = Engine(items, device="gpu", precision="fast", options=FUSED_H)
    got = engine.search(users, 1)
    assert engine.stats["fused"]
    oracle.assert_same_result(got, Engine(items, device="cpu").search(users, 1))
    assert (as_numpy(got.indices) == 200).all()


@pytest.mark.gpu
def test_fast_on_a_seeded_catalogue_takes_the_fused_kernel(gpu_available, monkeypatch):
    # The default options on a catalogue large enough to seed (8 x 8,192 items): the fused kernel, float32 scores.
    if not gpu_available:
        pytest.skip("no usable GPU")
    from recall.engine import fast as fast_mode

    monkeypatch.setattr(fast_mode, "MIN_SCORES", 0)  # 3,000 x 70,000 scores would decline for their number
    users, items = _lognormal(3000, 70000, 48, seed=31)
    engine = Engine(items, device="gpu", precision="fast")
    excl = {0: list(range(0, 70000, 2))}
    got = engine.search(users, 100, exclude=excl)
    assert engine.stats["fused"] and engine.stats["seed_sample"] > 0 and engine.stats["score_dtype"] == "float32"
    assert engine.stats["precision"] == "fast" and engine.stats["fallback_fraction"] < 0.01, engine.stats
    sample = np.arange(0, 3000, 10)  # user 0 first: its exclusions stay row 0's
    oracle.assert_topk_close(as_numpy(got.indices)[sample], as_numpy(got.scores)[sample], users[sample], items, 100,
                             exclude=excl)


@pytest.mark.gpu
@pytest.mark.parametrize("data,multiplied", [("normal", 64), ("lognormal", 80)])
def test_fast_fused_kernel_multiplies_the_dot_part_where_users_hold_nothing_else(gpu_available, monkeypatch, data,
                                                                                 multiplied):
    # Where the fused kernel keeps float32 scores and the items carry no bias or bound columns (norms that do not
    # spread), the users are not shifted and their rows end with the dot part: d = 64 multiplies 64 columns of the
    # 72, not 80. Items whose norms spread carry bound columns, which the users' factors multiply.
    if not gpu_available:
        pytest.skip("no usable GPU")
    from recall.engine import fast as fast_mode

    monkeypatch.setattr(fast_mode, "MIN_SCORES", 0)
    users, items = (normal_data if data == "normal" else _lognormal)(3000, 70000, 64, seed=32)
    engine = Engine(items, device="gpu", precision="fast")
    device_users = engine.backend.xp.asarray(users)  # host users are multiplied whole (pipeline.py)
    prepared = fast_mode._prepare(engine, device_users, 100)
    state = fast_mode._state(engine)
    # Float32 scores: never shifted (the shift column stays 0); the bound columns' factors where the norms spread.
    assert not prepared.half_scores
    assert (as_numpy(prepared.vecs16[:, state.items.shift_at]) == 0).all()
    assert (state.items.norms_at is None) == (data == "normal")
    got = engine.search(device_users, 100)
    assert engine.stats["fused"] and engine.stats["multiplied_columns"] == multiplied, engine.stats
    assert engine.stats["precision"] == "fast" and engine.stats["fallback_fraction"] < 0.01, engine.stats
    sample = np.arange(0, 3000, 10)
    oracle.assert_topk_close(as_numpy(got.indices)[sample], as_numpy(got.scores)[sample], users[sample], items, 100)


def test_users_are_shifted_only_where_score_tiles_are_float16(monkeypatch):
    # The CPU keeps float32 scores: no shift, the shift column stays 0 (the fused kernel's case). A pass that would
    # keep float16 tiles (Backend.pass_score_dtype) gets every user shifted.
    from recall.backends.numpy.backend import NumpyBackend
    from recall.engine import fast as fast_mode

    users, items = normal_data(200, 3000, 32, seed=33)
    asked = []
    for tiles16 in (False, True):
        if tiles16:
            monkeypatch.setattr(NumpyBackend, "pass_score_dtype", lambda self, plan, n_users, n_items, k, width, dtype,
                                options: asked.append((n_users, k, width)) or np.dtype(np.float16))
        engine = Engine(items, device="cpu", precision="fast", options=emulated())
        prepared = fast_mode._prepare(engine, users, 10)
        state = fast_mode._state(engine)
        assert prepared.half_scores == tiles16
        assert (prepared.vecs16[:, state.items.shift_at] != 0).any() == tiles16
    # Asked for the first pass's users and candidates (k + m + 1), with the columns the users hold without a shift:
    # the dot part alone.
    assert asked == [(200, 10 + fast.margin(10) + 1, 32)]
    # Items whose norms spread carry bound columns after the shift's, whose factors users hold: float32 scores, not
    # shifted all the same. Items exact in float16 (small integers, norms spread by powers of two) leave no residual:
    # no user holds a factor.
    monkeypatch.undo()
    rng = np.random.default_rng(35)
    exact16 = (rng.integers(-100, 101, (3000, 32)) * 2.0 ** rng.integers(-3, 4, (3000, 1))).astype(np.float32)
    for items, held in ((_lognormal(200, 3000, 32, seed=34)[1], True), (exact16, False)):
        engine = Engine(items, device="cpu", precision="fast", options=emulated())
        prepared = fast_mode._prepare(engine, users, 10)
        state = fast_mode._state(engine)
        assert state.items.norms_at is not None and not prepared.half_scores
        assert not (prepared.vecs16[:, state.items.shift_at] != 0).any()
        assert (prepared.vecs16[:, state.items.norms_at:] != 0).any() == held


def _half_plateau(n_users, seed, plateau=130):
    """plateau_data's items; every other user near the plateau's direction (its k = 110 needs more than 128
    candidates to certify: the plateau's 130 lie closer together than the bound), the others spread out (those of
    them that score the plateau's direction high need more than 128 too)."""
    users, items = plateau_data(n_users, seed=seed, plateau=plateau)
    spread = normal_data(n_users, 1, 16, seed=seed + 1)[0]
    users[1::2] = spread[1::2]
    return users, items


@pytest.mark.parametrize("k, n_items, narrow", [
    (1000, 1_000_000, 23),  # 1,251 candidates need 2,048 slots; 1,024 hold k + 24
    (900, 1_000_000, 123),
    (110, 3000, 17),  # 138 -> 128
    (100, 1_000_000, None),  # 126 candidates, within 128 already
    (2048, 1_000_000, 64),  # 2,561: the least margin's 2,065 need 4,096 too, so NARROW_FLAT
    (300, 1_000_000, None),  # 376 candidates within 512 like 317, and a margin of 75 too near NARROW_FLAT to pay
    (512, 1_000_000, 64),  # 641 -> 577 candidates (1,024 slots either way)
    (10, 1_000_000, None),  # the least margin is the default
    (1000, 1024, None),  # 1,024 candidates would be the whole catalogue
    (2048, 2113, None),  # 2,113 too
    (2048, 2114, 64),
])
def test_narrow_margin(k, n_items, narrow):
    from recall.engine import fast as fast_search

    assert fast_search._narrow_margin(k, n_items) == narrow


@settings(max_examples=300, deadline=None)
@given(k=st.integers(1, 20_000), n_items=st.integers(1, 2_000_000))
def test_a_narrowed_margin_is_narrower_and_leaves_items_out(k, n_items):
    from recall.engine import fast as fast_search

    narrow = fast_search._narrow_margin(k, n_items)
    if narrow is None:
        return
    assert 16 <= narrow < fast.margin(k) and k + narrow + 1 < n_items
    # Within a smaller power of two than the default's candidates, or NARROW_FLAT where that is half the default.
    fits = 1 << (k + narrow).bit_length() < 1 << (k + fast.margin(k)).bit_length()
    assert fits or (narrow == fast_search.NARROW_FLAT and fast.margin(k) >= 2 * narrow)


@pytest.mark.parametrize("ordered", [False, True])
def test_narrow_certified_counts_what_the_narrower_pass_certifies(device, ordered):
    # The first pass's count of the users a narrower pass would certify, against that narrower pass run: users near
    # the plateau's direction need more than 128 candidates, the others fewer, so the count is neither 0 nor all.
    from recall.core import metrics
    from recall.core.exclusions import Exclusions
    from recall.engine import fast as fast_search

    users, items = _half_plateau(400, seed=41)
    engine = Engine(items, device=device, precision="fast", options=emulated())
    state = fast_search._state(engine)
    prepared = engine.backend.ingest(metrics.prepare_users("ip", np, users))
    k, m, narrow = 110, fast.margin(110), fast_search._narrow_margin(110, 3000)
    excl = Exclusions.empty(400)
    fast_users = fast_search._prepare(engine, prepared, k, m)
    _, _, failed, stats, _ = fast_search._certified_pass(engine, state, prepared, fast_users, k, k + m, excl, ordered,
                                                         narrow=narrow)
    narrow_users = fast_search._prepare(engine, prepared, k, narrow)
    _, _, narrow_failed, _, _ = fast_search._certified_pass(engine, state, prepared, narrow_users, k, k + narrow, excl,
                                                            ordered)
    assert failed.size < 20 and 100 <= narrow_failed.size <= 350, (failed.size, narrow_failed.size)
    assert stats["narrow_certified"] == 400 - narrow_failed.size


def test_a_large_search_narrows_its_first_margin(device, monkeypatch):
    # With NARROW_MIN_USERS lowered to 6,400 users: the sample's 128 would all have been certified by 128
    # candidates at k = 110, so the search keeps 128 (not 138), and so does the next (the probe skipped).
    from recall.engine import fast as fast_search

    users, items = normal_data(6400, 3000, 16, seed=42)
    want = Engine(items, device=device).search(users, 110)
    engine = Engine(items, device=device, precision="fast", options=emulated())
    got = engine.search(users, 110)
    assert engine.stats["first_margin"] == fast.margin(110), engine.stats  # 6,400 users: too few to narrow
    monkeypatch.setattr(fast_search, "NARROW_MIN_USERS", 6400)
    engine = Engine(items, device=device, precision="fast", options=emulated())
    for probe in ("sampled", "skipped"):
        got = engine.search(users, 110)
        stats = engine.stats
        assert stats["probe"] == probe and stats["precision"] == "fast", stats
        assert stats["first_margin"] == 17 and stats["candidates"] == 128 and stats["widened_users"] == 0, stats
        oracle.assert_topk_close(as_numpy(got.indices), as_numpy(got.scores), users, items, 110)
        np.testing.assert_allclose(as_numpy(got.scores), as_numpy(want.scores), rtol=1e-5, atol=1e-5)


def test_a_sample_that_needs_the_margin_keeps_it(device, monkeypatch):
    # Most users need more than 128 candidates (the plateau): the probe's count says so, the search keeps the
    # default margin (whose first pass certifies nearly all of them).
    from recall.engine import fast as fast_search

    monkeypatch.setattr(fast_search, "NARROW_MIN_USERS", 6400)
    users, items = _half_plateau(6400, seed=43)
    engine = Engine(items, device=device, precision="fast", options=emulated())
    got = engine.search(users, 110)
    stats = engine.stats
    assert stats["probe"] == "sampled" and stats["first_margin"] == fast.margin(110), stats
    assert stats["widened_users"] < 6400 // 10 and engine._fast.margins == {}, stats
    _assert_plateau_exact(got, users, items, 110)


@pytest.mark.parametrize("widened, kept", [(0, True), (6, True), (7, False), (600, False)])
def test_a_narrowed_margin_that_widens_users_is_forgotten(widened, kept):
    from types import SimpleNamespace

    from recall.engine import fast as fast_search

    engine = SimpleNamespace(n_items=1_000_000, _fast=SimpleNamespace(margins={1000: 23}))
    stats = {"first_margin": 23, "widened_users": widened, "fallback_users": 0,
             "widened_passes": [[92, widened, widened]] if widened else []}
    fast_search._learn_margin(engine, 1000, stats, 6400)  # NARROW_MISS: 0.1% of 6,400 is 6.4
    assert engine._fast.margins == ({1000: 23} if kept else {})


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_items=st.integers(60, 500), n_users=st.integers(1, 40),
       dim=st.integers(2, 12), k=st.integers(1, 40), metric=st.sampled_from(["ip", "l2", "cosine"]),
       ties=st.booleans(), excluded=st.booleans(), ordered=st.booleans(), data=st.data())
def test_narrow_certified_is_the_narrower_pass_count(seed, n_items, n_users, dim, k, metric, ties, excluded, ordered,
                                                     data):
    # The first pass's count of users a pass of k + m' + 1 candidates would certify, against that pass run, on any
    # data: small integers (ties at the k-th place everywhere) or continuous, some users with exclusions.
    from recall.core import metrics
    from recall.core.exclusions import normalise
    from recall.engine import fast as fast_search

    rng = np.random.default_rng(seed)
    if ties:  # components in {-2, -1, 1, 2}: integer scores, and no zero vector (cosine has no direction for one)
        items, users = (rng.choice(np.array([-2, -1, 1, 2], np.float32), size=(n, dim)) for n in (n_items, n_users))
    else:
        items = rng.standard_normal((n_items, dim)).astype(np.float32)
        users = rng.standard_normal((n_users, dim)).astype(np.float32)
    m = fast.margin(k)
    narrow = data.draw(st.integers(0, m - 1))
    engine = Engine(items, metric=metric, device="cpu", precision="fast", options=emulated())
    state = fast_search._state(engine)
    prepared = metrics.prepare_users(metric, np, users)
    exclude = {u: rng.choice(n_items, int(rng.integers(0, n_items)), replace=False).tolist()
               for u in range(n_users) if rng.random() < 0.5} if excluded else {}
    excl = normalise(exclude, n_users, n_items)
    fast_users = fast_search._prepare(engine, prepared, k, m)
    _, _, failed, stats, wide = fast_search._certified_pass(engine, state, prepared, fast_users, k, k + m, excl,
                                                            ordered, narrow=narrow)
    if k + narrow + 1 >= wide:  # the narrower pass would keep every item: nothing to count
        assert "narrow_certified" not in stats
        return
    _, _, narrow_failed, _, _ = fast_search._certified_pass(
        engine, state, prepared, fast_search._prepare(engine, prepared, k, narrow), k, k + narrow, excl, ordered)
    assert stats["narrow_certified"] == n_users - narrow_failed.size
    assert set(failed.tolist()) <= set(narrow_failed.tolist())


def test_a_search_bound_by_staging_its_excluded_pairs_declines_the_float16_pass(device, monkeypatch):
    # Where the backend says the host's staging of a search's excluded pairs outlasts the float32 search's work on
    # the device (Backend.staging_bound), fast mode searches in exact mode at once, the backend's reason in the
    # stats, the answer exact mode's; a search without exclusions is not asked.
    calls = _spy_fast_searches(monkeypatch)
    users, items = normal_data(300, 2000, 16, seed=5)
    exclude = {u: [(u * 7 + j * 13) % 2000 for j in range(20)] for u in range(300)}
    engine = Engine(items, device=device, precision="fast", options=emulated())
    asked = []

    def bound(n_users, n_items, width, pairs, itemsize):
        asked.append((n_users, n_items, width, pairs, itemsize))
        return "the staging sets the pace"

    monkeypatch.setattr(engine.backend, "staging_bound", bound)
    got = engine.search(users, 10, exclude=exclude)
    oracle.assert_same_result(got, Engine(items, device=device).search(users, 10, exclude=exclude))
    assert calls == [] and engine.stats["precision"] == "exact", engine.stats
    assert engine.stats["fast_declined"] == "the staging sets the pace"
    assert asked == [(300, 2000, engine.prepared_items.shape[1], 6000, asked[0][4])] and asked[0][4] in (4, 8)
    asked.clear()
    got = engine.search(users, 10)
    oracle.assert_same_result(got, Engine(items, device=device).search(users, 10))
    assert asked == [] and calls and engine.stats["precision"] == "fast", engine.stats


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fast", "exact"])
def test_gpu_staging_model_declines_fast_mode_and_the_route_where_it_outlasts_the_float32_work(device, monkeypatch,
                                                                                            precision):
    # The GPU's model (backends.cupy.backend.staging_bound) on a small search: with the measured rates the staging
    # of 6,000 pairs is far under STAGING_MIN_S (fast mode and the route under "auto" run); with a host that stages
    # a kilobyte a second it outlasts everything: both decline to the float32 search, saying why. The route forced
    # "on" is never asked.
    if device != "gpu":
        pytest.skip("GPU only")
    from recall.backends.cupy import backend as gpu_backend

    users, items = normal_data(300, 2000, 16, seed=5)
    exclude = {u: [(u * 7 + j * 13) % 2000 for j in range(20)] for u in range(300)}
    want = Engine(items, device=device).search(users, 10, exclude=exclude)
    key = "fast_declined" if precision == "fast" else "certified_declined"

    def engine(mode="auto"):
        options = (emulated() if precision == "fast"
                   else EngineOptions(certified_exact=mode, fused="force", float16_min_scores=0))
        return Engine(items, device=device, precision=precision, options=options)

    def searched(e):
        got = e.search(users, 10, exclude=exclude)
        oracle.assert_same_result(got, want)
        return e.stats

    stats = searched(engine())
    assert key not in stats and stats.get("route", "certified") == "certified", stats
    monkeypatch.setattr(gpu_backend, "STAGING_BYTES_PER_S", 1e3)
    stats = searched(engine())
    assert stats["precision"] == "exact" and "6,000 excluded pairs" in stats[key], stats
    if precision == "exact":
        assert stats["route"] == "float32", stats
        stats = searched(engine("on"))
        assert stats["route"] == "certified" and key not in stats, stats


@pytest.mark.parametrize("k, want", [(1, 14), (5, 10), (10, 16), (20, 11), (50, 13), (55, 8), (56, 16), (63, 16),
                                     (64, 16), (100, 25)])
def test_a_pass_started_at_its_need_keeps_a_power_of_two(k, want):
    # Where the backend starts its first pass at the need, below k = 64 the pass keeps k + m + 1 within the power
    # of two that holds k + NEED_MARGIN + 1 (never more than the certificate's margin); elsewhere, and on a
    # backend that starts at a bound of the k + m + 1-th, the certificate's margin.
    from recall.engine import fast as fast_search

    got = first_margin(margin_engine(True), k)
    assert got == want and got <= fast.margin(k)
    if k < fast_search.NEED_MARGIN_MAX_K and got < fast.margin(k):
        assert k + got + 1 == 1 << (k + fast_search.NEED_MARGIN).bit_length()
    assert first_margin(margin_engine(False), k) == fast.margin(k)
    assert Engine(np.eye(4, dtype=np.float32), device="cpu", precision="fast").backend.starts_at_need(
        EngineOptions()) is False


def test_a_search_at_the_need_margin_is_exact(monkeypatch):
    # The CPU's emulation made to start at the need margin (as the GPU's seeded passes do): k = 50 keeps 64
    # candidates a user, and the answer is still the float64 oracle's, fallbacks and widened passes included (the
    # widened pass keeps k + 4 x 13 + 1 = 103).
    from recall.backends.numpy.backend import NumpyBackend

    monkeypatch.setattr(NumpyBackend, "starts_at_need", lambda self, options: True)
    users, items = normal_data(300, 4000, 16, seed=41)
    engine = Engine(items, device="cpu", precision="fast", options=emulated())
    got = engine.search(users, 50)
    assert engine.stats["first_margin"] == 13 and engine.stats["candidates"] == 64, engine.stats
    oracle.assert_topk_close(as_numpy(got.indices), as_numpy(got.scores), users, items, 50)
    users, items = plateau_data(300, seed=42, plateau=90)  # 64 candidates inside the plateau: every user widened
    engine = Engine(items, device="cpu", precision="fast", options=emulated())
    _assert_plateau_exact(engine.search(users, 50), users, items, 50)
    assert engine.stats["widened_passes"][0][:2] == [52, 300], engine.stats


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_gpu_first_passes_keep_the_need_margin(gpu_available, metric):
    # GPU: the seeded float16 passes start at the need, so below k = 64 they keep a power of two of candidates
    # (k = 50: 64, k = 20: 32); with estimates off (passes seeded from a bound) the certificate's margin. Exact
    # mode's answer either way.
    if not gpu_available:
        pytest.skip("no usable GPU")
    users, items = clustered_data(6400, 20000, 64, seed=43)
    exact = Engine(items, metric=metric, device="gpu")
    for options, k, margin in ((EngineOptions(float16_min_scores=0), 50, 13),
                               (EngineOptions(float16_min_scores=0), 20, 11),
                               (EngineOptions(float16_min_scores=0), 10, 16),
                               (EngineOptions(float16_min_scores=0, seed_estimate=False), 50, 16)):
        engine = Engine(items, metric=metric, device="gpu", precision="fast", options=options)
        got = engine.search(users, k)
        assert engine.stats["precision"] == "fast" and engine.stats["first_margin"] == margin, engine.stats
        want = exact.search(users, k)
        np.testing.assert_allclose(as_numpy(got.scores), as_numpy(want.scores), rtol=1e-5, atol=1e-5)
        sample = np.arange(0, 6400, 97)
        oracle.assert_topk_close(as_numpy(got.indices)[sample], as_numpy(got.scores)[sample], users[sample], items,
                                 k, metric)


def test_a_searchs_float16_pass_is_planned_once(device, monkeypatch):
    # fast._pass_plan: the plan _tiles16 asks for before a pass is the pass's own (one Engine.plan of the float16
    # users' shape a search, not two; a widened pass, of fewer users, has its own), and the next search plans
    # afresh: here its options pin other tiles, which its passes then run with. The answer is exact mode's either way.
    rng = np.random.default_rng(2)
    items, users = _ints(rng, 3000, 12), _ints(rng, 300, 12)
    engine = Engine(items, device=device, precision="fast", options=emulated(fast_sample=0))
    planned, ran = [], []
    real_plan, real_run = Engine.plan, Engine.run

    def plan(self, users_, n_items, k):
        out = real_plan(self, users_, n_items, k)
        if np.dtype(users_.dtype) == np.float16:
            planned.append(((int(users_.shape[0]), k), out))
        return out

    def run(self, users_, k, excl, *args, plan=None, **kwargs):
        if np.dtype(users_.dtype) == np.float16:
            ran.append(plan)
        return real_run(self, users_, k, excl, *args, plan=plan, **kwargs)

    def check(first, first_run):
        keys = [key for key, _ in planned[first:]]
        assert keys and len(keys) == len(set(keys))  # each shape planned once
        plans = [p for _, p in planned[first:]]
        assert ran[first_run:] and all(any(p is q for q in plans) for p in ran[first_run:])  # the passes ran those

    monkeypatch.setattr(Engine, "plan", plan)
    monkeypatch.setattr(Engine, "run", run)
    want = Engine(items, device=device).search(users, 40)
    got = engine.search(users, 40)
    check(0, 0)
    done, runs = len(planned), len(ran)
    engine.options = emulated(fast_sample=0, tiles=(64, 512, 2))
    again = engine.search(users, 40)
    check(done, runs)
    assert ran[runs].user_block == 64 and ran[0].user_block != 64  # the first pass of each search: every user
    for res in (got, again):
        np.testing.assert_array_equal(as_numpy(res.indices), as_numpy(want.indices))
        np.testing.assert_array_equal(as_numpy(res.scores), as_numpy(want.scores))
