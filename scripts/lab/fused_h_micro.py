"""The float16 fused kernel (``kernels/fused_h.cu``) alone, against cuBLAS's float16 GEMM on the same shape: is its
time in the tensor-core loop or in the filter? Compiles the kernel with measurement switches (``-D``) in this
process only, and launches it on S1's shape of one user block at a time, thresholds set where a seeded search has
them after its first merge (each user's 126th best of the first 65,536 items: ``--rank``), candidate counts reset per
segment.

Run from the project root on a GPU machine::

    PYTHONPATH=. python3 scripts/lab/fused_h_micro.py [--width 72] [--items N] [--rank R] [--json $OUT/micro.json]

``--rank 1900 --items 100000 --width 48``: the first segment of exact mode's certified route on 200k x 100k x 32
(l2, k = 1,000), whose first launch passed about 1,900 of its 65,536 items a user (docs/benchmarks.md).

Variants: as shipped (warps of 64 users x 32 items, each user's scores of a thread tested through their maximum
first, the survivors of a passing group taken one by one from a bit mask, a survivor's key stored at the thread's
next survivor, not while its slot's atomic is on its way); a branch per score of a passing group (``RH_EACH_SCORE``,
as shipped until 2026-12-03); each key
stored as soon as its slot comes back (``RH_INLINE_APPEND``); warps of 64 x 64 items (``RH_WN=64``), both ways; no
filter at all (``RH_SKIP_EPILOGUE``: the products summed, about what any filter can reach); as shipped with every
threshold at +inf (the filter's tests alone, no survivor); for rows of up to 96 columns multiplied other than 64, the
kernel taking them in one chunk a tile (``recall_fused_filter_h<CH>``, which the engine launches for them).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from recall.backends.cupy import kernels
from recall.backends.cupy.fused import half_kernel_name, half_smem

from _timing import device_times


def main() -> None:
    import cupy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=16384)
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--width", type=int, default=72)
    p.add_argument("--rank", type=int, default=126, help="each user's threshold: its RANK-th best of the first 65,536 "
                                                         "items")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    rng = cupy.random.default_rng(0)
    users = rng.standard_normal((a.users, a.width), dtype=np.float32).astype(np.float16)
    items = rng.standard_normal((a.items, a.width), dtype=np.float32).astype(np.float16)
    head = users.astype(np.float32) @ items[:65536].astype(np.float32).T
    r = min(a.rank, head.shape[1]) - 1
    thr = cupy.ascontiguousarray(-cupy.partition(-head, r, axis=1)[:, r])
    del head
    cap = 2048
    c = 16384
    cand = cupy.zeros((cap, c), cupy.uint64)
    cnt = cupy.zeros(cap, cupy.int32)
    padded = -(-a.width // 16) * 16
    flops = 2.0 * a.users * a.items * padded
    out = []
    variants = [("shipped", ()), ("a branch per score of a passing group (RH_EACH_SCORE)", ("-DRH_EACH_SCORE",)),
                ("keys stored as their slots come back (RH_INLINE_APPEND)", ("-DRH_INLINE_APPEND",)),
                ("warp tile 64 x 64 (RH_WN=64)", ("-DRH_WN=64",)),
                ("warp tile 64 x 64, keys stored as their slots come back", ("-DRH_WN=64", "-DRH_INLINE_APPEND")),
                ("no filter", ("-DRH_SKIP_EPILOGUE",)),
                ("shipped, no survivors (threshold +inf)", ())]
    if padded <= 96 and padded != 64:  # the kernel with one chunk a tile, as shipped for such rows
        variants.insert(1, (f"one chunk of {padded} halves a tile (recall_fused_filter_h{padded})", ()))
    inf = cupy.full_like(thr, np.inf)
    for name, opts in variants:
        mod = kernels.module(("topk.cu", "fused.cu", "fused_h.cu"), options=opts)
        th_used = inf if "no survivors" in name else thr
        chunk = padded if "one chunk" in name else 64
        fn = mod.get_function(half_kernel_name(chunk))
        threads = 128 if "-DRH_WN=64" in opts else 256  # fused_h.cu's RH_THREADS
        smem = half_smem(padded, chunk)  # users, three item chunks
        fn.max_dynamic_shared_size_bytes = smem
        tiles = -(-a.items // 128)

        def run() -> None:
            for u0 in range(0, a.users, cap):
                ub = users[u0:u0 + cap]
                for t0 in range(0, tiles, 512):
                    cnt.fill(0)
                    nt = min(512, tiles - t0)
                    fn((-(-nt // 8), cap // 128), (threads,),
                       (ub, np.int32(cap), items, np.int32(a.items), np.int32(a.width), np.int32(padded),
                        np.int32(t0), np.int32(nt), np.int32(8), th_used[u0:u0 + cap], cand, np.int32(c), cnt),
                       shared_mem=smem)

        t = sorted(device_times(run))[1]
        print(f"| {name} | {t:.4f} s | {flops / t / 1e12:.0f} TFLOP/s | regs {fn.num_regs}, local bytes "
              f"{fn.local_size_bytes} |", flush=True)
        out.append({"variant": name, "s": t, "tflops": flops / t / 1e12, "regs": fn.num_regs})
    # cuBLAS: the same products written as float16 score tiles of 2,048 x 65,536.
    tile = cupy.empty((cap, 65536), np.float16)

    whole = a.items // 65536 * 65536  # whole tiles only (the rate is per product either way)

    def gemm() -> None:
        for u0 in range(0, a.users, cap):
            for i0 in range(0, whole, 65536):
                cupy.matmul(users[u0:u0 + cap], items[i0:i0 + 65536].T, out=tile)

    t = device_times(gemm, 1)[0]
    rate = 2.0 * a.users * whole * a.width / t / 1e12
    print(f"| cuBLAS fp16 GEMM, fp16 tiles (no filter) | {t:.4f} s | {rate:.0f} TFLOP/s | - |", flush=True)
    out.append({"variant": "cublas", "s": t})
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
