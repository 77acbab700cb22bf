"""Fast mode's certificate on chosen data, on the CPU's emulation of the GPU's arithmetic: per case the users
widened and fallen back to an exact search, and whether the answer is exact mode's bit for bit. Every search takes
the float16 pass (no probe, no size rule), so that the certificate is what is measured. Sets of cases: ``far``, data
far from the origin (``recall.bench.workloads``' ``offset=``); ``heavy``, heavy-tailed item norms; ``matrix``, issue
18's continuous cells (normal, skewed, clustered and popular data; ip, cosine, l2; d = 32-256; k = 10-2,048).
``--float16-tiles``: the passes keep the GPU's float16 score tiles (``NumpyBackend.float16_tiles``: its cuBLAS path,
passes of k above 4,096 and rows wider than its float16 kernels multiply) rather than the fused kernels' float32 sums.

Run from the project root::

    PYTHONPATH=. python3 scripts/lab/certificate_cases.py [--set far] [--users 3000] [--items 30000] [--seed 0]
        [--float16-tiles] [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from recall import Engine, EngineOptions
from recall.backends.numpy.backend import NumpyBackend
from recall.bench.workloads import generate

FAR = (("normal:offset=3", "ip", 64, 10), ("normal:offset=30", "ip", 64, 100), ("normal:offset=300", "ip", 64, 10),
         ("normal:offset=300", "ip", 256, 100), ("skewed:offset=30", "ip", 32, 50), ("int8:offset=50", "ip", 96, 50),
         ("normal:offset=3", "cosine", 64, 10), ("clustered:offset=10", "cosine", 128, 20),
         ("normal:offset=30", "cosine", 64, 10), ("normal:offset=300", "cosine", 64, 10), ("skewed", "ip", 64, 10),
         ("clustered", "cosine", 64, 50))
HEAVY = (("normal:pareto_alpha=1.5", "l2", 64, 1000), ("normal:pareto_alpha=1.5", "l2", 256, 50),
         ("skewed:user_sigma=2,item_sigma=1.5", "l2", 256, 50), ("popular", "ip", 64, 100), ("skewed", "l2", 32, 50),
         ("normal:pareto_alpha=1.5", "ip", 64, 100), ("normal:item_sigma=1", "ip", 128, 10))
MATRIX = tuple((kind, metric, dim, k) for kind in ("normal", "skewed", "clustered", "popular")
               for metric in ("ip", "cosine", "l2") for dim in (32, 64, 128, 256) for k in (10, 100, 1000, 2048))
SETS = {"far": FAR, "heavy": HEAVY, "matrix": MATRIX}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", choices=sorted(SETS), default="far")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--users", type=int, default=3000)
    p.add_argument("--items", type=int, default=30_000)
    p.add_argument("--float16-tiles", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    NumpyBackend.float16_tiles = a.float16_tiles
    options = EngineOptions(fast_emulation=True, fast_sample=0, float16_min_scores=0)
    rows = []
    print(f"| case ({a.users:,} users x {a.items:,} items) | k | widened | fell back | equal to exact mode |")
    print("| --- | ---: | ---: | ---: | --- |")
    for spec, metric, dim, k in SETS[a.set]:
        users, items = generate(spec, a.users, a.items, dim, seed=a.seed)
        engine = Engine(items, metric=metric, device="cpu", precision="fast", options=options)
        got = engine.search(users, k)
        want = Engine(items, metric=metric, device="cpu").search(users, k)
        same = bool(np.array_equal(got.indices, want.indices) and np.array_equal(got.scores, want.scores))
        row = {"kind": spec, "metric": metric, "dim": dim, "k": k, "widened": engine.stats["widened_users"],
               "fell_back": engine.stats["fallback_users"], "equal": same}
        rows.append(row)
        print(f"| {metric} {spec} d={dim} | {k} | {row['widened']:,} | {row['fell_back']:,} | "
              f"{'bit for bit' if same else 'NO'} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"set": a.set, "users": a.users, "items": a.items, "seed": a.seed,
                       "float16_tiles": a.float16_tiles, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
