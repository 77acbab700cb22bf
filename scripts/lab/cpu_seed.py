"""The CPU backend's threshold sample (k >= 640): seeded and unseeded engines over the same data, interleaved.

Run from the project root::

    PYTHONPATH=. python3 scripts/lab/cpu_seed.py [--kind normal] [--users 10000] [--items 100000] [--k 1000]
        [--rounds 7] [--sample 4096 16384] [--json out.json]

One engine per variant (``EngineOptions(seed_thresholds=False)``, the shipped rule, and ``seed_sample=N`` for each
``--sample``), each warmed up on 500 users; then ``--rounds`` rounds, each variant searched once a round in turn, so
that the machine's drift falls on every variant alike. Prints the median and the fastest per variant, and checks
every answer equal to the unseeded one's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from recall import Engine, EngineOptions
from recall.bench.workloads import generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="normal")
    ap.add_argument("--users", type=int, default=10_000)
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--k", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sample", type=int, nargs="*", default=[])
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    variants = {"unseeded": EngineOptions(seed_thresholds=False), "shipped": EngineOptions()}
    variants.update({f"seed_sample={n}": EngineOptions(seed_sample=n) for n in a.sample})
    users, items = generate(a.kind, a.users, a.items, a.dim, seed=0)
    engines = {name: Engine(items, device="cpu", options=o) for name, o in variants.items()}
    for e in engines.values():
        e.search(users[:500], a.k)
    times: dict[str, list[float]] = {name: [] for name in engines}
    samples: dict[str, int] = {}
    reference = None
    for _ in range(a.rounds):
        for name, e in engines.items():
            t0 = time.perf_counter()
            res = e.search(users, a.k)
            times[name].append(time.perf_counter() - t0)
            samples[name] = int(e.stats.get("seed_sample", 0))
            if reference is None:
                reference = res
            elif not (np.array_equal(res.indices, reference.indices) and np.array_equal(res.scores, reference.scores)):
                raise SystemExit(f"{name}: answer differs from the unseeded one's")
    print(f"{a.kind}, {a.users:,} users x {a.items:,} items x {a.dim}, k = {a.k}, {a.rounds} rounds; "
          "every answer equal to the unseeded one's")
    print("| variant | sample | median s | fastest s |")
    print("| --- | ---: | ---: | ---: |")
    for name, ts in times.items():
        print(f"| {name} | {samples[name]:,} | {statistics.median(ts):.3f} | {min(ts):.3f} |")
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "times_s": times,
                                      "samples": samples}, indent=2))


if __name__ == "__main__":
    main()
