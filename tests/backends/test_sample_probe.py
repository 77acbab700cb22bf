"""Which rows a ranked threshold sample keeps evenly spaced (``tiled.probed_even_every``): found from a probe of the
first search's users, checked against every user's exact scores; the backends' samples built from it; the answers
unchanged (any rows give a valid seed)."""
from __future__ import annotations

import numpy as np
import pytest

from recall import Engine, EngineOptions
from recall.backends import cuda_status, tiled
from recall.backends.tiled import probed_even_every, sample_rows
from recall.bench.workloads import generate
from recall.core.metrics import row_norms

usable, reason = cuda_status()
on_gpu = pytest.mark.skipif(not usable, reason=f"no usable GPU: {reason}")

def _hot(n_users, n_items, dim, seed=0):
    # Normal users and items, an eighth of the items pulled far along one direction: the largest norms all point
    # the same way, away from half the users.
    rng = np.random.default_rng(seed)
    users = rng.standard_normal((n_users, dim)).astype(np.float32)
    items = rng.standard_normal((n_items, dim)).astype(np.float32)
    hot = rng.permutation(n_items)[: n_items // 8]
    items[hot, 0] += np.float32(27.0) * np.abs(items[hot, 0])
    return users, items


def _data(case, n_users=400, n_items=4096, dim=32):
    return _hot(n_users, n_items, dim) if case == "hot" else generate(case, n_users, n_items, dim, seed=3)


def _passed(users, items, rows, rank):
    # Every user's exact scores (float64) at or above its rank-th best of the sampled rows, over every item: mean.
    scores = users.astype(np.float64) @ items.astype(np.float64).T
    thr = -np.partition(-scores[:, rows], rank - 1, axis=1)[:, rank - 1]
    return float((scores >= thr[:, None]).sum(axis=1).mean())


@pytest.mark.parametrize("case, rank, want", [
    ("clustered", 53, 0), ("skewed", 53, 0), ("popular", 13, 0),  # norms spread: the largest norms are everyone's
    ("hot", 53, 2), ("hot", 13, 2)])                              # they point one way: the hedge
def test_the_probe_keeps_evenly_spaced_rows_only_where_they_pass_fewer_scores(case, rank, want):
    users, items = _data(case)
    norms = row_norms(np, items)
    got = probed_even_every(np, users, items, items.shape[0], 512, norms, rank)
    assert got == want
    # Against every user's exact scores, not the probe's: the layout chosen passes fewer.
    passed = {e: _passed(users, items, sample_rows(np, items.shape[0], 512, norms, e), rank) for e in (0, 2)}
    assert passed[got] < passed[2 - got], passed


def test_the_probe_needs_users_and_a_choice(monkeypatch):
    users, items = _data("clustered")
    norms = row_norms(np, items)
    n = items.shape[0]
    assert probed_even_every(np, users, items, n, 512, norms, 53) == 0
    assert probed_even_every(np, None, items, n, 512, norms, 53) == tiled.EVEN_EVERY
    assert probed_even_every(np, users[: tiled.PROBE_LEAST - 1], items, n, 512, norms, 53) == tiled.EVEN_EVERY
    assert probed_even_every(np, users[: tiled.PROBE_LEAST], items, n, 512, norms, 53) == 0
    assert probed_even_every(np, users, items, n, 512, norms, 0) == tiled.EVEN_EVERY    # no rank
    assert probed_even_every(np, users, items, n, 512, norms, 513) == tiled.EVEN_EVERY  # past the sample
    monkeypatch.setattr(tiled, "EVEN_CHOICES", (2,))
    assert probed_even_every(np, users, items, n, 512, norms, 53) == 2
    monkeypatch.setattr(tiled, "EVEN_CHOICES", (4, 0))
    assert probed_even_every(np, users, items, n, 512, norms, 53) == 0


def test_equal_counts_keep_the_hedge():
    # Items of one norm and users that score every item alike: both layouts pass every item.
    items = np.ones((2048, 4), np.float32)
    users = np.ones((100, 4), np.float32)
    assert probed_even_every(np, users, items, 2048, 256, row_norms(np, items), 10) == tiled.EVEN_EVERY


@pytest.mark.parametrize("case, want", [("clustered", 0), ("hot", 2)])
def test_the_cpu_backend_samples_what_the_probe_found(case, want):
    """The CPU backend's first search seeded at a bound (ranked) probes its users and keeps the sample for later
    searches; answers equal the float64 oracle's."""
    users, items = _data(case, n_users=600, n_items=70_000, dim=16)
    engine = Engine(items, device="cpu", metric="ip", options=EngineOptions(seed_estimate=False))
    k = 700  # (the CPU backend seeds where 8 samples fit in the catalogue)
    got = engine.search(users, k)
    size = engine.stats["seed_sample"]
    assert size
    samples = next(iter(engine.backend._ranked.values()))
    norms = row_norms(np, engine._items)
    np.testing.assert_array_equal(samples[(size, engine.n_items)],
                                  sample_rows(np, engine.n_items, size, norms, want))
    scores = users.astype(np.float64) @ items.astype(np.float64).T
    best = np.argpartition(-scores, k - 1, axis=1)[:, :k]  # (continuous data: no ties at the k-th)
    np.testing.assert_array_equal(np.sort(got.indices, axis=1), np.sort(best, axis=1))
    engine.search(users[:10], k)  # a later search keeps the sample
    np.testing.assert_array_equal(samples[(size, engine.n_items)], sample_rows(np, engine.n_items, size, norms, want))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("precision", ["fast", "exact"])
@pytest.mark.parametrize("case", ["clustered", "hot"])
def test_the_gpu_samples_what_the_probe_found(case, precision):
    """A GPU engine's first search probes its users (fast mode's float16 rows; exact mode's certified route): the
    sample's layout in ``stats`` is the device sample's, and passes no more of every user's exact scores than the
    other layout at the search's size and rank; answers equal the float64 oracle's."""
    import cupy

    users, items = _data(case, n_users=8_000)
    engine = Engine(items, device="gpu", metric="ip", precision=precision)
    k = 50
    got = engine.search(users, k)
    st = engine.stats
    size, every, rank = st["seed_sample"], st.get("seed_even_every"), st.get("seed_need_rank") or k
    assert size and every in tiled.EVEN_CHOICES, st
    n_items = items.shape[0]
    # Exact mode's certified route searches the float16 items too: the resident form whose sample it is.
    resident = [d for d in [engine._items] + ([engine._fast.resident] if engine._fast is not None else [])
                if d.even_every.get((size, n_items)) == every]
    assert resident, st
    rows, _norms, _sums = resident[0].sample(size, n_items, cupy.cuda.get_current_stream())
    norms = cupy.asnumpy(resident[0]._item_norms()[:n_items])  # the order the device ranked by
    rows = cupy.asnumpy(rows)
    np.testing.assert_array_equal(rows, sample_rows(np, n_items, size, norms, every))
    other = sample_rows(np, n_items, size, norms, 2 if every == 0 else 0)
    assert _passed(users, items, rows, rank) <= 1.02 * _passed(users, items, other, rank)
    scores = users.astype(np.float64) @ items.astype(np.float64).T
    best = np.argpartition(-scores, k - 1, axis=1)[:, :k]  # (continuous data: no ties at the k-th)
    np.testing.assert_array_equal(np.sort(got.indices, axis=1), np.sort(best, axis=1))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("case, want", [("clustered", 0), ("hot", 2)])
def test_the_probe_decides_alike_on_the_device(case, want):
    # The probe of CuPy arrays (device users, float16 items as fast mode keeps them): the choice NumPy's makes.
    import cupy

    users, items = _data(case)
    norms = row_norms(np, items)
    assert probed_even_every(np, users, items, items.shape[0], 512, norms, 53) == want
    got = probed_even_every(cupy, cupy.asarray(users, cupy.float16), cupy.asarray(items, cupy.float16),
                            items.shape[0], 512, cupy.asarray(norms), 53)
    assert got == want
