"""``recall.exclusions.normalise``: any accepted form becomes sorted, de-duplicated CSR over user rows; bad input is
an InputError that says what and where."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recall import InputError
from recall.core import exclusions
from recall.core.exclusions import Exclusions, normalise


def _as_lists(ex: Exclusions) -> list[list[int]]:
    return [ex.items[ex.indptr[u]:ex.indptr[u + 1]].tolist() for u in range(ex.indptr.size - 1)]


def test_none_is_empty():
    ex = normalise(None, 4, 10)
    np.testing.assert_array_equal(ex.indptr, np.zeros(5))
    assert ex.items.size == 0
    assert ex.indptr.dtype == np.int64 and ex.items.dtype == np.int64


def test_no_exclusions_hold_no_per_user_memory_and_block_as_zeros():
    ex = normalise(None, 1_000_000, 10)
    assert ex.indptr.shape == (1_000_001,) and ex.indptr.nbytes == 8_000_008
    assert ex.indptr.base is not None and ex.indptr.strides == (0,)  # a view of one zero, not 8 MB of them
    with pytest.raises(ValueError):
        ex.indptr[5] = 1  # read-only: nothing may write through it
    ptr, items = ex.block(32_768, 65_536)
    np.testing.assert_array_equal(ptr, np.zeros(32_769))
    assert ptr.flags.writeable and items.size == 0
    sub = ex.subset(np.array([3, -1, 999_999]))
    np.testing.assert_array_equal(sub.indptr, [0, 0, 0, 0])
    assert ex.count(12) == 0 and ex.window(2, 5) is ex


def test_mapping_sorted_and_deduplicated():
    ex = normalise({2: [9, 1, 9, 4], 0: (3, 3), 3: []}, 4, 10)
    assert _as_lists(ex) == [[3], [], [1, 4, 9], []]
    assert [ex.count(u) for u in range(4)] == [1, 0, 3, 0]
    assert ex.indptr.dtype == np.int64 and ex.items.dtype == np.int64


def test_mapping_value_types():
    ex = normalise({np.int64(1): np.array([5, 2], np.int32), 0: {7, 6}, 2: range(3), 3: (i for i in [8, 8])}, 4, 10)
    assert _as_lists(ex) == [[6, 7], [2, 5], [0, 1, 2], [8]]
    ex = normalise({0: np.array([4, 1], np.uint16)}, 1, 10)
    assert _as_lists(ex) == [[1, 4]]


def test_csr_sorted_and_deduplicated_within_users():
    indptr = np.array([0, 3, 3, 7])
    rows = np.array([5, 0, 5, 9, 2, 9, 2])
    ex = normalise((indptr, rows), 3, 10)
    assert _as_lists(ex) == [[0, 5], [], [2, 9]]
    np.testing.assert_array_equal(ex.indptr, [0, 2, 2, 4])


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32, np.int16])
def test_csr_item_rows_keep_int32_and_widen_the_rest(dtype):
    """A CSR pair of int32 item rows (a job's) stays int32, taken as it is where already sorted and unique; other
    widths become int64. Range errors name the row either way."""
    indptr = np.array([0, 2, 2, 5], np.int32)
    rows = np.array([1, 7, 0, 3, 9], dtype)
    ex = normalise((indptr, rows), 3, 10)
    want = np.int32 if dtype == np.int32 else np.int64
    assert ex.items.dtype == want and ex.indptr.dtype == np.int64
    assert np.shares_memory(ex.items, rows) == (dtype in (np.int32, np.int64))  # no copy
    assert _as_lists(ex) == [[1, 7], [], [0, 3, 9]]
    unsorted = normalise((indptr, np.array([7, 1, 9, 0, 9], dtype)), 3, 10)
    assert unsorted.items.dtype == want and _as_lists(unsorted) == [[1, 7], [], [0, 9]]
    with pytest.raises(InputError, match=r"item row 10 \(user row 2\)"):
        normalise((indptr, np.array([1, 7, 0, 3, 10], dtype)), 3, 10)


def test_same_pairs_in_dict_and_csr_are_equal():
    d = {0: [4, 2], 2: [1, 1, 0]}
    c = (np.array([0, 2, 2, 5]), np.array([2, 4, 1, 1, 0]))
    a, b = normalise(d, 3, 5), normalise(c, 3, 5)
    np.testing.assert_array_equal(a.indptr, b.indptr)
    np.testing.assert_array_equal(a.items, b.items)


def test_block_is_rebased():
    ex = normalise({0: [1], 1: [2, 3], 2: [], 3: [0, 4]}, 4, 5)
    ptr, items = ex.block(1, 4)
    np.testing.assert_array_equal(ptr, [0, 2, 2, 4])
    np.testing.assert_array_equal(items, [2, 3, 0, 4])
    ptr, items = ex.block(2, 3)
    np.testing.assert_array_equal(ptr, [0, 0])
    assert items.size == 0


def test_zero_users():
    for empty in (None, {}, (np.array([0]), np.array([], np.int64))):
        ex = normalise(empty, 0, 10)
        np.testing.assert_array_equal(ex.indptr, [0])
        assert ex.items.size == 0


def test_empty_forms():
    for empty in ({}, {1: []}, (np.zeros(3, np.int64), np.zeros(0, np.int64)), ([0, 0, 0], [])):
        ex = normalise(empty, 2, 10)
        np.testing.assert_array_equal(ex.indptr, [0, 0, 0])
        assert ex.items.size == 0


@pytest.mark.parametrize("exclude, needle", [
    ({0: [10]}, r"item row 10 \(user row 0\) is out of range for 10 items"),
    ({1: [3, -1]}, r"item row -1 \(user row 1\)"),
    ({3: [0]}, r"user row 3 is out of range for 3 users"),
    ({-1: [0]}, r"user row -1 is out of range"),
    ({True: [0]}, r"user key True"),
    ({"0": [0]}, r"user key '0'"),
    ({0.0: [0]}, r"user key 0.0"),
    ({0: [1.0]}, r"items of user row 0 must be integers"),
    ({0: ["1"]}, r"must be integers"),
    ((np.array([0, 1, 2]), np.array([1, 2])), r"indptr has 3 entries, expected n_users \+ 1 = 4"),
    ((np.array([1, 1, 2, 2]), np.array([1, 2])), r"indptr must start at 0"),
    ((np.array([0, 2, 1, 2]), np.array([1, 2])), r"never decrease"),
    ((np.array([0, 1, 1, 1]), np.array([1, 2])), r"end at len\(item_rows\)"),
    ((np.array([0, 1, 1, 3]), np.array([1, 2])), r"end at len\(item_rows\)"),
    ((np.array([0.0, 1, 1, 2]), np.array([1, 2])), r"indptr must be integers"),
    ((np.array([0, 1, 1, 2]), np.array([1.0, 2.0])), r"item rows must be integers"),
    ((np.array([0, 1, 1, 2]), np.array([1, 10])), r"item row 10 \(user row 2\)"),
    ([np.array([0, 1, 1, 2]), np.array([1, 2])], r"got list"),
    ((np.array([0, 0, 0, 0]), np.array([]), None), r"got tuple"),
    ("0:1", r"got str"),
])
def test_bad_input(exclude, needle):
    with pytest.raises(InputError, match=needle):
        normalise(exclude, 3, 10)


def test_out_of_range_names_the_right_user_in_csr():
    indptr = np.array([0, 2, 2, 5])
    rows = np.array([1, 2, 3, 4, 99])
    with pytest.raises(InputError, match=r"item row 99 \(user row 2\)"):
        normalise((indptr, rows), 3, 10)


@given(n_users=st.integers(0, 8), n_items=st.integers(1, 30), data=st.data())
@settings(max_examples=100)
def test_property_csr_is_sorted_unique_and_complete(n_users, n_items, data):
    pairs = data.draw(st.lists(st.tuples(st.integers(0, max(n_users - 1, 0)), st.integers(0, n_items - 1)),
                               max_size=60 if n_users else 0))
    as_dict: dict[int, list[int]] = {}
    for u, i in pairs:
        as_dict.setdefault(u, []).append(i)
    ex = normalise(as_dict, n_users, n_items)
    assert ex.indptr.shape == (n_users + 1,) and ex.indptr[0] == 0 and ex.indptr[-1] == ex.items.size
    assert np.all(np.diff(ex.indptr) >= 0)
    for u, got in enumerate(_as_lists(ex)):
        assert got == sorted({i for uu, i in pairs if uu == u})
    # The same pairs in CSR form, shuffled within users, normalise to the same thing.
    order = data.draw(st.permutations(range(len(pairs))))
    shuffled = [pairs[j] for j in order]
    shuffled.sort(key=lambda p: p[0])  # CSR groups by user; order within a user stays shuffled
    indptr = np.zeros(n_users + 1, np.int64)
    for u, _ in shuffled:
        indptr[u + 1] += 1
    indptr = np.cumsum(indptr)
    ex2 = normalise((indptr, np.array([i for _, i in shuffled], dtype=np.int64)), n_users, n_items)
    np.testing.assert_array_equal(ex2.indptr, ex.indptr)
    np.testing.assert_array_equal(ex2.items, ex.items)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int16])
def test_group_skips_negative_rows_and_takes_any_integer_width(dtype):
    rng = np.random.default_rng(3)
    users = rng.integers(-1, 50, 2_000).astype(dtype)
    items = rng.integers(-1, 300, 2_000).astype(dtype)
    indptr, rows = exclusions.group(users, items, 50, sort_unique=True)
    # int32 pairs (a job's) stay 4 bytes a row; any other width is grouped as int64
    assert rows.dtype == (np.int32 if dtype == np.int32 else np.int64) and indptr[-1] == rows.size
    assert indptr.dtype == np.int64
    for u in range(50):
        want = np.unique(items[(users == u) & (items >= 0)]).astype(np.int64)
        np.testing.assert_array_equal(rows[indptr[u]:indptr[u + 1]], want)
    indptr, rows = exclusions.group(users, items, 50, sort_unique=False)  # file order kept
    for u in range(50):
        np.testing.assert_array_equal(rows[indptr[u]:indptr[u + 1]], items[(users == u) & (items >= 0)])
