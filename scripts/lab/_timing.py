"""Timing for the lab scripts: one untimed call, then ``repeat`` timed ones (``time.perf_counter``)."""
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
