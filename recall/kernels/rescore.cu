// Per-user candidate re-scoring on the GPU (compiled at run time by NVRTC through CuPy).
//
// One thread block per user. The block scores the user's own candidate rows (CSR: rows[indptr[u] .. indptr[u+1]))
// and keeps the best K, best first, under the tie rule (score descending, lower item row first).
//
// A (score, item row) pair is packed into one 64-bit key that orders exactly like the tie rule, as in topk.cu:
//   high 32 bits: the float score mapped to an unsigned integer that sorts like the float (-0.0 folded into +0.0);
//   low 32 bits:  ~item_row, so that a lower row (the winner of a tie) gives a larger key.
// Real keys are never 0, so 0 marks an empty slot.
//
// Shared memory holds SZ keys (SZ a power of two >= 2 * K_pad). The first chunk of a user's list fills slots
// [0, SZ); every later chunk fills [K_pad, SZ) while slots [0, K_pad) hold the best K_pad keys so far. After each
// chunk a bitonic sort orders the keys (descending) and equal adjacent keys are dropped: that is how duplicate
// candidates are de-duplicated, and it is exact because a duplicate row gets the same score from the same
// arithmetic (the dot product below is computed the same way for every position), so its key is identical.
//
// recall_rescore computes the scores itself (gather fused with the dot product: every candidate vector is read
// once from the item matrix, nothing is written but the K results) when `scores` is null; otherwise it takes the
// score of CSR position p from scores[p] (the path that scores padded blocks with cublasSgemmStridedBatched).

typedef unsigned long long u64;
typedef unsigned int u32;

#define RS_NEG_INF __int_as_float(0xff800000)
#define RS_UNROLL 4

__device__ __forceinline__ u32 rs_f2ord(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float rs_ord2f(u32 o) {
    u32 b = (o & 0x80000000u) ? (o & 0x7fffffffu) : ~o;
    return __uint_as_float(b);
}

__device__ __forceinline__ u64 rs_key(float s, long long row) {
    if (s == 0.0f) s = 0.0f;  // -0.0 and +0.0 tie: only the item row may decide between them
    return ((u64)rs_f2ord(s) << 32) | (u64)(~(u32)row);
}

// Bitonic sort of keys[0, n), descending; n is a power of two. Every thread of the block calls it.
//
// Pair i of a phase is handled by thread i mod blockDim.x and touches keys in [64 * (i / 32), 64 * (i / 32) + 64)
// whenever the compare distance (stride) is <= 32; that block of 64 keys therefore belongs to one warp in every such
// phase (blockDim.x is a multiple of 32). Between two such phases the warp's own barrier orders its reads after its
// writes; the whole block meets only around a phase of stride > 32 (before it and after it) and at the end: 15 block
// barriers instead of 55 for 1,024 keys.
__device__ void rs_sort_desc(u64* keys, int n) {
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < (n >> 1); i += blockDim.x) {
                const int lo = 2 * i - (i & (stride - 1));
                const int hi = lo + stride;
                const bool desc = (lo & size) == 0;
                const u64 a = keys[lo], b = keys[hi];
                if ((a < b) == desc) { keys[lo] = b; keys[hi] = a; }
            }
            const int next = stride > 1 ? stride >> 1 : size;  // the next phase's stride (size: the next size's first)
            if (stride > 32 || next > 32 || (stride == 1 && size == n)) {
                __syncthreads();
            } else {
                __syncwarp();
            }
        }
    }
}

// In sorted keys[0, n): empty every key equal to its predecessor. Returns whether any was (then the caller sorts
// again so that the empties sink to the end). Flags first, writes after, so that runs of 3+ equal keys are safe.
__device__ bool rs_drop_duplicates(u64* keys, unsigned char* dup, int n) {
    int any = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const bool d = i > 0 && keys[i] != 0ull && keys[i] == keys[i - 1];
        dup[i] = d ? 1 : 0;
        any |= d ? 1 : 0;
    }
    if (!__syncthreads_or(any)) return false;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        if (dup[i]) keys[i] = 0ull;
    }
    __syncthreads();
    return true;
}

__device__ __forceinline__ int rs_pow2(int n) {
    return n <= 1 ? 1 : 1 << (32 - __clz(n - 1));
}

// Grid: one block per user (blockIdx.x = user of this launch). Dynamic shared memory:
//   SZ u64 keys | dim_pad floats (the user's vector, 16-byte aligned) | SZ bytes of duplicate flags.
// users: (n_users, dim) float32; items: (n_items, dim) float32; indptr: (n_users + 1,) int64 positions into rows
// (and scores); rows: int64 item rows (a negative row is an empty slot); G: lanes that share one candidate's dot
// product (a power of two <= 32 dividing blockDim.x); out_vals / out_rows: (n_users, K).
extern "C" __global__ void recall_rescore(const float* __restrict__ users, const float* __restrict__ items, int dim,
                                          const float* __restrict__ scores, const long long* __restrict__ indptr,
                                          const long long* __restrict__ rows, int K, int K_pad, int SZ, int G,
                                          float* __restrict__ out_vals, long long* __restrict__ out_rows) {
    extern __shared__ u64 rs_smem[];
    u64* keys = rs_smem;
    float* uvec = reinterpret_cast<float*>(rs_smem + SZ);
    const int dim_pad = (dim + 3) & ~3;
    unsigned char* dup = reinterpret_cast<unsigned char*>(uvec + dim_pad);

    const int u = blockIdx.x;
    const long long lo = indptr[u], hi = indptr[u + 1];
    const bool fused = scores == nullptr;
    if (fused) {
        for (int c = threadIdx.x; c < dim; c += blockDim.x) uvec[c] = users[(long long)u * dim + c];
    }
    __syncthreads();

    const int lane = threadIdx.x & (G - 1);
    const int group = threadIdx.x / G;
    const int n_groups = blockDim.x / G;
    const bool vec = (dim & 3) == 0;
    long long pos = lo;
    int start = 0;  // first slot this chunk fills
    do {
        const long long left = hi - pos;
        const int cnt = left < (long long)(SZ - start) ? (int)left : SZ - start;
        for (int j = cnt + threadIdx.x; j < SZ - start; j += blockDim.x) keys[start + j] = 0ull;
        if (!fused) {
            for (int j = threadIdx.x; j < cnt; j += blockDim.x) {
                const long long r = rows[pos + j];
                keys[start + j] = r >= 0 ? rs_key(scores[pos + j], r) : 0ull;
            }
        } else {
            // The loop bound is the same for every thread, so whole warps reach the shuffles together.
            for (int j0 = 0; j0 < cnt; j0 += n_groups * RS_UNROLL) {
                long long r[RS_UNROLL];
                float acc[RS_UNROLL];
#pragma unroll
                for (int q = 0; q < RS_UNROLL; ++q) {
                    const int j = j0 + q * n_groups + group;
                    r[q] = j < cnt ? rows[pos + j] : -1;
                    acc[q] = 0.0f;
                }
                if (vec) {
                    const int d4 = dim >> 2;
                    const float4* u4 = reinterpret_cast<const float4*>(uvec);
                    for (int c = lane; c < d4; c += G) {
                        const float4 a = u4[c];
                        float4 b[RS_UNROLL];
#pragma unroll
                        for (int q = 0; q < RS_UNROLL; ++q) {
                            // All loads first, then the arithmetic: RS_UNROLL rows in flight per lane.
                            b[q] = r[q] >= 0 ? __ldg(reinterpret_cast<const float4*>(items + r[q] * dim) + c)
                                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                        }
#pragma unroll
                        for (int q = 0; q < RS_UNROLL; ++q) {
                            acc[q] += a.x * b[q].x + a.y * b[q].y + a.z * b[q].z + a.w * b[q].w;
                        }
                    }
                } else {
                    for (int c = lane; c < dim; c += G) {
                        const float a = uvec[c];
                        float b[RS_UNROLL];
#pragma unroll
                        for (int q = 0; q < RS_UNROLL; ++q) b[q] = r[q] >= 0 ? __ldg(items + r[q] * dim + c) : 0.0f;
#pragma unroll
                        for (int q = 0; q < RS_UNROLL; ++q) acc[q] += a * b[q];
                    }
                }
#pragma unroll
                for (int q = 0; q < RS_UNROLL; ++q) {
                    for (int off = G >> 1; off > 0; off >>= 1) acc[q] += __shfl_xor_sync(0xffffffffu, acc[q], off, G);
                    const int j = j0 + q * n_groups + group;
                    if (lane == 0 && j < cnt) keys[start + j] = r[q] >= 0 ? rs_key(acc[q], r[q]) : 0ull;
                }
            }
        }
        __syncthreads();
        if (cnt > 0) {
            // Slots past start + cnt are empty (0, the smallest key): sorting the power-of-two prefix that covers
            // the filled slots orders the whole buffer.
            const int n_sort = rs_pow2(start + cnt);
            rs_sort_desc(keys, n_sort);
            if (rs_drop_duplicates(keys, dup, n_sort)) rs_sort_desc(keys, n_sort);
        }
        pos += cnt;
        start = K_pad;
    } while (pos < hi);

    for (int r = threadIdx.x; r < K; r += blockDim.x) {
        const u64 key = keys[r];
        const long long o = (long long)u * K + r;
        if (key == 0ull) {
            out_vals[o] = RS_NEG_INF;
            out_rows[o] = -1;
        } else {
            out_vals[o] = rs_ord2f((u32)(key >> 32));
            out_rows[o] = (long long)(~(u32)(key & 0xffffffffull));
        }
    }
}
