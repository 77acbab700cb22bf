"""The float16 fused kernel on Hopper's warpgroup instruction (``kernels/fused_w.cu``, wgmma) checked and timed
alone: its candidates against float64 products on small odd shapes (every width it is built for, 16-144 columns;
rows past the users and the items, widths not a multiple of 16 and rows wider than the columns multiplied), then against
``fused_h.cu``'s mma.sync kernel on the shapes of the engine's first launches (thresholds where a seeded search has
them after its first merge: each user's RANK-th best of the first 65,536 items), candidate counts reset per segment.

Run from the project root on an H200 (or any compute capability 9.0 GPU)::

    PYTHONPATH=. python3 scripts/lab/fused_w_check.py [--json $OUT/fused_w.json] [--no-timing] [--appends]
        [--defines "-DRW_SBO_PAD=16"] [--per-cta 8,16,32]

``--defines``: the kernel built with these options is checked too, then timed against the shipped one (both at each
``--per-cta``: the item tiles a thread block walks, EngineOptions.fused_tiles_per_block).

Exits 1 if a check fails. The bound a score must meet: |score - exact| <= 2 Wp 2^-24 sum_i |u_i v_i| (float32 sums
of exact products in any order), the same the certificate takes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from recall.backends.cupy import kernels
from recall.backends.cupy.fused import half_chunk, half_kernel_name, half_smem, wgmma_smem

from _timing import device_times

THREADS = 256


def decode(keys):
    """(scores, rows) of candidate keys (topk.cu's recall_key)."""
    b = (keys >> np.uint64(32)).astype(np.uint32)
    bits = np.where(b & np.uint32(0x80000000), b & np.uint32(0x7FFFFFFF), ~b).astype(np.uint32)
    return bits.view(np.float32), (~(keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)).astype(np.int64)


def launch(fn, smem, users, items, width, padded, thr, cand, cnt, per_cta=8, seg=512, reset=False):
    import cupy

    n_users, n_items = users.shape[0], items.shape[0]
    tiles = -(-n_items // 128)
    for t0 in range(0, tiles, seg):
        if reset:
            cnt.fill(0)
        nt = min(seg, tiles - t0)
        fn((-(-nt // per_cta), -(-n_users // 128)), (THREADS,),
           (users, np.int32(n_users), items, np.int32(n_items), np.int32(width), np.int32(padded), np.int32(t0),
            np.int32(nt), np.int32(per_cta), thr, cand, np.int32(cand.shape[1]), cnt), shared_mem=smem)
    cupy.cuda.Device().synchronize()


def kernel_w(mod, padded, pad=0):
    """fused_w.cu's kernel for ``padded`` columns of module ``mod`` and its shared memory; ``pad``: the module's
    RW_SBO_PAD (bytes after each row group of 8 rows, in the users' tile and each item tile in flight)."""
    fn = mod.get_function(f"recall_fused_filter_w{padded // 16}")
    smem = wgmma_smem(padded) + ((1 + (2 if padded > 96 else 3)) * 16 * pad - 8 * 128 if pad else 0)
    fn.max_dynamic_shared_size_bytes = smem
    return fn, smem


def kernel_h(mod, padded):
    fn = mod.get_function(half_kernel_name(half_chunk(padded)))
    smem = half_smem(padded)
    fn.max_dynamic_shared_size_bytes = smem
    return fn, smem


def check(mod, label, rng, pad=0) -> list[str]:
    """Every (width, columns multiplied) case on 300 users x 1,037 items: every score passes a -inf threshold, and
    the 50th (200th) best's threshold passes exactly the scores above it (up to the bound): 50 fit a user's stage in
    shared memory, 200 send it to the buffer mid-way. Returns the failures."""
    import cupy

    failures = []
    for ks in range(1, 10):
        padded = 16 * ks
        for width in sorted({padded, max(8, padded - 8), padded + 8}):
            n_users, n_items = 300, 1037
            u = rng.standard_normal((n_users, width)).astype(np.float16)
            v = rng.standard_normal((n_items, width)).astype(np.float16)
            cols = min(width, padded)
            uf, vf = u[:, :cols].astype(np.float64), v[:, :cols].astype(np.float64)
            exact = uf @ vf.T
            bound = 2 * padded * 2.0 ** -24 * (np.abs(uf) @ np.abs(vf).T)
            fn, smem = kernel_w(mod, padded, pad)
            du, dv = cupy.asarray(u), cupy.asarray(v)
            # "overflow": every score passes into buffers of 300 (each user's count must still be every item, and
            # the 300 keys kept distinct items with their scores).
            for name, thr, cap in (("all", np.full(n_users, -np.inf, np.float32), 2048),
                                   ("rank50", np.sort(exact, axis=1)[:, -50].astype(np.float32), 2048),
                                   ("rank200", np.sort(exact, axis=1)[:, -200].astype(np.float32), 2048),
                                   ("overflow", np.full(n_users, -np.inf, np.float32), 300)):
                cand = cupy.zeros((n_users, cap), cupy.uint64)
                cnt = cupy.zeros(n_users, cupy.int32)
                launch(fn, smem, du, dv, width, padded, cupy.asarray(thr), cand, cnt, per_cta=3, seg=5)
                counts, keys = cnt.get(), cand.get()
                bad = 0
                for i in range(n_users):
                    s, r = decode(keys[i, :min(counts[i], cap)])
                    want = exact[i] > thr[i].astype(np.float64)
                    near = np.abs(exact[i] - thr[i]) <= bound[i]
                    got = np.zeros(n_items, bool)
                    if r.size and (r.min() < 0 or r.max() >= n_items or np.unique(r).size != r.size):
                        bad += 1
                        continue
                    got[r] = True
                    err = np.abs(s.astype(np.float64) - exact[i, r]) > bound[i, r]
                    if cap < n_items:
                        if err.any() or counts[i] != n_items or r.size != cap:
                            bad += 1
                    elif err.any() or ((got != want) & ~near).any():
                        bad += 1
                print(f"| {label} | Wp {padded} | width {width} | {name} | users wrong {bad} of {n_users} |",
                      flush=True)
                if bad:
                    failures.append(f"{label} Wp {padded} width {width} {name}: {bad} users")
    return failures


def _compare(shapes, contenders, out) -> None:
    """Each (width, items, rank) of ``shapes`` timed for every (name, (kernel, shared memory)[, tiles a block]) of
    ``contenders(padded)``: 16,384 users in blocks of 2,048, thresholds at each user's RANK-th best of the first
    65,536 items (or of all where fewer), candidate counts reset per segment; median of 3."""
    import cupy

    rng = cupy.random.default_rng(0)
    for width, n_items, rank in shapes:
        n_users, cap, c = 16384, 2048, 16384
        users = rng.standard_normal((n_users, width), dtype=np.float32).astype(np.float16)
        items = rng.standard_normal((n_items, width), dtype=np.float32).astype(np.float16)
        head = users.astype(np.float32) @ items[:65536].astype(np.float32).T
        thr = cupy.ascontiguousarray(-cupy.partition(-head, rank - 1, axis=1)[:, rank - 1])
        del head
        padded = -(-width // 16) * 16
        cand = cupy.zeros((cap, c), cupy.uint64)
        cnt = cupy.zeros(cap, cupy.int32)
        row = {"width": width, "items": n_items, "rank": rank}
        for name, (fn, smem), *per_cta in contenders(padded):
            def run():
                for u0 in range(0, n_users, cap):
                    launch(fn, smem, users[u0:u0 + cap], items, width, padded, thr[u0:u0 + cap], cand, cnt,
                           per_cta=per_cta[0] if per_cta else 8, reset=True)
            t = sorted(device_times(run))[1]
            rate = 2.0 * n_users * n_items * padded / t / 1e12
            row[name] = t
            print(f"| {width} cols ({padded} multiplied), {n_items:,} items, rank {rank} | {name} | {t:.5f} s | "
                  f"{rate:.0f} TFLOP/s | regs {fn.num_regs} |", flush=True)
        out.append(row)


def timing(mod_h, mod_w, out) -> None:
    """fused_h.cu's mma.sync kernel against fused_w.cu's wgmma kernel on the engine's first launches' shapes."""
    _compare(((72, 1_000_000, 126), (48, 100_000, 1900), (64, 1_000_000, 126), (32, 1_000_000, 12),
              (128, 1_000_000, 126), (96, 1_000_000, 126), (136, 1_000_000, 126)),
             lambda padded: (("mma.sync (fused_h)", kernel_h(mod_h, padded)),
                             ("wgmma (fused_w)", kernel_w(mod_w, padded))), out)


def append_timing(mod_old, mod_new, out) -> None:
    """The kernel as shipped (survivors kept in shared memory a user, one atomic for many) against the one before
    (``-DRW_DIRECT_APPEND``: a global atomic a survivor), where few and where many scores pass."""
    _compare(((72, 1_000_000, 126), (64, 100_000, 671), (64, 100_000, 1900), (64, 20_000, 250),
              (48, 100_000, 1900), (64, 65_536, 1300), (136, 1_000_000, 126), (136, 100_000, 1900),
              (96, 100_000, 1900)),
             lambda padded: (("a global atomic a survivor", kernel_w(mod_old, padded)),
                             ("staged (shipped)", kernel_w(mod_new, padded))), out)


def variant_timing(mod_w, mod_v, defines, per_ctas, pad, out) -> None:
    """The kernel as shipped against the one built with ``defines``, each at every item-tile count a block walks of
    ``per_ctas``, on the shapes of the route's passes (k = 10 to 2,048; 4,096 items at k = 10 and 50) and of S1's."""
    _compare(((72, 1_000_000, 126), (64, 100_000, 760), (80, 100_000, 760), (64, 20_000, 250),
              (48, 100_000, 1900), (80, 100_000, 2300), (128, 1_000_000, 126), (48, 4096, 27), (64, 4096, 27),
              (48, 4096, 66)),
             lambda padded: [(f"{label} / {n} tiles a block", kernel_w(mod, padded, p), n)
                             for label, mod, p in (("shipped", mod_w, 0), (defines, mod_v, pad))
                             if mod is not None for n in per_ctas], out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--appends", action="store_true", help="time the survivors' appends against the kernel before")
    p.add_argument("--defines", default="", help="NVRTC options of a variant of fused_w.cu, e.g. -DRW_SBO_PAD=16")
    p.add_argument("--per-cta", default="8", help="item tiles a block walks, timed with --defines")
    a = p.parse_args()
    mod_w = kernels.hopper_fused_module()
    if mod_w is None:
        print("not a compute capability 9.0 GPU: fused_w.cu is not built here")
        return 1
    rng = np.random.default_rng(7)
    failures = check(mod_w, "shipped", rng)
    mod_old = kernels.hopper_module(kernels.HOPPER_FUSED_SOURCES, ("-DRW_DIRECT_APPEND",)) if a.appends else None
    if mod_old is not None:
        failures += check(mod_old, "a global atomic a survivor", rng)
    defines = tuple(a.defines.split())
    mod_v = kernels.hopper_module(kernels.HOPPER_FUSED_SOURCES, defines) if defines else None
    pad = next((int(d.split("=", 1)[1]) for d in defines if d.startswith("-DRW_SBO_PAD=")), 0)
    if mod_v is not None:
        failures += check(mod_v, a.defines, rng, pad)
    if failures:
        print("FAILED:", *failures, sep="\n  ")
        return 1
    out: list = []
    if defines or a.per_cta != "8":
        variant_timing(mod_w, mod_v, a.defines, [int(n) for n in a.per_cta.split(",")], pad, out)
    elif a.appends:
        append_timing(mod_old, mod_w, out)
    elif not a.no_timing:
        timing(kernels.selection_module(), mod_w, out)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
