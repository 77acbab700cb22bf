"""Host users against device users on the GPU: are staging (pinned, copy stream) and the return of results (pinned,
fetch stream) hidden behind the search? Run on a GPU machine: PYTHONPATH=. python3 scripts/gpu_overlap.py

Prints a table (median of 3 after a warm-up) and writes gpu_overlap.json to $OUT when set.
"""
from __future__ import annotations

import json
import os
import time

import cupy

import recall
from recall.bench.workloads import generate


def main() -> None:
    n_users = int(os.environ.get("OVERLAP_USERS", "100000"))
    users, items = generate("clustered", n_users, 1_000_000, 64, seed=0, device="gpu")
    host_users = users.get()
    engine = recall.Engine(items, device="gpu")
    rows = []
    for label, arg in (("device users, device results", users), ("host users, host results", host_users)):
        engine.search(arg, 100)
        times = []
        for _ in range(3):
            cupy.cuda.Device().synchronize()
            t = time.perf_counter()
            engine.search(arg, 100)
            cupy.cuda.Device().synchronize()
            times.append(time.perf_counter() - t)
        st = engine.stats
        rows.append({"case": label, "seconds": sorted(times)[1], "times": times, "gpu_busy_s": st["gpu_busy_s"],
                     "h2d_s": st["h2d_s"], "d2h_s": st.get("d2h_s", 0.0), "busy_fraction": st["busy_fraction"]})
    print(f"{'case':<32} {'median s':>9} {'GPU busy s':>10} {'busy':>6} {'H2D s':>7} {'D2H s':>7}")
    for r in rows:
        print(f"{r['case']:<32} {r['seconds']:>9.4f} {r['gpu_busy_s']:>10.4f} {r['busy_fraction']:>6.0%} "
              f"{r['h2d_s']:>7.4f} {r['d2h_s']:>7.4f}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_overlap.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
