"""The 64-bit key packing of the selection (recall.core.keys): one integer order that is the tie rule."""
from __future__ import annotations

import numpy as np

from recall.core import keys


def test_select_matches_a_stable_sort():
    rng = np.random.default_rng(4)
    scores = rng.integers(-3, 4, size=(50, 30)).astype(np.float32)
    scores[0, :5] = -0.0
    scores[1, :5] = 0.0
    rows = np.stack([rng.permutation(100)[:30] for _ in range(50)]).astype(np.int64)
    rows[2, 10:] = -1
    vals, got = keys.select(np, scores, rows, 12)
    for u in range(50):
        valid = rows[u] >= 0
        order = np.lexsort((rows[u][valid], -scores[u][valid]))[:12]
        want = rows[u][valid][order]
        np.testing.assert_array_equal(got[u][: want.size], want)
        np.testing.assert_array_equal(vals[u][: want.size], scores[u][valid][order])
        assert np.all(got[u][want.size:] == -1) and np.all(np.isneginf(vals[u][want.size:]))


def test_select_orders_like_the_tie_rule():
    scores = np.array([[-0.0, 0.0, 1.5, -2.0, 1.5], [3.0, 3.0, 3.0, 3.0, 3.0]], np.float32)
    rows = np.array([[5, 3, 9, 1, 2], [4, -1, 0, 8, 2]])
    vals, idx = keys.select(np, scores, rows, 6)
    np.testing.assert_array_equal(idx, [[2, 9, 3, 5, 1, -1], [0, 2, 4, 8, -1, -1]])
    np.testing.assert_array_equal(vals[0, :5], [1.5, 1.5, 0.0, 0.0, -2.0])
    assert np.isneginf(vals[0, 5]) and np.isneginf(vals[1, 4:]).all()
    assert not np.signbit(vals[0, 3])  # -0.0 is reported as 0.0: the two tie


def test_merge_topk_of_consecutive_ranges_is_the_whole_selection():
    """recall.core.results.merge_topk (the item shards' merge): equal to one selection over every item, ties to the
    lower row across range boundaries, ranges narrower than k, an empty range, and -0.0 kept as -0.0."""
    from recall.core.results import merge_topk

    rng = np.random.default_rng(11)
    n, n_items, k = 40, 37, 9
    scores = rng.integers(-2, 3, size=(n, n_items)).astype(np.float32)
    scores[0] = -0.0
    scores[1, :20] = 0.0
    scores[1, 20:] = -0.0
    scores[2] = 5.0  # every item ties
    rows = np.broadcast_to(np.arange(n_items), (n, n_items))
    want_vals, want_rows = keys.select(np, scores, rows, k)
    bounds = [0, 4, 4, 13, 30, n_items]  # one empty range, ranges narrower than k
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        width = min(k, hi - lo)
        v, r = keys.select(np, scores[:, lo:hi], rows[:, lo:hi], width) if hi > lo else \
            (np.zeros((n, 0), np.float32), np.zeros((n, 0), np.int64))
        # A part's own scores, as a search of the range returns them (-0.0 included).
        v = np.where(r >= 0, np.take_along_axis(scores, np.maximum(r, 0), axis=1), -np.inf).astype(np.float32)
        parts.append((v, r))
    vals, got = merge_topk(np, parts, k)
    np.testing.assert_array_equal(got, want_rows)
    np.testing.assert_array_equal(vals, want_vals)
    np.testing.assert_array_equal(got[2], np.arange(k))
    assert np.signbit(vals[0]).all()  # -0.0 everywhere, in row order
    assert not np.signbit(vals[1]).any() and np.array_equal(got[1], np.arange(k))
    np.testing.assert_array_equal(np.signbit(vals[1]), np.signbit(np.take_along_axis(scores[1:2], got[1:2], 1))[0])
    wide, wide_rows = merge_topk(np, parts, n_items + 5)  # wider than the parts hold: padded at the end
    held = sum(r.shape[1] for _, r in parts)
    assert (wide_rows[:, :held] >= 0).all() and np.isfinite(wide[:, :held]).all()
    assert (wide_rows[:, held:] == -1).all() and np.isneginf(wide[:, held:]).all()
    nothing = merge_topk(np, [(np.zeros((3, 0), np.float32), np.zeros((3, 0), np.int64))] * 2, 4)
    assert (nothing[1] == -1).all() and np.isneginf(nothing[0]).all() and nothing[0].shape == (3, 4)
