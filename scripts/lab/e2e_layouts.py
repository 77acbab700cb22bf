"""Does searching while the items load pay, and on which file layouts? ``recall score`` Parquet to Parquet with
``JobOptions(early=...)`` on and off, over the file layouts of ``recall.bench.layouts``, beside the resident search.

Run on a GPU machine, from the project root::

    PYTHONPATH=. python3 scripts/lab/e2e_layouts.py --users 1000000 --items 1000000 --dim 64 --k 100 \
        --layout pyarrow --layout warehouse [--repeat 3] [--batch-size auto,131072] [--json $OUT/e2e_layouts.json]

Data: the bench's ``clustered`` kind, generated on the host from the seed (so every layout holds the same rows).
Prints one table (median seconds of each mode, layout and batch size, the early users, the ratio to the resident
search) and writes every run to JSON, with the job's stage times (``JobSummary``: start, read, search, write, device
busy).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from recall import Engine
from recall.bench import layouts
from recall.bench.workloads import generate
from recall.core.options import EngineOptions
from recall.jobs import JobOptions, score_files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=1_000_000)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--layout", action="append", default=None, choices=list(layouts.LAYOUTS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="gpu")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--certified", default="auto", help="certified_exact modes to run, comma-separated")
    parser.add_argument("--early", default="auto,off", help="JobOptions.early modes to run, comma-separated")
    parser.add_argument("--batch-size", default="auto",
                        help="users a batch, comma-separated sizes run in turn within each repeat ('auto': the "
                             "job's own)")
    args = parser.parse_args()
    routes = args.certified.split(",")
    users, items = generate("clustered", args.users, args.items, args.dim, seed=0, device="cpu")
    resident, resident_by_route = [], {}
    for route in routes:
        engine = Engine(items, device=args.device, options=EngineOptions(certified_exact=route))
        engine.search(users, args.k)
        times = []
        for _ in range(args.repeat):
            engine.backend.synchronize()
            t0 = time.perf_counter()
            engine.search(users, args.k)
            times.append(time.perf_counter() - t0)
        resident_by_route[route] = times
        resident = resident or times
        print(f"resident search, certified_exact={route}: {statistics.median(times):.3f} s "
              f"(route {engine.stats.get('route', 'float32')})", flush=True)
        del engine
    runs = []
    with tempfile.TemporaryDirectory(prefix="recall-e2e-layouts-") as tmp:
        for layout in args.layout or ["pyarrow", "warehouse"]:
            up, ip = Path(tmp) / f"users-{layout}.parquet", Path(tmp) / f"items-{layout}.parquet"
            layouts.write(users, up, layout)
            layouts.write(items, ip, layout)
            for mode in args.early.split(","):
                for route in routes:
                    opts = JobOptions(early=mode, engine=EngineOptions(certified_exact=route))
                    sizes = [None if b == "auto" else int(b) for b in str(args.batch_size).split(",")]
                    times = {b: [] for b in sizes}
                    stages = {b: [] for b in sizes}
                    early_users = {}
                    # The first round warms the page cache and the kernels; the sizes then run in turn, so that a
                    # drift of the machine's speed over the rounds falls on every size alike.
                    for i in range(args.repeat + 1):
                        for b in sizes:
                            out = Path(tmp) / "out.parquet"
                            t0 = time.perf_counter()
                            summary = score_files(up, ip, out, args.k, device=args.device, options=opts,
                                                  batch_size=b)
                            if i:
                                times[b].append(time.perf_counter() - t0)
                                stages[b].append({key: getattr(summary, key) for key in (
                                    "start_s", "read_s", "search_s", "write_s", "device_busy_s", "batch_size")})
                            early_users[b] = summary.early_users
                            out.unlink()
                    for b in sizes:
                        runs.append({"layout": layout, "early": mode, "certified_exact": route,
                                     "batch_size": b or "auto", "times_s": times[b],
                                     "median_s": statistics.median(times[b]), "early_users": early_users[b],
                                     "stages": stages[b]})
                        last = stages[b][-1]
                        print(f"{layout} early={mode} certified_exact={route} batch={b or 'auto'} "
                              f"({last['batch_size']:,}): {statistics.median(times[b]):.3f} s; last run: start "
                              f"{last['start_s']:.3f} read {last['read_s']:.3f} search {last['search_s']:.3f} "
                              f"write {last['write_s']:.3f} device busy {last['device_busy_s']:.3f}", flush=True)
    base = statistics.median(resident)
    print(f"resident search: {base:.3f} s (median of {args.repeat}); {args.users:,} users x {args.items:,} items x "
          f"{args.dim}, k={args.k}")
    print(f"{'layout':<16}{'early':<8}{'certified':<10}{'batch':>8}{'median s':>10}{'x resident':>12}"
          f"{'early users':>14}")
    for r in runs:
        print(f"{r['layout']:<16}{r['early']:<8}{r['certified_exact']:<10}{r['batch_size']:>8}{r['median_s']:>10.3f}"
              f"{r['median_s'] / base:>12.2f}{r['early_users']:>14,}")
    if args.json:
        args.json.write_text(json.dumps({"resident_s": resident, "resident_by_route": resident_by_route,
                                         "runs": runs, "args": vars(args)}, default=str, indent=1))


if __name__ == "__main__":
    main()
