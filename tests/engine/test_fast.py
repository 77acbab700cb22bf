"""Fast mode: half-precision scores with a certified exact re-rank must give exact mode's answer."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from oracle import as_numpy
from recall import Engine, InputError
from recall.core import certificate as fast


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
    engine = Engine(items, metric=metric, device=device, precision="fast")
    got = engine.search(users, 40, exclude=excl)
    np.testing.assert_array_equal(as_numpy(got.indices), as_numpy(want.indices))
    np.testing.assert_array_equal(as_numpy(got.scores), as_numpy(want.scores))
    assert engine.stats["precision"] == "fast" and 0 <= engine.stats["fallback_users"] <= 300


@pytest.mark.parametrize("kind", ["normal", "clustered"])
def test_fast_is_exact_on_float_data(device, kind, make_normal, make_clustered):
    make = make_normal if kind == "normal" else make_clustered
    users, items = make(400, 6000, 32, seed=3)
    engine = Engine(items, device=device, precision="fast")
    res = engine.search(users, 50)
    idx, val = as_numpy(res.indices), as_numpy(res.scores)
    oracle.assert_topk_close(idx, val, users, items, 50)
    # Real-valued data certifies nearly everyone: the fallback is the exception, not the path.
    assert engine.stats["fallback_users"] < 40


def test_fast_k_at_least_the_catalogue(device):
    rng = np.random.default_rng(1)
    items, users = _ints(rng, 50, 6), _ints(rng, 20, 6)
    for k in (40, 50, 70):
        want = Engine(items, device=device).search(users, k)
        got = Engine(items, device=device, precision="fast").search(users, k)
        np.testing.assert_array_equal(as_numpy(got.indices), as_numpy(want.indices))


def test_failed_certificates_fall_back_to_exact(device, monkeypatch):
    # With no margin and heavy ties, most certificates fail: the answer must still be exact mode's.
    monkeypatch.setattr(fast, "margin", lambda k: 0)
    rng = np.random.default_rng(2)
    items = rng.integers(-1, 2, size=(2000, 4)).astype(np.float32)
    users = rng.integers(-1, 2, size=(200, 4)).astype(np.float32)
    engine = Engine(items, device=device, precision="fast")
    got = engine.search(users, 10)
    assert engine.stats["fallback_users"] > 100
    want = Engine(items, device=device).search(users, 10)
    np.testing.assert_array_equal(as_numpy(got.indices), as_numpy(want.indices))


def test_unknown_precision_is_an_input_error():
    with pytest.raises(InputError, match="unknown precision 'half'"):
        Engine(np.ones((3, 2), np.float32), device="cpu", precision="half")


@pytest.mark.parametrize("half_scores", [False, True])
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1e-30, 1e-6, 1.0, 1e6, 1e18]), st.integers(1, 70))
def test_error_bound_holds_for_every_pair(half_scores, seed, scale, dim):
    # The certificate is only as good as the bound: |approx - exact| <= E_u for every (user, item), across
    # magnitudes (including the float16 subnormal range after scaling) and dimensions; with half_scores the GEMM's
    # float32 result is scaled by output_scale and rounded to float16, as the GPU's score tiles are.
    rng = np.random.default_rng(seed)
    items = (rng.standard_normal((200, dim)) * scale * np.exp(rng.standard_normal((200, 1)))).astype(np.float32)
    users = (rng.standard_normal((30, dim)) * scale).astype(np.float32)
    items[rng.random(items.shape) < 0.1] *= 1e-4  # tiny components next to large ones
    items[0] = np.abs(items).max()  # one item at the top of the range in every component: the largest score
    users[0] = np.abs(users).max()
    fi = fast.prepare_items(np, items)
    u16, alpha, bound = fast.prepare_users(np, users, fi, half_scores=half_scores)
    raw = u16.astype(np.float32) @ fi.vecs16.astype(np.float32).T
    if half_scores:
        g = np.float32(fast.output_scale(dim))
        stored = (raw * g).astype(np.float16)
        assert np.isfinite(stored).all()
        raw = stored.astype(np.float32) / g
    approx = raw / (alpha[:, None] * fi.scale)
    exact = users.astype(np.float64) @ items.astype(np.float64).T
    assert np.all(np.abs(approx - exact) <= bound[:, None])
