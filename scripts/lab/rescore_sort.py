"""Lab (GPU): the re-scoring kernel's time at large k, and what its final sort of the K best keys a user takes.

Each case is ``users`` random float32 users, ``items`` random items, ``cand`` distinct candidate rows a user, re-scored
at ``k`` by ``rescore.rescore_fused`` (ordered sums: exact mode's certified route; or not: fast mode's) under kernels
built with lab defines of ``kernels/rescore.cu``:

- ``shipped``: as the tree builds it;
- ``smem-sort``: ``RS_LAB_SMEM_SORT``, the bitonic sort in shared memory alone (the kernel before 2026-12-05);
- ``no-sort``: ``RS_LAB_NO_SORT``, the K best left unsorted (a wrong answer: its time says what the sort costs).

Every variant but ``no-sort`` must give the first variant's scores and rows bit for bit. Prints a table, writes JSON.

    PYTHONPATH=. python3 scripts/lab/rescore_sort.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

# name: (users, items, dim, k, candidates a user, ordered)
CASES = {
    "k2048-2113": (100_000, 130_000, 64, 2048, 2113, True),  # cos-k2048-130k's lists at the narrowed margin of 64
    "k2048-2561": (100_000, 130_000, 64, 2048, 2561, True),  # ... at the default margin of 512
    "k1000-1024": (200_000, 100_000, 64, 1000, 1024, True),  # uh-ip-k1000's lists at the narrowed margin of 23
    "k2048-d32": (200_000, 100_000, 32, 2048, 2113, True),  # uh-l2-k2048's (d = 32 + the l2 column, padded)
    "k1000-fast": (200_000, 100_000, 64, 1000, 1024, False),  # fast mode's sums
    "k500-640": (200_000, 100_000, 64, 500, 640, True),
    "k3000-3751": (100_000, 200_000, 64, 3000, 3751, True),  # one chunk of K_pad = 4,096 keys
}
VARIANTS = {"shipped": (), "smem-sort": ("-DRS_LAB_SMEM_SORT",), "no-sort": ("-DRS_LAB_NO_SORT",)}


def _use(extra):
    """rescore._kernel built with the lab defines ``extra``."""
    from recall.backends.cupy import kernels, rescore

    def kernel(vec, ordered=False):
        regs = rescore._MAX_REGISTERS_STAGED if ordered else rescore._MAX_REGISTERS
        expr = f"recall_rescore_t<{rescore._UNROLL}, {rescore._CHUNKS}, {int(vec)}, {int(ordered)}>"
        return kernels.module(("rescore.cu",), (f"--maxrregcount={regs}", *extra), (expr,)).get_function(expr)

    rescore._kernel = kernel


def main() -> None:
    import cupy

    from recall.backends.cupy import rescore

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    shipped_kernel = rescore._kernel
    out = []
    print("| case | variant | median s | x first | same answer |")
    print("| --- | --- | ---: | ---: | --- |")
    for case in a.cases.split(","):
        n, n_items, dim, k, cand, ordered = CASES[case]
        rng = cupy.random.default_rng(0)
        users = rng.standard_normal((n, dim), dtype=cupy.float32)
        items = rng.standard_normal((n_items, dim), dtype=cupy.float32)
        # Distinct rows a user: a random start, then steps of a prime that does not divide the catalogue's size.
        start = rng.integers(0, n_items, size=(n, 1), dtype=cupy.int64)
        rows = ((start + cupy.arange(cand, dtype=cupy.int64)[None, :] * 7919) % n_items).ravel()
        indptr = np.arange(n + 1, dtype=np.int64) * cand
        ref = None
        first = None
        for vname in a.variants.split(","):
            _use(VARIANTS[vname])
            vals = cupy.empty((n, k), cupy.float32)
            got = cupy.empty((n, k), cupy.int64)
            times = []
            for rep in range(a.repeat + 1):  # a warm-up (the build), then the timed runs
                cupy.cuda.Device().synchronize()
                t0 = time.perf_counter()
                ok = rescore.rescore_fused(users, items, indptr, rows, k, vals, got, 1 << 34, ordered)
                cupy.cuda.Device().synchronize()
                assert ok, "the kernel does not take this case"
                if rep:
                    times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            first = first or t
            if ref is None:
                ref = (vals.copy(), got.copy())
                same = "the reference"
            elif vname == "no-sort":
                same = "unsorted (not compared)"
            else:
                same = str(bool((vals == ref[0]).all() and (got == ref[1]).all()))
            print(f"| {case} | {vname} | {t:.4f} | {t / first:.3f} | {same} |", flush=True)
            out.append({"case": case, "variant": vname, "median_s": t, "same": same,
                        "shape": {"users": n, "items": n_items, "dim": dim, "k": k, "candidates": cand,
                                  "ordered": ordered}})
        rescore._kernel = shipped_kernel
        users = items = rows = ref = None
        cupy.get_default_memory_pool().free_all_blocks()
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
