"""Where a search's wall time goes on the GPU's timeline: one search (after warm-ups) under torch.profiler, whose
CUPTI tracing records every kernel, copy and set of the process (CuPy's included, inside CUDA graphs too) and the
host's runtime and driver calls; printed as the time per kernel name, the device's idle gaps with the kernels on
either side and the host calls that overlap them, and the span from the search's call to its first kernel and from
its last kernel to its return. A measurement, not an option.

Run from the project root on a GPU machine (torch with CUDA in the environment)::

    PYTHONPATH=. python3 scripts/lab/route_timeline.py [--cell skewed:1000000:4096:32:50:l2] [--variant shipped]
        [--gap-us 10] [--trace $OUT/trace.json] [--json $OUT/timeline.json] [--cprofile 30]

Cells and variants are ``kernel_profile.py``'s (``cell_spec``, ``variant_options``, ``variant_hooks``).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_profile import cell_spec, variant_hooks, variant_options  # noqa: E402

from recall import Engine  # noqa: E402
from recall.bench import exclusions as bench_exclusions  # noqa: E402
from recall.bench.workloads import generate  # noqa: E402

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def timeline(events: list[dict], t_call: float, t_return: float, gap_us: float) -> dict:
    """The device's activity between the host's call (``t_call``) and return (``t_return``), trace microseconds."""
    dev = sorted((e for e in events if e.get("cat") in DEVICE_CATS and "dur" in e), key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e]
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    busy_end = None
    busy = 0.0
    gaps = []
    prev = None
    for e in dev:
        start, end = e["ts"], e["ts"] + e["dur"]
        per_name[_short(e["name"])][0] += 1
        per_name[_short(e["name"])][1] += e["dur"]
        if busy_end is None or start > busy_end:
            if busy_end is not None and start - busy_end >= gap_us:
                # Host calls running during the gap, longest first: what the device waited for.
                during = sorted(((min(h["ts"] + h["dur"], start) - max(h["ts"], busy_end), h["name"]) for h in host
                                 if h["ts"] < start and h["ts"] + h["dur"] > busy_end), reverse=True)[:3]
                gaps.append({"at_us": busy_end - dev[0]["ts"], "gap_us": start - busy_end,
                             "after": _short(prev["name"], 40), "before": _short(e["name"], 40),
                             "host_calls": [f"{n} {d:.0f} us" for d, n in during]})
            busy += end - start
            busy_end = end
        elif end > busy_end:
            busy += end - busy_end
            busy_end = end
        prev = e if prev is None or end >= prev["ts"] + prev["dur"] else prev
    first = dev[0]["ts"] if dev else t_call
    last = max((e["ts"] + e["dur"] for e in dev), default=t_return)
    return {"wall_us": t_return - t_call, "device_span_us": last - first, "device_busy_us": busy,
            "call_to_first_kernel_us": first - t_call, "last_kernel_to_return_us": t_return - last,
            "idle_in_span_us": (last - first) - busy,
            "gaps": gaps, "per_name": {n: {"count": c, "us": t} for n, (c, t) in
                                       sorted(per_name.items(), key=lambda kv: -kv[1][1])}}


def main() -> None:
    import cupy
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cell", default="skewed:1000000:4096:32:50:l2")
    p.add_argument("--variant", default="shipped")
    p.add_argument("--gap-us", type=float, default=10.0, help="idle stretches at least this long are listed")
    p.add_argument("--warmups", type=int, default=3)
    p.add_argument("--trace", type=Path, default=None, help="the chrome trace, kept here")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--cprofile", type=int, default=30, help="then one search under cProfile: its N costliest calls")
    a = p.parse_args()

    kind, nu, ni, dim, k, metric, per = cell_spec(a.cell)
    users, items = generate(kind, nu, ni, dim, seed=0, device="gpu")
    excl = bench_exclusions.generate(users, items, per, k=k, seed=0, metric=metric).host() if per else None
    engine = Engine(items, metric=metric, device="gpu", options=variant_options(a.variant))
    for hook in variant_hooks(a.variant):
        hook(engine)
    for _ in range(a.warmups):
        engine.search(users, k, exclude=excl)
    torch.cuda.init()
    cupy.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        cupy.cuda.Device().synchronize()
        with record_function("recall.search"):
            t0 = time.perf_counter()
            engine.search(users, k, exclude=excl)
            cupy.cuda.Device().synchronize()
            wall = time.perf_counter() - t0
    trace = a.trace or Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    mark = next(e for e in events if e.get("name") == "recall.search" and e.get("cat") == "user_annotation")
    out = timeline(events, mark["ts"], mark["ts"] + mark["dur"], a.gap_us)
    out.update(cell=a.cell, variant=a.variant, timed_wall_s=wall, stats={
        key: engine.stats.get(key) for key in ("route", "tiles", "gpu_busy_s", "seed_even_every", "widened_users",
                                               "fallback_users")})
    print(f"{a.cell} {a.variant}: wall {out['wall_us'] / 1e3:.2f} ms (timed {wall * 1e3:.2f}); device span "
          f"{out['device_span_us'] / 1e3:.2f} ms, busy {out['device_busy_us'] / 1e3:.2f}, idle within it "
          f"{out['idle_in_span_us'] / 1e3:.2f}; call to first kernel {out['call_to_first_kernel_us']:.0f} us, last "
          f"kernel to return {out['last_kernel_to_return_us']:.0f} us")
    print("| kernel | launches | ms |")
    print("| --- | ---: | ---: |")
    for name, v in out["per_name"].items():
        print(f"| {name} | {v['count']} | {v['us'] / 1e3:.3f} |")
    print(f"| idle stretch of {a.gap_us:.0f} us or more | at (ms) | us | after | before | host calls meanwhile |")
    print("| --- | ---: | ---: | --- | --- | --- |")
    for g in out["gaps"]:
        print(f"| | {g['at_us'] / 1e3:.3f} | {g['gap_us']:.0f} | {g['after']} | {g['before']} | "
              f"{'; '.join(g['host_calls'])} |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    if a.cprofile:
        # The host's side of one more search: where its time goes between and around the launches.
        import cProfile
        import io
        import pstats

        cupy.cuda.Device().synchronize()
        prof_host = cProfile.Profile()
        prof_host.enable()
        engine.search(users, k, exclude=excl)
        cupy.cuda.Device().synchronize()
        prof_host.disable()
        buf = io.StringIO()
        pstats.Stats(prof_host, stream=buf).sort_stats("cumulative").print_stats(a.cprofile)
        print(buf.getvalue())


if __name__ == "__main__":
    main()
