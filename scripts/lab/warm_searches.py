"""Lab (GPU): what each of an engine's first searches does beyond the search itself. ``kernel_profile.py
--interleave`` saw the first timed search of each call's first engine take 89.5-137 ms where every later one took
11 ms (clustered 1M x 4,096 x 32 ip, k = 50, the certified route; H100 2026-12-07, docs/benchmarks.md), after that
engine's warm-up search and the other variants' engines were made and warmed up.

Makes the ``--variants`` engines (options only, no hooks) of a cell in turn, each searched once (as
``--interleave`` does), then searches them ``--rounds`` times in turn; for every search prints its time and what it
started for the first time: kernel compilations (CuPy's compiler and recall's sm_90a cubins, each with its time),
CUDA graph captures (``BlockPipeline._capture``), the growth of CuPy's memory pool, and the stats that steer a search
(the probe, the first margin, the blocks and graph blocks, the threshold's estimate and need).

    PYTHONPATH=. python3 scripts/lab/warm_searches.py --cells clustered:1000000:4096:32:50:ip \
        --variants shipped,float32 [--rounds 3] [--json $OUT/warm.json]
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_profile import cell_spec, timed_search, variant_hooks, variant_options  # the lab's cells, variants, timer

EVENTS: list = []  # (what, seconds) since the last search started


def _logged(what, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            EVENTS.append((what, time.perf_counter() - t0))

    return wrapped


def _instrument() -> None:
    """Wrap the Python entry points that compile, load or capture: CuPy's compiler module (its functions are looked
    up there at each call), recall's sm_90a cubin builds and module loads, and the pipeline's graph captures."""
    from cupy.cuda import compiler

    from recall.backends.cupy import kernels, pipeline

    for name in dir(compiler):
        fn = getattr(compiler, name)
        if callable(fn) and (name.startswith("compile") or name.startswith("_compile")) and not isinstance(fn, type):
            setattr(compiler, name, _logged(f"cupy.{name}", fn))
    for name in ("_hopper_cubin", "module", "hopper_module"):
        setattr(kernels, name, _logged(f"recall.{name}", getattr(kernels, name)))
    pipeline.BlockPipeline._capture = _logged("graph capture", pipeline.BlockPipeline._capture)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", required=True)
    p.add_argument("--variants", default="shipped,float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    import cupy

    from recall import Engine
    from recall.bench.workloads import generate

    _instrument()
    pool = cupy.get_default_memory_pool()
    out = []

    names = list(dict.fromkeys(a.variants.split(",")))
    hooked = [name for name in names if variant_hooks(name)]
    if hooked:  # their module settings would stay for the variants after them (kernel_profile.py restores them)
        p.error(f"variants of options only: {', '.join(hooked)} set hooks")

    def search(cell, name, engine, users, k, label):
        EVENTS.clear()
        grown = pool.total_bytes()
        dt, _ = timed_search(engine, users, k, None)
        st = engine.stats
        # recall.module / hopper_module calls are lookups once built: only the slow ones say something.
        events = [(w, s) for w, s in EVENTS if not w.startswith("recall.") or w == "recall._hopper_cubin" or s > 1e-3]
        row = {"cell": cell, "variant": name, "search": label, "ms": dt * 1e3,
               "events": [[w, round(s * 1e3, 2)] for w, s in events],
               "pool_grown_mb": (pool.total_bytes() - grown) / 2**20,
               **{key: st.get(key) for key in ("probe", "first_margin", "blocks", "graph_blocks", "seed_estimate",
                                               "seed_need_rank", "widened_users", "fallback_users", "route")}}
        took = sum(s for _, s in events) * 1e3
        print(f"| {cell} | {name} | {label} | {row['ms']:.1f} ms | {len(events)} events ({took:.1f} ms): "
              f"{row['events'][:8]} | pool +{row['pool_grown_mb']:.0f} MB | "
              f"probe {row['probe']} margin {row['first_margin']} blocks {row['blocks']} graphs {row['graph_blocks']} "
              f"estimate {row['seed_estimate']} need {row['seed_need_rank']} |", flush=True)
        out.append(row)

    for cell in a.cells.split(","):
        kind, nu, ni, dim, k, metric, _ = cell_spec(cell)
        users, items = generate(kind, nu, ni, dim, seed=0, device="gpu")
        engines, budget = {}, None
        for name in names:
            engine = Engine(items, metric=metric, device="gpu", options=variant_options(name), precision="exact",
                            memory_budget=budget)
            budget = budget or engine.memory_budget
            engines[name] = engine
            search(cell, name, engine, users, k, "warm-up")
        for r in range(a.rounds):
            for name, engine in engines.items():
                search(cell, name, engine, users, k, f"round {r + 1}")
        del engines
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
