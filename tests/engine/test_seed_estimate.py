"""Fast mode's float16 passes may start each user at an *estimate* of its k-th best (``Backend.run_blocks``'
``left_out``, ``EngineOptions.seed_estimate``): the answer must stay exact mode's whatever the estimate does, because
the certificate counts every item below a user's start as left out, and a user whose estimate was too high (fewer
candidates above it than the pass keeps) is widened from lower bounds.

On the CPU, whose thresholds are lower bounds (``left_out`` -inf), an estimate is simulated: the first pass's results
are cut below a chosen score and that score reported as the start. On the GPU the seed kernel's estimate runs for
real (samples of evenly spaced rows: cosine and l2), with items planted so that the sample overstates every user's
scores."""
from __future__ import annotations

import numpy as np
import pytest

import oracle
from conftest import emulated, normal_data
from oracle import as_numpy
from recall import Engine, EngineOptions


def _lognormal(n_users, n_items, dim, seed):
    users, items = normal_data(n_users, n_items, dim, seed=seed)
    rng = np.random.default_rng(seed + 100)
    items *= rng.lognormal(0, 0.5, (n_items, 1)).astype(np.float32)
    users *= rng.lognormal(0, 0.5, (n_users, 1)).astype(np.float32)
    return users, items


def _simulate_estimates(monkeypatch, k):
    """NumpyBackend.run_blocks, where asked for ``left_out``, as a backend whose estimate overshoots: user u % 3 == 1
    keeps only its best k // 2 items (its start above its k-th best: the certificate must not pass it), u % 3 == 2
    its best k + 2 (fewer than the pass keeps, at least k: certified against the start). Returns the calls' log."""
    from recall.backends.numpy.backend import NumpyBackend

    real = NumpyBackend.run_blocks
    calls = []

    def run_blocks(self, plan, users, items, n_items, k_pass, excl, out_vals, out_rows, options, floor=None,
                   left_out=None, best_first=True, need=0):
        wait = real(self, plan, users, items, n_items, k_pass, excl, out_vals, out_rows, options, floor, left_out,
                    best_first, need)
        calls.append(left_out is not None)
        if left_out is None:
            return wait
        stats = wait()
        for u in range(out_vals.shape[0]):
            keep = {0: k_pass, 1: k // 2, 2: k + 2}[u % 3]
            if keep < k_pass:
                left_out[u] = out_vals[u, keep]  # the first score cut: every item cut lies at or below it
                out_vals[u, keep:] = -np.inf
                out_rows[u, keep:] = -1
        return lambda: stats

    monkeypatch.setattr(NumpyBackend, "run_blocks", run_blocks)
    return calls


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_users_short_of_their_estimate_are_widened_not_certified(monkeypatch, metric):
    users, items = _lognormal(90, 3000, 16, seed=41)
    k = 20
    calls = _simulate_estimates(monkeypatch, k)
    engine = Engine(items, metric=metric, device="cpu", precision="fast", options=emulated())
    got = engine.search(users, k)
    # The first pass asked for the bound; the widened pass (lower bounds only) did not.
    assert calls[0] and not all(calls), calls
    stats = engine.stats
    assert stats["estimate_short_users"] == 60, stats  # users 1 and 2 (mod 3): fewer than k + m + 1 kept
    # The third left with k // 2 items cannot be certified; with k + 2 they may be (the start counts as left out).
    assert stats["widened_users"] >= 30, stats
    oracle.assert_topk_close(as_numpy(got.indices), as_numpy(got.scores), users, items, k, metric)


def test_exact_modes_certified_route_stays_bit_for_bit_under_estimates(monkeypatch):
    users, items = _lognormal(60, 2500, 12, seed=42)
    k = 16
    # The route's scores are the fused kernel's sums (emulated on the CPU), whichever pass found the candidates.
    want = Engine(items, device="cpu", options=EngineOptions(certified_exact="on")).search(users, k)
    _simulate_estimates(monkeypatch, k)
    engine = Engine(items, device="cpu", options=EngineOptions(certified_exact="on"))
    got = engine.search(users, k)
    assert engine.stats["route"] == "certified" and engine.stats["estimate_short_users"] == 40, engine.stats
    oracle.assert_same_result(got, want)


def test_the_cpu_backends_bounds_leave_nothing_out():
    # The CPU's thresholds are lower bounds: it says so with -inf, and the pass is the same search.
    users, items = _lognormal(50, 2000, 8, seed=43)
    engine = Engine(items, device="cpu")
    prepared = engine.backend.ingest(users)
    vals = engine.backend.empty_out((50, 30), np.float32, False)
    rows = engine.backend.empty_out((50, 30), np.int64, False)
    left = np.zeros(50, np.float32)
    from recall.core.exclusions import normalise

    engine.run(prepared, 30, normalise(None, 50, 2000), vals, rows, left_out=left)()
    assert np.isneginf(left).all()
    want = engine.search(users, 30)
    np.testing.assert_array_equal(rows, as_numpy(want.indices))


@pytest.mark.parametrize("metric, n_items, ranked", [("l2", 4096, True), ("l2", 8192, True), ("l2", 8193, False),
                                                    ("ip", 4096, False), ("cosine", 4096, False)])
def test_small_l2_catalogues_rank_their_float16_samples_by_the_centroid(monkeypatch, metric, n_items, ranked):
    # fast.CENTROID_MAX_ITEMS: an l2 engine of at most that many items hands its float16 items' centroid ranks
    # (metrics.centroid_ranks, from the exact prepared vectors) to the backend with them; a larger one, and other
    # metrics, none (their samples: evenly spaced, or by the largest norms under ip).
    from recall.backends.numpy.backend import NumpyBackend
    from recall.core import metrics
    from recall.engine import fast as fast_mode

    real = NumpyBackend.load_items
    handed = []

    def load_items(self, prepared, norms_rank=False, constant_column=None, bias_columns=None, ranks=None):
        handed.append(ranks)
        return real(self, prepared, norms_rank, constant_column, bias_columns, ranks)

    monkeypatch.setattr(NumpyBackend, "load_items", load_items)
    users, items = _lognormal(4, n_items, 6, seed=47)
    engine = Engine(items, metric=metric, device="cpu", precision="fast")
    handed.clear()
    fast_mode._state(engine)
    assert len(handed) == 1
    if ranked:
        want = metrics.centroid_ranks(np, engine.prepared_items, "l2", 6)
        np.testing.assert_array_equal(handed[0], want)
    else:
        assert handed[0] is None


# --- on the GPU: the seed kernel's estimate, for real -----------------------------------------------------------


def _planted(n_users, n_items, dim, seed, k_pass=126):
    """Lognormal data whose sample rows (every stride-th row: the threshold sample's of a pass of ``k_pass`` where it
    estimates, tiled.sample_rows) are made the best items of every user: users gathered around a centre c, those
    items near c (the nearest under l2, the closest in angle under cosine) and the others near -2 c. An estimate
    taken over them lies far above every user's k-th best."""
    users, items = _lognormal(n_users, n_items, dim, seed)
    from recall.backends.cupy.selection import seed_size

    size = seed_size(n_items, k_pass, 1 << 20)  # k = 100 in fast mode keeps k + 25 + 1
    stride = n_items // size
    planted = np.arange(stride // 2, n_items, stride)[:size]
    rng = np.random.default_rng(seed + 7)
    centre = rng.standard_normal(dim).astype(np.float32)
    centre *= 3.0 * np.sqrt(dim) / np.linalg.norm(centre)
    users += centre
    items -= 2.0 * centre  # every other item far from the users, and pointing away
    # Spread wider than float16 score tiles round (d = 200 takes them): no crowd of ties at the estimate.
    items[planted] = centre + rng.standard_normal((planted.size, dim)).astype(np.float32)
    return users, items


def _assert_as_from_bounds(precision, st, got, plain, want, users, items, k, metric, sample, excl=None):
    """A search whose passes started below their last candidates (``got``, its stats ``st``) against the same search
    from lower bounds (``plain``, seed_estimate=False) and the float32 search (``want``): on the certified route
    (``precision`` "exact") both bit for bit the float32 search's; in fast mode ``got`` the oracle's for the users
    ``sample``, and both passes' lists the same for nearly every user (both hold every user's top k before the
    re-scoring; a user that fell back may differ by a rounding step's swap)."""
    if precision == "exact":
        assert st["route"] == "certified", st
        oracle.assert_same_result(got, want)
        oracle.assert_same_result(plain, want)
        return
    ex = None if excl is None else {i: excl[u] for i, u in enumerate(sample) if u in excl}
    oracle.assert_topk_close(as_numpy(got.indices)[sample], as_numpy(got.scores)[sample], users[sample], items, k,
                             metric, exclude=ex)
    assert (as_numpy(got.indices) == as_numpy(plain.indices)).all(axis=1).mean() >= 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("metric, k, estimated", [("ip", 100, False), ("ip", 1000, True), ("l2", 100, True),
                                                  ("cosine", 100, True), ("l2", 1000, True)])
@pytest.mark.parametrize("precision", ["fast", "exact"])
def test_gpu_estimates_keep_every_answer(gpu_available, monkeypatch, metric, k, estimated, precision):
    # A seeded catalogue (70,000 items), the fused kernels: with the estimate and without, the same answer (exact
    # mode's route bit for bit; fast mode against the oracle), and the estimate taken where the sample is of evenly
    # spaced rows: cosine and l2 (a catalogue past fast.CENTROID_MAX_ITEMS), and ip where the estimate is tight
    # (selection.ESTIMATE_EVEN_MU: k = 1,000 here; at k = 100 half the sample is the largest norms, whose (k + 3)-th
    # best is the start: selection.start_rank).
    if not gpu_available:
        pytest.skip("no usable GPU")
    from recall.engine import fast as fast_mode

    monkeypatch.setattr(fast_mode, "MIN_SCORES", 0)  # 2,000 x 70,000 scores would decline for their number
    monkeypatch.setattr(fast_mode, "MAX_CANDIDATE_SHARE", 1.0)  # and k = 1,000 for its share of the items
    users, items = _lognormal(2000, 70000, 48, seed=44)
    rng = np.random.default_rng(45)
    excl = {u: rng.choice(70000, 300, replace=False).tolist() for u in range(0, 2000, 7)}
    excl[3] = list(range(0, 70000, 2))
    want = Engine(items, metric=metric, device="gpu", options=EngineOptions(certified_exact="off")).search(
        users, k, exclude=excl)
    opts = EngineOptions(certified_exact="on") if precision == "exact" else EngineOptions()
    engine = Engine(items, metric=metric, device="gpu", precision=precision, options=opts)
    got = engine.search(users, k, exclude=excl)
    st = engine.stats
    assert (st["seed_estimate"] > 0) == estimated and st["fallback_users"] <= 20, st
    off = Engine(items, metric=metric, device="gpu", precision=precision,
                 options=EngineOptions(seed_estimate=False, certified_exact=opts.certified_exact))
    plain = off.search(users, k, exclude=excl)
    assert "seed_estimate" not in off.stats or off.stats["seed_estimate"] == 0, off.stats
    _assert_as_from_bounds(precision, st, got, plain, want, users, items, k, metric, np.arange(0, 2000, 9), excl)


@pytest.mark.gpu
@pytest.mark.parametrize("metric, dim, k", [("l2", 48, 1000), ("cosine", 48, 100), ("l2", 200, 1000)])
def test_gpu_an_estimate_too_high_is_caught(gpu_available, monkeypatch, metric, dim, k):
    # Items planted at the sample's rows outscore the rest for every user: the estimate over them lies above most
    # users' k-th best, those users end short, and the certificate sends them to the widened pass. dim 200: fast
    # mode's float16 rows of more than 128 columns take cuBLAS + filter (float16 tiles), the same seed.
    if not gpu_available:
        pytest.skip("no usable GPU")
    from recall.engine import fast as fast_mode

    monkeypatch.setattr(fast_mode, "MIN_SCORES", 0)
    monkeypatch.setattr(fast_mode, "MAX_CANDIDATE_SHARE", 1.0)  # k = 1,000 would decline for its share of the items
    monkeypatch.setattr(fast_mode, "MAX_CANDIDATE_SHARE_TILES16", 1.0)  # (d = 200: float16 score tiles)
    # (k = 1,000 under l2: its estimate applies whatever the catalogue's size, fast.CENTROID_MAX_ITEMS.)
    from recall.core import certificate

    users, items = _planted(1000, 70000, dim, 46, k + certificate.margin(k) + 1)
    want = Engine(items, metric=metric, device="gpu", options=EngineOptions(certified_exact="off")).search(users, k)
    for precision, opts in (("exact", EngineOptions(certified_exact="on")), ("fast", EngineOptions())):
        engine = Engine(items, metric=metric, device="gpu", precision=precision, options=opts)
        got = engine.search(users, k)
        st = engine.stats
        assert st["seed_estimate"] > 0 and st["estimate_short_users"] > 0, st
        if precision == "exact":
            oracle.assert_same_result(got, want)
        else:
            sample = np.arange(0, 1000, 7)
            oracle.assert_topk_close(as_numpy(got.indices)[sample], as_numpy(got.scores)[sample], users[sample],
                                     items, k, metric)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [100, 1000])
def test_gpu_starts_lie_near_the_kth_best_on_heavy_tailed_l2(gpu_available, monkeypatch, k):
    # l2 on item norms of a heavy tail (the bench's ``popular``: a few items 10-1,000x the median), d = 32: fast
    # mode's users hold a shift and bound factors, every item 2^15 in the shift column. The seed's margin takes that
    # column's product on its own (certificate.seed_margin): each user's start (Backend.run_blocks' left_out) leaves
    # a few times the candidates the pass keeps above it (at most 4x). Through the rows' whole norms it left about
    # 93% of the items.
    if not gpu_available:
        pytest.skip("no usable GPU")
    import cupy

    from recall.bench.workloads import generate
    from recall.engine import fast as fast_mode

    monkeypatch.setattr(fast_mode, "MIN_SCORES", 0)
    monkeypatch.setattr(fast_mode, "MAX_CANDIDATE_SHARE", 1.0)
    users, items = generate("popular", 1000, 70000, 32, seed=5)
    engine = Engine(items, metric="l2", device="gpu", precision="fast")
    passes = []
    real = engine.run

    def run(users16, k_pass, excl, out_vals, out_rows, items=None, left_out=None, **kw):
        wait = real(users16, k_pass, excl, out_vals, out_rows, items=items, left_out=left_out, **kw)
        passes.append((users16, k_pass, left_out))
        return wait

    monkeypatch.setattr(engine, "run", run)
    got = engine.search(users, k)
    st = engine.stats
    # The start: an estimate over evenly spaced rows (70,000 items: more than fast.CENTROID_MAX_ITEMS).
    assert st["fallback_users"] == 0 and st["seed_estimate"] > 0, st
    users16, wide, left = next(p for p in passes if p[2] is not None)
    vecs16 = fast_mode._state(engine).resident.vecs
    starts = cupy.asarray(left)[:200]
    t = cupy.asarray(users16[:200]).astype(cupy.float32) @ vecs16.astype(cupy.float32).T  # the sums, near enough
    above = cupy.asnumpy((t > starts[:, None]).sum(axis=1))
    assert np.median(above) <= 4 * wide, (np.median(above), wide)
    sample = np.arange(0, 1000, 9)
    oracle.assert_topk_close(as_numpy(got.indices)[sample], as_numpy(got.scores)[sample], users[sample], items, k,
                             "l2")


@pytest.mark.gpu
@pytest.mark.parametrize("kind, metric, dim", [("skewed", "ip", 64), ("skewed", "l2", 32), ("normal", "cosine", 48),
                                               ("int8", "ip", 64)])
def test_gpu_passes_start_at_what_the_certificate_needs(gpu_available, monkeypatch, kind, metric, dim):
    # 4,096 items at k = 10: the float16 pass keeps 27 candidates a user but starts at what the certificate needs,
    # k + NEED_SLACK = 13 items above the start (selection.start_rank: the sample's 13th best, or an estimate of it),
    # so that most users hold fewer than 27, each certified against its start. The answers: exact mode's float32
    # search's bit for bit on the certified route, the oracle's in fast mode, and both the same as passes that start
    # at the 27th best (seed_estimate=False). Small integers (int8): tied scores at the start cannot be certified
    # against it; those users widen, their answers exact all the same.
    if not gpu_available:
        pytest.skip("no usable GPU")
    from recall.bench.workloads import generate
    from recall.engine import fast as fast_mode

    monkeypatch.setattr(fast_mode, "SMALL_CATALOGUE_MIN_SCORES", 0)  # 3,000 x 4,096 scores would take exact mode
    monkeypatch.setattr(fast_mode, "SAMPLE_MIN", 1 << 30)  # no sample of users first: every user in one pass
    users, items = generate(kind, 3000, 4096, dim, seed=7)
    k = 10
    want = Engine(items, metric=metric, device="gpu", options=EngineOptions(certified_exact="off")).search(users, k)
    for precision, opts in (("exact", EngineOptions(certified_exact="on")), ("fast", EngineOptions())):
        engine = Engine(items, metric=metric, device="gpu", precision=precision, options=opts)
        got = engine.search(users, k)
        st = engine.stats
        need = k + fast_mode.NEED_SLACK
        assert st["seed_estimate"] + st["seed_need_rank"] > 0 and st["seed_need_rank"] in (0, need), st
        if metric != "cosine":  # a sample half of the items ranked first (ip, l2): most start near their k-th best
            assert st["estimate_short_users"] > 0, st  # users that hold fewer than the pass keeps
        if kind != "int8":
            assert st["widened_users"] <= 30 and st["fallback_users"] == 0, st
        bound = Engine(items, metric=metric, device="gpu", precision=precision,
                       options=EngineOptions(seed_estimate=False, certified_exact=opts.certified_exact))
        plain = bound.search(users, k)
        assert bound.stats.get("seed_need_rank", 0) == 0 and bound.stats.get("seed_estimate", 0) == 0, bound.stats
        _assert_as_from_bounds(precision, st, got, plain, want, users, items, k, metric, np.arange(0, 3000, 11))
