"""Lab (CPU): what one float32 sum per (user, item) costs the CPU backend (``NumpyBackend.gemm_strided_batched``:
small and one-row products by the ordered kernel; ``NumpyBackend._blas_first``: a search of one user by BLAS's
matrix-vector kernel, what it keeps re-scored). Times the engine's searches and re-scorings that take those routes,
and the routes a row's product could take on 13 tiles of 8,192 x 64; median of 7 (3 for the larger), seconds.
Prints a table, writes JSON.

    PYTHONPATH=. python3 scripts/lab/cpu_sums.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np

import recall


def median_time(fn, repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    logging.disable(logging.WARNING)
    rng = np.random.default_rng(0)
    items = rng.standard_normal((100_000, 64)).astype(np.float32)
    users = rng.standard_normal((2000, 64)).astype(np.float32)
    engine = recall.Engine(items, device="cpu")
    short = [rng.choice(100_000, 300, replace=False) for _ in range(2000)]
    long = [rng.choice(100_000, 3000, replace=False) for _ in range(500)]
    cases = [
        ("search: 1 user x 100k x 64, k = 10", lambda: engine.search(users[:1], 10), 7),
        ("search: 7 users x 100k x 64, k = 10", lambda: engine.search(users[:7], 10), 7),
        ("search: 2,000 users x 100k x 64, k = 100", lambda: engine.search(users, 100), 3),
        ("rescore: 2,000 users x 300 candidates, k = 50", lambda: engine.rescore(users, short, 50), 3),
        ("rescore: 500 users x 3,000 candidates, k = 100", lambda: engine.rescore(users[:500], long, 100), 3),
    ]
    tiles = rng.standard_normal((13, 8192, 64)).astype(np.float32)
    one = users[:1, None, :].copy()
    out1 = np.empty((13, 1, 8192), np.float32)
    out2 = np.empty((13, 2, 8192), np.float32)
    two = np.concatenate([one, one], axis=1)
    cases += [("13 x 8,192 x 64, one row: BLAS matrix-vector", lambda: np.matmul(one, tiles.transpose(0, 2, 1),
                                                                                  out=out1), 7),
              ("13 x 8,192 x 64, one row twice: BLAS matrix product", lambda: np.matmul(
                  two, tiles.transpose(0, 2, 1), out=out2), 7)]
    try:
        from recall.backends.numpy.ordered import ordered_products

        cases.append(("13 x 8,192 x 64, one row: ordered kernel", lambda: ordered_products(one, tiles, out1), 7))
    except ImportError:  # a tree before the ordered kernel
        pass
    rows = []
    print("| case | seconds |\n| --- | ---: |")
    for name, fn, repeat in cases:
        fn()  # warm-up (numba's cache, BLAS's threads)
        t = median_time(fn, repeat)
        rows.append({"case": name, "median_s": t})
        print(f"| {name} | {t:.5f} |", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
