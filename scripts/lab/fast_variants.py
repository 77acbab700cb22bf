"""Which parts of fast mode's certificate cost time where they are not needed? Times fast mode on the GPU with parts
of it switched off in this process (monkeypatched: a measurement, not an option), beside exact mode.

Run from the project root on a GPU machine::

    PYTHONPATH=. python3 scripts/lab/fast_variants.py [--json $OUT/fast_variants.json]

Cells: S1 (100k x 1M x 64, k=100, clustered, ip) and the user-heavy l2 cell of gpu-quick (200k x 100k x 32,
k=1000, popular). Variants: as shipped; no shift (users' shift 0, the column kept); no per-item bound columns (ip
only); the margin halved (max(16, k/8)). Median of 3 after a warm-up; fallbacks and widened users from
``engine.stats``; every answer compared with exact mode's.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

from recall import Engine
from recall.bench.workloads import generate
from recall.core import certificate
from recall.engine import fast

CELLS = {"S1": ("clustered", 100_000, 1_000_000, 64, 100, "ip"),
         "user-heavy-l2": ("popular", 200_000, 100_000, 32, 1000, "l2")}


@contextlib.contextmanager
def variant(name: str):
    saved = (fast._sampled_best, certificate._NORM_SPREAD, certificate.margin)
    try:
        if name == "no-shift":
            fast._sampled_best = lambda *a, **kw: None
        elif name == "no-per-item":
            certificate._NORM_SPREAD = float("inf")
        elif name == "half-margin":
            certificate.margin = lambda k: max(16, k // 8)
        yield
    finally:
        fast._sampled_best, certificate._NORM_SPREAD, certificate.margin = saved


def timed(engine: Engine, users, k: int, repeat: int = 3):
    engine.search(users[:5000], k)
    times = []
    for _ in range(repeat):
        engine.backend.synchronize()
        t0 = time.perf_counter()
        res = engine.search(users, k)
        engine.backend.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), res


def main() -> None:
    import cupy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    out = []
    for cell, (kind, nu, ni, dim, k, metric) in CELLS.items():
        users, items = generate(kind, nu, ni, dim, seed=0, device="gpu")
        t_exact, ref = timed(Engine(items, metric=metric, device="gpu"), users, k)
        print(f"| {cell} | exact | {t_exact:.4f} s | - | - |", flush=True)
        out.append({"cell": cell, "variant": "exact", "median_s": t_exact})
        for name in ("shipped", "no-shift", "no-per-item", "half-margin"):
            if name == "no-per-item" and metric != "ip":
                continue
            with variant(name):
                engine = Engine(items, metric=metric, device="gpu", precision="fast")
                t, res = timed(engine, users, k)
            same = bool(cupy.array_equal(cupy.asarray(res.indices), cupy.asarray(ref.indices)))
            st = engine.stats
            print(f"| {cell} | {name} | {t:.4f} s | fb {st.get('fallback_users')} widened {st.get('widened_users')} "
                  f"declined {st.get('fast_declined')} | same {same} | x exact {t / t_exact:.3f} |", flush=True)
            out.append({"cell": cell, "variant": name, "median_s": t, "same_answer": same,
                        "stats": {key: st.get(key) for key in ("fallback_users", "widened_users", "fast_declined")}})
            del engine, res
        del users, items, ref
        cupy.get_default_memory_pool().free_all_blocks()
    if a.json:
        a.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
