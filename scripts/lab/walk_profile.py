"""The walk's kernel (recall/backends/cupy/kernels/walk_w.cu) alone, on random float16 rows with log-normal norms:
its time per launch as built and with measurement-only defines (``-DRK_NO_TAKE``: the products and the filter's
tests, nothing staged; ``-DRK_SKIP_COMPACT``: survivors past a full stage dropped, no selection; ``-DRK_COUNT``:
counts of the take calls, selections and keys staged, per user). The route's time with and without the walk:
``scripts/lab/kernel_profile.py --variants shipped,walk``. Run from the project root on a Hopper GPU::

    PYTHONPATH=. python3 scripts/lab/walk_profile.py [--shapes 1000000:4096:64:27,200000:20000:48:27]
        [--defines ",-DRK_NO_TAKE,-DRK_COUNT"] [--json out.json]

A shape is users:items:columns:K (columns multiplied, a multiple of 16 up to 80; K candidates a user). Users are
walked in blocks of 32,768 (the pipeline's fused user block), each a launch; the median of 5 timed runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from _timing import device_times


def _rows(cp, rng, n, width):
    x = rng.standard_normal((n, width), dtype=np.float32) * rng.lognormal(0, 0.6, (n, 1)).astype(np.float32)
    return cp.asarray(x.astype(np.float16))


def main() -> int:
    import cupy as cp

    from recall.backends.cupy import fused as fused_path
    from recall.backends.cupy import kernels

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1000000:4096:64:27,200000:20000:48:27,100000:16384:64:27")
    p.add_argument("--defines", default=",-DRK_NO_TAKE,-DRK_COUNT")
    p.add_argument("--block", type=int, default=32768)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    print("| shape | build | time a pass | per user: takes, selections, keys staged |")
    print("| --- | --- | ---: | --- |")
    for shape in a.shapes.split(","):
        n_users, n_items, width, k = (int(x) for x in shape.split(":"))
        users, items = _rows(cp, rng, n_users, width), _rows(cp, rng, n_items, width)
        vals = cp.empty((a.block, k), cp.float32)
        out = cp.empty((a.block, k), cp.int64)
        ex_ptr = cp.zeros(a.block + 1, cp.int64)
        ex_items = cp.zeros(1, cp.int64)
        smem = fused_path.walk_smem(width)
        for define in a.defines.split(","):
            mod = kernels.hopper_module(kernels.HOPPER_WALK_SOURCES, tuple(define.split()))
            fn = mod.get_function(f"recall_walk_w{width // 16}")
            fn.max_dynamic_shared_size_bytes = smem

            def run():
                for s in range(0, n_users, a.block):
                    n = min(a.block, n_users - s)
                    fn((-(-n // 128),), (256,), (users[s:s + n], np.int32(n), items, np.int32(n_items),
                                                 np.int32(width), np.int32(k), vals, out, ex_ptr, ex_items,
                                                 np.int32(0)), shared_mem=smem)

            counts = ""
            if "RK_COUNT" in define:
                glob = mod.get_global("recall_walk_counts")
                c = cp.ndarray((3,), cp.uint64, glob)
                c.fill(0)
                run()
                cp.cuda.Device().synchronize()
                per = c.get().astype(np.float64) / n_users
                counts = ", ".join(f"{x:.1f}" for x in per)
                t = float("nan")
            else:
                t = statistics.median(device_times(run, 5))
            print(f"| {shape} | {define or 'shipped'} | {t * 1e3:.2f} ms | {counts} |", flush=True)
            rows.append({"shape": shape, "build": define or "shipped", "time_s": t, "counts_per_user": counts})
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
