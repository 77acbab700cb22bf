"""What a process's earlier searches leave behind that changes a later search's time (docs/benchmarks.md: fast mode
on 20k x 1M x 32 took 0.019 s in a fresh process and 0.023-0.025 s after larger searches; the first timed search
after a warm-up took about 80 ms more than the next ones, once per process).

Run from the project root on a GPU machine::

    PYTHONPATH=. python3 scripts/lab/state_effects.py [--json $OUT/state_effects.json]

One process, in this order, each step a few timed searches after whatever the step changes, every search between two
device synchronisations, with its wall time, the engine's GPU busy time and graph blocks, and the host time of the
float16 copies of its users (fast mode's first host-bound step, timed without synchronising):

1. ``fresh``: the small search (``--small``) in fast mode, then in exact mode, first searches of the process;
2. ``graphs-off``: the same exact search on an engine with CUDA graphs off (is the slow first timed search a
   capture?);
3. ``after-large``: one search of the large cell (``--large``), fast mode, then the small one again;
4. ``workspaces-cleared``: the backend's kept workspaces (and their graphs) let go, then the small one again;
5. ``pools-freed``: CuPy's device and pinned memory pools emptied as well, then the small one again.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from pathlib import Path

from recall import Engine
from recall.bench.workloads import generate
from recall.core import certificate
from recall.core.options import EngineOptions

# name: (kind, users, items, dim, k, metric)
CELLS = {
    "d32-k10": ("normal", 20_000, 1_000_000, 32, 10, "ip"),
    "uh-k100": ("skewed", 1_000_000, 100_000, 64, 100, "ip"),
    "S1": ("clustered", 100_000, 1_000_000, 64, 100, "ip"),
}


class HostTimer:
    """Host seconds spent in ``certificate.prepare_users`` (no synchronisation: the launches' own cost)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._real = certificate.prepare_users

    def __enter__(self) -> "HostTimer":
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return self._real(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - t0)

        certificate.prepare_users = timed
        return self

    def __exit__(self, *exc: object) -> None:
        certificate.prepare_users = self._real


def searches(engine, users, k, n, label, out):
    """``n`` timed searches of ``users`` (a fresh engine's first search among them), recorded under ``label``."""
    import cupy

    rows = []
    for i in range(n):
        with HostTimer() as host:
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            engine.search(users, k)
            cupy.cuda.Device().synchronize()
            wall = time.perf_counter() - t0
        st = engine.stats
        rows.append({"run": i, "wall_s": wall, "gpu_busy_s": st.get("gpu_busy_s"),
                     "graph_blocks": st.get("graph_blocks"), "blocks": st.get("blocks"),
                     "precision": st.get("precision"), "copies_host_s": sum(host.seconds)})
    times = ", ".join(f"{r['wall_s']:.4f}" for r in rows)
    graphs = ", ".join(f"{r['graph_blocks']}/{r['blocks']}" for r in rows)
    copies = ", ".join(f"{r['copies_host_s'] * 1e3:.2f}" for r in rows)
    print(f"| {label} | {times} | graphs {graphs} | copies host ms {copies} |", flush=True)
    out.append({"step": label, "runs": rows})


def main() -> None:
    import cupy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", default="d32-k10", choices=sorted(CELLS))
    p.add_argument("--large", default="uh-k100", choices=sorted(CELLS))
    p.add_argument("--runs", type=int, default=5, help="searches per step (the first of a fresh engine included)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    kind, nu, ni, dim, k, metric = CELLS[a.small]
    users, items = generate(kind, nu, ni, dim, seed=0, device="gpu")
    out: list[dict] = []
    print("| step | wall s per search (first = the engine's first search) | graph blocks | copies |")
    fast = Engine(items, metric=metric, device="gpu", precision="fast")
    searches(fast, users, k, a.runs, "fresh, fast", out)
    exact = Engine(items, metric=metric, device="gpu")
    searches(exact, users, k, a.runs, "fresh, exact", out)
    eager = Engine(items, metric=metric, device="gpu", options=dataclasses.replace(EngineOptions(), cuda_graphs=False))
    searches(eager, users, k, a.runs, "graphs-off, exact", out)
    del eager

    lkind, lnu, lni, ldim, lk, lmetric = CELLS[a.large]
    big_users, big_items = generate(lkind, lnu, lni, ldim, seed=0, device="gpu")
    big = Engine(big_items, metric=lmetric, device="gpu", precision="fast")
    searches(big, big_users, lk, 2, f"large ({a.large}), fast", out)
    del big, big_users, big_items
    gc.collect()
    searches(fast, users, k, a.runs, "after-large, fast", out)
    searches(exact, users, k, a.runs, "after-large, exact", out)

    pipeline = fast.backend.pipeline
    print(f"  kept workspaces before clearing: {len(pipeline._ws)}", flush=True)
    pipeline.synchronize()
    pipeline._ws.clear()
    searches(fast, users, k, a.runs, "workspaces-cleared, fast", out)

    pipeline.synchronize()
    pipeline._ws.clear()
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    searches(fast, users, k, a.runs, "pools-freed, fast", out)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
