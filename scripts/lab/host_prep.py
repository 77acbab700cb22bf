"""What host arrays cost before any search: users checked (norms: NaN, Inf, float32 overflow) and prepared for the
metric, and an engine built over host items (item norms, prepared items), on the CPU backend.

Run from the project root (``.oldtree/``, an exported earlier ``recall/``, for the tree before a change)::

    PYTHONPATH=. python3 scripts/lab/host_prep.py [--users 1000000] [--items 1000000] [--json out.json]
    PYTHONPATH=.oldtree python3 scripts/lab/host_prep.py ...

Normal data from seed 0, float32, dim 64. Median of ``--repeat`` timings after one untimed call, each phase on its
own: the users' ``Engine._check_users`` and ``metrics.prepare_users``, and ``Engine(items)``. Prints a table and
which ``recall`` it imported.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
from _timing import run_times

import recall
from recall import Engine
from recall.core import metrics


def timed(fn, repeat: int) -> float:
    return statistics.median(run_times(fn, repeat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=1_000_000)
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    users = rng.standard_normal((a.users, a.dim), dtype=np.float32)
    items = rng.standard_normal((a.items, a.dim), dtype=np.float32)
    small = items[:1000]
    print(f"recall from {recall.__file__}; {a.users:,} users, {a.items:,} items, dim {a.dim}, median of {a.repeat}")
    rows = []
    for metric in metrics.METRICS:
        engine = Engine(small, metric=metric, device="cpu")
        check = timed(lambda: engine._check_users(users, None), a.repeat)
        checked = engine._check_users(users, None)[1]
        prep = timed(lambda: metrics.prepare_users(metric, np, checked), a.repeat)
        build = timed(lambda: Engine(items, metric=metric, device="cpu"), a.repeat)
        rows.append({"metric": metric, "check_users_s": check, "prepare_users_s": prep, "engine_s": build})
    print("| metric | users checked s | users prepared s | Engine(items) s |")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['metric']} | {r['check_users_s']:.4f} | {r['prepare_users_s']:.4f} | {r['engine_s']:.4f} |")
    if a.json:
        a.json.write_text(json.dumps({"recall": recall.__file__, "args": vars(a) | {"json": str(a.json)},
                                      "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
