"""Lab (CPU): what ``precision="fast"`` costs on the CPU backend, against exact precision, in one run: "fast" as
shipped (no float16 arithmetic faster than float32 there: an exact-precision search, ``stats["fast_declined"]``) and
with ``EngineOptions(fast_emulation=True)`` (the GPU's float16 passes emulated, as every CPU "fast" search ran
before 2026-12-05). Skewed norms (log-normal, sigma 0.5, users and items), seed 0; median of ``--repeat`` after a
warm-up, seconds; every answer checked equal to exact precision's indices. Prints a table, writes JSON.

    PYTHONPATH=. python3 scripts/lab/cpu_fast_precision.py [--repeat 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import recall

CELLS = [  # users, items, dim, k
    (20_000, 100_000, 64, 100),
    (20_000, 100_000, 64, 10),
    (20_000, 100_000, 32, 1_000),
    (5_000, 100_000, 256, 100),
]


def skewed(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    vecs = rng.standard_normal((n, dim)).astype(np.float32)
    return vecs * np.exp(rng.normal(0.0, 0.5, (n, 1))).astype(np.float32)


def timed(engine: recall.Engine, users: np.ndarray, k: int, repeat: int) -> tuple[float, recall.SearchResult, dict]:
    result = engine.search(users, k)  # warm-up (numba's compile or cache load, the float16 copy of the items)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = engine.search(users, k)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], result, dict(engine.stats)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'users x items x dim, k':<28} {'exact s':>9} {'fast s':>9} {'emulated s':>11} {'fast precision':>15}")
    for n_users, n_items, dim, k in CELLS:
        items, users = skewed(rng, n_items, dim), skewed(rng, n_users, dim)
        row = {"users": n_users, "items": n_items, "dim": dim, "k": k}
        want = None
        for name, precision, options in (("exact", "exact", None), ("fast", "fast", None),
                                         ("emulated", "fast", recall.EngineOptions(fast_emulation=True))):
            engine = recall.Engine(items, device="cpu", precision=precision, options=options)
            seconds, result, stats = timed(engine, users, k, a.repeat)
            if want is None:
                want = result.indices
            elif not np.array_equal(result.indices, want):
                raise SystemExit(f"{name}: an answer other than exact precision's on {row}")
            row[f"{name}_s"] = round(seconds, 4)
            row[f"{name}_precision"] = stats.get("precision", "exact")
        rows.append(row)
        print(f"{f'{n_users:,} x {n_items:,} x {dim}, k={k}':<28} {row['exact_s']:>9.3f} {row['fast_s']:>9.3f} "
              f"{row['emulated_s']:>11.3f} {row['fast_precision']:>15}")
    if a.json is not None:
        a.json.write_text(json.dumps({"cells": rows, "numpy": np.__version__}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
