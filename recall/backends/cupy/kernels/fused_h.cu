// Fast mode's fused scoring and filtering: float16 vectors multiplied on tensor cores (mma.sync m16n8k16, float32
// accumulation), each score compared with its user's threshold in the registers and never written to memory.
// Compiled after topk.cu and fused.cu, in the same module (it appends to the candidate buffers that
// recall_merge_fused_h folds in, and uses fused.cu's cp.async helpers).
//
// One block of RH_THREADS threads owns 128 users and walks `tiles_per_cta` tiles of 128 items. Each warp computes a
// 64 x RH_WN patch of users (w & 1) * 64.. and items (w >> 1) * RH_WN..: 4 x (RH_WN / 8) mma tiles of 16 x 8, fed by
// ldmatrix from shared memory (RH_WN = 32, as shipped: 8 warps, 64 float32 accumulators a thread, 6 ldmatrix for 16
// mma; 64, measured and not kept: 4 warps, 128 accumulators, 8 ldmatrix for 32 mma). The users' rows stay in shared
// memory whole; the items come in chunks of 64 halves through a ring of three buffers filled with cp.async, two
// chunks ahead of the one multiplied. Rows of both are padded by 8 halves in shared memory, so that the 8 rows of
// every 8 x 8 matrix that ldmatrix reads lie in different banks.
//
// U is (n_users, W) and I is (n_items, W), row-major float16 with W a multiple of 8 (rows of whole 16-byte pieces);
// the kernel multiplies Wp = W rounded up to 16 columns, pieces past W and rows past n_users / n_items are filled
// with zeros as they are copied, so neither operand needs a padded copy. The float32 result of each score is the sum
// of exact products (float16 x float16 fits float32) in the tensor cores' order: the certificate's accumulation term
// (recall/core/certificate.py) covers any order.

#define RH_TILE 128
#define RH_STAGES 3
#define RH_CHUNK 64  // halves of an item row per pipeline stage
#ifndef RH_WN             // items per warp (fused.py's _H_THREADS follows: 32 * 2 * RH_TILE / RH_WN threads)
#define RH_WN 32
#endif
#ifndef RH_MIN_BLOCKS     // blocks an SM holds (__launch_bounds__: the registers a thread may take follow)
#define RH_MIN_BLOCKS 2
#endif
#define RH_THREADS (32 * 2 * (RH_TILE / RH_WN))

// 16 bytes from gmem, or 16 zero bytes where !valid (gmem is then not read).
__device__ __forceinline__ void recall_cp16_or_zero(unsigned smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(gmem), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void recall_ldmatrix4(u32* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// d += a b (zero: d = a b) for one 16 x 8 tile, k = 16.
__device__ __forceinline__ void recall_mma_16816(float* d, const u32* a, const u32* b, bool zero) {
    if (zero) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%10,%10,%10,%10};"
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

// A group of N scores of one user held by a thread, appended where they pass its threshold `th`: s[q] is the score of
// item row0 + 8 (q / 2) + q % 2 (the layout of an mma.m16n8 / wgmma accumulator along its n8 tiles); rows past
// n_items are skipped unless the tile is `whole`. The group's maximum is tested first, and the tests and branches of
// single scores run only where it passes (about 1% of the groups after a seeded search's first merge on a large
// catalogue; where the pass keeps a percent of the items, most warps hold some lane whose group passes). A passing
// group's survivors become bits, then one round a survivor: the warp goes round as often as its lane with the most,
// not once per score. Shared by fused_h.cu's kernels and fused_w.cu's. `pending` takes each survivor (push(cand, cnt,
// C, user, key)): a RecallPending, or fused_w.cu's RecallStaged.
template <int N, class Sink>
__device__ __forceinline__ void recall_append_group(const float (&s)[N], float th, int user, int row0, bool whole,
                                                    int n_items, Sink& pending, u64* __restrict__ cand,
                                                    int* __restrict__ cnt, int C) {
    float m[N / 2];
#pragma unroll
    for (int q = 0; q < N / 4; ++q) m[2 * q] = fmaxf(fmaxf(s[4 * q], s[4 * q + 1]), fmaxf(s[4 * q + 2], s[4 * q + 3]));
#pragma unroll
    for (int w = 2; w < N / 2; w *= 2)
#pragma unroll
        for (int q = 0; q + w < N / 2; q += 2 * w) m[q] = fmaxf(m[q], m[q + w]);
    if (!(m[0] > th)) return;
#if defined(RH_EACH_SCORE)  // measurement only: a branch per score of a passing group (shipped until 2026-12-03)
#pragma unroll
    for (int q = 0; q < N; ++q) {
        const int row = row0 + 8 * (q >> 1) + (q & 1);
        if (s[q] > th && (whole || row < n_items)) pending.push(cand, cnt, C, user, recall_key(s[q], row));
    }
#else
    // The comparisons alone, a set and a select a score; the rows past n_items taken off after, in the last tile only
    // (`whole` is the same in every thread of a block). Testing each score's row in every tile took 5 instructions a
    // score: 49 a passing group against 27, and 41 a survivor's round against 33 with the tree below (nvcc 13.0,
    // sm_90a, scripts/lab/sass_epilogue.py); the kernel 3-12% faster, the route 4-8% (H100, docs/benchmarks.md).
    unsigned bits = 0u;
#if defined(RH_BITS_SET)  // measurement only (kernel_profile.py's `bits-set`): a comparison and a predicated or
    // a score, in two chains (even and odd q) that the warp's issue need not wait on one after the other
    unsigned odd = 0u;
#pragma unroll
    for (int q = 0; q < N; ++q) {
        unsigned& b = (q & 1) ? odd : bits;
        asm("{\n.reg .pred p;\nsetp.gt.ftz.f32 p, %1, %2;\n@p or.b32 %0, %0, %3;\n}" : "+r"(b)
            : "f"(s[q]), "f"(th), "r"(1u << q));
    }
    bits |= odd;
#else
#pragma unroll
    for (int q = 0; q < N; ++q) bits |= (s[q] > th ? 1u : 0u) << q;
#endif
    if (!whole) {
#pragma unroll
        for (int q = 0; q < N; ++q)
            if (row0 + 8 * (q >> 1) + (q & 1) >= n_items) bits &= ~(1u << q);
    }
#if defined(RH_GROUP_RESERVE)  // measurement only (kernel_profile.py's `group-reserve`): the group's slots taken
    // with one atomic (its survivors' count), so that no round waits on an atomic's answer
    if (!bits) return;  // (the rows past n_items took every survivor: nothing to reserve)
    int slot = pending.reserve(cnt, user, __popc(bits));
#endif
#pragma unroll 1
    while (bits) {
        const int q = __ffs(bits) - 1;
        bits &= bits - 1u;
        const int row = row0 + 8 * (q >> 1) + (q & 1);
        // s[q] selected in registers by q's bits, lowest first: N - 1 selects on log2 N tests.
        static_assert((N & (N - 1)) == 0, "a tree over a power of two of scores");
        float t[N];
#pragma unroll
        for (int r = 0; r < N; ++r) t[r] = s[r];
#pragma unroll
        for (int w = 1; w < N; w *= 2) {
            const bool upper = (q & w) != 0;
#pragma unroll
            for (int r = 0; r < N; r += 2 * w) t[r] = upper ? t[r + w] : t[r];
        }
        const float v = t[0];
#if defined(RH_INLINE_APPEND)  // measurement only: the key stored as soon as its slot comes back
        const int pos = atomicAdd(&cnt[user], 1);
        if (pos < C) cand[(long long)user * C + pos] = recall_key(v, row);
#elif defined(RH_GROUP_RESERVE)
        pending.put(cand, cnt, C, user, slot++, recall_key(v, row));
#else
        pending.push(cand, cnt, C, user, recall_key(v, row));
#endif
    }
#endif
}

// Dynamic shared memory: 128 * (Wp + 8) halves of users, then RH_STAGES * 128 * (CH + 8) halves of item chunks.
template <int CH, int WN>
__device__ __forceinline__ void recall_fused_h_body(const half_bits* __restrict__ U, int n_users,
                                                    const half_bits* __restrict__ I, int n_items, int W, int Wp,
                                                    int tile0, int n_tiles, int tiles_per_cta,
                                                    const float* __restrict__ thr, u64* __restrict__ cand, int C,
                                                    int* __restrict__ cnt, half_bits* smem) {
    constexpr int IS = CH + 8;                       // halves per item row of a chunk in shared memory
    constexpr int THREADS = 32 * 2 * (RH_TILE / WN);
    constexpr int NI = WN / 8;                           // n8 tiles of a warp
    constexpr int LOADS = RH_TILE * (CH / 8) / THREADS;  // 16-byte pieces of a chunk each thread copies
    const int us = Wp + 8;
    const unsigned u_base = recall_smem_addr(smem);
    const unsigned i_base = u_base + 2u * RH_TILE * us;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 1, wn = warp >> 1, g = lane >> 2, t = lane & 3;
    const int u0 = blockIdx.y * RH_TILE;
    const int t_first = tile0 + blockIdx.x * tiles_per_cta;
    const int t_count = min(tiles_per_cta, tile0 + n_tiles - t_first);
    if (t_count <= 0) return;
    const int chunks = (Wp + CH - 1) / CH;
    const int steps = t_count * chunks;

    const int pieces = Wp / 8;  // 16-byte pieces of a user row
    for (int p = tid; p < RH_TILE * pieces; p += THREADS) {
        const int r = p / pieces, c = p - r * pieces;
        const bool ok = u0 + r < n_users && c * 8 < W;
        recall_cp16_or_zero(u_base + 2u * (r * us + c * 8), ok ? U + (long long)(u0 + r) * W + c * 8 : U, ok);
    }
    // Step s copies chunk s % chunks of item tile t_first + s / chunks into buffer s % RH_STAGES.
    auto load_items = [&](int s) {
        const unsigned dst = i_base + 2u * (s % RH_STAGES) * (RH_TILE * IS);
        const long long row0 = (long long)(t_first + s / chunks) * RH_TILE;
        const int k0 = (s % chunks) * CH;
        // Unrolled where that spills nothing (ptxas, sm_90, 128 registers): 64 halves, and up to 32.
#pragma unroll(CH == 64 || CH <= 32 ? LOADS : 1)
        for (int q = 0; q < LOADS; ++q) {
            const int p = tid + q * THREADS;
            const int r = p / (CH / 8), piece = p % (CH / 8);
            const int col = k0 + piece * 8;
            const bool ok = row0 + r < n_items && col < W;
            recall_cp16_or_zero(dst + 2u * (r * IS + piece * 8), ok ? I + (row0 + r) * W + col : I, ok);
        }
    };
#pragma unroll
    for (int st = 0; st < RH_STAGES - 1; ++st) {
        if (st < steps) load_items(st);
        recall_cp_commit();  // the users go with the first chunk
    }

    // Thresholds change only in the merges between launches: read once. Rows: mi * 16 + g + 8h of the warp's 64.
    float th[4][2];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int user = u0 + wm * 64 + mi * 16 + g + 8 * h;
            th[mi][h] = user < n_users ? thr[user] : __int_as_float(0x7f800000);  // +inf: none passes
        }
    // ldmatrix rows: A (users) lane l reads row (l & 15) at column (l >> 4) * 8 of a 16 x 16 patch; B (items) row
    // (l & 7) + (l >> 4) * 8 at column ((l >> 3) & 1) * 8: two n8 tiles of k = 16 in one x4 load.
    const unsigned a_lane = u_base + 2u * ((wm * 64 + (lane & 15)) * us + (lane >> 4) * 8);
    const unsigned b_lane = 2u * ((wn * WN + (lane & 7) + ((lane >> 4) << 3)) * IS + ((lane >> 3) & 1) * 8);

    // A survivor's append does not wait for its slot's atomic (fused.cu's RecallPending).
    RecallPending pending = {nullptr, 0, 0ull};
    float acc[4][NI][4];
    for (int s = 0; s < steps; ++s) {
        recall_cp_wait<RH_STAGES - 2>();
        __syncthreads();  // chunk s has landed for every thread, and no warp still reads the buffer refilled next
        if (s + RH_STAGES - 1 < steps) load_items(s + RH_STAGES - 1);
        recall_cp_commit();
        const unsigned ib = i_base + 2u * (s % RH_STAGES) * (RH_TILE * IS) + b_lane;
        const int chunk = s % chunks;
        const int k0 = chunk * CH;
#pragma unroll
        for (int kk = 0; kk < CH; kk += 16) {
            if (k0 + kk < Wp) {
                u32 a[4][4], b[NI][2];
#pragma unroll
                for (int mi = 0; mi < 4; ++mi) recall_ldmatrix4(a[mi], a_lane + 2u * (mi * 16 * us + k0 + kk));
#pragma unroll
                for (int np = 0; np < NI / 2; ++np) {
                    u32 r[4];
                    recall_ldmatrix4(r, ib + 2u * (np * 16 * IS + kk));
                    b[2 * np][0] = r[0]; b[2 * np][1] = r[1]; b[2 * np + 1][0] = r[2]; b[2 * np + 1][1] = r[3];
                }
                const bool first = chunk == 0 && kk == 0;  // a new tile: the products replace the sums
#pragma unroll
                for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                    for (int ni = 0; ni < NI; ++ni) recall_mma_16816(acc[mi][ni], a[mi], b[ni], first);
            }
        }
        if (chunk == chunks - 1) {
            const int j0 = (t_first + s / chunks) * RH_TILE + wn * WN;
            const bool whole = j0 + WN <= n_items;
#if defined(RH_SKIP_EPILOGUE)  // measurement only (scripts/lab/fused_h_micro.py): the products, no filter
            float sum = 0.0f;
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                    for (int r = 0; r < 4; ++r) sum += acc[mi][ni][r];
            if (sum == 1234.5f && whole) cnt[0] = 1;
#elif defined(RH_PER_ELEMENT)  // measurement only: a test and a branch per score
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int row = j0 + ni * 8 + 2 * t + (r & 1);
                        if (acc[mi][ni][r] > th[mi][r >> 1] && (whole || row < n_items)) {
                            const int user = u0 + wm * 64 + mi * 16 + g + 8 * (r >> 1);
                            const int pos = atomicAdd(&cnt[user], 1);
                            if (pos < C) cand[(long long)user * C + pos] = recall_key(acc[mi][ni][r], row);
                        }
                    }
#else
            // A thread holds 2 * NI scores of each of its 8 users (rows mi * 16 + g + 8h), score q = 2 ni + c of
            // item j0 + 8 ni + 2t + c.
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float s[2 * NI];
#pragma unroll
                    for (int q = 0; q < 2 * NI; ++q) s[q] = acc[mi][q >> 1][2 * h + (q & 1)];
                    recall_append_group(s, th[mi][h], u0 + wm * 64 + mi * 16 + g + 8 * h, j0 + 2 * t, whole, n_items,
                                        pending, cand, cnt, C);
                }
#endif
        }
    }
    pending.flush(C);
}

// Launched for rows of at most 128 columns multiplied (fast mode's float16 vectors up to d = 128,
// fused.FUSED_H_MAX_WIDTH): wider rows take cuBLAS + filter, whose products are faster there (docs/benchmarks.md).
// recall_fused_filter_h takes the items in chunks of RH_CHUNK halves; recall_fused_filter_h<CH> in chunks of CH, so
// that rows of CH <= 96 columns multiplied come in one chunk a tile (one barrier and one wait a tile, not a second
// for a last chunk of 16 columns; three stages of up to 96 halves leave room for two blocks an SM).
#define RECALL_FUSED_H_KERNEL(NAME, CH)                                                                              \
    extern "C" __global__ void __launch_bounds__(RH_THREADS, RH_MIN_BLOCKS)                                        \
    NAME(const half_bits* __restrict__ U, int n_users, const half_bits* __restrict__ I, int n_items, int W, int Wp, \
         int tile0, int n_tiles, int tiles_per_cta, const float* __restrict__ thr, u64* __restrict__ cand, int C,   \
         int* __restrict__ cnt) {                                                                                  \
        extern __shared__ float4 recall_fused_h_smem[];                                                           \
        recall_fused_h_body<CH, RH_WN>(U, n_users, I, n_items, W, Wp, tile0, n_tiles, tiles_per_cta, thr, cand, C,  \
                                       cnt, reinterpret_cast<half_bits*>(recall_fused_h_smem));                   \
    }
RECALL_FUSED_H_KERNEL(recall_fused_filter_h, RH_CHUNK)
RECALL_FUSED_H_KERNEL(recall_fused_filter_h16, 16)
RECALL_FUSED_H_KERNEL(recall_fused_filter_h32, 32)
RECALL_FUSED_H_KERNEL(recall_fused_filter_h48, 48)
RECALL_FUSED_H_KERNEL(recall_fused_filter_h80, 80)
RECALL_FUSED_H_KERNEL(recall_fused_filter_h96, 96)

// A segment's scores recomputed for the merge after an overflow (float32 sums of the same exact products, in order:
// within the same bound as the tensor cores' sums, not bit for bit equal to them; the overflowing segment's
// candidates are all recomputed, so no item is held with two scores).
struct RecallDotTileH {
    const half_bits* U; const half_bits* I; int W; int u; int item_start;
    __device__ __forceinline__ float at(int i) const {
        const half_bits* a = U + (long long)u * W;
        const half_bits* b = I + ((long long)item_start + i) * W;
        float acc = 0.0f;
        for (int k = 0; k < W; ++k) acc = fmaf(recall_load(a, k), recall_load(b, k), acc);
        return acc;
    }
};

extern "C" __global__ void recall_merge_fused_h(u64* __restrict__ top, int* __restrict__ n_valid,
                                                float* __restrict__ thr, u64* __restrict__ cand,
                                                int* __restrict__ cnt, int* __restrict__ base,
                                                const half_bits* __restrict__ U, const half_bits* __restrict__ I,
                                                int W, int item_start, int n_tile, int n_items, int K, int K_pad,
                                                int C, int high_water, int final_pass, float* __restrict__ out_vals,
                                                long long* __restrict__ out_rows,
                                                const long long* __restrict__ ex_ptr,
                                                const long long* __restrict__ ex_items, int has_excl) {
    const RecallDotTileH tile = {U, I, W, (int)blockIdx.x, item_start};
    recall_merge_body<RecallDotTileH, false>((int)blockIdx.x, top, n_valid, thr, cand, cnt, base, tile, n_tile,
                                             item_start, n_items, K, K_pad, C, high_water, final_pass, out_vals,
                                             out_rows, has_excl ? ex_ptr : nullptr, ex_items);
}

// The same one warp a user (topk.cu's recall_merge_warp_body), RECALL_MERGE_WARPS users a block of n_users: HELD
// keys a lane in registers (the kernel's suffix).
#define RECALL_MERGE_FUSED_H_WARP(NAME, HELD)                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * RECALL_MERGE_WARPS)                                            \
    NAME(u64* __restrict__ top, int* __restrict__ n_valid, float* __restrict__ thr, u64* __restrict__ cand,          \
         int* __restrict__ cnt, int* __restrict__ base, const half_bits* __restrict__ U,                             \
         const half_bits* __restrict__ I, int W, int item_start, int n_tile, int n_items, int K, int K_pad, int C,   \
         int high_water, int final_pass, float* __restrict__ out_vals, long long* __restrict__ out_rows,             \
         const long long* __restrict__ ex_ptr, const long long* __restrict__ ex_items, int has_excl, int n_users) {  \
        const int u = (int)blockIdx.x * RECALL_MERGE_WARPS + (int)(threadIdx.x >> 5);                                \
        if (u >= n_users) return;                                                                                    \
        const RecallDotTileH tile = {U, I, W, u, item_start};                                                        \
        recall_merge_warp_body<RecallDotTileH, HELD>(u, top, n_valid, thr, cand, cnt, base, tile, n_tile,            \
                                                     item_start, n_items, K, K_pad, C, high_water, final_pass,       \
                                                     out_vals, out_rows, has_excl ? ex_ptr : nullptr, ex_items);     \
    }

RECALL_MERGE_FUSED_H_WARP(recall_merge_fused_hw8, 8)
RECALL_MERGE_FUSED_H_WARP(recall_merge_fused_hw16, 16)
