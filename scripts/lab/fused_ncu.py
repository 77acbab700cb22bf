"""One shape of a float16 fused kernel launched a few times, for Nsight Compute: fused_h.cu's (mma.sync), or with
``--wgmma`` fused_w.cu's (Hopper); 4,096 users x WIDTH columns against ITEMS items, each user's threshold its RANK-th
best of the first 65,536.

    PYTHONPATH=. ncu --clock-control none -k regex:recall_fused_filter_ -s 2 -c 1 --section SpeedOfLight \\
        python3 scripts/lab/fused_ncu.py WIDTH ITEMS RANK [--wgmma] [-D...]
"""
import sys

import cupy
import numpy as np

from recall.backends.cupy import kernels

width, n_items, rank = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
wgmma = "--wgmma" in sys.argv[4:]
opts = tuple(a for a in sys.argv[4:] if a != "--wgmma")
cap, c = 4096, 16384
rng = cupy.random.default_rng(0)
users = rng.standard_normal((cap, width), dtype=np.float32).astype(np.float16)
items = rng.standard_normal((n_items, width), dtype=np.float32).astype(np.float16)
head = users.astype(np.float32) @ items[:65536].astype(np.float32).T
thr = cupy.ascontiguousarray(-cupy.partition(-head, rank - 1, axis=1)[:, rank - 1])
del head
cand = cupy.zeros((cap, c), cupy.uint64)
cnt = cupy.zeros(cap, cupy.int32)
padded = -(-width // 16) * 16
if wgmma:
    from recall.backends.cupy.fused import wgmma_smem

    fn = kernels.hopper_module(kernels.HOPPER_FUSED_SOURCES, opts).get_function(f"recall_fused_filter_w{padded // 16}")
    smem = wgmma_smem(padded)
else:
    from recall.backends.cupy.fused import half_chunk, half_kernel_name, half_smem

    fn = kernels.module(("topk.cu", "fused.cu", "fused_h.cu"), options=opts).get_function(
        half_kernel_name(half_chunk(padded)))
    smem = half_smem(padded)
fn.max_dynamic_shared_size_bytes = smem
tiles = -(-n_items // 128)
print("regs", fn.num_regs, "local", fn.local_size_bytes, flush=True)
for rep in range(3):
    for t0 in range(0, tiles, 512):
        cnt.fill(0)
        nt = min(512, tiles - t0)
        fn((-(-nt // 8), cap // 128), (256,),
           (users, np.int32(cap), items, np.int32(n_items), np.int32(width), np.int32(padded), np.int32(t0),
            np.int32(nt), np.int32(8), thr, cand, np.int32(c), cnt), shared_mem=smem)
cupy.cuda.Device().synchronize()
print("survivors per user (last segment)", float(cnt.mean()), flush=True)
