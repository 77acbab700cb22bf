"""The threshold sample's select alone: the warp-a-user select (``recall_seed_warp*``) against the block-a-user one
(``recall_seed``) on the same sampled scores, per (users, sampled scores a user, rank), float32 scores of float16
vectors (fast mode's fused passes) and float32 of float32 (exact mode's search). Prints a table and writes JSON.

Run from the project root on a GPU machine::

    PYTHONPATH=. python3 scripts/lab/seed_select_micro.py [--json $OUT/seed_select.json]

Scores: i.i.d. normal, and the same with each user's scores scaled by a log-normal factor and offset (skewed users:
the keys of a row crowd a few binades). Median of 7 launches after a warm-up, timed with CUDA events.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

# (users, sampled scores a user, k, estimate rank (0: k, a bound))
SHAPES = [(200_000, 2048, 100, 30), (200_000, 4096, 100, 30), (100_000, 8192, 100, 0), (100_000, 8192, 126, 0),
          (20_000, 16384, 100, 0), (20_000, 32768, 100, 0), (20_000, 65536, 128, 0), (4_000, 2048, 100, 30),
          (1_000_000, 2048, 100, 30)]


def main() -> None:
    import cupy

    from recall.backends import resolve
    from recall.backends.cupy import selection
    from recall.backends.cupy.selection import GpuTopK

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    backend = resolve("gpu")
    sel = backend.selection
    shipped = selection.SEED_WARP_RANK, selection.SEED_WARP_MAX_SIZE
    rng = cupy.random.default_rng(0)
    out = []
    print("| users | sampled | k | rank | data | vectors | block ms | warp ms | block / warp | warp >= block | "
          "warp == block |")
    print("| ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | --- | --- |")
    for n, size, k, ke in SHAPES:
        for data in ("normal", "skewed"):
            scores = rng.standard_normal((1, n, size), dtype=cupy.float32)
            if data == "skewed":
                scale = cupy.exp(rng.standard_normal((1, n, 1), dtype=cupy.float32))
                scores = scores * scale + cupy.float32(3.0) * scale
            rows = cupy.arange(size, dtype=cupy.int64)
            norms = cupy.abs(rng.standard_normal(size, dtype=cupy.float32)) + cupy.float32(0.5)
            for vectors in (cupy.float16, cupy.float32):
                users = rng.standard_normal((n, 72), dtype=cupy.float32).astype(vectors) * 0.1
                state = GpuTopK.allocate(n, k, 1)
                ptr, ex = cupy.zeros(n + 1, cupy.int64), cupy.zeros(0, cupy.int64)
                times, thr = {}, {}
                for name, rule in (("block", (0, 0)), ("warp", (128, 65536))):
                    selection.SEED_WARP_RANK, selection.SEED_WARP_MAX_SIZE = rule
                    sel.seed(state, scores, rows, users, norms, ptr, ex, ke, (64, 2.0 ** 15))
                    ts = []
                    for _ in range(7):
                        a_ev, b_ev = cupy.cuda.Event(), cupy.cuda.Event()
                        a_ev.record()
                        sel.seed(state, scores, rows, users, norms, ptr, ex, ke, (64, 2.0 ** 15))
                        b_ev.record()
                        b_ev.synchronize()
                        ts.append(cupy.cuda.get_elapsed_time(a_ev, b_ev))
                    times[name] = statistics.median(ts)
                    thr[name] = state.thr[:n].copy()
                selection.SEED_WARP_RANK, selection.SEED_WARP_MAX_SIZE = shipped
                ge = bool((thr["warp"] >= thr["block"]).all())
                eq = float((thr["warp"] == thr["block"]).mean())
                vname = np.dtype(vectors).name
                rank = ke or k
                print(f"| {n:,} | {size:,} | {k} | {rank} | {data} | {vname} | {times['block']:.3f} | "
                      f"{times['warp']:.3f} | {times['block'] / times['warp']:.2f} | {ge} | {eq:.4f} |", flush=True)
                out.append({"users": n, "sampled": size, "k": k, "rank": rank, "data": data, "vectors": vname,
                            "block_ms": times["block"], "warp_ms": times["warp"], "warp_ge_block": ge,
                            "equal_share": eq})
                del users, state
            del scores
            cupy.get_default_memory_pool().free_all_blocks()
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
