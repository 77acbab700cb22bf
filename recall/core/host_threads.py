"""Passes over large host arrays split by rows across a few threads: the users' norms a search checks, their
prepared copies, and the copies into pinned memory that move host users to a device.

One such pass of one thread runs at 6-9 GB/s on the GPU machine's host; 1M users x 64 float32 (256 MB) cost 55 ms
to check and 28 ms to upload, two thirds of a search whose GPU work takes 12 ms (docs/benchmarks.md). The work runs
in compiled loops and NumPy copies that release the GIL, so Python threads run it in parallel. The pool's size is a
share of the cores this process may use (a job's worker is pinned to its own, ``backends.placement``), at most
MAX_THREADS: memory bandwidth, not cores, bounds such passes beyond that. A pass called from a pool thread runs in
that thread (no pool task waits on another), as does one called from the CPU backend's workers
(:func:`run_passes_here`). The pool lives as long as the process, as the CPU backend's does
(its threads are named ``recall_host_N``, not ``recall-...`` as a job's own threads, which end with the job).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

#: Threads of the pool, at most: 4 copy 30 GB/s on the GPU machine's host, 8 no more (scripts/lab/host_transfers.py).
MAX_THREADS = 8
#: Bytes a part at least: below, a thread's start-up and hand-over cost more than the pass it would take.
MIN_PART_BYTES = 1 << 21

_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the pid that made it, the pool): a forked child makes its own
_local = threading.local()


def threads() -> int:
    """Threads a pass may use: the cores this process may run on, at most MAX_THREADS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(threads(), thread_name_prefix="recall_host",
                                                     initializer=run_passes_here))
        return _pool[1]


def run_passes_here() -> None:
    """Mark the calling thread as one that runs host passes in itself: this pool's threads, and a pool's of its own
    that already keeps every core busy (the CPU backend's workers: their blocks' norms split again would only
    oversubscribe the cores). A thread initializer."""
    _local.worker = True


def submit(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` on a pool thread (here, done, where a pass may use one thread or this is a pool thread)."""
    if threads() > 1 and not getattr(_local, "worker", False):
        return _executor().submit(fn, *args)
    done: Future = Future()
    try:
        done.set_result(fn(*args))
    except BaseException as exc:  # the caller's result() raises it, as a pool thread's would
        done.set_exception(exc)
    return done


def over_rows(fn: Callable[[int, int], Any], n_rows: int, row_bytes: int) -> list:
    """``fn(start, stop)`` over rows [0, n_rows) split into contiguous parts, one a thread, of at least
    MIN_PART_BYTES (``row_bytes`` a row); the parts' results in row order. One part (a small array, one core, or a
    call from a pool thread) runs here."""
    parts = min(threads(), max(1, n_rows * max(1, row_bytes) // MIN_PART_BYTES))
    if parts <= 1 or getattr(_local, "worker", False):
        return [fn(0, n_rows)]
    bounds = np.linspace(0, n_rows, parts + 1).astype(np.int64)
    pool = _executor()
    futures = [pool.submit(fn, int(bounds[i]), int(bounds[i + 1])) for i in range(1, parts)]
    first = fn(0, int(bounds[1]))  # this thread takes a part too
    return [first] + [f.result() for f in futures]


def by_rows(fn: Callable[..., Any], *arrays: np.ndarray) -> list:
    """``fn(*(a[start:stop] for a in arrays))`` over the arrays' rows by :func:`over_rows`, the parts' size measured
    on the first array (the one the pass reads or writes most)."""
    first = arrays[0]
    row_bytes = first.itemsize * (int(np.prod(first.shape[1:])) if first.ndim > 1 else 1)
    return over_rows(lambda start, stop: fn(*(a[start:stop] for a in arrays)), first.shape[0], row_bytes)


def copy_part(dest: np.ndarray, src: np.ndarray) -> None:
    """``dest[...] = src`` in this thread, with NumPy's casting: a float64 value beyond float32's range becomes an
    infinity without a warning (from a pool thread it would reach no caller); the callers' checks name such rows."""
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(dest, src, casting="unsafe")


def copy_rows(dest: np.ndarray, src: np.ndarray) -> None:
    """:func:`copy_part` of the same number of rows by :func:`over_rows`, the parts' size measured on the bytes a
    row reads and writes (a 1.6M-row block of excluded item rows, int64 to int32: 8 parts, not the 3 its written
    bytes alone would make)."""
    if dest.shape[0] != src.shape[0]:
        raise ValueError(f"copy_rows: {src.shape[0]} rows into {dest.shape[0]}")
    row_bytes = (dest.nbytes + src.nbytes) // max(1, dest.shape[0])
    over_rows(lambda start, stop: copy_part(dest[start:stop], src[start:stop]), dest.shape[0], row_bytes)
