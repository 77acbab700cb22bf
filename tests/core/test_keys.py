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
