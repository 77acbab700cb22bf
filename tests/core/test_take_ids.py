"""``recall.core.results.take_ids``: the item ids of item rows, by NumPy or, for large gathers, by a parallel compiled
kernel; both must be NumPy's gather exactly (values, dtype, shape, padding, errors)."""
from __future__ import annotations

import numpy as np
import pytest

from recall import Engine
from recall.core import results
from recall.core.results import PARALLEL_TAKE, SearchResult, take_ids


def _numpy(ids: np.ndarray, rows: np.ndarray, pad=None) -> np.ndarray:
    if pad is None:
        return ids[rows]
    out = ids[np.maximum(rows, 0)]
    out[rows < 0] = pad
    return out


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint64, np.uint32, np.float64])
@pytest.mark.parametrize("size", [0, 1, PARALLEL_TAKE - 1, PARALLEL_TAKE, 3 * PARALLEL_TAKE + 7])
def test_take_ids_is_numpys_gather(dtype, size):
    rng = np.random.default_rng(size)
    ids = (rng.permutation(5000) * 977 + 3).astype(dtype)
    rows = rng.integers(0, ids.size, size).astype(np.int64)
    got = take_ids(ids, rows)
    assert got.dtype == ids.dtype and got.shape == rows.shape
    np.testing.assert_array_equal(got, ids[rows])
    grid = rows[: size - size % 7].reshape(-1, 7)  # two-dimensional, and a column slice (not contiguous)
    np.testing.assert_array_equal(take_ids(ids, grid), ids[grid])
    np.testing.assert_array_equal(take_ids(ids, grid[:, 2:5]), ids[grid[:, 2:5]])


@pytest.mark.parametrize("size", [50, 2 * PARALLEL_TAKE])
def test_take_ids_pads_negative_rows(size):
    rng = np.random.default_rng(1)
    rows = rng.integers(-1, 300, (size, 4)).astype(np.int64)
    rows[:, -1] = -1
    for ids, pad in ((np.arange(300, dtype=np.int64) * 5, -1),
                     (np.arange(300, dtype=np.uint64) + 2 ** 63, np.iinfo(np.uint64).max)):
        got = take_ids(ids, rows, pad)
        np.testing.assert_array_equal(got, _numpy(ids, rows, pad))
        assert (got[:, -1] == pad).all() and got.dtype == ids.dtype


@pytest.mark.parametrize("size", [50, 2 * PARALLEL_TAKE])
def test_take_ids_keeps_numpys_errors_and_negative_indexing(size):
    ids = np.arange(100, dtype=np.int64) * 3
    rows = np.zeros(size, np.int64)
    rows[size // 2] = 100  # one past the ids
    with pytest.raises(IndexError):
        take_ids(ids, rows)
    rows[size // 2] = -2  # without a pad, NumPy's negative indexing
    np.testing.assert_array_equal(take_ids(ids, rows), ids[rows])


def test_the_parallel_kernel_runs_where_the_gather_is_large(monkeypatch):
    calls = []
    kernel = results._take
    monkeypatch.setattr(results, "_take", lambda *a: calls.append(a[1].size) or kernel(*a))
    ids = np.arange(1000, dtype=np.int64)
    take_ids(ids, np.zeros(PARALLEL_TAKE - 1, np.int64))
    take_ids(ids, np.zeros(PARALLEL_TAKE, np.int64))
    assert calls == [PARALLEL_TAKE]


def test_to_arrow_and_map_ids_through_the_kernel_give_numpys_ids():
    # A result of more than PARALLEL_TAKE slots, with padding, through both of the engine's id paths: an engine's
    # own ids (map_ids) and a Parquet job's (to_arrow with item_ids).
    rng = np.random.default_rng(3)
    items = rng.standard_normal((40, 4)).astype(np.float32)
    users = rng.standard_normal((PARALLEL_TAKE // 20 + 1, 4)).astype(np.float32)
    ids = (np.arange(40, dtype=np.uint64) * 7 + 2 ** 63)
    engine = Engine(items, ids=ids, device="cpu")
    allow = np.arange(0, 40, 3)  # 14 pass: the last 6 of 20 slots padded
    got = engine.search(users, 20, allow=allow)
    assert got.indices.size >= PARALLEL_TAKE and (got.indices[:, -1] < 0).all()
    np.testing.assert_array_equal(got.ids, _numpy(ids, got.indices, np.iinfo(np.uint64).max))
    plain = Engine(items, device="cpu").search(users, 20, allow=allow)
    table = plain.to_arrow(np.arange(users.shape[0]), ids)
    want = [ids[r[r >= 0]].tolist() for r in plain.indices]
    assert table.column("item_ids").to_pylist() == want
    assert SearchResult(plain.indices, plain.scores, plain.ids).to_arrow(None, ids).equals(table)


def test_one_core_where_numba_s_threads_cannot_be_shared(monkeypatch):
    # Without OpenMP (or a layer asked for by name that is thread-safe), numba's workqueue aborts when two threads
    # run parallel kernels at once: the gather then runs on one core, with the same answer.
    def no_pool(name, *args):
        raise ImportError(name)

    with monkeypatch.context() as patch:
        patch.setattr(results.importlib, "import_module", no_pool)
        assert not results._threadsafe_pool()
        for layer, safe in (("workqueue", False), ("forksafe", False), ("tbb", True), ("threadsafe", True)):
            patch.setattr(results.numba.config, "THREADING_LAYER", layer)
            assert results._threadsafe_pool() is safe
    from numba import njit

    serial = njit(nogil=True)(results._take_kernel)
    ids = np.arange(500, dtype=np.int64) * 3
    rows = np.random.default_rng(2).integers(-1, 500, 1000).astype(np.int64)
    out = np.empty(rows.size, np.int64)
    assert serial(ids, rows, np.int64(-1), out) == (int((rows < 0).sum()), 0)
    np.testing.assert_array_equal(out, _numpy(ids, rows, -1))


@pytest.mark.parametrize("dtype", [">i8", ">u8", ">f8", np.float16, np.longdouble, np.int8, np.uint16])
def test_id_dtypes_numba_does_not_take_go_to_numpy(dtype):
    ids = (np.arange(300) * 3).astype(dtype)
    rows = np.random.default_rng(5).integers(0, 300, PARALLEL_TAKE + 5).astype(np.int64)
    got = take_ids(ids, rows)
    assert got.dtype == ids.dtype
    np.testing.assert_array_equal(got, ids[rows])
