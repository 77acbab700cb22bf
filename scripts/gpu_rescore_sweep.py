"""Issue 7: time the fused re-scoring kernel's variants and thread counts on S5, and check every answer.

Run on a GPU machine:  PYTHONPATH=. python3 scripts/gpu_rescore_sweep.py

S5: 100,000 users x 1,000 own candidates (distinct random rows of a 1,000,000 x 64 float32 item matrix, clustered
data, the bench's generator and seed), k=100; bytes counted = candidate vectors read once + results written
(25.72 GB), against the 4.20 TB/s copy bandwidth measured on the H200 (target: 60%, i.e. <= 10.2 ms). The copy
bandwidth is also measured here, in the same process.

What it does, in order (about a minute on an H200, most of it NVRTC compiling one module per variant):
1. exactness on integer data (float32 scores are exact, so answers must equal a float64 oracle bit for bit, tie
   order included): duplicates, lists shorter than k, empty lists, lists of one repeated row, lists longer than one
   sort chunk; dims 64 (float4 loads) and 30 (scalar loads); k 1, 7, 100, 1000; every variant through both GPU
   paths (fused, and gather + GEMM whose selection runs the same kernel on precomputed scores) and three thread
   counts;
2. S5: each variant x thread count, the kernel alone (one launch, CUDA events, a warm-up then the median of
   SWEEP_REPEAT runs) and end to end (``Engine.rescore`` with device arrays: validation, launch, everything);
   the cuBLAS path (RECALL_RESCORE=gemm) end to end; a gather-only ceiling kernel (same rows, same bytes, no
   selection: what the memory system gives this access pattern); the candidate validation alone;
3. every S5 answer: equal to the first configuration's (bitwise, or within float32 rounding where the lanes differ
   and so the summation order), and checked on a sample of users against float64 scores computed with CuPy
   (own distinct candidates, score error, order and tie rule, nothing better left out).

Environment: SWEEP_USERS (100000), SWEEP_REPEAT (5), SWEEP_THREADS ("128,256,512"), SWEEP_VARIANTS (all, first =
reference), SWEEP_SAMPLE (2048 users for the float64 check), OUT (writes rescore_sweep.json there).
Exit status 1 when any check fails.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import cupy
import numpy as np

import recall
from recall import rescore
from recall.bench import workloads

COPY_TBPS = 4.20  # measured on the project's H200 (docs/benchmarks.md); this run's own figure is printed too
TARGET = 0.60

_CEILING_SRC = r"""
// Gather-only ceiling: one block per user, dim 64 only: rows staged in shared memory as int32, 8 lanes per row x 2
// float4 each, 8 rows per lane in flight; the dot products are summed and one float per user is written.
extern "C" __global__ void gather_ceiling(const float* __restrict__ items, const long long* __restrict__ rows,
                                          int per_user, const float* __restrict__ users, float* __restrict__ out) {
    extern __shared__ int srows[];
    const long long base = (long long)blockIdx.x * per_user;
    for (int j = threadIdx.x; j < per_user; j += 4 * blockDim.x) {
        long long v[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) v[t] = j + t * (int)blockDim.x < per_user ? __ldcs(rows + base + j + t * blockDim.x) : 0;
#pragma unroll
        for (int t = 0; t < 4; ++t) if (j + t * (int)blockDim.x < per_user) srows[j + t * blockDim.x] = (int)v[t];
    }
    __syncthreads();
    const int lane = threadIdx.x & 7, group = threadIdx.x >> 3, ng = blockDim.x >> 3;
    const float4* it = reinterpret_cast<const float4*>(items);
    const float4* uu = reinterpret_cast<const float4*>(users) + (long long)blockIdx.x * 16;
    const float4 a0 = uu[lane], a1 = uu[lane + 8];
    float acc = 0.0f;
    for (int j0 = 0; j0 < per_user; j0 += ng * 8) {
        float4 b[8][2];
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            const int j = j0 + q * ng + group;
            const int r = j < per_user ? srows[j] : -1;
            const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
            b[q][0] = r >= 0 ? __ldg(it + (long long)r * 16 + lane) : z;
            b[q][1] = r >= 0 ? __ldg(it + (long long)r * 16 + lane + 8) : z;
        }
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            acc += a0.x * b[q][0].x + a0.y * b[q][0].y + a0.z * b[q][0].z + a0.w * b[q][0].w;
            acc += a1.x * b[q][1].x + a1.y * b[q][1].y + a1.z * b[q][1].z + a1.w * b[q][1].w;
        }
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if ((threadIdx.x & 31) == 0) atomicAdd(out + blockIdx.x, acc);
}
"""


def _sync() -> None:
    cupy.cuda.Device().synchronize()


def _time_ms(fn: Callable[[], Any], repeat: int) -> list[float]:
    """A warm-up call, then ``repeat`` calls timed with CUDA events on the current stream (ms)."""
    fn()
    _sync()
    out = []
    for _ in range(repeat):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        out.append(cupy.cuda.get_elapsed_time(start, stop))
    return out


def _set_env(variant: str | None, threads: int | None, mode: str = "fused") -> None:
    for key, value in (("RECALL_RESCORE_VARIANT", variant), ("RECALL_RESCORE_THREADS", threads),
                       ("RECALL_RESCORE", mode)):
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = str(value)


def _occupancy(kern: Any, threads: int, smem: int) -> int | None:
    """Resident blocks per SM of a launch (None when the driver call is unavailable)."""
    try:
        from cupy_backends.cuda.api import driver

        return int(driver.occupancyMaxActiveBlocksPerMultiprocessor(kern.kernel.ptr, threads, smem))
    except Exception:
        return None


# ---- 1. exactness on integer data ----------------------------------------------------------------------------------

def _ties_case(dim: int, seed: int = 7, n_users: int = 1200, n_items: int = 20_000):
    rng = np.random.default_rng(seed)
    items = rng.integers(-2, 3, (n_items, dim)).astype(np.float32)
    users = rng.integers(-2, 3, (n_users, dim)).astype(np.float32)
    lists = []
    for u in range(n_users):
        n = int(rng.integers(0, 1500))
        lst = rng.integers(0, n_items, n)  # drawn with replacement: duplicates
        if u % 5 == 0 and n > 9:
            third = n // 3
            lst[:third] = lst[third:2 * third]  # many duplicates, also among the best
        lists.append(lst)
    lists[0] = np.zeros(0, np.int64)                         # empty
    lists[1] = np.arange(9000)[::-1] % n_items               # three chunks of 4,096
    lists[2] = np.full(3000, 17)                             # one row, 3,000 times
    lists[3] = rng.integers(0, n_items, 5000)                # two chunks, duplicates across them
    lists[4] = np.array([5, 5, 9])                           # fewer distinct rows than any k > 1
    lists[5] = np.concatenate([np.arange(100), np.arange(100)])  # exactly 100 distinct, each twice
    lists[6] = np.concatenate([np.arange(4000), np.arange(4000)])  # a duplicate of every row in the next chunk
    return users, items, lists


def _oracle(users: np.ndarray, items: np.ndarray, lists: list, k: int) -> tuple[np.ndarray, np.ndarray]:
    """float64: per user the best k distinct candidates by (score desc, row asc), padded (-inf, -1)."""
    idx = np.full((len(lists), k), -1, np.int64)
    val = np.full((len(lists), k), -np.inf, np.float32)
    u64, i64 = users.astype(np.float64), items.astype(np.float64)
    for u, lst in enumerate(lists):
        c = np.unique(np.asarray(lst, np.int64))
        if c.size == 0:
            continue
        s = i64[c] @ u64[u]
        top = np.lexsort((c, -s))[:k]
        idx[u, :top.size] = c[top]
        val[u, :top.size] = s[top].astype(np.float32)
    return idx, val


def exactness(variants: list[str]) -> list[dict]:
    results = []
    for dim in (64, 30):
        users, items, lists = _ties_case(dim)
        engine = recall.Engine(cupy.asarray(items), device="gpu")
        for k in (1, 7, 100, 1000):
            want_idx, want_val = _oracle(users, items, lists, k)
            for variant in variants:
                runs = [("fused", 256), ("gemm", 256)]
                if k == 100:
                    runs += [("fused", 64), ("fused", 1024)]
                for mode, threads in runs:
                    _set_env(variant, threads, mode)
                    res = engine.rescore(users, lists, k)
                    idx, val = cupy.asnumpy(res.indices), cupy.asnumpy(res.scores)
                    path = engine.stats.get("rescore_path")
                    ok = bool(np.array_equal(idx, want_idx) and np.array_equal(val, want_val))
                    bad = int(np.any((idx != want_idx) | (val != want_val), axis=1).sum())
                    results.append({"dim": dim, "k": k, "variant": variant, "mode": mode, "threads": threads,
                                    "path": path, "ok": ok, "users_wrong": bad})
                    if not ok:
                        print(f"  EXACTNESS FAILED: dim {dim} k {k} variant {variant} {mode} threads {threads} "
                              f"(path {path}): {bad} users differ from the float64 oracle", flush=True)
    _set_env(None, None)
    n_bad = sum(not r["ok"] for r in results)
    print(f"exactness on integer data: {len(results) - n_bad}/{len(results)} runs equal the float64 oracle "
          f"bit for bit (ties, duplicates, short/empty/long lists, dims 64 and 30, k 1/7/100/1000)", flush=True)
    return results


# ---- 3. checks of S5 answers ---------------------------------------------------------------------------------------

def check_f64(users: Any, items: Any, cands: Any, sample: Any, vals: Any, rows: Any, k: int) -> dict:
    """The sampled users' answers against float64 scores of all their candidates (CuPy): own distinct candidates,
    score error, order with the tie rule on the returned scores, nothing better than the k-th left out."""
    u = users[sample].astype(cupy.float64)
    c = cands[sample]
    vecs = items[c].astype(cupy.float64)                          # (s, n_cand, dim)
    true = cupy.einsum("sd,scd->sc", u, vecs)
    scale = cupy.linalg.norm(u, axis=1) * cupy.linalg.norm(vecs, axis=2).max(axis=1)
    tol = (1e-5 * scale)[:, None]
    r, v = rows[sample], vals[sample].astype(cupy.float64)
    member = r[:, :, None] == c[:, None, :]
    own = member.any(axis=2) & (r >= 0)
    true_r = cupy.take_along_axis(true, member.argmax(axis=2), axis=1)
    rs = cupy.sort(r, axis=1)
    distinct = ~((rs[:, 1:] == rs[:, :-1]) & (rs[:, 1:] >= 0)).any(axis=1)
    err = cupy.abs(v - true_r) / cupy.maximum(scale[:, None], 1e-30)
    ordered = (v[:, :-1] > v[:, 1:]) | ((v[:, :-1] == v[:, 1:]) & (r[:, :-1] < r[:, 1:]))
    kth = cupy.where(own, true_r, cupy.inf).min(axis=1, keepdims=True)
    better = (true > kth + tol).sum(axis=1)
    better_returned = ((true_r > kth + tol) & own).sum(axis=1)
    out = {"users": int(sample.size), "not_own": int((~own).sum()), "not_distinct": int((~distinct).sum()),
           "max_score_error": float(cupy.where(own, err, 0).max()), "misordered": int((~ordered).sum()),
           "better_left_out": int((better - better_returned).sum())}
    out["ok"] = (out["not_own"] == 0 and out["not_distinct"] == 0 and out["misordered"] == 0
                 and out["better_left_out"] == 0 and out["max_score_error"] <= 1e-5)
    return out


def compare(vals: Any, rows: Any, ref_vals: Any, ref_rows: Any) -> dict:
    """Against the reference answer: bitwise, else scores within float32 rounding at every position (rows may then
    differ only where two candidates' scores are that close)."""
    scale = cupy.maximum(cupy.abs(ref_vals).max(axis=1, keepdims=True), 1e-30)
    close = cupy.abs(vals.astype(cupy.float64) - ref_vals) <= 1e-5 * scale
    return {"bitwise": bool((rows == ref_rows).all() and (vals == ref_vals).all()),
            "rows_equal": float((rows == ref_rows).mean()), "scores_close": bool(close.all())}


# ---- 2. S5 timings -------------------------------------------------------------------------------------------------

def main() -> int:
    t_start = time.perf_counter()
    repeat = int(os.environ.get("SWEEP_REPEAT", "5"))
    n_users = int(os.environ.get("SWEEP_USERS", "100000"))
    threads_list = [int(t) for t in os.environ.get("SWEEP_THREADS", "128,256,512").split(",") if t.strip()]
    variants = [v for v in os.environ.get("SWEEP_VARIANTS", ",".join(rescore.VARIANTS)).split(",") if v.strip()]
    variants = ["legacy"] + [v for v in variants if v != "legacy"] if "legacy" in variants else variants
    n_sample = int(os.environ.get("SWEEP_SAMPLE", "2048"))
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    print(f"{gpu}, {props['multiProcessorCount']} SMs, CuPy {cupy.__version__}, variants {variants}, "
          f"threads {threads_list}, reference = {variants[0]} at {threads_list[0]} threads", flush=True)

    # The device-to-device copy bandwidth, as recall.bench.ceilings measures it (read + write).
    src = cupy.ones((4 << 30) // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    copy_ms = statistics.median(_time_ms(lambda: cupy.copyto(dst, src), repeat))
    copy_tbps = 2.0 * src.nbytes / (copy_ms * 1e-3) / 1e12
    src = dst = None
    cupy.get_default_memory_pool().free_all_blocks()
    print(f"device copy: {copy_tbps:.2f} TB/s this run (the target is measured against {COPY_TBPS:.2f})", flush=True)

    exact = exactness(variants)
    print(f"[{time.perf_counter() - t_start:.0f} s]", flush=True)

    w = workloads.get("S5")
    k, per_user = w.k, w.candidates
    if n_users != w.n_users:
        from dataclasses import replace

        w = replace(w, n_users=n_users)
    cand_users, items = w.generate(seed=0, device="gpu")
    users, cands = cand_users.vecs, cand_users.candidates       # (n, 64) float32, (n, 1000) int64 on the device
    dim = int(items.shape[1])
    bytes_moved = w.bytes_moved
    _sync()
    print(f"S5: {n_users:,} users x {per_user:,} candidates of {items.shape[0]:,} x {dim}, k={k}: "
          f"{bytes_moved / 1e9:.2f} GB counted [{time.perf_counter() - t_start:.0f} s]", flush=True)

    engine = recall.Engine(items, device="gpu")
    indptr = np.arange(n_users + 1, dtype=np.int64) * per_user
    indptr_d = cupy.asarray(indptr)
    rows_flat = cands.reshape(-1)
    cfg = rescore._launch_config(k, dim, per_user)
    k_pad, sz, smem = cfg
    sample = cupy.asarray(np.random.default_rng(1).choice(n_users, min(n_sample, n_users), replace=False))

    def tbps(ms: float) -> float:
        return bytes_moved / (ms * 1e-3) / 1e12

    rows_out: list[dict] = []
    ref: tuple[Any, Any] | None = None
    failed = any(not r["ok"] for r in exact)
    for variant in variants:
        for threads in threads_list:
            _set_env(variant, threads)
            kern, used_threads, lanes = rescore.launch_shape(dim, variant)
            out_v = cupy.empty((n_users, k), cupy.float32)
            out_r = cupy.empty((n_users, k), cupy.int64)
            kernel_ms = _time_ms(lambda: rescore._launch(users, items, dim, None, indptr_d, rows_flat, k, cfg,
                                                         out_v, out_r), repeat)
            e2e = {}
            e2e_ms = _time_ms(lambda: e2e.__setitem__("res", engine.rescore(users, cands, k)), repeat)
            res = e2e["res"]
            row = {"variant": variant, "threads": used_threads, "asked_threads": threads, "lanes": lanes,
                   "registers": int(kern.num_regs), "spill_bytes": int(kern.local_size_bytes),
                   "blocks_per_sm": _occupancy(kern, used_threads, smem),
                   "smem_bytes": smem, "kernel_ms": statistics.median(kernel_ms), "kernel_runs_ms": kernel_ms,
                   "e2e_ms": statistics.median(e2e_ms), "e2e_runs_ms": e2e_ms,
                   "path": engine.stats.get("rescore_path")}
            same = bool((res.indices == out_r).all() and (res.scores == out_v).all())
            if ref is None:
                ref = (out_v.astype(cupy.float64), out_r)
                row["vs_reference"] = {"bitwise": True, "rows_equal": 1.0, "scores_close": True, "reference": True}
            else:
                row["vs_reference"] = compare(out_v, out_r, *ref)
            row["e2e_equals_kernel"] = same
            row["f64_check"] = check_f64(users, items, cands, sample, out_v, out_r, k)
            row["ok"] = bool(row["vs_reference"]["scores_close"] and row["f64_check"]["ok"] and same
                             and row["path"] == "fused")
            failed |= not row["ok"]
            rows_out.append(row)
            print(f"  {variant:<14} {used_threads:>5} threads: kernel {row['kernel_ms']:7.3f} ms "
                  f"({tbps(row['kernel_ms']):.2f} TB/s), e2e {row['e2e_ms']:7.3f} ms, regs {row['registers']} "
                  f"(local {row['spill_bytes']} B), "
                  f"blocks/SM {row['blocks_per_sm']}, check {'ok' if row['ok'] else 'FAILED'} "
                  f"[{time.perf_counter() - t_start:.0f} s]", flush=True)

    # The cuBLAS path end to end (gather, strided-batched GEMM, selection), on the same engine.
    _set_env(None, None, "gemm")
    e2e = {}
    gemm_ms = _time_ms(lambda: e2e.__setitem__("res", engine.rescore(users, cands, k)), max(3, repeat // 2))
    res = e2e["res"]
    gemm_row = {"variant": "gemm (cuBLAS)", "threads": None, "kernel_ms": None, "e2e_ms": statistics.median(gemm_ms),
                "e2e_runs_ms": gemm_ms, "path": engine.stats.get("rescore_path"),
                "vs_reference": compare(res.scores, res.indices, *ref),
                "f64_check": check_f64(users, items, cands, sample, res.scores, res.indices, k)}
    gemm_row["ok"] = bool(gemm_row["vs_reference"]["scores_close"] and gemm_row["f64_check"]["ok"])
    failed |= not gemm_row["ok"]
    res = e2e = None
    _set_env(None, None)

    # What the default end-to-end call spends outside the kernel: the candidates' validation (range check).
    valid_ms = statistics.median(_time_ms(lambda: rescore.normalise_candidates(cands, n_users, int(items.shape[0]),
                                                                              cupy), repeat))
    # The same range check in one pass (a reduction reading the rows once), for comparison.
    out_of_range = cupy.ReductionKernel("int64 x, int64 n", "int64 y", "(x < 0 || x >= n) ? 1 : 0", "a + b",
                                        "y = a", "0", "rescore_out_of_range")
    one_pass_ms = statistics.median(_time_ms(lambda: int(out_of_range(rows_flat, np.int64(items.shape[0]))), repeat))

    # Gather-only ceiling (dim 64): the same rows and bytes, no selection, one float written per user.
    ceiling = []
    if dim == 64:
        ceil_kern = cupy.RawKernel(_CEILING_SRC, "gather_ceiling", options=("--std=c++14",))
        sums = cupy.zeros(n_users, cupy.float32)
        for threads in (256, 512):
            ms = _time_ms(lambda: ceil_kern((n_users,), (threads,), (items, rows_flat, np.int32(per_user), users,
                                                                     sums), shared_mem=4 * per_user), repeat)
            ceiling.append({"threads": threads, "kernel_ms": statistics.median(ms), "runs_ms": ms})

    # ---- the table ----
    print()
    print(f"S5 on {gpu}: {bytes_moved / 1e9:.2f} GB counted; % of {COPY_TBPS:.2f} TB/s (target {TARGET:.0%}: "
          f"<= {bytes_moved / (TARGET * COPY_TBPS * 1e12) * 1e3:.2f} ms); this run's copy: {copy_tbps:.2f} TB/s")
    head = (f"{'variant':<15} {'threads':>7} {'lanes':>5} {'regs':>4} {'blk/SM':>6} {'kernel ms':>9} {'TB/s':>5} "
            f"{'% 4.20':>6} {'e2e ms':>8} {'TB/s':>5} {'% 4.20':>6}  check")
    print(head)
    print("-" * len(head))

    def pct(ms: float | None) -> str:
        return f"{tbps(ms) / COPY_TBPS:6.1%}" if ms else f"{'-':>6}"

    def tb(ms: float | None) -> str:
        return f"{tbps(ms):5.2f}" if ms else f"{'-':>5}"

    for r in rows_out + [gemm_row]:
        vs = r["vs_reference"]
        note = ("ok" if r["ok"] else "FAILED") + (", bitwise = ref" if vs.get("bitwise") else
                                                   f", rows = ref {vs['rows_equal']:.4%}")
        km = r["kernel_ms"]
        print(f"{r['variant']:<15} {r['threads'] if r['threads'] else '-':>7} {r.get('lanes', '-'):>5} "
              f"{r.get('registers', '-'):>4} {str(r.get('blocks_per_sm', '-')):>6} "
              f"{(f'{km:9.3f}' if km else '-'):>9} {tb(km)} {pct(km)} {r['e2e_ms']:8.3f} {tb(r['e2e_ms'])} "
              f"{pct(r['e2e_ms'])}  {note}")
    for c in ceiling:
        print(f"{'gather ceiling':<15} {c['threads']:>7} {8:>5} {'':>4} {'':>6} {c['kernel_ms']:9.3f} "
              f"{tb(c['kernel_ms'])} {pct(c['kernel_ms'])} {'':>8} {'':>5} {'':>6}  (no selection)")
    print(f"candidate validation alone (normalise_candidates, part of every e2e call): {valid_ms:.3f} ms; "
          f"the same range check as one reduction pass: {one_pass_ms:.3f} ms")
    best = min((r for r in rows_out if r["ok"]), key=lambda r: r["kernel_ms"], default=None)
    if best:
        print(f"best kernel: {best['variant']} at {best['threads']} threads, {best['kernel_ms']:.3f} ms = "
              f"{tbps(best['kernel_ms']):.2f} TB/s = {tbps(best['kernel_ms']) / COPY_TBPS:.1%} of {COPY_TBPS} "
              f"(e2e {best['e2e_ms']:.3f} ms = {tbps(best['e2e_ms']) / COPY_TBPS:.1%})")
    print(f"f64 check: {n_sample} sampled users per configuration; exactness runs failed: "
          f"{sum(not r['ok'] for r in exact)}; total {time.perf_counter() - t_start:.0f} s")

    if os.environ.get("OUT"):
        report = {"gpu": gpu, "cupy": cupy.__version__, "copy_tbps_measured": copy_tbps, "copy_tbps_target_base":
                  COPY_TBPS, "target_fraction": TARGET, "bytes_moved": bytes_moved, "n_users": n_users,
                  "candidates": per_user, "k": k, "dim": dim, "k_pad": k_pad, "sz": sz, "repeat": repeat,
                  "rows": rows_out, "gemm": gemm_row, "ceiling": ceiling, "validation_ms": valid_ms,
                  "validation_one_pass_ms": one_pass_ms,
                  "exactness": exact, "failed": failed, "seconds": time.perf_counter() - t_start}
        for r in rows_out + [gemm_row] + ceiling:
            for key in ("kernel_ms", "e2e_ms"):
                if r.get(key):
                    r[key.replace("_ms", "_tbps")] = tbps(r[key])
                    r[key.replace("_ms", "_pct")] = tbps(r[key]) / COPY_TBPS
        with open(os.path.join(os.environ["OUT"], "rescore_sweep.json"), "w") as f:
            json.dump(report, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
