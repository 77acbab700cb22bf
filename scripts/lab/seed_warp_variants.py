"""Where the warp-a-user threshold select (``recall_seed_warp_fh``) spends its time: lab kernels built on topk.cu's
own device functions that stop after each of its steps (read and lower the row only; and keep each lane's 16 best
keys; then the bisection), with the shipped branchless insertion and with the first version's bubble, timed against
the shipped kernel on the same scores. Prints a table and writes JSON. (Run on 2026-12-04 18:59 UTC with the bubble
shipped, when ``lab_keep_bl``/``lab_bisect_bl`` named the branchless variants: docs/benchmarks.md.)

Run from the project root on a GPU machine::

    PYTHONPATH=. python3 scripts/lab/seed_warp_variants.py [--json $OUT/seed_warp_variants.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

EXTRA = r"""
// Variant steps: 1 reads and lowers (keys counted), 2 also keeps the 16 best, 3 also bisects (the shipped kernel's
// work but the whole-row fallback). BUBBLE: the first version's insertion, a bubble that stops where the key belongs
// (a data-dependent exit at each place); otherwise the shipped RecallSeedLaneTop's branchless one.
template <int M>
struct LabTopBubble : RecallSeedLaneTop<M> {  // the count, the keys and at_least as shipped; another insertion
    __device__ __forceinline__ void operator()(u32 k) {
        u32* key = this->key;
        if (k == 0u) return;
        ++this->count;
        if (k <= key[M - 1]) return;
        key[M - 1] = k;
#pragma unroll
        for (int j = M - 1; j > 0; --j) {
            if (key[j] <= key[j - 1]) break;
            const u32 t = key[j];
            key[j] = key[j - 1];
            key[j - 1] = t;
        }
    }
};

struct LabCount {
    int count; u32 best;
    __device__ __forceinline__ void operator()(u32 k) { count += k != 0u; best = max(best, k); }
};

template <int STEP, bool BUBBLE>
__device__ void lab_body(const float* __restrict__ scores, int U, int T, int K, float* __restrict__ thr,
                         const half_bits* __restrict__ users, int W, const float* __restrict__ vnorm, int KE) {
    const int lane = threadIdx.x & 31;
    const int u = blockIdx.x * 8 + (int)(threadIdx.x >> 5);
    if (u >= U) return;
    const float* row = scores + (long long)u * T;
    const RecallSeedMargin mg = {vnorm, nullptr, 1e-6f, 0.0f, 0.0f, 1e-30f};  // au, ab, r32, z32
    if (STEP == 1) {
        LabCount c = {0, 0u};
        recall_seed_lane_each(row, mg, T, lane, c);
        const int n = recall_warp_sum(c.count);
        const u32 b = recall_warp_max(c.best);
        if (lane == 0) thr[u] = recall_ord2f(b) + (float)n;
        return;
    }
    typename std::conditional<BUBBLE, LabTopBubble<16>, RecallSeedLaneTop<16>>::type top;
#pragma unroll
    for (int j = 0; j < 16; ++j) top.key[j] = 0u;
    top.count = 0;
    recall_seed_lane_each(row, mg, T, lane, top);
    if (STEP == 2) {
        const u32 b = recall_warp_max(top.key[15]);
        if (lane == 0) thr[u] = recall_ord2f(b);
        return;
    }
    const int rank = KE;
    u32 lo = 1u;
    unsigned long long hi = (unsigned long long)recall_warp_max(top.key[0]) + 1ull;
    while (hi - lo > 1ull) {
        const u32 mid = lo + (u32)((hi - lo) >> 1);
        if (recall_warp_sum(top.at_least(mid)) >= rank) lo = mid; else hi = mid;
    }
    if (lane == 0) thr[u] = recall_ord2f(lo);
}

#define LAB(name, STEP, BL) \
    extern "C" __global__ void __launch_bounds__(256) name(const float* __restrict__ scores, int U, int T, int K, \
        float* __restrict__ thr, const half_bits* __restrict__ users, int W, const float* __restrict__ vnorm, int KE) { \
        lab_body<STEP, BL>(scores, U, T, K, thr, users, W, vnorm, KE); }
LAB(lab_read, 1, false)
LAB(lab_keep_bubble, 2, true)
LAB(lab_bisect_bubble, 3, true)
LAB(lab_keep, 2, false)
LAB(lab_bisect, 3, false)
"""

SHAPES = [(4096, 2048, 100, 30), (200_000, 2048, 100, 30), (100_000, 8192, 100, 100)]


def main() -> None:
    import cupy
    import numpy as np

    from recall.backends import resolve
    from recall.backends.cupy import kernels
    from recall.backends.cupy.selection import GpuTopK

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    code = "#include <type_traits>\n" + kernels.source("topk.cu") + EXTRA
    try:
        mod = cupy.RawModule(code=code, options=("--std=c++14",))
        mod.get_function("lab_read")
    except Exception:  # NVRTC without the standard headers: std::conditional by hand
        code = code.replace("#include <type_traits>\n", "namespace std { template <bool B, class T, class F> struct "
                            "conditional { typedef T type; }; template <class T, class F> struct conditional<false, T, "
                            "F> { typedef F type; }; }\n")
        mod = cupy.RawModule(code=code, options=("--std=c++14",))
    backend = resolve("gpu")
    rng = cupy.random.default_rng(0)
    out = []
    print("| users | sampled | rank | kernel | ms |")
    print("| ---: | ---: | ---: | --- | ---: |")
    for n, size, k, ke in SHAPES:
        scores = rng.standard_normal((1, n, size), dtype=cupy.float32)
        norms = cupy.abs(rng.standard_normal(size, dtype=cupy.float32)) + cupy.float32(0.5)
        users = (rng.standard_normal((n, 72), dtype=cupy.float32) * 0.1).astype(cupy.float16)
        thr = cupy.empty(n, cupy.float32)
        state = GpuTopK.allocate(n, k, 1)
        rows = cupy.arange(size, dtype=cupy.int64)
        ptr, ex = cupy.zeros(n + 1, cupy.int64), cupy.zeros(0, cupy.int64)

        def shipped():
            backend.selection.seed(state, scores, rows, users, norms, ptr, ex, ke, (64, 2.0 ** 15))

        def lab(name):
            fn = mod.get_function(name)
            return lambda: fn(((n + 7) // 8,), (256,), (scores, np.int32(n), np.int32(size), np.int32(k), thr, users,
                                                        np.int32(72), norms, np.int32(ke or k)))

        runs = {"shipped": shipped, **{name: lab(name) for name in ("lab_read", "lab_keep_bubble",
                                                                      "lab_bisect_bubble", "lab_keep", "lab_bisect")}}
        for name, fn in runs.items():
            fn()
            ts = []
            for _ in range(7):
                e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                ts.append(cupy.cuda.get_elapsed_time(e0, e1))
            ms = statistics.median(ts)
            print(f"| {n:,} | {size:,} | {ke or k} | {name} | {ms:.3f} |", flush=True)
            out.append({"users": n, "sampled": size, "rank": ke or k, "kernel": name, "ms": ms})
        del scores, users, state
        cupy.get_default_memory_pool().free_all_blocks()
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
