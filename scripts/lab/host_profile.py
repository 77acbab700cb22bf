"""Lab (GPU): where the host's time goes in one search of a cell. Times N searches (after warm-ups) from the call to
``search_async``'s return (for the certified route, which waits for its certificates, the whole search) and to the
synchronised result, then runs N more under cProfile and prints the functions of ``recall`` and CuPy by their own
time and by cumulative time, over the N searches. ``--stamps``: instead of cProfile, the N searches untraced with
each function of ``timeline._HOST`` timed (its calls and inclusive time a search, without a profiler's overhead) and
the GPU's wait from the call to the first block's launches (CUDA events recorded at both).

    PYTHONPATH=. python3 scripts/lab/host_profile.py --cells uh-20k-k100 --variants shipped,float32 [--top 25]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_profile import cell_spec, variant_options  # the lab's cells and variants
from timeline import wrap_host  # the host functions a trace marks


def _stamp_host() -> tuple[dict, list]:
    """Time every function of ``timeline._HOST`` (label -> [calls, seconds], inclusive) and record a CUDA event on the
    compute stream at the first block's launches of a search while the list returned is empty: (totals, that list)."""
    import cupy

    from recall.backends.cupy import pipeline

    totals: dict = {}

    def make(fn, label):
        slot = totals.setdefault(label, [0, 0.0])

        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                slot[0] += 1
                slot[1] += time.perf_counter() - t0

        return wrapped

    wrap_host(make)
    first: list = []
    search_slot = pipeline.BlockPipeline._search_slot

    def first_block(self, *args, **kwargs):
        if not first:
            first.append(cupy.cuda.Event())
            first[0].record(self.compute_stream)
        return search_slot(self, *args, **kwargs)

    pipeline.BlockPipeline._search_slot = first_block
    return totals, first


def _stamped(engine, users, k: int, excl, repeat: int, totals: dict, first: list) -> list[str]:
    """``repeat`` searches timed by :func:`_stamp_host`'s wrappers: the lines to print."""
    import cupy

    for v in totals.values():
        v[0], v[1] = 0, 0.0
    waits = []
    for _ in range(repeat):
        first.clear()
        start = cupy.cuda.Event()
        start.record()
        engine.search(users, k, exclude=excl)
        cupy.cuda.Device().synchronize()
        waits.append(cupy.cuda.get_elapsed_time(start, first[0]) if first else float("nan"))
    lines = [f"|   the call to the first block's launches on the GPU | {statistics.median(waits):.3f} ms |"]
    for label, (calls, secs) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        if calls:
            lines.append(f"|   {label} | {calls / repeat:g} calls | {secs / repeat * 1e3:.3f} ms a search |")
    return lines


def main() -> None:
    import cupy

    from recall import Engine
    from recall.bench import exclusions as bench_exclusions
    from recall.bench.workloads import generate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default="uh-20k-k100")
    p.add_argument("--variants", default="shipped,float32")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--stamps", action="store_true", help="time the marked host functions instead of cProfile")
    p.add_argument("--host-users", action="store_true",
                   help="users (and results) in host memory, as `recall score` and a job's batches give them")
    a = p.parse_args()
    stamps = _stamp_host() if a.stamps else None
    for cell in a.cells.split(","):
        kind, nu, ni, dim, k, metric, per = cell_spec(cell)
        users, items = generate(kind, nu, ni, dim, seed=0, device="gpu")
        # The cell's exclusions a user, as kernel_profile.py passes them: host CSR, normalised by every search.
        excl = bench_exclusions.generate(users, items, per, k=k, seed=0, metric=metric).host() if per else None
        if a.host_users:
            users = cupy.asnumpy(users)
        for vname in a.variants.split(","):
            opts = variant_options(vname)
            engine = Engine(items, metric=metric, device="gpu", options=opts)
            for _ in range(3):
                engine.search(users, k, exclude=excl)
            cupy.cuda.Device().synchronize()
            walls, queued = [], []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                pending = engine.search_async(users, k, exclude=excl)
                queued.append(time.perf_counter() - t0)
                pending.result()
                cupy.cuda.Device().synchronize()
                walls.append(time.perf_counter() - t0)
            print(f"| {cell} | {vname} | wall {statistics.median(walls) * 1e3:.2f} ms | search_async returned after "
                  f"{statistics.median(queued) * 1e3:.2f} ms | route {engine.stats.get('route')} |", flush=True)
            if stamps is not None:
                print("\n".join(_stamped(engine, users, k, excl, a.repeat, *stamps)), flush=True)
                del engine
                continue
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.repeat):
                engine.search(users, k, exclude=excl)
                cupy.cuda.Device().synchronize()
            prof.disable()
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                st = pstats.Stats(prof, stream=buf)
                st.sort_stats(key).print_stats("recall|cupy", a.top)
                print(f"--- {cell} {vname} by {key}, over {a.repeat} searches ---")
                print("\n".join(line for line in buf.getvalue().splitlines()
                                 if line.strip() and not line.startswith(("   Ordered", "   List"))))
            del engine
        del users, items, excl
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
