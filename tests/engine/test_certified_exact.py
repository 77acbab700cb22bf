"""Exact precision's certified route (``EngineOptions.certified_exact``): candidates from fast mode's float16 pass,
re-scored with the fused exact kernel's own float32 sums, so that the answer is exact mode's bit for bit.

The reference is the FMA chain emulated on the CPU (``recall.backends.numpy.ordered``) over every item, ranked by
the tie rule: on the GPU it is what the fused kernel computes (``tests/backends/test_ordered.py``), so the same
test bodies check the route on both backends. The CPU takes the route only when asked ("on", for these tests).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from conftest import clustered_data, emulated, normal_data, plateau_data, ties_data
from oracle import as_numpy
from recall import Engine, EngineOptions
from recall.backends.numpy.ordered import ordered_dots
from recall.core import certificate, metrics
from recall.core.exclusions import normalise
from recall.engine import fast

ON = EngineOptions(certified_exact="on")


def _options(device: str, **fields) -> EngineOptions:
    # On the GPU the route follows exact mode's fused kernel, which a search of fewer than 128 users (or an unseeded
    # one) takes only when forced.
    return replace(ON, fused="force", **fields) if device == "gpu" else replace(ON, **fields)


def _reference(engine: Engine, users: np.ndarray, k: int, exclude=None) -> tuple[np.ndarray, np.ndarray]:
    """(rows, inner-product scores) (n, k): every item scored by the FMA chain, best first, ties to the lower row,
    excluded items left out, padded with (-1, -inf)."""
    prepared = metrics.prepare_users(engine.metric, np, users)
    items = as_numpy(engine.prepared_items)
    scores = ordered_dots(prepared, np.broadcast_to(items, (users.shape[0],) + items.shape)).astype(np.float64)
    excl = normalise(exclude, users.shape[0], items.shape[0])
    for u in range(users.shape[0]):
        scores[u, excl.items[excl.indptr[u]:excl.indptr[u + 1]]] = -np.inf
    rows = np.broadcast_to(np.arange(items.shape[0]), scores.shape)
    order = np.lexsort((rows, -scores), axis=-1)[:, :k]
    top = np.take_along_axis(scores, order, axis=1)
    return np.where(np.isneginf(top), -1, order), top.astype(np.float32)


def _assert_reference(engine: Engine, res, users, k, exclude=None) -> None:
    rows, scores = _reference(engine, users, k, exclude)
    np.testing.assert_array_equal(as_numpy(res.indices), rows)
    if engine.metric != "l2":  # l2's scores are finished from these (-|u - v|^2); its rows say the same
        np.testing.assert_array_equal(as_numpy(res.scores), scores)


def _assert_reference_rows(engine: Engine, res, users, k, exclude, sel) -> None:
    """:func:`_assert_reference` on the users ``sel`` alone (``exclude`` a mapping of all users' rows)."""
    sub = type(res)(indices=as_numpy(res.indices)[sel], scores=as_numpy(res.scores)[sel], ids=None)
    _assert_reference(engine, sub, users[sel], k, {i: exclude.get(int(u), []) for i, u in enumerate(sel)})


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
@pytest.mark.parametrize("kind", ["clustered", "skewed"])
def test_route_gives_the_fused_sums_answer_bit_for_bit(device, metric, kind):
    if kind == "clustered":
        users, items = clustered_data(300, 4000, 40, seed=5)
    else:
        users, items = normal_data(300, 4000, 33, seed=6)
        rng = np.random.default_rng(6)
        users *= np.exp2(rng.integers(-8, 8, (300, 1))).astype(np.float32)
        items *= rng.lognormal(0.0, 1.0, (4000, 1)).astype(np.float32)
    rng = np.random.default_rng(7)
    exclude = {u: rng.choice(4000, 50, replace=False).tolist() for u in range(0, 300, 3)}
    exclude[4] = list(range(4000))  # every item excluded: nothing to return
    engine = Engine(items, metric=metric, device=device, options=_options(device))
    res = engine.search(users, 25, exclude=exclude)
    assert engine.stats["route"] == "certified" and engine.stats["precision"] == "exact"
    assert (as_numpy(res.indices)[4] == -1).all()
    _assert_reference(engine, res, users, 25, exclude)


@pytest.mark.parametrize("metric, offset", [("ip", 300.0), ("ip", -40.0), ("cosine", 20.0)])
def test_route_on_items_far_from_the_origin(device, metric, offset):
    # Items far from the origin are rounded about their centre (certificate.prepare_items): the route certifies its
    # users (none fell back: rounded about the origin, every one did at 300) and the answer is the fused sums', bit
    # for bit, exclusions and an all-excluded user included.
    users, items = normal_data(300, 4000, 40, seed=8)
    users, items = users + np.float32(offset), items + np.float32(offset)
    rng = np.random.default_rng(9)
    exclude = {u: rng.choice(4000, 30, replace=False).tolist() for u in range(0, 300, 5)}
    exclude[7] = list(range(4000))
    engine = Engine(items, metric=metric, device=device, options=_options(device, fast_sample=0))
    res = engine.search(users, 20, exclude=exclude)
    assert engine.stats["route"] == "certified" and engine.stats["fallback_users"] == 0, engine.stats
    assert fast._state(engine).items.centre is not None
    assert (as_numpy(res.indices)[7] == -1).all()
    _assert_reference(engine, res, users, 20, exclude)


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_route_results_taken_later_are_the_search_s(device, metric):
    # search_async on the route returns once the search ran; its results are fetched and finished (l2's scores from
    # the users' norms) when they are taken: from the engine's own copy of the users, so a caller reusing its array
    # meanwhile (a job's next batch) changes nothing, and the stats are there with them.
    users, items = clustered_data(300, 4000, 24, seed=8)
    engine = Engine(items, metric=metric, device=device, options=_options(device))
    want = engine.search(users, 20)
    batch = users.copy()
    taken = []
    finish = engine._result
    engine._result = lambda *args: taken.append(args[1].shape[0]) or finish(*args)
    pending = engine.search_async(batch, 20)
    assert taken == []  # not fetched nor finished yet
    batch[:] = 7.0
    engine.search(batch[:5], 3)  # another search in between: its stats are the engine's now
    got = pending.result()
    assert taken == [5, 300]
    assert pending.stats["route"] == "certified" and pending.stats["precision"] == "exact", pending.stats
    np.testing.assert_array_equal(as_numpy(got.indices), as_numpy(want.indices))
    np.testing.assert_array_equal(as_numpy(got.scores), as_numpy(want.scores))


@pytest.mark.parametrize("k", [1, 3, 59, 60, 100])
def test_route_small_catalogue_and_k_at_its_size(device, k):
    users, items = clustered_data(150, 60, 24, seed=k)
    engine = Engine(items, device=device, options=_options(device))
    res = engine.search(users, k)
    assert engine.stats["route"] == "certified"
    _assert_reference(engine, res, users, min(k, 60))


def test_route_falls_back_and_widens_bit_for_bit(device, monkeypatch):
    # No margin: certificates fail; float data with duplicated rows and norms over binades, so that a fallback that
    # summed in another order would show.
    monkeypatch.setattr(certificate, "margin", lambda k: 0)
    users, items = normal_data(200, 3000, 29, seed=8)
    items[::7] = items[3]
    items *= np.exp2(np.random.default_rng(8).integers(-3, 3, (3000, 1))).astype(np.float32)
    engine = Engine(items, device=device, options=_options(device))
    res = engine.search(users, 10)
    assert engine.stats["route"] == "certified"
    assert engine.stats["widened_users"] > 0
    if device == "gpu":  # the CPU's own exact search sums in BLAS's order: its fallbacks are checked on integers
        assert engine.stats["fallback_users"] > 0
        _assert_reference(engine, res, users, 10)


def test_route_fallbacks_on_integer_data(device, monkeypatch):
    # Every float32 sum of integers is exact: whichever search a fallback takes, the reference holds.
    monkeypatch.setattr(certificate, "margin", lambda k: 0)
    users, items = ties_data(200, 2000, 4, low=-1, high=1, seed=9)
    engine = Engine(items, device=device, options=_options(device))
    res = engine.search(users, 10)
    assert engine.stats["fallback_users"] > 50
    _assert_reference(engine, res, users, 10)


def test_route_declines_where_the_sample_falls_back(device):
    # 0/1 vectors in 4 dimensions against 3,000 items tie by the hundred at the k-th place: the sample's users fall
    # back after both widened passes (against 400 items the second holds most ties whole), so the route declines and
    # exact mode's own search runs (the same answer).
    users, items = ties_data(6400, 3000, 4, low=0, high=1, seed=10)
    engine = Engine(items, device=device, options=_options(device))
    res = engine.search(users, 20)
    assert engine.stats["route"] == "float32" and "sample" in engine.stats["certified_declined"]
    want = Engine(items, device=device, options=replace(_options(device), certified_exact="off")).search(users, 20)
    np.testing.assert_array_equal(as_numpy(res.indices), as_numpy(want.indices))
    np.testing.assert_array_equal(as_numpy(res.scores), as_numpy(want.scores))


def test_route_declines_without_room_for_the_float16_copy(device, monkeypatch):
    users, items = clustered_data(200, 2000, 16, seed=11)
    engine = Engine(items, device=device, options=_options(device))
    monkeypatch.setattr(engine.backend, "free_memory", lambda: 0)
    res = engine.search(users, 10)
    assert engine.stats["route"] == "float32" and "no room" in engine.stats["certified_declined"]
    assert engine._fast is None
    want = Engine(items, device=device, options=replace(_options(device), certified_exact="off")).search(users, 10)
    np.testing.assert_array_equal(as_numpy(res.indices), as_numpy(want.indices))


def test_route_with_an_item_filter(device):
    users, items = clustered_data(200, 3000, 20, seed=12)
    engine = Engine(items, device=device, options=_options(device))
    engine.set_item_filter(allow=np.arange(0, 3000, 3))
    res = engine.search(users, 15)
    assert engine.stats["route"] == "certified"
    plain = Engine(items[::3], device=device, options=_options(device))
    rows, scores = _reference(plain, users, 15)
    np.testing.assert_array_equal(as_numpy(res.indices), np.where(rows >= 0, rows * 3, -1))
    np.testing.assert_array_equal(as_numpy(res.scores), scores)


def test_off_and_auto_on_the_cpu_take_the_float32_search():
    users, items = clustered_data(100, 500, 8, seed=13)
    for mode in ("off", "auto"):
        engine = Engine(items, device="cpu", options=EngineOptions(certified_exact=mode))
        engine.search(users, 5)
        assert "route" not in engine.stats and engine.stats.get("precision", "exact") == "exact"


def test_auto_takes_the_route_only_for_large_searches(monkeypatch):
    # The size rule (fast.min_scores): SMALL_CATALOGUE_MIN_SCORES under SHARE_MIN_ITEMS items, MIN_SCORES from there
    # on, float16_min_scores in place of either where the options give it.
    users, items = clustered_data(100, 500, 8, seed=14)
    engine = Engine(items, device="cpu", options=EngineOptions(certified_exact="auto"))
    monkeypatch.setattr(engine.backend, "certify_exact", lambda *args: True)
    assert not fast.certifies_exact(engine, users, 5)  # 50,000 scores
    monkeypatch.setattr(fast, "MIN_SCORES", 50_000)  # a large catalogue's limit: not this one's
    assert not fast.certifies_exact(engine, users, 5)
    monkeypatch.setattr(fast, "SMALL_CATALOGUE_MIN_SCORES", 50_000)
    assert fast.certifies_exact(engine, users, 5)
    assert not fast.certifies_exact(engine, users[:99], 5)
    engine.options = EngineOptions(certified_exact="auto", float16_min_scores=50_001)
    assert not fast.certifies_exact(engine, users, 5)
    engine.options = EngineOptions(certified_exact="auto", float16_min_scores=0)
    assert fast.certifies_exact(engine, users[:1], 5)
    engine.options = EngineOptions(certified_exact="off")
    assert not fast.certifies_exact(engine, users, 5)
    rng = np.random.default_rng(15)
    large = Engine(rng.standard_normal((fast.SHARE_MIN_ITEMS, 8)).astype(np.float32), device="cpu")
    monkeypatch.setattr(large.backend, "certify_exact", lambda *args: True)
    monkeypatch.setattr(fast, "MIN_SCORES", 3 * fast.SHARE_MIN_ITEMS)
    assert fast.certifies_exact(large, users[:3], 5) and not fast.certifies_exact(large, users[:2], 5)


def test_the_size_rule_is_lower_for_wider_rows():
    # fast.min_scores: the limits as measured at 64 dimensions (and kept below), scaled by 64 / d on a catalogue of
    # fewer than SHARE_MIN_ITEMS items and by (64 / d)^1.5 on a larger one, up to ROUTE_DIM_MAX dimensions.
    from types import SimpleNamespace

    def limit(dim: int, n_items: int, asked: int | None = None) -> int:
        options = EngineOptions(float16_min_scores=asked)
        return fast.min_scores(SimpleNamespace(dim=dim, n_items=n_items, options=options))

    small, large = fast.SHARE_MIN_ITEMS - 1, fast.SHARE_MIN_ITEMS
    for dim in (1, 32, 64):
        assert limit(dim, small) == 1 << 29 and limit(dim, large) == 1 << 30
    assert limit(96, small) == int((1 << 29) / 1.5)
    assert limit(128, small) == 1 << 28 and limit(256, small) == 1 << 27 and limit(1536, small) == 1 << 27
    assert 1 << 28 < limit(128, large) == int((1 << 30) / 2 ** 1.5) < 1 << 29
    assert limit(256, large) == 1 << 27 and limit(1536, large) == 1 << 27
    assert limit(256, small, asked=5) == 5 and limit(32, large, asked=0) == 0


def _stand_in_gpu(warpgroup: bool = True):
    """The GPU backend's route rules without a GPU: a CupyBackend holding only what they read."""
    from types import SimpleNamespace

    from recall.backends.cupy.backend import CupyBackend

    backend = CupyBackend.__new__(CupyBackend)
    backend.selection = SimpleNamespace(fused_w=object() if warpgroup else None)
    return backend


@pytest.mark.parametrize("width, takes", [(64, True), (256, True), (257, True), (768, True)])
def test_gpu_rule_takes_the_route_where_fused_or_wider_than_it(width, takes):
    # Up to 256 columns the route stands in for the fused kernel (where that runs); above, for cuBLAS's GEMM.
    from recall.backends.cupy.backend import WIDE_PASS_SHARE
    from recall.backends.protocol import PASS_SHARE
    from recall.core.tiling import TilePlan

    backend, plan, auto = _stand_in_gpu(), TilePlan(4096, 8192, 4), EngineOptions()
    assert backend.certify_exact(plan, 20000, 1_000_000, 100, width, auto) == takes
    assert not backend.certify_exact(plan, 20000, 1_000_000, 100, width, EngineOptions(certified_exact="off"))
    share = backend.float16_pass_share(20000, 1_000_000, 100, width, auto)
    assert share == (WIDE_PASS_SHARE if width > 256 else PASS_SHARE)
    # Where the fused kernel covers the rows but would not run (forced off), the float32 search is cuBLAS at a
    # width the route was not measured to pay at: it declines; wider rows still take it.
    off = EngineOptions(fused="off")
    assert backend.certify_exact(plan, 20000, 1_000_000, 100, width, off) == (width > 256)
    from recall.core.tiling import InterestPlan

    multi = TilePlan(4096, 8192, 4, interests=InterestPlan(2, 2, "max", False, 2730))
    assert not backend.certify_exact(multi, 20000, 1_000_000, 100, width, auto)


@pytest.mark.parametrize("certified_by, share, runs", [
    # Every user widened, none certified by more than half of them in one pass: 0.5 x (1 + 1 + 0.55 + 0.25) = 1.4
    # of an exact search, and it declines; at the GEMMs' share 0.7, and it runs.
    ((0.45, 0.3, 0.25), 0.5, False),
    ((0.45, 0.3, 0.25), 0.25, True),
    # Every user certified by the first widened pass: the search starts there, at 0.5.
    ((1.0,), 0.5, True),
    # More than half certified by the second widened pass: the search starts there, and the third is for 0.2 of
    # the users: 0.5 x 1.2 = 0.6.
    ((0.2, 0.6, 0.2), 0.5, True),
])
def test_the_probe_weighs_widened_users_by_the_pass_share(monkeypatch, certified_by, share, runs):
    # A sample whose every user was widened and none fell back, certified by the widened passes in these shares.
    users, items = normal_data(6400, 3000, 12, seed=21)
    real = fast._search_fast

    def all_widened(engine, users, k, excl, fast_users=None, ordered=False, margin=None, narrow=None):
        vals, rows, stats = real(engine, users, k, excl, fast_users, ordered, margin, narrow)
        n, m, left, passes = int(users.shape[0]), stats["first_margin"], int(users.shape[0]), []
        for i, share_of_users in enumerate(certified_by):
            passes.append([fast.WIDEN ** (i + 1) * m, left, round(share_of_users * n)])
            left -= round(share_of_users * n)
        return vals, rows, {**stats, "widened_users": n, "fallback_users": 0, "widened_passes": passes}

    monkeypatch.setattr(fast, "_search_fast", all_widened)
    engine = Engine(items, device="cpu", precision="fast", options=emulated())
    monkeypatch.setattr(engine.backend, "float16_pass_share", lambda *args: share)
    engine.search(users, 20)
    if not runs:
        assert engine.stats["precision"] == "exact" and "modelled 1.40" in engine.stats["fast_declined"], engine.stats
        return
    assert engine.stats["precision"] == "fast" and engine.stats["probe"] == "sampled", engine.stats
    assert 20 in engine._fast.trusted  # the whole search's modelled cost paid too


def test_the_modelled_cost():
    m = certificate.margin(20)
    one = {"widened_users": 10, "fallback_users": 3, "widened_passes": [[4 * m, 10, 7]]}
    assert fast._cost(one, 20, 0.25) == pytest.approx(0.25 * 1.5 + 0.15)
    stats = {"first_margin": m, "widened_users": 10, "fallback_users": 1,
             "widened_passes": [[4 * m, 10, 2], [16 * m, 8, 7]]}
    assert fast._cost(stats, 20, 0.5) == pytest.approx(0.5 * (1 + 18 / 20) + 1 / 20)
    assert fast._cost(stats, 20, 0.5, start=2) == pytest.approx(0.5 + 1 / 20)


@pytest.mark.parametrize("plateau, learned, n_passes", [(60, 4, 1), (150, 16, 2)])
def test_the_route_learns_a_wider_first_pass(device, plateau, learned, n_passes):
    # Exact mode's certified route runs fast mode's passes: where a widened pass (the first, or the second for the
    # wider plateau) certified most users, the next search of that k starts with its margin too, and its answer
    # stays the fused kernel's sums, bit for bit.
    users, items = plateau_data(600, seed=34, dim=12, plateau=plateau)
    engine = Engine(items, device=device, options=_options(device))
    m = fast._default_margin(engine, 20)  # the certificate's 16, or 11 where passes start at the need (the GPU's)
    for first, widened in ((m, 600), (learned * m, 0)):
        res = engine.search(users, 20)
        stats = engine.stats
        assert stats["route"] == "certified" and stats["first_margin"] == first, stats
        assert stats["widened_users"] == widened and stats["fallback_users"] == 0, stats
        assert len(stats["widened_passes"]) == (n_passes if widened else 0), stats
        _assert_reference(engine, res, users, 20)


def test_bad_mode_is_refused():
    from recall import InputError

    with pytest.raises(InputError, match="certified_exact"):
        EngineOptions(certified_exact="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("metric,dim,k", [("ip", 200, 100), ("cosine", 256, 1000), ("l2", 160, 10), ("ip", 64, 1)])
def test_gpu_route_equals_the_fused_search_bit_for_bit(metric, dim, k, device, monkeypatch):
    # Large enough for exact mode's own choices (seeded, fused, 4,096-user blocks) on both sides; fast mode's
    # declines for small searches (350M scores, under MIN_SCORES) and for k = 1,000 of 70,000 items lifted.
    if device != "gpu":
        pytest.skip("GPU only")
    monkeypatch.setattr(fast, "MIN_SCORES", 1)
    monkeypatch.setattr(fast, "MAX_CANDIDATE_SHARE", 1.0)
    monkeypatch.setattr(fast, "MAX_CANDIDATE_SHARE_TILES16", 1.0)  # d = 256 keeps float16 score tiles
    users, items = clustered_data(5000, 70000, dim, seed=dim)
    rng = np.random.default_rng(dim)
    users *= np.exp2(rng.integers(-4, 4, (5000, 1))).astype(np.float32)
    exclude = {u: rng.choice(70000, 200, replace=False).tolist() for u in range(0, 5000, 2)}
    want_engine = Engine(items, metric=metric, device="gpu", options=EngineOptions(certified_exact="off"))
    want = want_engine.search(users, k, exclude=exclude)
    assert want_engine.stats["fused"]
    engine = Engine(items, metric=metric, device="gpu", options=EngineOptions(certified_exact="on"))
    got = engine.search(users, k, exclude=exclude)
    assert engine.stats["route"] == "certified", engine.stats
    np.testing.assert_array_equal(as_numpy(got.indices), as_numpy(want.indices))
    np.testing.assert_array_equal(as_numpy(got.scores), as_numpy(want.scores))


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_gpu_route_at_k_8192_equals_the_fused_search_bit_for_bit(metric, device, monkeypatch):
    # k = 8,192: the float32 search the route stands in for is the fused kernel's (fused.FUSED_SEEDED_MAX_K), the
    # route's float16 pass of 10,241 candidates a user keeps float16 score tiles (above FUSED_HALF_SEEDED_MAX_K; the
    # route takes this only where the catalogue is large, the limits lifted here), and the re-scoring selects 8,192
    # in one block (rescore.launch_config: the duplicate flags in the stage's room), not the gather + GEMM path.
    if device != "gpu":
        pytest.skip("GPU only")
    monkeypatch.setattr(fast, "MIN_SCORES", 1)
    monkeypatch.setattr(fast, "MAX_CANDIDATE_SHARE_TWO_CHUNKS", 1.0)
    monkeypatch.setattr(fast, "MAX_CANDIDATE_SHARE_TILES16", 1.0)
    users, items = clustered_data(400, 300_000, 32, seed=81)
    rng = np.random.default_rng(81)
    users *= np.exp2(rng.integers(-4, 4, (400, 1))).astype(np.float32)
    exclude = {u: rng.choice(300_000, 5000, replace=False).tolist() for u in range(0, 400, 7)}
    exclude[5] = list(range(300_000 - 8000))  # 8,000 items left: fewer than k
    exclude[6] = list(range(300_000))  # none left
    want_engine = Engine(items, metric=metric, device="gpu", options=EngineOptions(certified_exact="off"))
    want = want_engine.search(users, 8192, exclude=exclude)
    assert want_engine.stats["fused"], want_engine.stats
    engine = Engine(items, metric=metric, device="gpu", options=EngineOptions(certified_exact="on"))
    got = engine.search(users, 8192, exclude=exclude)
    assert engine.stats["route"] == "certified" and not engine.stats["fused"], engine.stats
    assert engine.stats["rescore_path"] == "fused", engine.stats
    rows = as_numpy(got.indices)
    assert (rows[5, :8000] >= 0).all() and (rows[5, 8000:] == -1).all() and (rows[6] == -1).all()
    np.testing.assert_array_equal(rows, as_numpy(want.indices))
    np.testing.assert_array_equal(as_numpy(got.scores), as_numpy(want.scores))


@pytest.mark.gpu
def test_gpu_auto_rule(device):
    if device != "gpu":
        pytest.skip("GPU only")
    # 70,000 items: a seeded search (fused) from 65,536 on; 1.4G scores, above MIN_SCORES.
    users, items = normal_data(20000, 70000, 256, seed=1)
    engine = Engine(items, device="gpu")
    engine.search(users, 10)
    assert engine.stats["route"] == "certified"
    engine = Engine(items[:, :64], device="gpu")
    engine.search(users[:, :64], 10)
    assert engine.stats["route"] == "certified"
    # Below MIN_SCORES, or host users beyond the memory budget: exact mode's float32 search.
    engine = Engine(items, device="gpu")
    engine.search(users[:1000], 10)
    assert "route" not in engine.stats
    engine = Engine(items, device="gpu", memory_budget=16 << 20)
    engine.search(users, 10)
    assert "route" not in engine.stats
    # l2 at 256 dimensions is 260 prepared columns: wider than the fused kernel takes, so exact mode's float32
    # search is cuBLAS's, and the route stands in for it with its ordered sums (and "off" keeps cuBLAS).
    engine = Engine(items, metric="l2", device="gpu")
    engine.search(users, 10)
    assert engine.stats["route"] == "certified" and not engine.stats["fused"], engine.stats
    engine = Engine(items, metric="l2", device="gpu", options=EngineOptions(certified_exact="off"))
    engine.search(users, 10)
    assert "route" not in engine.stats and not engine.stats["fused"]
    # A catalogue of fewer than 65,536 items: the route from 2^29 scores on (fast.SMALL_CATALOGUE_MIN_SCORES).
    small = Engine(items[:20000, :64], device="gpu")
    small.search(users[:, :64], 10)  # 400M scores
    assert "route" not in small.stats, small.stats
    small.search(np.concatenate([users[:, :64], users[:7000, :64]]), 10)  # 540M
    assert small.stats["route"] == "certified", small.stats
    # Wider rows take it from fewer scores: 2^28 on that catalogue at 128 dimensions, 2^27 on 70,000 items at 256.
    small = Engine(items[:20000, :128], device="gpu")
    small.search(users[:13421, :128], 10)  # 268,420,000 scores
    assert "route" not in small.stats, small.stats
    small.search(users[:13422, :128], 10)  # 268,440,000
    assert small.stats["route"] == "certified", small.stats
    engine = Engine(items, device="gpu")
    engine.search(users[:1917], 10)  # 134,190,000
    assert "route" not in engine.stats, engine.stats
    engine.search(users[:1918], 10)  # 134,260,000
    assert engine.stats["route"] == "certified", engine.stats


@pytest.mark.gpu
@pytest.mark.parametrize("metric,dim,k", [("ip", 384, 100), ("cosine", 300, 10), ("l2", 256, 50)])
def test_gpu_route_above_256_dims_is_the_ordered_sums_top_k(metric, dim, k, device, monkeypatch):
    # Rows wider than the fused float32 kernel takes (l2 at 256 dimensions: 260 prepared columns): exact mode's
    # float32 search is cuBLAS's GEMM, and "auto" takes the route (the size limit lifted for a test-sized search). Each
    # certified user's list is the top k of the ordered float32 sums over every item, scores bit for bit; the cuBLAS
    # search finds the same lists up to near-ties a rounding step apart, both exact against the float64 oracle.
    if device != "gpu":
        pytest.skip("GPU only")
    import oracle

    users, items = clustered_data(1500, 20000, dim, seed=dim)
    rng = np.random.default_rng(dim)
    users *= np.exp2(rng.integers(-3, 3, (1500, 1))).astype(np.float32)
    exclude = {u: rng.choice(20000, 100, replace=False).tolist() for u in range(0, 1500, 3)}
    engine = Engine(items, metric=metric, device="gpu", options=EngineOptions(float16_min_scores=0))
    got = engine.search(users, k, exclude=exclude)
    assert engine.stats["route"] == "certified" and engine.stats["fallback_users"] == 0, engine.stats
    sel = np.arange(0, 1500, 71)
    _assert_reference_rows(engine, got, users, k, exclude, sel)
    plain = Engine(items, metric=metric, device="gpu", options=EngineOptions(certified_exact="off"))
    want = plain.search(users, k, exclude=exclude)
    assert "route" not in plain.stats
    for res in (got, want):
        oracle.assert_topk_close(as_numpy(res.indices)[sel], as_numpy(res.scores)[sel], users[sel], items, k,
                                 metric, {i: exclude.get(int(u), []) for i, u in enumerate(sel)})
    same = (as_numpy(got.indices) == as_numpy(want.indices)).all(axis=1).mean()
    assert same > 0.9, same


def test_tune_force_tunes_the_float32_pass_only(device):
    # The route's float16 pass reads the cache (as fast mode does); tune="force" tunes exact mode's float32 pass.
    from recall.engine import tuning

    users, items = clustered_data(300, 3000, 16, seed=15)
    engine = Engine(items, device=device, tune="force", options=_options(device))
    res = engine.search(users, 10)
    assert engine.stats["route"] == "certified"
    _assert_reference(engine, res, users, 10)
    assert all("float16" not in name for name in tuning._forced)
