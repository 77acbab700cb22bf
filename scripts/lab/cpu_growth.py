"""How the CPU search grows with work: exact top-k of seeded data from tiny to 200,000 users x 1M items, each cell in
a fresh process, its time (best of ``--repeat``), its cost per user x item x dim, and the process's peak RSS
against the inputs' own size and the engine's memory budget.

Usage, from the project root::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=. python scripts/lab/cpu_growth.py [--out bench-out/growth]

Prints a table and writes ``growth.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

CELLS = [  # users, items, dim, k
    (100, 1_000, 16, 10),
    (1_000, 10_000, 32, 100),
    (10_000, 100_000, 64, 100),
    (20_000, 100_000, 64, 100),
    (20_000, 100_000, 128, 100),
    (50_000, 200_000, 64, 100),
    (100_000, 500_000, 64, 100),
    (200_000, 1_000_000, 64, 100),
]


def one(users: int, items: int, dim: int, k: int, repeat: int, kind: str) -> dict:
    import numpy as np

    from recall import Engine
    from recall.bench.workloads import generate

    u, i = generate(kind, users, items, dim, seed=0)
    u, i = np.asarray(u), np.asarray(i)
    rss_inputs = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine = Engine(i, device="cpu", tune="off")
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = engine.search(u, k)
        best = min(best, time.perf_counter() - t0)
        del result
    return {"users": users, "items": items, "dim": dim, "k": k, "kind": kind, "seconds": best,
            "ns_per_uid": best / (users * items * dim) * 1e9,
            "input_bytes": int(u.nbytes + i.nbytes), "result_bytes": users * k * 12,
            "rss_after_inputs": rss_inputs,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "budget": engine.backend.default_budget()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--kind", default="skewed")
    parser.add_argument("--max-cells", type=int, default=len(CELLS))
    parser.add_argument("--out", type=Path, default=Path("bench-out/growth"))
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # one cell, in the child process
    args = parser.parse_args(argv)
    if args.cell:
        print(json.dumps(one(*map(int, args.cell.split(",")), args.repeat, args.kind)))
        return 0
    rows = []
    print(f"{'users':>8} {'items':>10} {'dim':>4} {'k':>4} {'s':>8} {'ns/(u*i*d)':>11} {'inputs MB':>9} "
          f"{'results MB':>10} {'peak RSS MB':>11}")
    for cell in CELLS[:args.max_cells]:
        out = subprocess.run([sys.executable, __file__, "--cell", ",".join(map(str, cell)), "--repeat",
                              str(args.repeat), "--kind", args.kind], capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{row['users']:>8,} {row['items']:>10,} {row['dim']:>4} {row['k']:>4} {row['seconds']:>8.3f} "
              f"{row['ns_per_uid']:>11.4f} {row['input_bytes'] / 1e6:>9.0f} {row['result_bytes'] / 1e6:>10.0f} "
              f"{row['peak_rss'] / 1e6:>11.0f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "growth.json").write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
