"""Lab (CPU): exact searches of large k seeded at a lower bound of each user's k-th best against seeded at an
estimate (``EngineOptions.seed_estimate``), same data, one process; twice each after a warm-up, seconds. Checks that
both give the same indices and scores. Prints a table, writes JSON.

    PYTHONPATH=. python3 scripts/lab/cpu_estimate.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import recall
from recall import EngineOptions

CELLS = [  # users, items, dim, k, data
    (20_000, 100_000, 64, 1_000, "normal"),
    (5_000, 100_000, 64, 1_000, "skewed"),
    (2_000, 100_000, 64, 8_192, "normal"),
    (20_000, 100_000, 64, 300, "skewed"),
    (5_000, 100_000, 64, 500, "normal"),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'cell':<36} {'bound s':>14} {'estimate s':>14} {'rank':>6} {'again':>6}")
    for n_users, n_items, dim, k, kind in CELLS:
        users = rng.standard_normal((n_users, dim), dtype=np.float32)
        items = rng.standard_normal((n_items, dim), dtype=np.float32)
        if kind == "skewed":
            users *= np.exp(rng.normal(0, 0.5, (n_users, 1))).astype(np.float32)
            items *= np.exp(rng.normal(0, 0.5, (n_items, 1))).astype(np.float32)
        times: dict[bool, list[float]] = {False: [], True: []}
        results, stats = {}, {}
        for estimate in (False, True, False, True):
            engine = recall.Engine(items, device="cpu", options=EngineOptions(seed_estimate=estimate), tune="off")
            engine.search(users, k)
            start = time.perf_counter()
            results[estimate] = engine.search(users, k)
            times[estimate].append(time.perf_counter() - start)
            stats[estimate] = dict(engine.stats)
        same = (np.array_equal(results[True].indices, results[False].indices)
                and np.array_equal(results[True].scores, results[False].scores))
        if not same:
            raise SystemExit(f"different answers: {n_users} x {n_items} x {dim}, k = {k}")
        row = {"users": n_users, "items": n_items, "dim": dim, "k": k, "data": kind,
               "bound_s": [round(t, 4) for t in times[False]], "estimate_s": [round(t, 4) for t in times[True]],
               "rank": stats[True].get("seed_estimate"), "again": stats[True].get("estimate_short_users")}
        rows.append(row)
        cell = f"{n_users:,} x {n_items:,} x {dim}, k={k} {kind}"
        print(f"{cell:<36} {min(times[False]):>6.3f}-{max(times[False]):<7.3f} {min(times[True]):>6.3f}-"
              f"{max(times[True]):<7.3f} {row['rank']!s:>6} {row['again']!s:>6}")
    if a.json is not None:
        a.json.write_text(json.dumps({"cells": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
