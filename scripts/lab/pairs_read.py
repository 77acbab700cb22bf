"""How long does mapping a job-sized exclusion file to rows take? ``recall.io.read_pairs`` of 1M users x 20 random
item ids (ids 0..n-1, the bench's ``layouts.write_exclusions`` layout), ``--calls`` times in one process (the first
compiles or loads the kernels), then the best of the later calls.

    PYTHONPATH=. python3 scripts/lab/pairs_read.py [--users 1000000] [--items 1000000] [--per-user 20] [--calls 4]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from recall.bench import layouts
from recall.io import read_pairs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=1_000_000)
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--per-user", type=int, default=20)
    p.add_argument("--calls", type=int, default=4)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    indptr = np.arange(a.users + 1, dtype=np.int64) * a.per_user
    items = rng.integers(0, a.items, size=a.users * a.per_user).astype(np.int64)
    with tempfile.TemporaryDirectory(prefix="recall-pairs-") as tmp:
        path = os.path.join(tmp, "exclusions.parquet")
        layouts.write_exclusions(indptr, items, path)
        user_ids, item_ids = np.arange(a.users, dtype=np.int64), np.arange(a.items, dtype=np.int64)
        times = []
        for i in range(max(2, a.calls)):
            t0 = time.perf_counter()
            pairs = read_pairs(path, user_ids, item_ids, what="exclusion")
            times.append(time.perf_counter() - t0)
            print(f"read_pairs, call {i + 1}: {times[-1]:.3f} s ({pairs.n_pairs:,} pairs)", flush=True)
        print(f"best of calls 2-{len(times)}: {min(times[1:]):.3f} s")


if __name__ == "__main__":
    main()
