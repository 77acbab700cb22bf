"""``recall.io.parquet.lookup``: id values to rows, by a table indexed by the id (dense integer ids) or by Arrow's
hash lookup, checked against a dict on both paths."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recall.io.parquet import DENSE_SPAN, lookup

I64 = np.iinfo(np.int64)


def _want(values: list, ids: np.ndarray) -> np.ndarray:
    pos = {v: i for i, v in enumerate(ids.tolist())}
    return np.array([pos.get(v, -1) for v in values], np.int64)


def _chunked(values: list, cuts: list[int], type_: pa.DataType) -> pa.ChunkedArray:
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(values)), len(values)]
    return pa.chunked_array([pa.array(values[a:b], type_) for a, b in zip(bounds, bounds[1:])], type_)


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize("ids, values", [
    (np.array([10, 11, 13, 12], np.int64), [13, 10, 14, 9, 12, 11, 11]),  # dense, absent on both sides
    (np.array([I64.max - 2, I64.max, I64.max - 1], np.int64), [I64.max, I64.min, 0, I64.max - 2, -1]),
    (np.array([I64.min, I64.min + 1], np.int64), [I64.max, I64.min + 1, I64.min, 5]),  # differences that wrap
    (np.array([0, 10 ** 12, 7], np.int64), [7, 10 ** 12, 3, 0]),  # sparse: the hash path
])
def test_lookup_by_table_and_by_hash(ids: np.ndarray, values: list, dtype: type) -> None:
    for cuts in ([], [1], [2, 3, 5]):
        got = lookup(_chunked(values, cuts, pa.int64()), ids, dtype)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, _want(values, ids))
    np.testing.assert_array_equal(lookup(pa.array(values, pa.int64()), ids, dtype), _want(values, ids))


def test_lookup_of_strings_and_of_nothing() -> None:
    ids = np.array(["b", "a", "c"], object)
    np.testing.assert_array_equal(lookup(pa.array(["c", "x", "a"]), ids, np.int32), [2, -1, 1])
    assert lookup(pa.chunked_array([], pa.int64()), np.arange(3), np.int32).shape == (0,)
    np.testing.assert_array_equal(lookup(pa.array([1, 2], pa.int64()), np.zeros(0, np.int64)), [-1, -1])


@given(ids=st.lists(st.integers(-50, 50), unique=True, min_size=1, max_size=40),
       values=st.lists(st.integers(-60, 60), max_size=80), cuts=st.lists(st.integers(0, 80), max_size=4),
       sparse=st.booleans())
@settings(max_examples=100)
def test_property_lookup_matches_a_dict(ids: list, values: list, cuts: list, sparse: bool) -> None:
    arr = np.array(ids, np.int64) * (DENSE_SPAN * 1000 if sparse else 1)
    vals = [v * (DENSE_SPAN * 1000 if sparse else 1) for v in values]
    np.testing.assert_array_equal(lookup(_chunked(vals, cuts, pa.int64()), arr, np.int32), _want(vals, arr))
