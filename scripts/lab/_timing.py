"""Timing for the lab scripts: one untimed call, then ``repeat`` timed ones (``time.perf_counter``, or CUDA events
on the current stream for device work)."""
from __future__ import annotations

import time
from typing import Any, Callable


def run_times(fn: Callable[[], Any], repeat: int = 3) -> list[float]:
    """Seconds of each of ``repeat`` calls of ``fn``, after one untimed call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def device_times(fn: Callable[[], Any], repeat: int = 3) -> list[float]:
    """Seconds of each of ``repeat`` calls of ``fn``'s device work on the current CUDA stream (CuPy events around each
    call), after one untimed call."""
    import cupy

    fn()
    times = []
    for _ in range(repeat):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return times
