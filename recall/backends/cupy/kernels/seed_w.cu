// The threshold sample of a float16 pass on Hopper, scored and selected in one kernel: a threshold just below each
// user's rank-th best sampled score, from the users' and the sample's float16 rows themselves, where the pass keeps
// at most 80 candidates a user (fused.py's SEED_W_MAX_K: fast mode's and the certified route's k + margin + 1, k up
// to 63), starts at a rank of at most 4 KEPT (below), and the search excludes nothing.
// cuBLAS's GEMM wrote the sample's float32 scores to memory and recall_seed_warp read them back: for a million users
// and 512 sampled items, 2 GB each way, 3.1-3.2 ms against this kernel's 2.1 (H100, docs/benchmarks.md). Compiled
// after fused_w.cu (its wgmma helpers, tile layout, loader and product step), in its module.
//
// A block of RW_THREADS owns 128 users and multiplies them by the sample a tile of 128 items at a time, as fused_w.cu
// does: the same wgmma sequence over the same float16 rows, so that each sampled score here is the pass's own score
// of that item, bit for bit. The threshold is not lowered by a margin (recall_seed_warp's, over cuBLAS's sums in
// another order, is): it sits below the pass's own rank-th best sampled score, so those items pass its filter, and
// the certificate counts every item below a user's start as left out, bounding their exact scores itself (fast.py);
// a threshold above some user's scores costs that user time (a widened pass), never an answer. Unlowered, the route
// took 0.94-0.98x the time on 4,096-item catalogues (H100, docs/benchmarks.md). -DRS_LOWER (measurement only: the
// rule before) lowers each sampled score by its margin (topk.cu's RecallSeedMargin) as recall_seed_warp does. A
// thread holds 2 users' (h = 0, 1) 32 scores of each tile, the 4 lanes of a quad (t = lane % 4) a user's 128; each
// lane keeps its KEPT largest keys (recall_f2ord) of each user in registers, sorted, largest first: a key moves every
// smaller one down a place, two comparisons a place and no branch. Then the
// quad pops its largest kept key `rank` times: the rank-th largest of the 4 KEPT kept keys, ties counted, which is the
// rank-th largest of the row unless a lane dropped a key at or above it (it held more than KEPT of the row's best),
// and never above it: at or below the pass's own k-th best all the same (recall_seed_warp would go on over the
// whole row, which this kernel does not keep). -inf where the quad kept fewer than K keys, or than the 4 KEPT it can
// where K is more (fewer than K finite sampled scores: recall_seed's rule, counted on what was kept).
//
// Searches without exclusions only (the pipeline's rule): with 50 excluded items a user, each key that might enter
// a lane's kept keys looked up among them, the route on 1M users x 4,096 items took 15.0 ms of GPU time against 13.1
// with cuBLAS's GEMM, recall_mask_sampled and recall_seed_warp (H100, docs/benchmarks.md).
// Keys a lane keeps of each user: RS_KEPT in passes of at most 32 candidates (fused.py's SEED_W_NARROW_K), RS_KEPT_WIDE
// in wider ones (the `_wide` kernels: k = 50's pass keeps 64, its need's rank 53, above the 48 that 4 x 12 kept keys
// hold). 1M users x 512 sampled items x 80 columns at rank 27 (k = 10's pass), in launches of 32,768 users (H100,
// scripts/lab/seed_w_profile.py, a build that also looked exclusions up): 12 keys 2.49 ms, 98.1% of users at the
// GEMM path's threshold (the rest a place or two below); 16 keys 2.79 ms, 99.99%; 8 keys 2.38 ms, 28%; cuBLAS's GEMM
// and recall_seed_warp 3.49 ms. At rank 53, 16 keys a lane leave about half the users a place or two below the
// sample's 53rd best, and 4-5% more scores pass after them (counted on the CPU); 16 keys take 128 registers (4 bytes
// spilled at 128 columns). -DRS_KEPT=n, -DRS_KEPT_WIDE=n: measurement only. (Measured with each key pushed into the
// kept ones in turn; a tile's keys are now taken a batch at a time, recall_seed_take.)
#ifndef RS_KEPT
#define RS_KEPT 12
#endif
#ifndef RS_KEPT_WIDE
#define RS_KEPT_WIDE 16
#endif

// A lane's KEPT largest keys of a user, largest first (0: an empty place).
template <int KEPT>
struct RecallSeedKept {
    u32 key[KEPT];

    __device__ __forceinline__ void clear() {
#pragma unroll
        for (int j = 0; j < KEPT; ++j) key[j] = 0u;
    }

    __device__ __forceinline__ void push(u32 k) {  // k <= key[KEPT - 1] (0 too) changes nothing
#if defined(RS_NO_KEEP)  // measurement only (scripts/lab/seed_w_profile.py): the largest key alone
        key[0] = max(key[0], k);
#else
        recall_seed_push(key, k);
#endif
    }

    __device__ __forceinline__ int held() const {
        int c = 0;
#pragma unroll
        for (int j = 0; j < KEPT; ++j) c += key[j] != 0u ? 1 : 0;
        return c;
    }
};

// A tile's keys taken into a lane's kept keys a batch at a time (RS_PUSH: one at a time, recall_seed_push, the rule
// before; measurement only). A thread's 32 scores of user h in a tile (d[4 j + 2 h + c], element i = 2 j + c) become
// keys in place in d (wgmma overwrites d at the next tile's first product: its input is not read), elements 0-15 are
// sorted largest first and 16-31 smallest first (bitonic networks, 80 compare-exchanges each), the larger of each
// pair i, 16 + i holds the 16 largest (a bitonic run), merged largest first (32); the larger of that run's element
// 15 - i and kept key i (0 past KEPT) holds the 16 largest of both, merged again, and the first KEPT are kept: the
// same keys the pushes keep, in about 500 instructions a 32 where each push took about 60 a key (the kept keys'
// 16 places, two comparisons and two selects each).
#define RS_SLOT(i, h) (4 * ((i) >> 1) + 2 * (h) + ((i) & 1))

__device__ __forceinline__ void recall_seed_cx(float* d, int a, int b, bool desc) {
    const u32 x = __float_as_uint(d[a]), y = __float_as_uint(d[b]);
    d[a] = __uint_as_float(desc ? max(x, y) : min(x, y));
    d[b] = __uint_as_float(desc ? min(x, y) : max(x, y));
}

// Elements BASE .. BASE + 15 of user H's tile sorted, largest first (ASC: smallest first).
template <int H, int BASE, bool ASC>
__device__ __forceinline__ void recall_seed_sort16(float* d) {
#pragma unroll
    for (int size = 2; size <= 16; size <<= 1)
#pragma unroll
        for (int stride = size >> 1; stride > 0; stride >>= 1)
#pragma unroll
            for (int i = 0; i < 16; ++i)
                if ((i ^ stride) > i)
                    recall_seed_cx(d, RS_SLOT(BASE + i, H), RS_SLOT(BASE + (i ^ stride), H), ((i & size) == 0) != ASC);
}

// Elements 0 .. 15 of user H's tile, a bitonic run, merged largest first.
template <int H>
__device__ __forceinline__ void recall_seed_merge16(float* d) {
#pragma unroll
    for (int stride = 8; stride > 0; stride >>= 1)
#pragma unroll
        for (int i = 0; i < 16; ++i)
            if ((i ^ stride) > i) recall_seed_cx(d, RS_SLOT(i, H), RS_SLOT(i ^ stride, H), true);
}

// User H's 32 keys of the tile (in d) into its KEPT kept keys (KEPT <= 16).
template <int H, int KEPT>
__device__ __forceinline__ void recall_seed_take(float* d, u32 (&key)[KEPT]) {
    static_assert(KEPT <= 16, "a lane keeps at most the 16 largest of a tile's 32");
    recall_seed_sort16<H, 0, false>(d);
    recall_seed_sort16<H, 16, true>(d);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const u32 a = __float_as_uint(d[RS_SLOT(i, H)]), b = __float_as_uint(d[RS_SLOT(16 + i, H)]);
        d[RS_SLOT(i, H)] = __uint_as_float(max(a, b));
    }
    recall_seed_merge16<H>(d);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 a = __float_as_uint(d[RS_SLOT(i, H)]), b = __float_as_uint(d[RS_SLOT(15 - i, H)]);
        d[RS_SLOT(i, H)] = __uint_as_float(max(i < KEPT ? key[i] : 0u, b));
        d[RS_SLOT(15 - i, H)] = __uint_as_float(max(15 - i < KEPT ? key[15 - i] : 0u, a));
    }
    recall_seed_merge16<H>(d);
#pragma unroll
    for (int i = 0; i < KEPT; ++i) key[i] = __float_as_uint(d[RS_SLOT(i, H)]);
}

__device__ __forceinline__ u32 recall_quad_max(u32 x) {
    x = max(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return max(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ int recall_quad_sum(int x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <int KS, int KEPT>
__device__ __forceinline__ void recall_seed_w_body(const half_bits* __restrict__ S, int T, int K, int n_users,
                                                   float* __restrict__ thr, const half_bits* __restrict__ U, int W,
                                                   const float* __restrict__ vnorm, const float* __restrict__ vbias,
                                                   int BL, int BH, int CC, double CV, double A, double R, double Z,
                                                   int KE, half_bits* smem) {
    constexpr int CH = 16 * KS;
    constexpr int STAGES = RW_STAGES_OF(KS);
    constexpr unsigned TILE_BYTES = 2u * RW_TILE * CH + 16u * RW_SBO_PAD;
    constexpr unsigned SBO = 16u * CH + RW_SBO_PAD;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int u0 = blockIdx.x * RW_TILE;
    const int n_tiles = (T + RW_TILE - 1) / RW_TILE;
    const unsigned u_base = recall_smem_addr(smem);
    const unsigned i_base = u_base + TILE_BYTES;

    const RecallWLoader<KS> load_tile(tid, W);
    recall_w_prime<KS, STAGES>(load_tile, u_base, i_base, U, u0, n_users, S, T, n_tiles);
    const int wrow = (warp >> 2) * 64 + (warp & 3) * 16;
    const unsigned a_base = u_base + (unsigned)(warp >> 2) * 8u * SBO;

#if defined(RS_LOWER)
    // Each user's margin (recall_seed_column of each column, then recall_seed_margin_of, as recall_seed_warp's), from
    // the users' tile once it has landed: the quad's lanes read 16-byte pieces t, t + 4, ... of the row (columns
    // past W are zeros), and sum over the quad. Only the user's own terms are kept (au, ab, z; r is every user's),
    // so that the registers the products need are not spilled. Reading the row from global memory one column at a
    // time held each block up as long as its products (scripts/lab/seed_w_profile.py).
    recall_cp_wait<STAGES - 2>();  // the users' tile (with item tile 0)
    __syncthreads();
    const bool bias = BH > BL;  // vbias read only then (recall_seed's sums stand in for it otherwise)
    float au[2], ab[2], z[2], r = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = wrow + g + 8 * h;
        double sq = 0.0, ub = 0.0, uc = 0.0;
#pragma unroll
        for (int pc = t; pc < 2 * KS; pc += 4) {
            // Row group row >> 3 starts SBO (2 KS pieces of 128 bytes, and any padding) after the one before.
            const uint4 q = *reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(smem)
                                                            + ((row >> 3) * 2 * KS + pc) * 128
                                                            + (row >> 3) * RW_SBO_PAD + (row & 7) * 16);
            const half_bits piece[8] = {(half_bits)(q.x & 0xffffu), (half_bits)(q.x >> 16), (half_bits)(q.y & 0xffffu),
                                        (half_bits)(q.y >> 16), (half_bits)(q.z & 0xffffu), (half_bits)(q.z >> 16),
                                        (half_bits)(q.w & 0xffffu), (half_bits)(q.w >> 16)};
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int col = 8 * pc + e;
                recall_seed_column(col, recall_load(piece, e), CC, BL, BH, sq, ub, uc);
            }
        }
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) {
            sq += __shfl_xor_sync(0xffffffffu, sq, o);
            ub = fmax(ub, __shfl_xor_sync(0xffffffffu, ub, o));
            uc = fmax(uc, __shfl_xor_sync(0xffffffffu, uc, o));
        }
        // (phi 0: float16 vectors never leave float32's normal range, recall_seed_margin_of)
        const RecallSeedMargin m = recall_seed_margin_of(vnorm, vbias, BL, BH, CV, A, R, Z, sq, ub, uc, 0.0);
        au[h] = m.au;
        ab[h] = m.ab;
        z[h] = m.z32;
        r = m.r32;
    }
#else
    // Unlowered: the margins' arguments are not read (recall_w_step waits for each tile itself).
    (void)vnorm;
    (void)vbias;
    (void)BL;
    (void)BH;
    (void)CC;
    (void)CV;
    (void)A;
    (void)R;
    (void)Z;
#endif
    RecallSeedKept<KEPT> kept[2];
    kept[0].clear();
    kept[1].clear();

    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.0f;
    for (int s = 0; s < n_tiles; ++s) {
        recall_w_step<KS, STAGES>(d, load_tile, a_base, i_base, S, T, s, n_tiles);

        const int j0 = s * RW_TILE + 2 * t;  // d[4j + 2h + c] is item j0 + 8j + c
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int item = j0 + 8 * j + c;
                const bool in = item < T;
#if defined(RS_LOWER)
                const float vn = in ? __ldg(vnorm + item) : 0.0f;
                const float vb = in && bias ? __ldg(vbias + item) : 0.0f;
#endif
#pragma unroll
                for (int h = 0; h < 2; ++h) {
#if defined(RS_LOWER)
                    const RecallSeedMargin m = {vnorm, nullptr, au[h], ab[h], r, z[h]};
                    const u32 k = in ? recall_seed_key(m.lower(d[4 * j + 2 * h + c], vn, vb)) : 0u;
#else
                    const u32 k = in ? recall_seed_key(d[4 * j + 2 * h + c]) : 0u;
#endif
#if defined(RS_PUSH) || defined(RS_NO_KEEP)
                    kept[h].push(k);
#else
                    d[4 * j + 2 * h + c] = __uint_as_float(k);
#endif
                }
            }
#if !defined(RS_PUSH) && !defined(RS_NO_KEEP)
        recall_seed_take<0, KEPT>(d, kept[0].key);
        recall_seed_take<1, KEPT>(d, kept[1].key);
#endif
    }

    const int rank = KE > 0 && KE < K ? KE : K;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int user = u0 + wrow + g + 8 * h;
        // Enough where the quad kept K keys, or all it could: a rank past the 4 KEPT kept (which fused.py's
        // seeds_fused does not send here) would pop zeros, the lowest threshold, a bound all the same.
        const bool enough = recall_quad_sum(kept[h].held()) >= min(K, 4 * KEPT);
        // The quad's largest kept key, `rank` times: each time the lowest lane holding it drops it. Every lane of
        // the warp pops (the shuffles take the whole warp): a quad short of keys pops zeros, unused.
        u32 lo = 0u;
        for (int p = 0; p < rank; ++p) {
            lo = recall_quad_max(kept[h].key[0]);
            const unsigned mine = (__ballot_sync(0xffffffffu, kept[h].key[0] == lo) >> (lane & ~3)) & 0xfu;
            if (t == __ffs(mine) - 1) {
#pragma unroll
                for (int j = 0; j < KEPT - 1; ++j) kept[h].key[j] = kept[h].key[j + 1];
                kept[h].key[KEPT - 1] = 0u;
            }
        }
        // A key below every finite float's (the most negative scores' bins): -FLT_MAX, as recall_seed_warp.
        const u32 low = max(lo, recall_f2ord(-3.402823466e38f));
        if (t == 0 && user < n_users)
            thr[user] = enough ? nextafterf(recall_ord2f(low), RECALL_NEG_INF) : RECALL_NEG_INF;
    }
}

// recall_seed_w<KS>: rows of 16 KS columns multiplied (KS = 1 .. 9, as fused_w.cu's), RS_KEPT keys a lane;
// recall_seed_w<KS>_wide, RS_KEPT_WIDE; grid ceil(n_users / 128) blocks of RW_THREADS; shared memory fused.py's
// seed_w_smem. The sample's T rows S (T, W) and K, then the users' count and recall_seed_warp's arguments from thr on
// (selection.py's Selection.seed_args).
#define RECALL_SEED_W_KERNEL(KS, NAME, KEPT)                                                                       \
    extern "C" __global__ void __launch_bounds__(RW_THREADS, 2)                                                    \
    NAME(const half_bits* __restrict__ S, int T, int K, int n_users, float* __restrict__ thr,                     \
         const half_bits* __restrict__ U, int W, const float* __restrict__ vnorm, const float* __restrict__ vbias, \
         int BL, int BH, int CC, double CV, double A, double R, double Z, int KE) {                                 \
        extern __shared__ float4 recall_seed_w_smem[];                                                            \
        recall_seed_w_body<KS, KEPT>(S, T, K, n_users, thr, U, W, vnorm, vbias, BL, BH, CC, CV, A, R, Z, KE,        \
                                     reinterpret_cast<half_bits*>(recall_seed_w_smem));                           \
    }
#define RECALL_SEED_W_KERNELS(KS)                                                                                  \
    RECALL_SEED_W_KERNEL(KS, recall_seed_w##KS, RS_KEPT)                                                           \
    RECALL_SEED_W_KERNEL(KS, recall_seed_w##KS##_wide, RS_KEPT_WIDE)
RECALL_SEED_W_KERNELS(1)
RECALL_SEED_W_KERNELS(2)
RECALL_SEED_W_KERNELS(3)
RECALL_SEED_W_KERNELS(4)
RECALL_SEED_W_KERNELS(5)
RECALL_SEED_W_KERNELS(6)
RECALL_SEED_W_KERNELS(7)
RECALL_SEED_W_KERNELS(8)
RECALL_SEED_W_KERNELS(9)
