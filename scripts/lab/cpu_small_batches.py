"""CPU: the embedded engine's latency for small batches at several depths (1 to 64 users against 100k items, k =
100, dims 32 to 768): one line of median milliseconds of 5 searches after a warm-up, per (dim, users). Run from the
project root (or with PYTHONPATH at another tree, to compare)::

    PYTHONPATH=. python3 scripts/lab/cpu_small_batches.py
"""
import statistics
import time

import numpy as np

import recall
rng = np.random.default_rng(0)
rows = []
for d in (32, 128, 256, 448, 768):
    items = rng.standard_normal((100_000, d)).astype(np.float32)
    e = recall.Engine(items, device="cpu")
    for nu in (1, 2, 4, 16, 64):
        users = rng.standard_normal((nu, d)).astype(np.float32)
        e.search(users, 100)
        t = []
        for _ in range(5):
            t0 = time.perf_counter(); e.search(users, 100); t.append(time.perf_counter() - t0)
        rows.append(f"d{d} u{nu} {statistics.median(t)*1e3:.1f}")
print(" | ".join(rows))
