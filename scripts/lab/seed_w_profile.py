"""The threshold sample of a float16 pass, two ways, alone: cuBLAS's GEMM writing the sampled scores and the select
reading them (``Selection.seed``), against seed_w.cu's one kernel (``FusedSearch.seed``) as built and with
measurement-only defines (``-DRS_KEPT=n``: n keys a lane keeps; ``-DRS_NO_KEEP``: the largest key alone, the
products and the lowering without the kept keys' cost). Random float16 rows with log-normal norms, thresholds of
the pass's K (no estimate), blocks of 32,768 users (the pipeline's fused user block), each a launch, or with
``--block 0`` all in one; the median of 5 timed runs. Run from the project root on a Hopper GPU::

    PYTHONPATH=. python3 scripts/lab/seed_w_profile.py [--shapes 1000000:512:80:27,200000:1024:48:27]
        [--defines ",-DRS_KEPT=8,-DRS_KEPT=16,-DRS_NO_KEEP"] [--json out.json]

A shape is users:sample:columns:K (columns a multiple of 16 up to 144). Also prints how far each build's
thresholds lie from the GEMM path's (users equal, users lower).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from _timing import device_times
from walk_profile import _rows  # random float16 rows with log-normal norms, as the walk's profile takes


def main() -> int:
    import cupy as cp

    from recall.backends import resolve
    from recall.backends.cupy import fused as fused_path
    from recall.backends.cupy import kernels
    from recall.backends.cupy.items import DeviceItems
    from recall.backends.cupy.selection import GpuTopK, Selection, seed_w_kernels

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1000000:512:80:27,200000:1024:48:27,100000:1024:80:27")
    p.add_argument("--defines", default=",-DRS_KEPT=8,-DRS_KEPT=16,-DRS_NO_KEEP")
    p.add_argument("--block", type=int, default=32768,
                   help="users a launch (0: every user in one launch: the kernels' own time, no host between them)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    backend = resolve("gpu")
    sel = backend.selection
    stream = cp.cuda.get_current_stream()
    rows_out = []
    print("| shape | path | time a pass | users at the GEMM path's threshold | below it |")
    print("| --- | --- | ---: | ---: | ---: |")
    for shape in a.shapes.split(","):
        n_users, size, width, k = (int(x) for x in shape.split(":"))
        users, sample = _rows(cp, rng, n_users, width), _rows(cp, rng, size, width)
        items = DeviceItems(sample)
        srows, norms, _ = items.sample(size, size, stream, even=True)
        block = a.block or n_users
        state = GpuTopK.allocate(block, k, 1)
        scores = cp.empty((1, block, size), cp.float32)
        ex_ptr, ex_items = cp.zeros(block + 1, cp.int64), cp.zeros(0, cp.int64)
        thr = {}

        def gemm_select():
            for s in range(0, n_users, block):
                n = min(block, n_users - s)
                backend.gemm_strided_batched(users[s:s + n].reshape(1, n, width), sample.reshape(1, size, -1),
                                             scores[:, :n])
                sel.seed(state, scores[:, :n], srows, users[s:s + n], norms, ex_ptr, ex_items)

        runs = {"gemm + select": (gemm_select, None)}
        for define in a.defines.split(","):
            mod = kernels.hopper_module(kernels.HOPPER_FUSED_SOURCES, tuple(define.split()))
            shim = type("Sel", (), {"seed_w": seed_w_kernels(mod),
                                    "seed_args": staticmethod(Selection.seed_args)})()
            search = fused_path.FusedSearch(shim)

            def one_kernel(search=search):
                for s in range(0, n_users, block):
                    n = min(block, n_users - s)
                    search.seed(state, users[s:s + n], sample, norms)

            runs[f"seed_w {define}".strip()] = (one_kernel, define)
        for name, (run, _) in runs.items():
            t = statistics.median(device_times(run, 5))
            # The thresholds of the last block, against the GEMM path's.
            run()
            thr[name] = state.thr[: n_users - (n_users - 1) // block * block].get()
            ref = thr["gemm + select"]
            same, below = float((thr[name] == ref).mean()), float((thr[name] < ref).mean())
            print(f"| {shape} | {name} | {t * 1e3:.3f} ms | {same:.4f} | {below:.4f} |", flush=True)
            rows_out.append({"shape": shape, "path": name, "time_s": t, "same": same, "below": below})
    if a.json:
        a.json.write_text(json.dumps(rows_out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
