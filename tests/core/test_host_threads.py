"""Host passes split by rows across threads (``core.host_threads``): every part run once, in row order, the same
values as one thread's pass; the users' norms and prepared copies that take them, bit for bit."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from recall.core import host_threads, metrics


@pytest.fixture
def four_parts(monkeypatch):
    """Four threads and parts of any size, whatever this machine's cores."""
    monkeypatch.setattr(host_threads, "threads", lambda: 4)
    monkeypatch.setattr(host_threads, "MIN_PART_BYTES", 1)


def test_over_rows_covers_every_row_once_in_order(four_parts):
    seen, names = [], set()

    def part(start, stop):
        seen.append((start, stop))
        names.add(threading.current_thread().name)
        return (start, stop)

    got = host_threads.over_rows(part, 10, 4)
    assert [g[0] for g in got] == sorted(g[0] for g in got) and got[0][0] == 0 and got[-1][1] == 10
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))  # contiguous, no row twice or missed
    assert sorted(seen) == got and len(got) == 4
    assert threading.current_thread().name in names and any(n.startswith("recall_host") for n in names)


@pytest.mark.parametrize("rows", [0, 1, 3])
def test_over_rows_fewer_rows_than_threads(four_parts, rows):
    got = host_threads.over_rows(lambda s, e: list(range(s, e)), rows, 4)
    assert [r for part in got for r in part] == list(range(rows))


def test_small_passes_stay_in_the_calling_thread(monkeypatch):
    monkeypatch.setattr(host_threads, "threads", lambda: 4)
    names = []
    host_threads.over_rows(lambda s, e: names.append(threading.current_thread().name), 1000, 8)  # 8 kB in all
    assert names == [threading.current_thread().name]


def test_a_pass_inside_a_pool_thread_runs_there(four_parts):
    """A part that itself splits a pass does not wait on the pool it runs in (no deadlock on a full pool)."""
    inner = []

    def part(start, stop):
        inner.append(host_threads.over_rows(lambda s, e: threading.current_thread().name, 100, 4))
        return start

    host_threads.over_rows(part, 8, 4)
    pool_parts = [names for names in inner if names[0].startswith("recall_host")]
    assert pool_parts and all(len(names) == 1 for names in pool_parts)


@pytest.mark.parametrize("threads", [1, 4])
def test_submit_runs_and_raises_like_a_pool_thread(monkeypatch, threads):
    monkeypatch.setattr(host_threads, "threads", lambda: threads)
    assert host_threads.submit(lambda a, b: a + b, 2, 3).result() == 5
    with pytest.raises(ZeroDivisionError):
        host_threads.submit(lambda: 1 / 0).result()


def test_errors_in_a_part_reach_the_caller(four_parts):
    def part(start, stop):
        if start > 0:
            raise ValueError(f"part at {start}")
        return start

    with pytest.raises(ValueError, match="part at"):
        host_threads.over_rows(part, 100, 4)


@pytest.mark.parametrize("layout", ["C", "strided", "float64"])
def test_copy_rows_equals_assignment(four_parts, layout):
    rng = np.random.default_rng(1)
    base = rng.standard_normal((257, 20))
    src = {"C": base.astype(np.float32)[:, :10].copy(), "strided": base.astype(np.float32)[:, ::2],
           "float64": base[:, :10]}[layout]
    dest = np.zeros((257, 10), np.float32)
    host_threads.copy_rows(dest, src)
    want = np.zeros_like(dest)
    want[...] = src
    np.testing.assert_array_equal(dest, want)
    with pytest.raises(ValueError, match="256 rows into 257"):
        host_threads.copy_rows(dest, src[:256])


def test_split_norms_and_prepared_users_equal_one_threads(four_parts, monkeypatch):
    """row_norms' compiled loop, cosine's scaling and l2's wider copy, split by rows: bit for bit one pass's, NaN and
    Inf rows included."""
    rng = np.random.default_rng(7)
    vecs = (rng.standard_normal((1001, 37)) * np.exp(2 * rng.standard_normal((1001, 1)))).astype(np.float32)
    vecs[500, 3] = np.nan
    vecs[999, 0] = np.inf
    split = {m: metrics.prepare_users(m, np, np.nan_to_num(vecs, nan=1.0, posinf=2.0)) for m in ("cosine", "l2")}
    split_norms = metrics.row_norms(np, vecs)
    monkeypatch.setattr(host_threads, "threads", lambda: 1)
    whole = {m: metrics.prepare_users(m, np, np.nan_to_num(vecs, nan=1.0, posinf=2.0)) for m in ("cosine", "l2")}
    np.testing.assert_array_equal(split_norms, metrics.row_norms(np, vecs))
    assert np.isnan(split_norms[500]) and split_norms[999] == np.inf
    assert np.isnan(metrics.largest_row_norm(np, vecs))
    for m in split:
        np.testing.assert_array_equal(split[m], whole[m])
    np.testing.assert_array_equal(split["l2"][:, :37], np.nan_to_num(vecs, nan=1.0, posinf=2.0))
    assert (split["l2"][:, 37] == 1.0).all() and (split["l2"][:, 38:] == 0.0).all()


def test_the_cpu_backends_workers_run_passes_in_themselves(four_parts):
    """The CPU backend's pool keeps every core busy with its blocks: a host pass inside one of its tasks runs in that
    thread, not split again across the host pool."""
    from recall.backends.numpy.backend import NumpyBackend

    pool = NumpyBackend().executor()
    names = pool.submit(lambda: host_threads.over_rows(lambda s, e: threading.current_thread().name, 1000, 64)).result()
    assert len(names) == 1 and not names[0].startswith("recall_host")


def test_copies_beyond_float32_become_infinities_silently(four_parts):
    """A float64 value beyond float32's range is copied as an infinity without a warning (a pool thread's would reach
    no caller; the engine's checks name the row)."""
    import warnings

    src = np.ones((300, 4))
    src[123, 2] = 1e300
    src[200, 0] = -1e300
    dest = np.empty((300, 4), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        host_threads.copy_rows(dest, src)
        host_threads.copy_part(dest[:1], src[123:124])
    assert dest[123, 2] == np.inf and dest[200, 0] == -np.inf and dest[0, 2] == np.inf  # the last: copy_part's
    assert np.isfinite(np.delete(dest.ravel(), [2, 123 * 4 + 2, 800])).all()
