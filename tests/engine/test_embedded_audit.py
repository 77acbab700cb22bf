"""The embedded engine as a long-lived object of a feature pipeline (CPU): searched from several threads at once,
its filter replaced meanwhile, pickled, used in a forked child, its inputs reused by the caller; every answer
against the float64 oracle (ties to the lower item row)."""
from __future__ import annotations

import itertools
import multiprocessing
import pickle
import threading

import numpy as np
import pytest

from recall import Engine, EngineOptions
from recall.backends.numpy import backend as numpy_backend
from recall.core.filters import ItemFilter

from oracle import filtered_topk, int_matrix


def _want(users, items, k, metric="ip", passing=None, exclude=None):
    """The oracle's (rows, float32 scores), as wide as the engine's answer, padded where fewer items pass."""
    rows, vals = filtered_topk(users, items, k, metric, passing, exclude)
    return rows, vals.astype(np.float32)


def _check(res, want):
    np.testing.assert_array_equal(np.asarray(res.indices), want[0])
    np.testing.assert_array_equal(np.asarray(res.scores), want[1])


def _mask(rows, n):
    m = np.zeros(n, bool)
    m[np.asarray(rows, np.int64)] = True
    return m


def _blas_threads():
    """The threads of the BLAS libraries the CPU backend limits: those loaded when it first searched (NumPy's; a BLAS
    another library loads later, as faiss-cpu's, is not the one its GEMMs call)."""
    return [lib.num_threads for lib in numpy_backend._blas_controller().select(user_api="blas").lib_controllers]


@pytest.fixture
def two_blas_threads():
    """BLAS at two threads for the test (whatever this machine's default), or a skip where threadpoolctl finds none."""
    from threadpoolctl import threadpool_limits

    if not _blas_threads():
        pytest.skip("threadpoolctl finds no BLAS library to limit")
    with threadpool_limits(limits=2, user_api="blas"):
        assert set(_blas_threads()) == {2}
        yield


def test_overlapping_searches_keep_blas_at_one_thread_and_restore_it(two_blas_threads):
    # Two searches of two threads overlap, the first ending first: BLAS stays at one thread until the last one
    # ends, then goes back to what the process had (each taking and restoring its own limit left it at 1 for good).
    backend = Engine(np.eye(4, dtype=np.float32), device="cpu").backend
    first, second = backend.compute_context(), backend.compute_context()
    first.__enter__()
    second.__enter__()
    assert set(_blas_threads()) == {1}
    first.__exit__(None, None, None)
    assert set(_blas_threads()) == {1}, "BLAS restored while another search still runs"
    second.__exit__(None, None, None)
    assert set(_blas_threads()) == {2}, "BLAS not restored to the process's limit after the last search"


class _HookDict(dict):
    """A dict whose first one-argument ``pop`` (an eviction) runs ``hook`` first: another thread's call that lands
    between the evicting thread's choice of the oldest entry and its pop."""

    def __init__(self, *args, hook=None):
        super().__init__(*args)
        self.hook = hook

    def pop(self, *args):
        if self.hook is not None and len(args) == 1:
            hook, self.hook = self.hook, None
            hook()
        return super().pop(*args)


def _in_another_thread(fn):
    """Run ``fn`` in a thread and wait up to 0.5 s: where the caller holds a lock ``fn`` needs, it finishes later."""
    errors = []

    def run():
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(0.5)
    return thread, errors


def test_filtered_catalogues_evicted_by_two_threads_at_once():
    # Two searches with new filters each evict the oldest kept catalogue: the second one's pop of the same entry
    # raised KeyError (with 8 threads and a short switch interval, also "dictionary changed size during iteration").
    rng = np.random.default_rng(1)
    items, users = int_matrix(rng, 300, 4), int_matrix(rng, 3, 4)
    engine = Engine(items, device="cpu")
    allows = [rng.choice(300, 120, replace=False) for _ in range(4)]
    for allow in allows[:2]:
        engine.search(users, 5, allow=allow)  # two catalogues kept: the next new one evicts
    other = {}

    def hook():
        other["thread"], other["errors"] = _in_another_thread(lambda: other.setdefault(
            "res", engine.search(users, 5, allow=allows[3])))

    engine._views = _HookDict(engine._views, hook=hook)
    res = engine.search(users, 5, allow=allows[2])
    other["thread"].join(30)
    assert not other["errors"], other["errors"]
    _check(res, _want(users, items, 5, passing=_mask(allows[2], 300)))
    _check(other["res"], _want(users, items, 5, passing=_mask(allows[3], 300)))
    assert len(engine._views) <= 2


def test_ranked_item_arrays_evicted_by_two_threads_at_once():
    # The CPU backend keeps the threshold-sample norms of 8 item arrays; two loads evicting the oldest at once
    # raised KeyError in the second (filtered catalogues made by concurrent searches load their items).
    backend = Engine(np.eye(4, dtype=np.float32), device="cpu").backend
    arrays = [np.full((10, 4), i, np.float32) for i in range(numpy_backend._RANKED_ARRAYS + 2)]
    for arr in arrays[:numpy_backend._RANKED_ARRAYS]:
        backend.load_items(arr, norms_rank=True)
    other = {}

    def hook():
        other["thread"], other["errors"] = _in_another_thread(lambda: backend.load_items(arrays[-1], True))

    backend._ranked = _HookDict(backend._ranked, hook=hook)
    backend.load_items(arrays[-2], norms_rank=True)
    other["thread"].join(30)
    assert not other["errors"], other["errors"]
    assert len(backend._ranked) == numpy_backend._RANKED_ARRAYS


class _FilterReplacedMidCall(Engine):
    """An engine whose kept filter reads as ``reads`` gives it: as if ``set_item_filter()`` ran in another thread
    between two reads of one search."""

    reads = None

    @property
    def _filter(self):
        return next(self.reads) if self.reads is not None else None

    @_filter.setter
    def _filter(self, value):
        pass


@pytest.mark.parametrize("call", ["search", "search_async", "rescore"])
def test_a_filter_removed_during_a_search_with_its_own_filter(call):
    # The engine's filter was read twice per call (``self._filter is None``, then ``self._filter.rows``): removed
    # in between, the search raised AttributeError. Each call must see one filter: here the old one.
    rng = np.random.default_rng(2)
    items, users = int_matrix(rng, 200, 4), int_matrix(rng, 4, 4)
    engine = _FilterReplacedMidCall(items, device="cpu")
    kept = rng.choice(200, 120, replace=False)
    allow = rng.choice(200, 100, replace=False)
    engine.reads = itertools.chain([ItemFilter.build(200, allow=kept)], itertools.repeat(None))
    if call == "search":
        res = engine.search(users, 7, allow=allow)
    elif call == "search_async":
        res = engine.search_async(users, 7, allow=allow).result()
    else:
        res = engine.rescore(users, np.tile(np.arange(200), (4, 1)), 7, allow=allow)
    _check(res, _want(users, items, 7, passing=_mask(kept, 200) & _mask(allow, 200)))


@pytest.mark.parametrize("filtered", [False, True])
def test_l2_users_reused_after_search_async_returns(filtered):
    # search_async says the users are copied before it returns; under l2 the scores were finished (2·s - |u|²)
    # from the caller's array when result() was taken: overwritten meanwhile, every score was wrong.
    rng = np.random.default_rng(3)
    items = int_matrix(rng, 500, 6)
    users = int_matrix(rng, 9, 6)
    deny = np.arange(0, 500, 3) if filtered else None
    want = _want(users, items, 12, "l2", passing=None if deny is None else ~_mask(deny, 500))
    engine = Engine(items, metric="l2", device="cpu")
    pending = engine.search_async(users, 12, deny=deny)
    users[:] = 50.0  # the caller's next batch, read into the same buffer
    _check(pending.result(), want)


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_pickled_engine_gives_the_same_answers(metric):
    # Engines go to spawned processes and Spark executors pickled: this raised "cannot pickle '_thread.lock'
    # object" (the CPU backend's pool lock).
    rng = np.random.default_rng(5)
    items, users = int_matrix(rng, 3000, 8), int_matrix(rng, 6, 8)
    engine = Engine(items, metric=metric, device="cpu", ids=np.arange(3000) * 10)
    engine.set_item_filter(deny=np.arange(0, 3000, 7))
    engine.search(users, 5, allow=np.arange(1000))  # a filtered catalogue kept
    clone = pickle.loads(pickle.dumps(engine))
    passing = ~_mask(np.arange(0, 3000, 7), 3000)
    for k in (5, 400):
        want = _want(users, items, k, metric, passing=passing, exclude={0: [1, 2]})
        res = clone.search(users, k, exclude={0: [1, 2]})
        _check(res, want)
        np.testing.assert_array_equal(res.ids, np.where(want[0] >= 0, want[0] * 10, -1))
    assert clone.backend.executor() is not engine.backend.executor()
    _check(engine.search(users, 5), _want(users, items, 5, metric, passing=passing))  # the original still works


def _child_search(conn, engine, users):
    res = engine.search(users, 5)
    conn.send((res.indices.tolist(), res.scores.tolist(), _blas_threads()))


def test_forked_child_of_a_parent_mid_search(two_blas_threads):
    # A child forked while a thread of the parent is inside the backend (its pool lock held, BLAS limited for a
    # search in flight): the child's own search must run, give the oracle's answer and leave BLAS as it was.
    rng = np.random.default_rng(6)
    items, users = int_matrix(rng, 3000, 8), int_matrix(rng, 3, 8)
    engine = Engine(items, device="cpu", options=EngineOptions(tiles=(64, 256, 1)))
    engine.backend.workers = 2  # two item ranges, one task each: the search takes the pool
    want = _want(users, items, 5)
    _check(engine.search(users, 5), want)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    with engine.backend.compute_context(), engine.backend._pool_lock:
        proc = ctx.Process(target=_child_search, args=(child, engine, users))
        proc.start()
    try:
        assert parent.poll(20), "the forked child's search did not finish"
        rows, scores, blas = parent.recv()
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    np.testing.assert_array_equal(rows, want[0])
    np.testing.assert_array_equal(np.asarray(scores, np.float32), want[1])
    assert set(blas) == {2}
