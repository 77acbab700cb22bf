"""GPU kernel smoke check and tile sweep (run on a GPU machine: PYTHONPATH=. python3 scripts/gpu_smoke.py).

Checks the GPU engine against a float64 oracle on awkward shapes (eager and CUDA-graph paths, exclusions, ties,
k up to 8192), then times S1-sized searches for a few tilings. Prints a table; writes JSON to $OUT if set.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import recall


def oracle(users, items, k, excl=None):
    s = users.astype(np.float64) @ items.astype(np.float64).T
    if excl:
        for u, rows in excl.items():
            s[u, list(rows)] = -np.inf
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    vals = np.take_along_axis(s, order, axis=1)
    order[np.isneginf(vals)] = -1
    return order, vals


def check(name, users, items, k, excl=None, tiles=None, ties=False):
    if tiles:
        os.environ["RECALL_GPU_TILES"] = tiles
    else:
        os.environ.pop("RECALL_GPU_TILES", None)
    eng = recall.Engine(items, device="gpu")
    res = eng.search(users, k, exclude=excl)
    want_i, want_v = oracle(users, items, min(k, items.shape[0]), excl)
    got_i = res.indices[:, : want_i.shape[1]]
    if ties:
        ok = np.array_equal(got_i, want_i)
    else:
        # Tie-aware: every returned item's true score reaches the true k-th score (float32 rounding may swap
        # near-equal neighbours), and padding only where the oracle pads.
        s = users.astype(np.float64) @ items.astype(np.float64).T
        kth = want_v[:, -1:]
        got_true = np.take_along_axis(s, np.maximum(got_i, 0), axis=1)
        scale = np.abs(s).max()
        valid = want_i >= 0
        ok = bool(np.all((got_true >= kth - 1e-5 * scale) | ~valid) and np.array_equal(got_i < 0, want_i < 0))
    fin = np.isfinite(want_v)
    err = float(np.max(np.abs(res.scores[:, : want_v.shape[1]][fin] - want_v[fin]))) if fin.any() else 0.0
    print(f"{'PASS' if ok else 'FAIL'} {name}: match={np.mean(got_i == want_i):.6f} max|err|={err:.2e} "
          f"stats={eng.backend.stats}", flush=True)
    return ok


def main() -> int:
    rng = np.random.default_rng(1)
    ok = True
    if os.environ.get("SMOKE_SKIP_CHECKS") == "1":
        return sweep(ok)
    items = rng.standard_normal((10007, 64), dtype=np.float32)
    users = rng.standard_normal((3001, 64), dtype=np.float32)
    ok &= check("default tiles", users, items, 100)
    ok &= check("small tiles graph", users, items, 100, tiles="256,1000,3")
    os.environ["RECALL_CUDA_GRAPHS"] = "0"
    ok &= check("small tiles eager", users, items, 100, tiles="256,1000,3")
    os.environ.pop("RECALL_CUDA_GRAPHS")
    # graph replay and eager launches must give identical results
    os.environ["RECALL_GPU_TILES"] = "256,1000,3"
    r_graph = recall.Engine(items, device="gpu").search(users, 64, exclude={1: [5, 6]})
    os.environ["RECALL_CUDA_GRAPHS"] = "0"
    r_eager = recall.Engine(items, device="gpu").search(users, 64, exclude={1: [5, 6]})
    os.environ.pop("RECALL_CUDA_GRAPHS")
    same = np.array_equal(r_graph.indices, r_eager.indices) and np.array_equal(r_graph.scores, r_eager.scores)
    print(f"{'PASS' if same else 'FAIL'} graph == eager", flush=True)
    ok &= same
    ok &= check("odd width", users, items, 37, tiles="300,999,2")
    ok &= check("k=1", users, items, 1, tiles="512,2048,2")
    excl = {u: rng.choice(10007, size=500, replace=False).tolist() for u in range(0, 3001, 7)}
    excl[5] = list(range(10007))
    ok &= check("exclusions", users, items, 100, excl=excl, tiles="512,2048,2")
    ti = rng.integers(-2, 3, size=(5000, 16)).astype(np.float32)
    tu = rng.integers(-2, 3, size=(700, 16)).astype(np.float32)
    ok &= check("ties", tu, ti, 50, tiles="128,512,2", ties=True)
    ok &= check("ties default", tu, ti, 1000, ties=True)
    big_i = rng.standard_normal((60000, 32), dtype=np.float32)
    big_u = rng.standard_normal((300, 32), dtype=np.float32)
    ok &= check("k=8192", big_u, big_i, 8192)
    ok &= check("k>n", users[:50], items[:100], 150)
    adv = items[np.argsort(items @ users.mean(0))]
    ok &= check("adversarial", users, adv, 100)

    return sweep(ok)


def fused_only(backend, users, items, block: int) -> float:
    """Seconds of recall_fused_filter alone over every user block and item segment, with thresholds of +inf: the
    fused kernel's GEMM and its threshold test, no candidates and no merges."""
    import cupy

    n_users, dim = users.shape
    items_t = backend._transpose_items(items, items.shape[0], dim)
    users_t = cupy.zeros((items_t.shape[0], -(-block // 128) * 128), cupy.float32)
    thr = cupy.full(block, cupy.inf, cupy.float32)
    cand = cupy.zeros((block, 1), cupy.uint64)
    cnt = cupy.zeros(block, cupy.int32)
    tiles = items_t.shape[1] // 128
    seg, per_cta = backend.fused_segment // 128, backend.fused_tiles_per_cta
    smem = 4 * 128 * (items_t.shape[0] + 64)
    backend._fused.max_dynamic_shared_size_bytes = max(smem, 48 * 1024)
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    with backend.compute_stream:
        for s0 in range(0, n_users, block):
            n = min(block, n_users - s0)
            users_t[:dim, :n] = users[s0:s0 + n].T
            for t0 in range(0, tiles, seg):
                nt = min(seg, tiles - t0)
                backend._fused((-(-nt // per_cta), -(-n // 128)), (256,),
                               (users_t, np.int32(users_t.shape[1]), items_t, np.int64(items_t.shape[1]),
                                np.int32(items_t.shape[0]), np.int32(t0), np.int32(nt), np.int32(per_cta),
                                np.int32(items.shape[0]), np.int32(n), thr, cand, np.int32(1), cnt), shared_mem=smem)
    backend.compute_stream.synchronize()
    return time.perf_counter() - t


def sweep(ok: bool) -> int:
    """Tile sweep on S1-shaped data, resident on the GPU."""
    import cupy

    n_users = int(os.environ.get("SMOKE_USERS", "100000"))
    kind = os.environ.get("SMOKE_KIND", "normal")
    if kind == "normal":
        cu_items = cupy.random.default_rng(0).standard_normal((1_000_000, 64), dtype=cupy.float32)
        cu_users = cupy.random.default_rng(1).standard_normal((n_users, 64), dtype=cupy.float32)
    else:
        from recall.bench.workloads import generate

        cu_users, cu_items = generate(kind, n_users, 1_000_000, 64, seed=0, device="gpu")
    print(f"sweep data: {kind}", flush=True)
    rows = []
    precisions = os.environ.get("SMOKE_PRECISIONS", "exact").split(",")
    # SMOKE_FUSED: exact mode's fused-kernel settings to try, "mode" or "mode:tiles per block:segment items:merge at".
    fused_runs = os.environ.get("SMOKE_FUSED", "auto").split(";")
    runs = [(t, g, p, f) for t in os.environ.get("SMOKE_TILES", "1024,4096,2;2048,4096,2;1024,8192,2;2048,8192,4")
            .split(";") for g in os.environ.get("SMOKE_GRAPHS", "1,0").split(",") for p in precisions
            for f in (fused_runs if p == "exact" else ["auto"])]
    for tiles, graphs, precision, fused in runs:
        os.environ["RECALL_GPU_TILES"] = tiles
        os.environ["RECALL_CUDA_GRAPHS"] = graphs
        mode, *rest = fused.split(":")
        os.environ["RECALL_FUSED"] = mode
        os.environ["RECALL_FUSED_TPC"] = rest[0] if rest else "8"
        os.environ["RECALL_FUSED_SEGMENT"] = rest[1] if len(rest) > 1 else "65536"
        os.environ["RECALL_FUSED_MERGE_AT"] = rest[2] if len(rest) > 2 else "0"
        eng = recall.Engine(cu_items, device="gpu", precision=precision)
        eng.search(cu_users[:5000], 100)
        cupy.cuda.Device().synchronize()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            eng.search(cu_users, 100)
            cupy.cuda.Device().synchronize()
            times.append(time.perf_counter() - t)
        med = sorted(times)[1]
        tflops = 2 * n_users * 1e6 * 64 / med / 1e12
        rows.append({"tiles": tiles, "graphs": graphs, "precision": precision, "fused": fused, "seconds": med,
                     "tflops": tflops, "stats": {k: v for k, v in eng.stats.items() if k != "tiles"}})
        print(f"tiles={tiles:>14} graphs={graphs} {precision:>5} fused={fused:<14} {med:.3f}s {tflops:.1f} TFLOP/s "
              f"busy {eng.stats.get('busy_fraction', 0):.2f} fallback {eng.stats.get('fallback_users', '-')}",
              flush=True)
        if precision != "exact" or fused != fused_runs[0]:
            continue
        # The GEMMs alone at the same tiling: what selection costs on top of them.
        from recall import scoring

        plan = scoring.plan_tiles(n_users, 1_000_000, 64, 100, eng.memory_budget,
                                  eng.backend.preferred_tiles(64, 100), eng.backend.state_bytes(100))
        buf = cupy.empty(plan.user_block * plan.item_tile * plan.tiles_per_call, cupy.float32)
        t = time.perf_counter()
        with eng.backend.compute_stream:
            for s0 in range(0, n_users, plan.user_block):
                ub = cu_users[s0:s0 + plan.user_block]
                for st, w, nt in scoring.item_segments(1_000_000, plan):
                    eng.backend.gemm_strided_batched(
                        ub.reshape(1, *ub.shape), cu_items[st:st + w * nt].reshape(nt, w, 64),
                        buf[: nt * ub.shape[0] * w].reshape(nt, ub.shape[0], w))
        eng.backend.compute_stream.synchronize()
        gemm = time.perf_counter() - t
        rows[-1]["gemm_only_seconds"] = gemm
        fused_alone = fused_only(eng.backend, cu_users, cu_items, plan.user_block)
        rows[-1]["fused_kernel_only_seconds"] = fused_alone
        print(f"    gemm only {gemm:.3f}s -> total/gemm {med / gemm:.2f}; fused kernel alone (no score passes) "
              f"{fused_alone:.3f}s", flush=True)
    os.environ.pop("RECALL_CUDA_GRAPHS", None)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_smoke.json"), "w") as f:
            json.dump({"ok": bool(ok), "sweep": rows}, f, indent=1)
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
