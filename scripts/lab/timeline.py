"""Lab (GPU): where a search leaves the GPU idle. One search of a cell (after a warm-up) is traced with torch's
profiler (CUPTI: every kernel and copy of the process, CuPy's included, graphs replayed or not); the script prints the
search's span on the GPU, the time some kernel or copy ran, the largest idle gaps with what ran either side of them,
and the busy time per kernel name (a cell's exclusions passed as host pairs, as kernel_profile.py passes them; with
``--host``, how long the GPU works after the host's last block loop). Writes JSON (and the Chrome trace with
``--trace``).

    PYTHONPATH=. python3 scripts/lab/timeline.py --cells uh-20k-k100,uh-ip-k1000 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_profile import cell_spec, variant_options  # the lab's cells and variants


def _events(trace_events: list, cats: tuple = ("kernel", "gpu_memcpy", "gpu_memset"), prefix: str = ""):
    """(name, start µs, end µs) of every event of a Chrome trace's ``traceEvents`` in ``cats`` (default: GPU kernels,
    copies and memsets) whose name starts with ``prefix``, by start."""
    out = []
    for ev in trace_events:
        if ev.get("ph") == "X" and ev.get("cat") in cats and str(ev.get("name", "")).startswith(prefix):
            out.append((ev["name"], float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0))))
    return sorted(out, key=lambda e: e[1])


#: Host functions marked in the trace (``--host``): (module, attribute path, label). A gap is then reported with the
#: innermost of them the host was in when the GPU went idle.
_HOST = (
    ("recall.engine.engine", "Engine._check_users", "check users"),
    ("recall.engine.inputs", "matrix", "inputs.matrix"),
    ("recall.backends.cupy.backend", "CupyBackend.largest_norm", "largest_norm"),
    ("recall.engine.fast", "certifies_exact", "certifies_exact"),
    ("recall.engine.engine", "Engine.plan", "Engine.plan"),
    ("recall.engine.fast", "_tiles16", "fast._tiles16"),
    ("recall.engine.fast", "_search", "fast._search"),
    ("recall.engine.fast", "_prepare", "users' float16 copies"),
    ("recall.engine.fast", "_certified_pass", "certified pass"),
    ("recall.backends.cupy.pipeline", "BlockPipeline._run_blocks", "run_blocks (queueing)"),
    ("recall.backends.cupy.pipeline", "BlockPipeline._search_slot", "a block's launches"),
    ("recall.backends.cupy.pipeline", "BlockPipeline._refresh_sample", "threshold sample rows"),
    ("recall.backends.cupy.fused", "multiplied_width", "multiplied_width"),
    ("recall.backends.cupy.backend", "CupyBackend.rescore", "rescore (launch)"),
    ("recall.backends.cupy.backend", "CupyBackend.to_host", "to_host (waits)"),
    ("recall.backends.cupy.backend", "CupyBackend.queue_after", "queue_after"),
    ("recall.core.host_threads", "copy_rows", "copy_rows (host threads)"),
    ("recall.core.exclusions", "Exclusions.block", "exclusions' block"),
    # The certified route's host steps before its first block (host_profile.py --stamps).
    ("recall.engine.fast", "search", "fast.search"),
    ("recall.engine.fast", "_search_fast", "fast._search_fast"),
    ("recall.engine.fast", "_pass_share", "fast._pass_share"),
    ("recall.engine.engine", "Engine._prepared", "Engine._prepared"),
    ("recall.engine.tuning", "preferred_tiles", "tuning.preferred_tiles"),
    ("recall.backends.cupy.backend", "CupyBackend.ingest", "ingest"),
    ("recall.backends.cupy.backend", "CupyBackend.certify_exact", "certify_exact"),
    ("recall.backends.cupy.backend", "CupyBackend.fast_users", "fast_users (launch)"),
    ("recall.backends.cupy.backend", "CupyBackend.fused_applies", "fused_applies"),
    ("recall.backends.cupy.backend", "CupyBackend.pass_score_dtype", "pass_score_dtype"),
    ("recall.backends.cupy.pipeline", "BlockPipeline._workspace", "pipeline._workspace"),
    ("recall.backends.cupy.fused", "FusedSearch.seed", "seed_w (launch)"),
)
_MARK = "recall: "


def wrap_host(make) -> None:
    """Replace every function of _HOST with ``make(fn, label)`` (a function already wrapped so is left as it is)."""
    import functools
    import importlib

    for module_name, path, label in _HOST:
        owner = importlib.import_module(module_name)
        *parents, attr = path.split(".")
        for name in parents:
            owner = getattr(owner, name)
        fn = getattr(owner, attr, None)
        if fn is None or getattr(fn, "_lab_wrapped", False):
            continue
        wrapped = functools.update_wrapper(make(fn, label), fn)
        wrapped._lab_wrapped = True
        setattr(owner, attr, wrapped)


def _mark_host() -> None:
    """Wrap every function of _HOST in a ``torch.profiler.record_function`` range labelled _MARK + its label."""
    import torch

    def make(fn, label):
        def wrapped(*args, **kwargs):
            with torch.profiler.record_function(_MARK + label):
                return fn(*args, **kwargs)

        return wrapped

    wrap_host(make)


def _host_at(marks: list, at: float) -> str:
    """The innermost marked host range that holds time ``at`` (µs), or "-"."""
    inside = [(e - s, name) for name, s, e in marks if s <= at < e]
    return min(inside)[1][len(_MARK):] if inside else "-"


def main() -> None:

    import cupy
    import torch
    from torch.profiler import ProfilerActivity, profile

    from recall import Engine
    from recall.bench import exclusions as bench_exclusions
    from recall.bench.workloads import generate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default="uh-20k-k100")
    p.add_argument("--variants", default="shipped")
    p.add_argument("--gaps", type=int, default=12, help="the largest idle gaps printed")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--trace", type=Path, default=None, help="a folder for each search's Chrome trace")
    p.add_argument("--events", type=int, default=0, help="print the first N GPU events and the host's ranges then")
    p.add_argument("--host", action="store_true",
                   help="mark the host's functions (_HOST) in the trace and name, for each gap, the one the host was in")
    a = p.parse_args()
    assert torch.cuda.is_available()
    if a.host:
        _mark_host()
    out = []
    for cell in a.cells.split(","):
        kind, nu, ni, dim, k, metric, per = cell_spec(cell)
        users, items = generate(kind, nu, ni, dim, seed=0, device="gpu")
        # A cell's exclusions as kernel_profile.py passes them: host pairs.
        excl = bench_exclusions.generate(users, items, per, k=k, seed=0, metric=metric).host() if per else None
        for vname in a.variants.split(","):
            opts = variant_options(vname)
            engine = Engine(items, metric=metric, device="gpu", options=opts)
            engine.search(users, k, exclude=excl)
            engine.search(users, k, exclude=excl)  # the second: the probe skipped, graphs captured
            cupy.cuda.Device().synchronize()
            for _ in range(2):  # the second trace is kept: a process's first carries the profiler's own start-up
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    engine.search(users, k, exclude=excl)
                    cupy.cuda.Device().synchronize()
            folder = a.trace or Path(tempfile.mkdtemp())
            folder.mkdir(parents=True, exist_ok=True)
            trace = folder / f"{cell}-{vname}.json"
            prof.export_chrome_trace(str(trace))
            trace_events = json.loads(trace.read_text()).get("traceEvents", [])
            evs = _events(trace_events)
            marks = _events(trace_events, ("user_annotation", "cpu_op", "python_function"), _MARK) if a.host else []
            if not evs:
                print(f"| {cell} | {vname} | no GPU events traced |", flush=True)
                continue
            span = evs[-1][2] - evs[0][1]
            busy, gaps, end, last = 0.0, [], evs[0][1], evs[0][0]
            per_name = defaultdict(float)
            for name, s, e in evs:
                per_name[name] += e - s
                if s > end:
                    gaps.append((s - end, last, name, s - evs[0][1]))
                    busy += e - s
                elif e > end:
                    busy += e - end
                if e > end:
                    end, last = e, name
            gaps.sort(reverse=True)
            idle = span - busy
            print(f"| {cell} | {vname} | span {span / 1e3:.3f} ms | busy {busy / 1e3:.3f} ms | idle {idle / 1e3:.3f} "
                  f"ms in {len(gaps)} gaps | {len(evs)} GPU events | stats route {engine.stats.get('route')} |",
                  flush=True)
            tail = None
            loops = [e for name, s, e in marks if name == _MARK + "run_blocks (queueing)"]
            if loops:
                # The GPU's work after the host queued its last block: what the search adds once the host's own
                # loop is done (where the host is the slower of the two, the part of the search nothing hides).
                tail = (evs[-1][2] - max(loops)) / 1e3
                print(f"|   GPU work ends {tail:.3f} ms after the host's last block loop "
                      f"({len(loops)} loops, the first ending at {(min(loops) - evs[0][1]) / 1e3:.3f} ms) |")
            for g, before, after, at in gaps[:a.gaps]:
                host = f" | host in {_host_at(marks, evs[0][1] + at - g)}" if a.host else ""
                print(f"|   gap {g / 1e3:.3f} ms at {at / 1e3:.3f} ms | after {before[:70]} | before {after[:70]}{host} |")
            t0 = evs[0][1]
            for name, s, e in evs[:a.events]:
                host = f" | host in {_host_at(marks, s)}" if a.host else ""
                print(f"|   event {name[:60]} | {(s - t0) / 1e3:.3f} ms | {(e - s) / 1e3:.3f} ms{host} |")
            if a.events and a.host:
                for name, s, e in marks:
                    if s - t0 < 5e3:
                        print(f"|   host {name[len(_MARK):]} | {(s - t0) / 1e3:.3f} ms | {(e - s) / 1e3:.3f} ms |")
            # Each copy's bytes and rate: a copy slower than its link says what else holds the link or the host.
            copies = defaultdict(lambda: [0, 0, 0.0])
            for ev in trace_events:
                if ev.get("ph") == "X" and ev.get("cat") == "gpu_memcpy":
                    c = copies[ev["name"]]
                    c[0] += 1
                    c[1] += int(ev.get("args", {}).get("bytes", 0))
                    c[2] += float(ev.get("dur", 0.0))
            for name, (n, nbytes, us) in sorted(copies.items()):
                print(f"|   copies {name} | {n} | {nbytes / 1e6:.1f} MB | {us / 1e3:.3f} ms | "
                      f"{nbytes / max(us, 1e-9) / 1e3:.1f} GB/s |")
            top = sorted(per_name.items(), key=lambda kv: -kv[1])[:20]
            print("|   busy by name | " + " ; ".join(f"{n[:50]} {t / 1e3:.3f} ms" for n, t in top) + " |", flush=True)
            out.append({"cell": cell, "variant": vname, "span_ms": span / 1e3, "busy_ms": busy / 1e3,
                        "idle_ms": idle / 1e3, "tail_ms": tail,
                        "gaps": [{"ms": g / 1e3, "at_ms": at / 1e3, "after": b, "before": f}
                                 for g, b, f, at in gaps[:50]],
                        "by_name_ms": {n: t / 1e3 for n, t in per_name.items()}})
            del engine
        del users, items
        cupy.get_default_memory_pool().free_all_blocks()
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
