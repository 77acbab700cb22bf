"""Where a search's time goes outside the device pipeline: for each cell (``kernel_profile.py``'s CELLS or
``GRID:INDEX``), exact and fast mode engines made one after the other as the bench makes them (the first let go
before the second is made), searches alternating between the two modes, each timed between two device
synchronisations. Per search: the whole call, the validation of its exclusions alone (``normalise`` of the same host
CSR, timed separately just before), and the pipeline's own ``wall_s`` (engine.stats); the rest is the host work
around the pipeline. Then one search per mode under cProfile, its top entries by cumulative time.

    PYTHONPATH=. python3 scripts/lab/search_split.py --cells S1-x200,x20 [--rounds 4] [--json $OUT/split.json]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_profile import cell_spec  # noqa: E402

from recall import Engine  # noqa: E402
from recall.bench import exclusions as bench_exclusions  # noqa: E402
from recall.bench.workloads import generate  # noqa: E402
from recall.core.exclusions import normalise  # noqa: E402


def one(engine, users, k, excl, sync):
    t_norm = 0.0
    if excl is not None:
        t0 = time.perf_counter()
        normalise(excl, int(users.shape[0]), engine.n_items)
        t_norm = time.perf_counter() - t0
    sync()
    t0 = time.perf_counter()
    engine.search(users, k, exclude=excl)
    sync()
    total = time.perf_counter() - t0
    return {"total_s": total, "normalise_s": t_norm, "pipeline_s": float(engine.stats.get("wall_s", 0.0)),
            "route": engine.stats.get("route"), "probe": engine.stats.get("probe")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default="S1-x200,x20")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    import cupy

    def sync():
        cupy.cuda.Device().synchronize()

    out = []
    for cell in a.cells.split(","):
        kind, nu, ni, dim, k, metric, per = cell_spec(cell)
        users, items = generate(kind, nu, ni, dim, seed=0, device="gpu")
        excl = bench_exclusions.generate(users, items, per, k=k, seed=0, metric=metric).host() if per else None
        engines = {}
        for mode in ("exact", "fast"):  # as the bench does: one engine, warmed, then let go, then the next
            e = Engine(items, metric=metric, device="gpu", precision=mode)
            one(e, users, k, excl, sync)
            engines[mode] = e
        rows = {"exact": [], "fast": []}
        for _ in range(a.rounds):
            for mode in ("exact", "fast"):
                rows[mode].append(one(engines[mode], users, k, excl, sync))
        for mode, rs in rows.items():
            med = {key: statistics.median(r[key] for r in rs) for key in ("total_s", "normalise_s", "pipeline_s")}
            rest = med["total_s"] - med["pipeline_s"]
            runs = " ".join(f"{r['total_s']:.4f}" for r in rs)
            print(f"| {cell} | {mode} | total {med['total_s']:.4f} s | pipeline {med['pipeline_s']:.4f} | outside "
                  f"{rest:.4f} | normalise alone {med['normalise_s']:.4f} | runs "
                  f"{runs} | route {rs[-1]['route']} |", flush=True)
            out.append({"cell": cell, "mode": mode, **med, "runs": rs})
        for mode, e in engines.items():
            prof = cProfile.Profile()
            sync()
            prof.enable()
            e.search(users, k, exclude=excl)
            sync()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(18)
            print(f"--- {cell} {mode}: cProfile, cumulative")
            print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:4000])
        del engines
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
