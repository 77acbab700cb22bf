"""Streamed items against resident items on one GPU: same answer, and what the streaming costs.

Run from the project root on a GPU machine::

    PYTHONPATH=. python3 scripts/lab/streamed_bench.py [--users 1000000] [--items 1000000] [--big-items 50000000] \
        [--big-users 20000] [--item-memory-gb 4] [--json $OUT/streamed.json]

1. ``--users`` x ``--items`` x 64 (clustered, generated on the GPU from seed 0), k=100: a resident engine and one
   with ``item_memory`` a quarter of the resident footprint, alternating, median of ``--repeat``; answers compared.
2. ``--big-items`` x 64 items (normal, generated on the GPU in chunks, kept in host memory) with
   ``item_memory`` of ``--item-memory-gb``, ``--big-users`` users: the streamed search timed, its TFLOP/s, and
   (where the device holds the catalogue) the resident search of the same items beside it, answers compared.

Prints a table and writes every time to JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from recall import Engine
from recall.bench.workloads import generate


def _timed(engine: Engine, users, k: int) -> tuple[float, object]:
    engine.backend.synchronize()
    t0 = time.perf_counter()
    res = engine.search(users, k)
    engine.backend.synchronize()
    return time.perf_counter() - t0, res


def _same(a, b) -> bool:
    import cupy

    return bool(cupy.array_equal(cupy.asarray(a.indices), cupy.asarray(b.indices))
                and cupy.array_equal(cupy.asarray(a.scores), cupy.asarray(b.scores)))


def part_one(args, out: dict) -> None:
    users, items = generate("clustered", args.users, args.items, 64, seed=0, device="gpu")
    resident = Engine(items, device="gpu")
    quarter = resident.backend.resident_bytes(args.items, 64) // 4
    streamed = Engine(items, device="gpu", item_memory=quarter)
    warm = users[:10_000]
    resident.search(warm, args.k)
    streamed.search(warm, args.k)
    times = {"resident": [], "streamed": []}
    same = True
    for _ in range(args.repeat):
        t, a = _timed(resident, users, args.k)
        times["resident"].append(t)
        t, b = _timed(streamed, users, args.k)
        times["streamed"].append(t)
        same &= _same(a, b)
        del a, b
    med = {m: statistics.median(v) for m, v in times.items()}
    out["part1"] = {"users": args.users, "items": args.items, "dim": 64, "k": args.k, "item_memory": quarter,
                    "times_s": times, "median_s": med, "same_answer": same, "stats": streamed.stats,
                    "ratio_resident_over_streamed": med["resident"] / med["streamed"]}
    print(f"| {args.users:,} x {args.items:,} x 64, k={args.k} | resident {med['resident']:.3f} s | streamed "
          f"(item_memory {quarter / 2**20:,.0f} MiB, {streamed.stats['item_segments']} segments, "
          f"{streamed.stats['user_groups']} user groups) {med['streamed']:.3f} s | speed "
          f"{med['resident'] / med['streamed']:.3f}x resident | same answer {same} |", flush=True)


def part_two(args, out: dict) -> None:
    import cupy

    n, dim = args.big_items, 64
    host = np.empty((n, dim), np.float32)
    rng = cupy.random.default_rng(1)
    step = 1 << 22
    t0 = time.perf_counter()
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        host[lo:hi] = rng.standard_normal((hi - lo, dim), dtype=cupy.float32).get()
    users = rng.standard_normal((args.big_users, dim), dtype=cupy.float32)
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = Engine(host, device="gpu", item_memory=int(args.item_memory_gb * 2**30))
    build_s = time.perf_counter() - t0
    engine.search(users[:500], args.k)
    t, res = _timed(engine, users, args.k)
    tflops = 2.0 * args.big_users * n * dim / t / 1e12
    row = {"items": n, "users": args.big_users, "dim": dim, "k": args.k, "item_memory": engine.item_memory,
           "generate_s": gen_s, "build_s": build_s, "search_s": t, "tflops": tflops, "stats": engine.stats}
    print(f"| {args.big_users:,} x {n:,} x 64, k={args.k} | streamed, item_memory {args.item_memory_gb} GiB "
          f"({engine.stats['item_segments']} segments) {t:.3f} s, {tflops:.1f} TFLOP/s | engine built in "
          f"{build_s:.1f} s |", flush=True)
    keep = cupy.asarray(res.indices), cupy.asarray(res.scores)
    del res, engine
    try:
        resident = Engine(host, device="gpu")
        resident.search(users[:500], args.k)
        tr, rr = _timed(resident, users, args.k)
        row.update(resident_s=tr, resident_tflops=2.0 * args.big_users * n * dim / tr / 1e12,
                   same_answer=bool(cupy.array_equal(keep[0], cupy.asarray(rr.indices))
                                    and cupy.array_equal(keep[1], cupy.asarray(rr.scores))))
        print(f"|   the same items resident | {tr:.3f} s, {row['resident_tflops']:.1f} TFLOP/s | streamed / resident "
              f"time {t / tr:.3f} | same answer {row['same_answer']} |", flush=True)
    except Exception as exc:  # noqa: BLE001 - a catalogue the device cannot hold: say so, keep the streamed row
        row["resident_error"] = f"{type(exc).__name__}: {exc}"
        print(f"|   resident: {row['resident_error']} |", flush=True)
    out["part2"] = row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=1_000_000)
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--big-items", type=int, default=50_000_000)
    p.add_argument("--big-users", type=int, default=20_000)
    p.add_argument("--item-memory-gb", type=float, default=4.0)
    p.add_argument("--skip", choices=["one", "two"], default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    out: dict = {"argv": vars(args) | {"json": str(args.json)}}
    if args.skip != "one":
        part_one(args, out)
    if args.skip != "two":
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
        part_two(args, out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
