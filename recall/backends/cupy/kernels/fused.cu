// Exact mode's fused scoring and filtering: an FP32 GEMM whose scores never leave the registers. Compiled after
// topk.cu, in the same module (it appends to the candidate buffers that recall_merge_fused folds in).
//
// One block of 256 threads owns 128 users and walks `tiles_per_cta` tiles of 128 items. The users' vectors stay in
// shared memory; the items come in chunks of 32 dimensions through a double buffer filled with cp.async, so that the
// next chunk loads while this one is multiplied. Each thread accumulates an 8 x 8 patch of scores (users ty*4+i and
// 64+ty*4+i, items tx*4+j and 64+tx*4+j) with one fmaf per dimension in order, from 0, the sequence that
// RecallDotTile repeats when a merge must recompute a segment. When a tile is done, every score above its user's
// threshold is appended to the user's candidates (one atomic each: after a block is seeded, few pass; a user's 8
// scores are tested through their maximum first, and where it passes its survivors are taken one by one from a bit
// mask), its key stored once the thread has gone on to the next survivor or to its end, not while the atomic's slot
// is on its way.
//
// uT is (Dp, ldu) and iT is (Dp, ldi): users and items transposed, zero-padded to Dp (a multiple of 32) dimensions
// and to whole tiles of 128 rows (the scores of padding rows are computed, and never kept). Only the first Dk of the
// Dp dimensions are multiplied (the vectors' width rounded up to 8): the last chunk takes its 8, 16, 24 or 32 rows,
// so that l2's bias column (64 + 4 dimensions) costs 72 dimensions' FMAs, not 96. RecallDotTile recomputes the same
// Dk dimensions in the same order.

// A survivor appended without waiting for its slot: the pending one's key is stored now (its slot came back long
// ago, a tile's products ago as a rule), this one's slot is asked for with a global atomic and kept with its key
// until the thread's next survivor or its end (`flush`), so that the atomic's round trip overlaps the products.
struct RecallPending {
    u64* dst;
    int pos;
    u64 key;
    __device__ __forceinline__ void push(u64* __restrict__ cand, int* __restrict__ cnt, int C, int user, u64 k) {
        if (dst != nullptr && pos < C) dst[pos] = key;
        dst = cand + (long long)user * C;
        pos = atomicAdd(&cnt[user], 1);
        key = k;
    }
    __device__ __forceinline__ void flush(int C) {
        if (dst != nullptr && pos < C) dst[pos] = key;
    }
    // Measurement only (fused_h.cu's RH_GROUP_RESERVE): n slots of the user's buffer taken at once, then each key put
    // into its own.
    __device__ __forceinline__ int reserve(int* __restrict__ cnt, int user, int n) { return atomicAdd(&cnt[user], n); }
    __device__ __forceinline__ void put(u64* __restrict__ cand, int* __restrict__, int C, int user, int slot, u64 k) {
        if (slot < C) cand[(long long)user * C + slot] = k;
    }
};

#define RF_TILE 128
#define RF_CHUNK 32
#define RF_THREADS 256

__device__ __forceinline__ unsigned recall_smem_addr(const void* p) {
    unsigned a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void recall_cp16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(recall_smem_addr(smem)), "l"(gmem));
}

__device__ __forceinline__ void recall_cp_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void recall_cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Dynamic shared memory: Dp * 128 floats of users, then 2 * 32 * 128 floats of item chunks.
extern "C" __global__ void __launch_bounds__(RF_THREADS, 2)
recall_fused_filter(const float* __restrict__ uT, int ldu, const float* __restrict__ iT, long long ldi, int Dp,
                    int Dk, int tile0, int n_tiles, int tiles_per_cta, int n_items, int n_users,
                    const float* __restrict__ thr, u64* __restrict__ cand, int C, int* __restrict__ cnt) {
    extern __shared__ float4 recall_fused_smem[];
    float* As = reinterpret_cast<float*>(recall_fused_smem);
    float* Bs = As + Dp * RF_TILE;
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int u0 = blockIdx.y * RF_TILE;
    const int t_first = tile0 + blockIdx.x * tiles_per_cta;
    const int t_count = min(tiles_per_cta, tile0 + n_tiles - t_first);
    if (t_count <= 0) return;
    const int chunks = Dp / RF_CHUNK;
    const int steps = t_count * chunks;

    for (int p = tid; p < Dp * 32; p += RF_THREADS) {
        const int r = p >> 5, col = (p & 31) * 4;
        recall_cp16(As + r * RF_TILE + col, uT + (long long)r * ldu + u0 + col);
    }
    // Step s multiplies chunk s % chunks of item tile t_first + s / chunks.
    auto load_items = [&](int s) {
        float* dst = Bs + (s & 1) * (RF_CHUNK * RF_TILE);
        const long long col0 = (long long)(t_first + s / chunks) * RF_TILE;
        const int k0 = (s % chunks) * RF_CHUNK;
#pragma unroll
        for (int q = 0; q < (RF_CHUNK * RF_TILE / 4) / RF_THREADS; ++q) {
            const int p = tid + q * RF_THREADS;
            const int r = p >> 5, col = (p & 31) * 4;
            recall_cp16(dst + r * RF_TILE + col, iT + (long long)(k0 + r) * ldi + col0 + col);
        }
    };
    load_items(0);
    recall_cp_commit();

    RecallPending pending = {nullptr, 0, 0ull};
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

    for (int s = 0; s < steps; ++s) {
        if (s + 1 < steps) {
            load_items(s + 1);
            recall_cp_commit();
            recall_cp_wait<1>();
        } else {
            recall_cp_wait<0>();
        }
        __syncthreads();
        const float* Ak = As + (s % chunks) * (RF_CHUNK * RF_TILE);
        const float* Bk = Bs + (s & 1) * (RF_CHUNK * RF_TILE);
        // Dimension k of the chunk: 64 FMAs into the thread's 8 x 8 scores, added to `base` (the sums so far, or 0).
#define RF_FMA_ROW_TO(k, base)                                                                                       \
    {                                                                                                                \
        const float4 a0 = *reinterpret_cast<const float4*>(Ak + (k) * RF_TILE + ty * 4);                             \
        const float4 a1 = *reinterpret_cast<const float4*>(Ak + (k) * RF_TILE + 64 + ty * 4);                        \
        const float4 b0 = *reinterpret_cast<const float4*>(Bk + (k) * RF_TILE + tx * 4);                             \
        const float4 b1 = *reinterpret_cast<const float4*>(Bk + (k) * RF_TILE + 64 + tx * 4);                        \
        const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};                                         \
        const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};                                         \
        _Pragma("unroll") for (int i = 0; i < 8; ++i)                                                                \
            _Pragma("unroll") for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], base);                        \
    }
#define RF_FMA_ROW(k) RF_FMA_ROW_TO(k, acc[i][j])
        // A tile's first dimension starts its sums: fmaf(a, b, 0), the first step of RecallDotTile's sequence,
        // without clearing 64 registers after every tile.
        if (s % chunks == 0) RF_FMA_ROW_TO(0, 0.0f) else RF_FMA_ROW(0)
        const int rows = min(RF_CHUNK, Dk - (s % chunks) * RF_CHUNK);  // the last chunk: 8, 16, 24 or 32 of them
        if (rows == RF_CHUNK) {
#pragma unroll
            for (int k = 1; k < RF_CHUNK; ++k) RF_FMA_ROW(k)
        } else {
#pragma unroll
            for (int k = 1; k < 8; ++k) RF_FMA_ROW(k)
            for (int k8 = 8; k8 < rows; k8 += 8) {
#pragma unroll
                for (int k = 0; k < 8; ++k) RF_FMA_ROW(k8 + k)
            }
        }
#undef RF_FMA_ROW
#undef RF_FMA_ROW_TO
        __syncthreads();  // the buffer just read is refilled at the next step
        if (s % chunks == chunks - 1) {
            const int j0 = (t_first + s / chunks) * RF_TILE;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int user = u0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + i - 4);
                const float t = user < n_users ? thr[user] : __int_as_float(0x7f800000);  // +inf: none passes
                // As in fused_h.cu: the maximum of the user's 8 scores is tested first, single scores only where it
                // passes (NaN sums pass neither test).
                const float m = fmaxf(fmaxf(fmaxf(acc[i][0], acc[i][1]), fmaxf(acc[i][2], acc[i][3])),
                                      fmaxf(fmaxf(acc[i][4], acc[i][5]), fmaxf(acc[i][6], acc[i][7])));
                if (!(m > t)) continue;
#if defined(RF_EACH_SCORE)  // measurement only: a branch per score of a passing user (shipped until 2026-12-03)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int row = j0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + j - 4);
                    if (acc[i][j] > t && row < n_items) pending.push(cand, cnt, C, user, recall_key(acc[i][j], row));
                }
#else
                // As in fused_h.cu: the survivors as bits, then one round a survivor.
                unsigned bits = 0u;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int row = j0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + j - 4);
                    if (acc[i][j] > t && row < n_items) bits |= 1u << j;
                }
#pragma unroll 1
                while (bits) {
                    const int j = __ffs(bits) - 1;
                    bits &= bits - 1u;
                    const int row = j0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + j - 4);
                    float v = acc[i][0];  // acc[i][j], selected in registers
#pragma unroll
                    for (int r = 1; r < 8; ++r)
                        if (j == r) v = acc[i][r];
#if defined(RF_INLINE_APPEND)  // measurement only: the key stored as soon as its slot comes back
                    const int pos = atomicAdd(&cnt[user], 1);
                    if (pos < C) cand[(long long)user * C + pos] = recall_key(v, row);
#else
                    pending.push(cand, cnt, C, user, recall_key(v, row));
#endif
                }
#endif
            }
        }
    }
    pending.flush(C);
}
