"""Where an embedded engine's time goes on small batches: host (Python, cProfile) against device (the block's
launches, each timed with graphs off), for a resident exact engine answering the same few users again and again.

Run from the project root on a GPU machine::

    PYTHONPATH=. python3 scripts/lab/small_batch_profile.py [--items 1000000] [--dim 64] [--k 100] [--batches 1,32]

For each batch size: 10 warm-up searches, then 50 timed ones (median wall, the engine's ``gpu_busy_s``), then 50
under cProfile (the 20 functions of most own time); then, for each, one search with graphs off and every launch
timed.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_profile import instrument  # noqa: E402

from recall import Engine, EngineOptions  # noqa: E402
from recall.bench.workloads import generate  # noqa: E402


def main() -> None:
    import cupy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--batches", default="1,32")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    users, items = generate("clustered", max(batches), a.items, a.dim, seed=0, device="gpu")
    engine = Engine(items, device="gpu")
    for b in batches:
        q = users[:b]
        for _ in range(10):
            engine.search(q, a.k)
        cupy.cuda.Device().synchronize()
        walls, busy = [], []
        for _ in range(50):
            t0 = time.perf_counter()
            engine.search(q, a.k)
            cupy.cuda.Device().synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
            busy.append(engine.stats.get("gpu_busy_s", 0.0) * 1e3)
        st = engine.stats
        print(f"## {b} users: wall {statistics.median(walls):.3f} ms, gpu busy {statistics.median(busy):.3f} ms; "
              f"fused {st.get('fused')} tiles {st.get('tiles')} graph blocks {st.get('graph_blocks')} "
              f"seed {st.get('seed_sample')}", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            engine.search(q, a.k)
        cupy.cuda.Device().synchronize()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000], flush=True)
    # Last: the timing wrappers stay on the backend (which engines of a device share).
    eager = Engine(items, device="gpu", options=EngineOptions(cuda_graphs=False))
    log = []
    instrument(eager.backend, log)
    for b in batches:
        q = users[:b]
        eager.search(q, a.k)
        cupy.cuda.Device().synchronize()
        log.clear()
        eager.search(q, a.k)
        cupy.cuda.Device().synchronize()
        per = defaultdict(lambda: [0, 0.0])
        for name, ev_a, ev_b in log:
            per[name][0] += 1
            per[name][1] += cupy.cuda.get_elapsed_time(ev_a, ev_b)
        print(f"## {b} users, graphs off, launches timed: "
              + " ; ".join(f"{n} x{c} {ms:.3f} ms" for n, (c, ms) in sorted(per.items(), key=lambda x: -x[1][1])),
              flush=True)

if __name__ == "__main__":
    main()
