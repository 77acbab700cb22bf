"""Shared item filters (allow / deny, per search or kept by the engine) with per-user exclusions, against the float64
oracle on both backends: never a leak, k results whenever k items pass, padding otherwise, ties to the lower row."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from recall import Engine, InputError

from oracle import as_numpy, filtered_topk, int_matrix, score_matrix


def _want(users, items, k, metric="ip", passing=None, exclude=None):
    """The oracle's (rows, scores) with a shared mask ``passing`` and exclusions (``oracle.filtered_topk``)."""
    return filtered_topk(users, items, k, metric, passing, exclude)


def _mask(rows, n):
    m = np.zeros(n, bool)
    m[np.asarray(rows, np.int64)] = True
    return m


def _check(res, want_rows, want_vals):
    np.testing.assert_array_equal(as_numpy(res.indices), want_rows)
    np.testing.assert_array_equal(as_numpy(res.scores), want_vals.astype(np.float32))


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_allow_deny_and_exclusions_match_the_oracle(device, metric):
    rng = np.random.default_rng(0)
    items, users = int_matrix(rng, 400, 6), int_matrix(rng, 37, 6)
    allow = rng.choice(400, 150, replace=False)
    deny = rng.choice(400, 80, replace=False)
    full = score_matrix(users, items, metric)
    # Exclude each user's best allowed item and an item tied with its k-th allowed score.
    excl = {}
    for u in range(0, 37, 2):
        ok = np.setdiff1d(allow, deny)
        ranked = ok[np.lexsort((ok, -full[u, ok]))]
        excl[u] = [int(ranked[0]), int(ranked[9])]
    passing = _mask(allow, 400) & ~_mask(deny, 400)
    engine = Engine(items, metric=metric, device=device)
    for k in (1, 10, 69, 200):
        _check(engine.search(users, k, exclude=excl, allow=allow, deny=deny), *_want(users, items, k, metric,
                                                                                     passing, excl))
    # A boolean mask is the same filter as its rows.
    _check(engine.search(users, 10, allow=_mask(allow, 400), deny=deny), *_want(users, items, 10, metric, passing))


def test_kept_filter_combines_with_a_searchs_own(device):
    rng = np.random.default_rng(1)
    items, users = int_matrix(rng, 300, 5), int_matrix(rng, 20, 5)
    engine = Engine(items, device=device)
    day = rng.choice(300, 120, replace=False)
    engine.set_item_filter(allow=day)
    assert engine.item_filter.n_passing == 120
    _check(engine.search(users, 15), *_want(users, items, 15, passing=_mask(day, 300)))
    extra = rng.choice(300, 40, replace=False)
    both = _mask(day, 300) & ~_mask(extra, 300)
    _check(engine.search(users, 15, deny=extra), *_want(users, items, 15, passing=both))
    pending = engine.search_async(users, 15, deny=extra)
    _check(pending.result(), *_want(users, items, 15, passing=both))
    engine.set_item_filter()  # removed: every item again
    _check(engine.search(users, 15), *_want(users, items, 15))


def test_fewer_allowed_than_k_and_none_allowed_pad(device):
    rng = np.random.default_rng(2)
    items, users = int_matrix(rng, 100, 4), int_matrix(rng, 9, 4)
    engine = Engine(items, device=device)
    res = engine.search(users, 8, allow=[3, 50, 7])
    assert (as_numpy(res.indices)[:, 3:] == -1).all() and np.isneginf(as_numpy(res.scores)[:, 3:]).all()
    _check(res, *_want(users, items, 8, passing=_mask([3, 7, 50], 100)))
    empty = engine.search(users, 4, allow=np.zeros(0, np.int64))
    assert (as_numpy(empty.indices) == -1).all() and np.isneginf(as_numpy(empty.scores)).all()
    assert (as_numpy(engine.search(users, 4, deny=np.ones(100, bool)).indices) == -1).all()


def test_ids_are_mapped_from_the_catalogue(device):
    rng = np.random.default_rng(3)
    items, users = int_matrix(rng, 60, 4), int_matrix(rng, 5, 4)
    ids = np.array([f"item-{i}" for i in range(60)], object)
    res = Engine(items, ids=ids, device=device).search(users, 6, allow=np.arange(10, 60, 3))
    rows = as_numpy(res.indices)
    assert np.all(res.ids[rows >= 0] == ids[rows[rows >= 0]])


def test_multi_interest_and_rescore_honour_the_filter(device):
    rng = np.random.default_rng(4)
    items = int_matrix(rng, 200, 5)
    users3 = np.stack([int_matrix(rng, 12, 5), int_matrix(rng, 12, 5)], axis=1)
    allow = rng.choice(200, 70, replace=False)
    engine = Engine(items, device=device)
    got = engine.search(users3, 9, aggregate="max", allow=allow, exclude={0: [int(allow[0])]})
    full = np.maximum(score_matrix(users3[:, 0], items), score_matrix(users3[:, 1], items))
    passing = _mask(allow, 200)
    for u in range(12):
        ok = np.flatnonzero(passing)
        if u == 0:
            ok = ok[ok != allow[0]]
        want = ok[np.lexsort((ok, -full[u, ok]))][:9]
        np.testing.assert_array_equal(as_numpy(got.indices)[u], want)
    lists = [rng.integers(0, 200, 30) for _ in range(12)]
    res = engine.rescore(users3[:, 0], lists, 5, deny=allow)
    rows = as_numpy(res.indices)
    assert not np.isin(rows[rows >= 0], allow).any()
    full0 = score_matrix(users3[:, 0], items)
    for u, lst in enumerate(lists):
        ok = np.setdiff1d(np.unique(lst), allow)
        want = ok[np.lexsort((ok, -full0[u, ok]))][:5]
        np.testing.assert_array_equal(rows[u, :want.size], want)


def test_bad_filters_are_refused(device):
    engine = Engine(np.eye(4, dtype=np.float32), device=device)
    with pytest.raises(InputError, match="allow: item row 4 is out of range for 4 items"):
        engine.search(np.eye(4, dtype=np.float32), 2, allow=[1, 4])
    with pytest.raises(InputError, match=r"deny: a boolean mask must have one entry per item \(4\)"):
        engine.set_item_filter(deny=np.ones(3, bool))
    with pytest.raises(InputError, match="expected item rows"):
        engine.search(np.eye(4, dtype=np.float32), 2, allow=np.array([0.5]))
    # A 0/1 mask given as integers would, read as rows, pass items 0 and 1 alone: refused, saying how to pass it.
    wide = Engine(np.eye(9, dtype=np.float32), device=device)
    mask = np.array([1, 0, 1, 1, 0, 0, 1, 0, 1], np.int8)
    with pytest.raises(InputError, match=r"allow: 9 integers, each 0 or 1, one per item: a mask given as integers\?"):
        wide.search(np.eye(9, dtype=np.float32), 2, allow=mask)
    with pytest.raises(InputError, match="deny: 9 integers"):
        wide.set_item_filter(deny=mask.tolist())
    got = wide.search(np.eye(9, dtype=np.float32), 2, allow=mask.astype(bool))
    assert set(as_numpy(got.indices).ravel().tolist()) <= {0, 2, 3, 6, 8, -1}
    assert as_numpy(wide.search(np.eye(9, dtype=np.float32), 1, allow=[0, 1, 1]).indices).ravel().tolist() == [
        0, 1, 0, 0, 0, 0, 0, 0, 0]  # rows with repeats, fewer than the items: rows


@settings(max_examples=40)
@given(data=st.data())
def test_property_never_a_leak_and_equal_to_the_oracle(device, data):
    seed = data.draw(st.integers(0, 2 ** 16))
    rng = np.random.default_rng(seed)
    n_items = data.draw(st.integers(1, 60))
    n_users = data.draw(st.integers(1, 12))
    dim = data.draw(st.integers(1, 5))
    items, users = int_matrix(rng, n_items, dim, -1, 2), int_matrix(rng, n_users, dim, -1, 2)  # ties everywhere
    k = data.draw(st.integers(1, n_items + 3))
    allow = rng.integers(0, n_items, rng.integers(0, n_items + 1)) if data.draw(st.booleans()) else None
    deny = rng.integers(0, n_items, rng.integers(0, n_items + 1)) if data.draw(st.booleans()) else None
    excl = {u: rng.integers(0, n_items, rng.integers(0, n_items + 1)).tolist() for u in range(n_users)
            if rng.random() < 0.5}
    passing = np.ones(n_items, bool)
    if allow is not None:
        passing &= _mask(allow, n_items)
    if deny is not None:
        passing &= ~_mask(deny, n_items)
    got = Engine(items, device=device).search(users, k, exclude=excl, allow=allow, deny=deny)
    _check(got, *_want(users, items, k, passing=passing, exclude=excl))
