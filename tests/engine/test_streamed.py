"""Items beyond ``item_memory``: kept in host memory and streamed to the device in segments at every search. The
answer must be the resident engine's, bit for bit (small-integer data: float32 is exact, ties everywhere), with
exclusions, item filters, several interests, re-scoring and fast precision, on both backends."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import emulated
from recall import Engine, InputError
from recall.backends import resolve
from recall.core import metrics
from recall.engine import streamed

from oracle import as_numpy, assert_same_result, assert_topk_close, int_matrix, topk


def _memory(device: str, dim: int, metric: str, rows: int) -> int:
    """An item_memory that streams segments of ``rows`` rows."""
    per_row = streamed.row_bytes(resolve(device), metrics.scored_width(metric, dim))
    return 2 * rows * per_row


def _pair(device, items, metric="ip", rows=37, **kw):
    resident = Engine(items, metric=metric, device=device, **kw)
    streaming = Engine(items, metric=metric, device=device, item_memory=_memory(device, items.shape[1], metric, rows),
                       **kw)
    assert streaming.streamed and not resident.streamed
    return resident, streaming


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
@pytest.mark.parametrize("k", [1, 10, 50, 250, 400])
def test_same_answer_as_resident(device: str, metric: str, k: int) -> None:
    rng = np.random.default_rng(1)
    items, users = int_matrix(rng, 300, 6), int_matrix(rng, 70, 6)
    items[:, 0] += 1  # no zero vectors under cosine
    users[:, 0] += 1
    resident, streaming = _pair(device, items, metric)
    got = streaming.search(users, k)
    if metric == "cosine":
        # Normalised vectors are not exact in float32, and a 37-row segment is not searched by the GEMM shapes of
        # the whole catalogue (aligned segments are: the test below), so scores may differ in the last bit.
        assert_topk_close(got.indices, got.scores, users, items, k, metric)
    else:
        assert_same_result(resident.search(users, k), got)
    assert streaming.stats["streamed"] and streaming.stats["item_segments"] == -(-300 // 37)
    want_rows, _ = topk(users, items, min(k, 300), metric)
    if metric == "ip":  # exact in float32 on small integers: the oracle's order, ties to the lower row
        np.testing.assert_array_equal(as_numpy(got.indices), want_rows)


def test_exclusions_filters_and_all_excluded_users(device: str) -> None:
    rng = np.random.default_rng(2)
    items, users = int_matrix(rng, 200, 5), int_matrix(rng, 40, 5)
    resident, streaming = _pair(device, items, rows=23)
    exclude = {0: list(range(200)), 3: [1, 2, 3, 150, 199], 7: list(range(0, 200, 2))}  # user 0: everything
    allow = rng.permutation(200)[:90]
    for kw in ({"exclude": exclude}, {"exclude": exclude, "allow": allow}, {"deny": np.arange(0, 200, 3)}):
        a, b = resident.search(users, 30, **kw), streaming.search(users, 30, **kw)
        assert_same_result(a, b)
    assert (as_numpy(streaming.search(users, 30, exclude=exclude).indices)[0] == -1).all()
    resident.set_item_filter(allow=allow)
    streaming.set_item_filter(allow=allow)
    assert_same_result(resident.search(users, 12, exclude=exclude), streaming.search(users, 12, exclude=exclude))


def test_filtered_catalogue_that_fits_becomes_resident(device: str) -> None:
    rng = np.random.default_rng(3)
    items, users = int_matrix(rng, 1000, 4), int_matrix(rng, 25, 4)
    resident, streaming = _pair(device, items, rows=200)  # item_memory: two segments of 200 rows
    allow = np.arange(10, 60)  # 50 rows: fit in item_memory (the GPU's padding of its transposed copy included)
    assert_same_result(resident.search(users, 7, allow=allow), streaming.search(users, 7, allow=allow))
    view = next(iter(streaming._views.values()))
    assert not view.streamed
    wide = np.arange(0, 1000, 2)  # 500 rows: still streamed
    assert_same_result(resident.search(users, 7, allow=wide), streaming.search(users, 7, allow=wide))


def test_interests_rescore_fast_and_async(device: str) -> None:
    rng = np.random.default_rng(4)
    items = int_matrix(rng, 250, 6)
    multi = int_matrix(rng, 30 * 3, 6).reshape(30, 3, 6)
    resident, streaming = _pair(device, items, rows=31)
    for aggregate in ("max", "sum"):
        assert_same_result(resident.search(multi, 20, aggregate=aggregate),
                           streaming.search(multi, 20, aggregate=aggregate))
    users = multi[:, 0]
    cands = [rng.choice(250, size=int(rng.integers(0, 120)), replace=True) for _ in range(30)]
    assert_same_result(resident.rescore(users, cands, 15), streaming.rescore(users, cands, 15))
    assert_same_result(resident.search(users, 9), streaming.search_async(users, 9).result())
    fast = Engine(items, device=device, precision="fast", item_memory=_memory(device, 6, "ip", 31), options=emulated())
    assert_same_result(resident.search(users, 9), fast.search(users, 9))
    assert fast.stats["precision"] == "exact" and "streamed" in fast.stats["fast_declined"]
    # A filter whose rows fit makes a resident catalogue (on the CPU; the GPU's padded copy keeps this one
    # streamed): fast mode runs there, with the same answer.
    fast_resident = Engine(items, device=device, precision="fast", options=emulated())
    allow = np.arange(0, 250, 5)
    got = fast.search(users, 9, allow=allow)
    assert next(iter(fast._views.values())).streamed == (device == "gpu")
    assert_same_result(fast_resident.search(users, 9, allow=allow), got)


def test_one_item_one_user_no_users(device: str) -> None:
    items = np.array([[1.0, 2.0]], np.float32)
    engine = Engine(np.repeat(items, 3, axis=0), device=device, item_memory=_memory(device, 2, "ip", 1))
    assert engine.streamed
    res = engine.search(np.array([[1.0, 1.0]], np.float32), 5)
    np.testing.assert_array_equal(as_numpy(res.indices), [[0, 1, 2]])  # ties: lower rows first
    assert as_numpy(engine.search(np.zeros((0, 2), np.float32), 5).indices).shape == (0, 3)


def test_segments_and_user_groups_aligned_give_resident_scores_on_any_data(device: str) -> None:
    # Continuous data: each GEMM of a streamed search has the shape of the resident search's over the same rows,
    # so the float32 scores are the same bits, not only the same ranks.
    rng = np.random.default_rng(5)
    items = rng.standard_normal((3 * streamed.ALIGN + 100, 8)).astype(np.float32)
    users = rng.standard_normal((300, 8)).astype(np.float32)
    resident, streaming = _pair(device, items, rows=streamed.ALIGN + 5)
    assert streaming._items.segment_rows == streamed.ALIGN
    assert_same_result(resident.search(users, 40), streaming.search(users, 40))


def test_bad_items_named_by_their_row(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streamed, "PREPARE_ROWS", 16)  # the bad row is in a later chunk
    items = np.ones((100, 3), np.float32)
    items[57, 1] = np.nan
    with pytest.raises(InputError, match="row 57 has a NaN"):
        Engine(items, device=device, item_memory=_memory(device, 3, "ip", 10))
    items[57, 1] = 0.0
    items[61] = 0.0
    with pytest.raises(InputError, match="row 61 is a zero vector"):
        Engine(items, metric="cosine", device=device, item_memory=_memory(device, 3, "cosine", 10))
    with pytest.raises(InputError, match="cannot hold two item rows"):
        Engine(items, device=device, item_memory=1)
    with pytest.raises(InputError, match="item_memory"):
        Engine(items, device=device, item_memory=-5)


@settings(max_examples=25)
@given(n_items=st.integers(3, 90), n_users=st.integers(1, 12), k=st.integers(1, 100), rows=st.integers(1, 40),
       metric=st.sampled_from(["ip", "l2"]), seed=st.integers(0, 2 ** 16), n_excl=st.integers(0, 30))
def test_property_streamed_equals_resident_cpu(n_items, n_users, k, rows, metric, seed, n_excl) -> None:
    rng = np.random.default_rng(seed)
    items, users = int_matrix(rng, n_items, 3, -2, 3), int_matrix(rng, n_users, 3, -2, 3)
    exclude = {int(u): rng.choice(n_items, size=min(n_excl, n_items), replace=False) for u in range(0, n_users, 2)}
    resident, streaming = _pair("cpu", items, metric, rows=min(rows, (n_items - 1) // 2))
    assert_same_result(resident.search(users, k, exclude=exclude), streaming.search(users, k, exclude=exclude))
