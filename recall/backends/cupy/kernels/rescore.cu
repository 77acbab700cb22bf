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
// Shared memory holds SZ keys: where every list of the launch fits in one chunk, the longest list's length rounded up
// to 32 (rescore.py's launch_config and SZ_STEP: at k = 2,048, lists of 2,113 take 2,144 keys, not 4,096, and with the
// selected keys in the stage five blocks an SM on a Hopper instead of three); else a power of two >= 2 * K_pad. The
// first chunk of a user's list fills slots [0, SZ); every later chunk fills [K_pad, SZ) while slots [0, K_pad) hold the
// best keys so far (distinct, best first, zero-padded). After each chunk a radix select finds the K-th largest key
// counted with multiplicity, the K keys at or above it are compacted into a K_pad buffer and only those are sorted (a
// full bitonic sort of 1,024 keys is 55 phases and ~12,000 shared-memory wavefronts per user, during which the block
// issues no loads; the select reads the keys about 4 times and sorts K_pad = 128). If the K compacted keys are distinct
// they are the answer (any distinct key above the K-th is among them); a duplicate among them sends the chunk down the
// exact long way: a bitonic sort of the buffer, equal adjacent keys dropped, sorted again (rare: only duplicate
// candidate rows make equal keys). De-duplication by key is exact because a duplicate row gets the same score from the
// same arithmetic (the dot product below is computed the same way for every position within one kernel), so its key is
// identical.
//
// recall_rescore_t computes the scores itself (gather fused with the dot product: every candidate vector is read
// once from the item matrix, nothing is written but the K results) when `scores` is null; otherwise it takes the
// score of CSR position p from scores[p] (precomputed scores of a padded block: the backend's select).
//
// Each chunk's item rows are first copied into shared memory as int32 (one coalesced read, one memory latency), so
// that the gather loop does not wait for an index load before each round of vector loads. Template parameters:
//   U, C   each lane of a G-lane group keeps U rows x C float4 (or float) chunks of loads in flight before any
//          arithmetic: U * C is the memory-level parallelism per thread (U = C = 2 measured best on the H200,
//          docs/benchmarks.md; with --maxrregcount=40, six blocks of 128 threads share an SM).
//   VEC    rows are read as float4 (dim % 4 == 0).
//   ORD    each score is the fused exact kernel's float32 sum (fused.cu, RecallDotTile): fmaf(u_0, v_0, 0), then
//          fmaf(u_d, v_d, s) for each further dimension in order. One lane a candidate, so that no partial sums are
//          added in another order; exact mode's certified route re-scores its candidates this way, and its scores
//          are then exact mode's, bit for bit. The rows are not read by the lane that sums them: a warp reads its
//          32 candidates' rows a piece of RS_ORD_PIECE columns at a time into shared memory, and each lane then sums
//          its own row from there. With VEC (rs_gather_ordered) each load instruction reads four whole 128-byte
//          pieces of rows; without (dim % 4 != 0, e.g. ip at d = 50, where l2 pads its rows to 4 columns:
//          rs_gather_ordered_scalar) one row's piece, a float a lane (a short last piece: several rows an
//          instruction). One lane reading a whole row would make
//          each load instruction touch 32 rows' lines, 16 bytes (or 4) of each (measured on the H200: exact mode's
//          re-scoring 8-12 ms slower than fast mode's at k >= 1,000, with float4 rows).

typedef unsigned long long u64;
typedef unsigned int u32;

#define RS_NEG_INF __int_as_float(0xff800000)
#define RS_FULL 0xffffffffu

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

__device__ __forceinline__ u64 rs_shr(u64 x, int s) { return s >= 64 ? 0ull : x >> s; }

// Bitonic sort of keys[0, n), descending, in shared memory alone; n is a power of two. Every thread of the block
// calls it (rs_sort_desc below takes it for n < RS_REG_BLOCK_PAIR).
//
// Pair i of a phase is handled by thread i mod blockDim.x and touches keys in [64 * (i / 32), 64 * (i / 32) + 64)
// whenever the compare distance (stride) is <= 32; that block of 64 keys therefore belongs to one warp in every such
// phase (blockDim.x is a multiple of 32). Between two such phases the warp's own barrier orders its reads after its
// writes; the whole block meets only around a phase of stride > 32 (before it and after it) and at the end: 15 block
// barriers instead of 55 for 1,024 keys.
// One phase of that network (compare distance `stride`, bitonic size `size`) over keys[0, n), in shared memory: pair i
// by thread i mod blockDim.x.
__device__ __forceinline__ void rs_smem_phase(u64* keys, int n, int size, int stride) {
    for (int i = threadIdx.x; i < (n >> 1); i += blockDim.x) {
        const int lo = 2 * i - (i & (stride - 1));
        const int hi = lo + stride;
        const bool desc = (lo & size) == 0;
        const u64 a = keys[lo], b = keys[hi];
        if ((a < b) == desc) { keys[lo] = b; keys[hi] = a; }
    }
}

__device__ void rs_sort_desc_smem(u64* keys, int n) {
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            rs_smem_phase(keys, n, size, stride);
            const int next = stride > 1 ? stride >> 1 : size;  // the next phase's stride (size: the next size's first)
            if (stride > 32 || next > 32 || (stride == 1 && size == n)) {
                __syncthreads();
            } else {
                __syncwarp();
            }
        }
    }
}

// The same network from 256 keys on, with the phases of stride < 128 in registers. A warp holds a block of 128 keys,
// four a lane (element base + 32 i + lane in a[i], loaded and stored conflict-free), and runs every phase of stride
// < 128 on them: strides 32 and 64 exchange a lane's own registers, strides 1 to 16 go through shuffles. Only the
// phases of stride >= 128 (10 of 66 for 2,048 keys) read and write shared memory, each followed by a block barrier.
// Each pair compares and keeps what the shared-memory network keeps: the same sort. Measured on the H200
// (docs/benchmarks.md, scripts/lab/rescore_sort.py): the kernel 2-13% faster at k from 500 to 3,000 (k = 2,048, d
// = 32: 0.0397 -> 0.0352 s for 200k users), where leaving the K best unsorted would save 17-34%.
#define RS_REG_BLOCK 128
#define RS_REG_BLOCK_PAIR 256

// One phase (compare distance `stride`, bitonic size `size`) on a warp's block whose first element is `base`.
__device__ __forceinline__ void rs_reg_phase(u64 (&a)[4], int lane, int base, int stride, int size) {
    if (stride >= 32) {
        const int d = stride >> 5;  // 1 or 2: the partner is a[i ^ d]
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int p = i ^ d;
            if (p > i) {
                const bool desc = ((base + 32 * i + lane) & size) == 0;
                if ((a[i] < a[p]) == desc) {
                    const u64 t = a[i];
                    a[i] = a[p];
                    a[p] = t;
                }
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int e = base + 32 * i + lane;
            const u64 b = __shfl_xor_sync(RS_FULL, a[i], stride);
            const bool keep_max = ((e & stride) == 0) == ((e & size) == 0);
            a[i] = keep_max ? (a[i] > b ? a[i] : b) : (a[i] < b ? a[i] : b);
        }
    }
}

__device__ void rs_sort_desc(u64* keys, int n) {
#if !defined(RS_LAB_SMEM_SORT)  // measurement only (scripts/lab/rescore_sort.py): the shared-memory network alone
    if (n >= RS_REG_BLOCK_PAIR) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
        // Sizes 2 to 128: each block of 128 whole in a warp's registers.
        for (int base = warp * RS_REG_BLOCK; base < n; base += warps * RS_REG_BLOCK) {
            u64 a[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = keys[base + 32 * i + lane];
#pragma unroll
            for (int size = 2; size <= RS_REG_BLOCK; size <<= 1)
#pragma unroll
                for (int stride = size >> 1; stride > 0; stride >>= 1) rs_reg_phase(a, lane, base, stride, size);
#pragma unroll
            for (int i = 0; i < 4; ++i) keys[base + 32 * i + lane] = a[i];
        }
        __syncthreads();
        for (int size = RS_REG_BLOCK_PAIR; size <= n; size <<= 1) {
            for (int stride = size >> 1; stride >= RS_REG_BLOCK; stride >>= 1) {
                rs_smem_phase(keys, n, size, stride);
                __syncthreads();
            }
            for (int base = warp * RS_REG_BLOCK; base < n; base += warps * RS_REG_BLOCK) {
                u64 a[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) a[i] = keys[base + 32 * i + lane];
#pragma unroll
                for (int stride = RS_REG_BLOCK >> 1; stride > 0; stride >>= 1)
                    rs_reg_phase(a, lane, base, stride, size);
#pragma unroll
                for (int i = 0; i < 4; ++i) keys[base + 32 * i + lane] = a[i];
            }
            __syncthreads();
        }
        return;
    }
#endif
    rs_sort_desc_smem(keys, n);
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

// Bitonic sort of keys[0, n), descending, for any n, in shared memory: the network whose every comparator puts the
// larger key first (the first phase of each size compares mirror places, lo ^ (size - 1)), over pow2(n) places of
// which those past n hold zeros that are never stored: a comparator whose second place is past n would keep a key
// >= 0 where it is, so it is skipped, and nothing is read or written past n. Every thread calls it (the long way
// only: a barrier every phase).
__device__ void rs_sort_desc_any(u64* keys, int n) {
    const int np = rs_pow2(n);
    for (int size = 2; size <= np; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < (np >> 1); i += blockDim.x) {
                const int lo = 2 * i - (i & (stride - 1));
                const int hi = stride == (size >> 1) ? lo ^ (size - 1) : lo + stride;
                if (hi < n) {
                    const u64 a = keys[lo], b = keys[hi];
                    if (a < b) { keys[lo] = b; keys[hi] = a; }
                }
            }
            __syncthreads();
        }
    }
}

// The long way: sort keys[0, n), drop duplicates, sort again. Every thread calls it.
__device__ void rs_sort_dedup(u64* keys, unsigned char* dup, int n) {
    if ((n & (n - 1)) == 0) {
        rs_sort_desc(keys, n);
        if (rs_drop_duplicates(keys, dup, n)) rs_sort_desc(keys, n);
        return;
    }
    rs_sort_desc_any(keys, n);
    if (rs_drop_duplicates(keys, dup, n)) rs_sort_desc_any(keys, n);
}

// Control words of the select, in shared memory: ctrl[0] the largest key, ctrl[1] the smallest non-empty key, then
// 32-bit words c32 = ctrl + 2: [0] non-empty keys, [1] chosen digit, [2] keys above its bin, [3] keys in its bin,
// [4] and [5] the compaction's counters. rs_select_init runs (one thread) before the barrier that ends each gather.
#define RS_CTRL_WORDS 6

__device__ __forceinline__ void rs_select_init(u64* ctrl) {
    if (threadIdx.x == 0) {
        ctrl[0] = 0ull;
        ctrl[1] = ~0ull;
        u32* c32 = reinterpret_cast<u32*>(ctrl + 2);
        c32[0] = 0u;
        c32[4] = 0u;
        c32[5] = 0u;
    }
}

__device__ __forceinline__ u64 rs_warp_max(u64 v) {
    for (int off = 16; off > 0; off >>= 1) {
        const u64 o = __shfl_xor_sync(RS_FULL, v, off);
        v = o > v ? o : v;
    }
    return v;
}

__device__ __forceinline__ u64 rs_warp_min(u64 v) {
    for (int off = 16; off > 0; off >>= 1) {
        const u64 o = __shfl_xor_sync(RS_FULL, v, off);
        v = o < v ? o : v;
    }
    return v;
}

// The best K distinct keys of keys[0, n) (zeros past n up to pow2(n)), best first, zero-padded to K_pad: returns
// `sel` or `keys` (the long way), whichever holds them in [0, K_pad). Every thread calls it; hist (256 words) is
// zero on entry and on return; rs_select_init ran before the last barrier.
__device__ u64* rs_select(u64* keys, int n, int K, int K_pad, u64* ctrl, u64* sel, u32* hist, unsigned char* dup) {
    u32* c32 = reinterpret_cast<u32*>(ctrl + 2);
    const int lane = threadIdx.x & 31;
    const u32 lanes_below = (1u << lane) - 1u;

    // 1. How many non-empty keys, and their range (whose highest differing bit starts the radix digits).
    {
        u32 cnt = 0;
        u64 mx = 0ull, mn = ~0ull;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const u64 key = keys[i];
            if (key != 0ull) {
                ++cnt;
                mx = key > mx ? key : mx;
                mn = key < mn ? key : mn;
            }
        }
        for (int off = 16; off > 0; off >>= 1) cnt += __shfl_xor_sync(RS_FULL, cnt, off);
        mx = rs_warp_max(mx);
        mn = rs_warp_min(mn);
        if (lane == 0 && cnt > 0) {
            atomicAdd(&c32[0], cnt);
            atomicMax(&ctrl[0], mx);
            atomicMin(&ctrl[1], mn);
        }
    }
    __syncthreads();
    const u32 n_valid = c32[0];
    const u64 key_max = ctrl[0], key_min = ctrl[1];

    if (n_valid <= (u32)K) {
        // Every key is in: compact them, sort, drop duplicates (all candidates are here, so this is exact).
        for (int base = threadIdx.x - lane; base < n; base += blockDim.x) {  // warp-uniform trip count
            const int i = base + lane;
            const u64 key = i < n ? keys[i] : 0ull;
            const u32 m = __ballot_sync(RS_FULL, key != 0ull);
            u32 at = 0;
            if (lane == 0 && m) at = atomicAdd(&c32[4], (u32)__popc(m));
            at = __shfl_sync(RS_FULL, at, 0);
            if (key != 0ull) sel[at + __popc(m & lanes_below)] = key;
        }
        for (int i = (int)n_valid + threadIdx.x; i < K_pad; i += blockDim.x) sel[i] = 0ull;
        __syncthreads();
        rs_sort_dedup(sel, dup, K_pad);
        return sel;
    }
    if (key_max == key_min) {
        // More than K copies of one key: that key, once.
        for (int i = threadIdx.x; i < K_pad; i += blockDim.x) sel[i] = i == 0 ? key_max : 0ull;
        __syncthreads();
        return sel;
    }

    // 2. Radix select, most significant digit first, over the bits below the common prefix of all keys: the region
    // is the keys with rs_shr(key, s) == P; `need` of the K are still to be found in it.
    int s = 64 - __clzll((long long)(key_max ^ key_min));
    u64 P = rs_shr(key_max, s);
    u32 need = (u32)K;
    for (;;) {
        const int w = s < 8 ? s : 8;
        const int s2 = s - w;
        const u32 mask = (1u << w) - 1u;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const u64 key = keys[i];
            if (key != 0ull && rs_shr(key, s) == P) atomicAdd(&hist[(u32)(key >> s2) & mask], 1u);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // Warp 0: lane l owns bins [8l, 8l + 8); a suffix sum over lanes finds the bin holding the need-th key
            // from the top. The bins are zeroed for the next pass (and the next chunk) on the way.
            u32 h[8];
            u32 tot = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                h[j] = hist[lane * 8 + j];
                hist[lane * 8 + j] = 0u;
                tot += h[j];
            }
            u32 suf = tot;
            for (int off = 1; off < 32; off <<= 1) {
                const u32 v = __shfl_down_sync(RS_FULL, suf, off);
                if (lane + off < 32) suf += v;
            }
            u32 above = suf - tot;
#pragma unroll
            for (int j = 7; j >= 0; --j) {
                if (above < need && need <= above + h[j]) {
                    c32[1] = (u32)(lane * 8 + j);
                    c32[2] = above;
                    c32[3] = h[j];
                }
                above += h[j];
            }
        }
        __syncthreads();
        const u32 digit = c32[1], above = c32[2], in_bin = c32[3];
        P = (P << w) | digit;
        s = s2;
        need -= above;
        if (in_bin == need || s == 0) break;  // the whole bin is in, or the bin is one key value (its copies)
    }

    // 3. Compact: every key above the bin, then `need` keys of the bin (all of it unless they are copies of one key).
    const u32 n_above = (u32)K - need;
    for (int base = threadIdx.x - lane; base < n; base += blockDim.x) {  // warp-uniform trip count
        const int i = base + lane;
        const u64 key = i < n ? keys[i] : 0ull;
        const u64 v = rs_shr(key, s);
        const bool hi = key != 0ull && v > P, eq = key != 0ull && v == P;
        const u32 mh = __ballot_sync(RS_FULL, hi), me = __ballot_sync(RS_FULL, eq);
        u32 at_h = 0, at_e = 0;
        if (lane == 0) {
            if (mh) at_h = atomicAdd(&c32[4], (u32)__popc(mh));
            if (me) at_e = atomicAdd(&c32[5], (u32)__popc(me));
        }
        at_h = __shfl_sync(RS_FULL, at_h, 0);
        at_e = __shfl_sync(RS_FULL, at_e, 0);
        if (hi) sel[at_h + __popc(mh & lanes_below)] = key;
        if (eq) {
            const u32 slot = at_e + __popc(me & lanes_below);
            if (slot < need) sel[n_above + slot] = key;
        }
    }
    for (int i = K + threadIdx.x; i < K_pad; i += blockDim.x) sel[i] = 0ull;
    __syncthreads();
#if defined(RS_LAB_NO_SORT)  // measurement only (scripts/lab/rescore_sort.py): the K best unsorted, a wrong answer
    return sel;
#endif
    rs_sort_desc(sel, K_pad);

    // 4. Distinct K best-with-multiplicity keys are the answer; a duplicate among them: the long way, exactly.
    int any = 0;
    for (int i = threadIdx.x + 1; i < K; i += blockDim.x) any |= (sel[i] != 0ull && sel[i] == sel[i - 1]) ? 1 : 0;
    if (!__syncthreads_or(any)) return sel;
    rs_sort_dedup(keys, dup, n);
    return keys;
}

// Scores of cnt candidates (item rows from rows32, staged), written as keys to out_keys[0, cnt), in no particular
// order of summation (ordered sums take rs_gather_ordered or rs_gather_ordered_scalar).
// G lanes share one candidate; each lane loads U rows x C chunks before any arithmetic.
template <int U, int C, int VEC>
__device__ __forceinline__ void rs_gather(const float* __restrict__ items, int dim, const float* uvec,
                                          const int* rows32, int cnt, int G, u64* out_keys) {
    const int lane = threadIdx.x & (G - 1);
    const int group = threadIdx.x / G;
    const int n_groups = blockDim.x / G;
    const int n_chunks = VEC ? dim >> 2 : dim;
    // The loop bound is the same for every thread, so whole warps reach the shuffles together.
    for (int j0 = 0; j0 < cnt; j0 += n_groups * U) {
        int r[U];  // item rows fit in 32 bits (the launcher checks n_items < 2**31); -1: nothing to load
        float acc[U];
#pragma unroll
        for (int q = 0; q < U; ++q) {
            const int j = j0 + q * n_groups + group;
            r[q] = j < cnt ? rows32[j] : -1;
            acc[q] = 0.0f;
        }
        for (int c0 = 0; c0 < n_chunks; c0 += C * G) {
            if (VEC) {
                const float4* u4 = reinterpret_cast<const float4*>(uvec);
                float4 b[U][C];
#pragma unroll
                for (int t = 0; t < C; ++t) {
                    const int c = c0 + t * G + lane;
#pragma unroll
                    for (int q = 0; q < U; ++q) {
                        // All loads first, then the arithmetic: U * C chunks in flight per lane.
                        b[q][t] = (r[q] >= 0 && c < n_chunks)
                                      ? __ldg(reinterpret_cast<const float4*>(items + (long long)r[q] * dim) + c)
                                      : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    }
                }
#pragma unroll
                for (int t = 0; t < C; ++t) {
                    const int c = c0 + t * G + lane;
                    const float4 a = c < n_chunks ? u4[c] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                    for (int q = 0; q < U; ++q)
                        acc[q] += a.x * b[q][t].x + a.y * b[q][t].y + a.z * b[q][t].z + a.w * b[q][t].w;
                }
            } else {
                float b[U][C];
#pragma unroll
                for (int t = 0; t < C; ++t) {
                    const int c = c0 + t * G + lane;
#pragma unroll
                    for (int q = 0; q < U; ++q) b[q][t] = (r[q] >= 0 && c < n_chunks) ? __ldg(items + (long long)r[q] * dim + c) : 0.0f;
                }
#pragma unroll
                for (int t = 0; t < C; ++t) {
                    const int c = c0 + t * G + lane;
                    const float a = c < n_chunks ? uvec[c] : 0.0f;
#pragma unroll
                    for (int q = 0; q < U; ++q) acc[q] += a * b[q][t];
                }
            }
        }
#pragma unroll
        for (int q = 0; q < U; ++q) {
            for (int off = G >> 1; off > 0; off >>= 1) acc[q] += __shfl_xor_sync(RS_FULL, acc[q], off, G);
            const int j = j0 + q * n_groups + group;
            if (lane == 0 && j < cnt) out_keys[j] = r[q] >= 0 ? rs_key(acc[q], r[q]) : 0ull;
        }
    }
}

// ORD with VEC (above): the candidates of each warp are its 32 lanes' (j = j0 + lane), a piece of RS_ORD_PIECE
// columns of their rows at a time staged in the warp's RS_ORD_STAGE floats of `stage` (a row every RS_ORD_STRIDE
// floats: an 8-lane phase of a 16-byte shared access then meets 32 distinct banks, reading or writing). A piece of w4
// float4 columns takes wp load instructions a warp (wp the power of two at least w4, at most 8), each reading 32 / wp
// rows' pieces, wp lanes a row: a whole piece of 32 columns 8 instructions of four rows, l2's last piece of 4 columns
// (d = 32, 64, 128 and its norm column: rows of 36, 68, 132) one instruction of 32 rows, where it took the 8 of a
// whole piece with one lane in eight reading; four loads are in flight per lane before the first store (the
// memory-level parallelism of rs_gather's U = C = 2). The sums are the same either way (each lane adds its own row in
// order). RS_ORD_WHOLE_PIECES (measurement only, scripts/lab/kernel_profile.py's `rescore-pieces`): every piece 8
// instructions, as before 2026-12-07.
#define RS_ORD_PIECE 32
#define RS_ORD_STRIDE (RS_ORD_PIECE + 4)
#define RS_ORD_STAGE (32 * RS_ORD_STRIDE)
__device__ __forceinline__ void rs_gather_ordered(const float* __restrict__ items, int dim, const float* uvec,
                                                  const int* rows32, int cnt, float* st, u64* out_keys, int j_first,
                                                  int j_step) {
    const int lane = threadIdx.x & 31;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // j0 is the same for every lane of a warp: whole warps reach the shuffles and __syncwarp together.
    for (int j0 = j_first; j0 < cnt; j0 += j_step) {
        const int j = j0 + lane;
        const int r = j < cnt ? rows32[j] : -1;  // -1: nothing to load
        float acc = 0.0f;
        for (int p0 = 0; p0 < dim; p0 += RS_ORD_PIECE) {
            const int w4 = min(RS_ORD_PIECE, dim - p0) >> 2;  // float4 columns of this piece
#if defined(RS_ORD_WHOLE_PIECES)
            const int lg = 3;
#else
            const int lg = w4 > 4 ? 3 : w4 > 2 ? 2 : w4 > 1 ? 1 : 0;  // wp = 1 << lg
#endif
            const int wp = 1 << lg;
            const int c = lane & (wp - 1), sub = lane >> lg;  // this lane's float4 column, its row in the load
#pragma unroll 1
            for (int h = 0; h < wp; h += 4) {  // not unrolled: four loads in flight, not eight (registers)
                float4 b[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    // (wp is the warp's: every lane shuffles, or none)
                    const int rr = h + i < wp ? __shfl_sync(RS_FULL, r, (((h + i) << (5 - lg)) + sub) & 31) : -1;
                    b[i] = rr >= 0 && c < w4
                               ? __ldg(reinterpret_cast<const float4*>(items + (long long)rr * dim + p0) + c)
                               : zero;
                }
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    if (h + i < wp)
                        *reinterpret_cast<float4*>(st + (((h + i) << (5 - lg)) + sub) * RS_ORD_STRIDE + 4 * c) = b[i];
            }
            __syncwarp();
            const float4* u4 = reinterpret_cast<const float4*>(uvec + p0);
            const float4* v4 = reinterpret_cast<const float4*>(st + lane * RS_ORD_STRIDE);
            for (int q = 0; q < w4; ++q) {
                const float4 a = u4[q], v = v4[q];
                acc = fmaf(a.x, v.x, acc);
                acc = fmaf(a.y, v.y, acc);
                acc = fmaf(a.z, v.z, acc);
                acc = fmaf(a.w, v.w, acc);
            }
            __syncwarp();  // the next piece overwrites the stage
        }
        if (j < cnt) out_keys[j] = r >= 0 ? rs_key(acc, r) : 0ull;
    }
}

// ORD without VEC (rows of a dim that is not a multiple of 4: ip or cosine at d = 50, say): rs_gather_ordered's staging
// with float loads. A piece of w <= RS_ORD_PIECE columns takes wp load instructions a warp (wp the power of two at
// least w), each reading 32 / wp rows' pieces, wp consecutive floats of each (a full piece: one row's 128 bytes; a
// last piece of one column: one float of each of the 32 rows), RS_ORD_FLOATS in flight a lane before the first
// store. A row sits every RS_ORD_SSTRIDE floats of the stage, so that the lanes summing their rows read 32 distinct
// banks.
#define RS_ORD_SSTRIDE (RS_ORD_PIECE + 1)
#define RS_ORD_FLOATS 4  // loads in flight a lane (nvcc 13.0, sm_90, 48 registers: 8 spill, 4 do not)
__device__ __forceinline__ void rs_gather_ordered_scalar(const float* __restrict__ items, int dim, const float* uvec,
                                                         const int* rows32, int cnt, float* st, u64* out_keys,
                                                         int j_first, int j_step) {
    const int lane = threadIdx.x & 31;  // st: 32 rows x RS_ORD_SSTRIDE floats fit in RS_ORD_STAGE
    // j0 is the same for every lane of a warp: whole warps reach the shuffles and __syncwarp together.
    for (int j0 = j_first; j0 < cnt; j0 += j_step) {
        const int j = j0 + lane;
        const int r = j < cnt ? rows32[j] : -1;  // -1: nothing to load
        float acc = 0.0f;
        for (int p0 = 0; p0 < dim; p0 += RS_ORD_PIECE) {
            const int w = min(RS_ORD_PIECE, dim - p0);  // columns of this piece
            const int wp = w > 16 ? 32 : w > 8 ? 16 : w > 4 ? 8 : w > 2 ? 4 : w > 1 ? 2 : 1;
            const int per = 32 / wp;  // rows a load instruction reads
            const int col = lane & (wp - 1), sub = lane / wp;  // this lane's column, and its row in the instruction
#pragma unroll 1
            for (int h = 0; h < wp; h += RS_ORD_FLOATS) {
                float b[RS_ORD_FLOATS];
#pragma unroll
                for (int i = 0; i < RS_ORD_FLOATS; ++i) {
                    const int slot = ((h + i) * per + sub) & 31;  // the candidate (lane) whose row this reads
                    const int rr = __shfl_sync(RS_FULL, r, slot);
                    b[i] = h + i < wp && rr >= 0 && col < w ? __ldg(items + (long long)rr * dim + p0 + col) : 0.0f;
                }
#pragma unroll
                for (int i = 0; i < RS_ORD_FLOATS; ++i)
                    if (h + i < wp) st[((h + i) * per + sub) * RS_ORD_SSTRIDE + col] = b[i];
            }
            __syncwarp();
            const float* v = st + lane * RS_ORD_SSTRIDE;
            for (int q = 0; q < w; ++q) acc = fmaf(uvec[p0 + q], v[q], acc);
            __syncwarp();  // the next piece overwrites the stage
        }
        if (j < cnt) out_keys[j] = r >= 0 ? rs_key(acc, r) : 0ull;
    }
}

// Bytes of dynamic shared memory (recall/backends/cupy/rescore.py's smem_bytes mirrors this):
//   keys: SZ u64 | ctrl: RS_CTRL_WORDS u64 | stage: RS_ORD_STAGE floats a warp, or max(SZ, K_pad) bytes (rounded up
//   to 16) if more, ORD only (16-byte aligned: SZ is even) | uvec: dim_pad floats (16-byte aligned) |
//   scratch: max(4 * SZ, 8 * K_pad) bytes (the chunk's rows as int32 during the gather, then the select's K_pad u64) |
//   hist: 256 u32 | dup: max(SZ, K_pad) bytes (rounded up to 16), except where there is a stage, which the
//   duplicate flags then take: the select that writes them and the gather that stages rows are separated by a
//   barrier on either side. (So K = 8,192 at SZ = 16,384 fits in the 227 KB of a Hopper block: the stage's 18 KB
//   would not fit beside the flags' 16 KB.)
// Where the stage holds the select's K_pad keys (ORD, 8 K_pad bytes within the warps' RS_ORD_STAGE floats: K_pad up
// to 2,048 at 128 threads), they take it instead, the duplicate flags take the scratch (the chunk's rows are not
// needed once the gather's barrier passed), and the scratch is max(4 * SZ, the flags' bytes): at k = 2,048 with
// lists of 2,113 (SZ 2,144) 45,488 bytes a block instead of 53,552 (SZ 2,176 in the layout above), five blocks an SM
// on a Hopper instead of four.
// The best so far move to the front of keys before the next chunk's gather stages rows over them, as they do from
// the scratch.
//
// Grid: one block per user (blockIdx.x = user of this launch). users: (n_users, dim) float32; items: (n_items, dim)
// float32; indptr: (n_users + 1,) int64 positions into rows (and scores); rows: int64 item rows (a negative row is an
// empty slot; every row < 2**31); G: lanes that share one candidate's dot product (a power of two <= 32 dividing
// blockDim.x); out_vals / out_rows: (n_users, K).
template <int U, int C, int VEC, int ORD>
__global__ void
recall_rescore_t(const float* __restrict__ users, const float* __restrict__ items, int dim,
                 const float* __restrict__ scores, const long long* __restrict__ indptr,
                 const long long* __restrict__ rows, int K, int K_pad, int SZ, int G, float* __restrict__ out_vals,
                 long long* __restrict__ out_rows) {
    extern __shared__ u64 rs_smem[];
    u64* keys = rs_smem;
    u64* ctrl = rs_smem + SZ;
    float* stage = reinterpret_cast<float*>(ctrl + RS_CTRL_WORDS);
    // Ordered sums stage their rows (the launcher never gives them precomputed scores).
    const int flag_bytes = (max(SZ, K_pad) + 15) & ~15;
    const int stage_room = ORD ? (int)(blockDim.x >> 5) * RS_ORD_STAGE * 4 : 0;
    const bool sel_staged = ORD && 8 * K_pad <= stage_room;  // the selected keys in the stage, the flags in scratch
    const int stage_floats = ORD ? (sel_staged ? stage_room : max(stage_room, flag_bytes)) >> 2 : 0;
    float* uvec = stage + stage_floats;
    const int dim_pad = (dim + 3) & ~3;
    unsigned char* scratch = reinterpret_cast<unsigned char*>(uvec + dim_pad);
    int* rows32 = reinterpret_cast<int*>(scratch);
    u64* sel = sel_staged ? reinterpret_cast<u64*>(stage) : reinterpret_cast<u64*>(scratch);
    u32* hist = reinterpret_cast<u32*>(scratch + (sel_staged ? max(4 * SZ, flag_bytes) : max(4 * SZ, 8 * K_pad)));
    unsigned char* dup = !ORD ? reinterpret_cast<unsigned char*>(hist + 256)
                              : sel_staged ? scratch : reinterpret_cast<unsigned char*>(stage);

    const int u = blockIdx.x;
    const long long lo = indptr[u], hi = indptr[u + 1];
    const bool fused = scores == nullptr;
    if (fused) {
        for (int c = threadIdx.x; c < dim; c += blockDim.x) uvec[c] = users[(long long)u * dim + c];
    }
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0u;

    long long pos = lo;
    int start = 0;  // first slot this chunk fills
    u64* best = keys;
    do {
        const long long left = hi - pos;
        const int cnt = left < (long long)(SZ - start) ? (int)left : SZ - start;
        for (int j = cnt + threadIdx.x; j < SZ - start; j += blockDim.x) keys[start + j] = 0ull;
        rs_select_init(ctrl);
        if (!fused) {
            for (int j = threadIdx.x; j < cnt; j += blockDim.x) {
                const long long r = rows[pos + j];
                keys[start + j] = r >= 0 ? rs_key(scores[pos + j], r) : 0ull;
            }
        } else {
            // Four streaming index loads in flight per thread, then the int32 copies: one memory latency.
            for (int j = threadIdx.x; j < cnt; j += 4 * blockDim.x) {
                long long v[4];
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    const int jj = j + t * blockDim.x;
                    v[t] = jj < cnt ? __ldcs(rows + pos + jj) : -1;
                }
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    const int jj = j + t * blockDim.x;
                    if (jj < cnt) rows32[jj] = v[t] >= 0 ? (int)v[t] : -1;
                }
            }
            __syncthreads();  // the user's vector (first chunk) and the staged rows
            const int warp = threadIdx.x >> 5;  // each warp stages its own candidates' rows
            if (ORD && VEC) {
                rs_gather_ordered(items, dim, uvec, rows32, cnt, stage + warp * RS_ORD_STAGE, keys + start, warp * 32,
                                  blockDim.x);
            } else if (ORD) {
                rs_gather_ordered_scalar(items, dim, uvec, rows32, cnt, stage + warp * RS_ORD_STAGE, keys + start,
                                         warp * 32, blockDim.x);
            } else {
                rs_gather<U, C, VEC>(items, dim, uvec, rows32, cnt, G, keys + start);
            }
        }
        __syncthreads();
        best = keys;
        if (cnt > 0) best = rs_select(keys, start + cnt, K, K_pad, ctrl, sel, hist, dup);
        pos += cnt;
        start = K_pad;
        if (pos < hi && best != keys) {
            // The next chunk's rows are staged where `sel` lives (the scratch, or the stage): the best so far move to
            // the front of keys first.
            for (int i = threadIdx.x; i < K_pad; i += blockDim.x) keys[i] = best[i];
            __syncthreads();
            best = keys;
        }
    } while (pos < hi);

    // keys holds SZ slots, which may be fewer than K where every list is shorter than k (an empty list leaves the
    // select unasked and `best` at keys); sel holds K_pad.
    const int best_n = best == keys ? SZ : K_pad;
    for (int r = threadIdx.x; r < K; r += blockDim.x) {
        const u64 key = r < best_n ? best[r] : 0ull;
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

// Ordered re-scoring of short lists (RS_WARP_KEYS candidates a user at most, K <= RS_WARP_KEYS): one warp a user,
// no block barrier, where the block kernel above takes a block of 128 threads a user and meets it at every phase of
// its select and sort (two dozen barriers for 126 candidates). Measured on the H200 (docs/benchmarks.md): the
// certified route on 1M x 100k at k = 100 0.97x of its time with the block kernel; both kernels' time is mostly the
// candidates' rows read. Here the warp stages its rows and sums them as rs_gather_ordered does
// (the same FMA sequence: the same scores, bit for bit), then sorts its keys in registers, four a lane (element
// 4 lane + i), with a bitonic network whose exchanges across lanes are shuffles; a duplicate key (a candidate row
// listed twice) is dropped and the keys sorted again, as rs_sort_dedup does. Shared memory a warp (rescore.py's
// warp_smem_bytes mirrors it): RS_WARP_KEYS keys, the stage (RS_ORD_STAGE floats), the user's vector (dim rounded
// up to 4 floats), RS_WARP_KEYS int32 rows.
#define RS_WARP_KEYS 128

// keys a[0..N-1] of this lane: elements N lane + i of 32 N; sorted descending across the warp on return (a bitonic
// network: exchanges of stride N or more are shuffles of one register, shorter ones within the lane).
template <int N>
__device__ __forceinline__ void rs_warp_sort(u64 (&a)[N], int lane) {
#pragma unroll
    for (int size = 2; size <= 32 * N; size <<= 1) {
#pragma unroll
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            if (stride >= N) {  // the partner is element e ^ stride: lane ^ (stride / N), the same register
#pragma unroll
                for (int i = 0; i < N; ++i) {
                    const int e = N * lane + i;
                    const u64 b = __shfl_xor_sync(RS_FULL, a[i], stride / N);
                    const bool keep_max = ((e & stride) == 0) == ((e & size) == 0);
                    a[i] = keep_max ? (a[i] > b ? a[i] : b) : (a[i] < b ? a[i] : b);
                }
            } else {
#pragma unroll
                for (int i = 0; i < N; ++i) {
                    const int p = i ^ stride;
                    if (p > i) {
                        const bool desc = ((N * lane + i) & size) == 0;
                        if ((a[i] < a[p]) == desc) {
                            const u64 t = a[i];
                            a[i] = a[p];
                            a[p] = t;
                        }
                    }
                }
            }
        }
    }
}

#ifndef RS_WARP_SHORT
#define RS_WARP_SHORT 1  // lists of at most 32 (64) at k <= 32 (64) sorted 1 (2) keys a lane; 0: 4 keys a lane for
                         // every list, as before 2026-12-06 (the lab's comparison)
#endif

// The warp's sort of its cnt keys (keys[0..cnt)), N a lane, a duplicate dropped and the rest sorted again, and the
// best K written (-1 / -inf past the distinct keys).
template <int N>
__device__ __forceinline__ void rs_warp_finish(const u64* keys, int cnt, int K, int lane, long long u,
                                               float* __restrict__ out_vals, long long* __restrict__ out_rows) {
    u64 a[N];
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] = N * lane + i < cnt ? keys[N * lane + i] : 0ull;
    rs_warp_sort<N>(a, lane);
    // A key equal to the one before it (element N lane + i - 1) is a duplicate row: emptied, then sorted again.
    const u64 before = __shfl_up_sync(RS_FULL, a[N - 1], 1);  // every lane: a shuffle's mask is the whole warp
    bool dup[N];
    bool any = false;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const u64 prev = i == 0 ? before : a[i - 1];
        dup[i] = a[i] != 0ull && (i > 0 || lane > 0) && a[i] == prev;
        any |= dup[i];
    }
    if (__any_sync(RS_FULL, any)) {
#pragma unroll
        for (int i = 0; i < N; ++i)
            if (dup[i]) a[i] = 0ull;
        rs_warp_sort<N>(a, lane);
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int e = N * lane + i;
        if (e < K) {
            const long long o = u * K + e;
            if (a[i] == 0ull) {
                out_vals[o] = RS_NEG_INF;
                out_rows[o] = -1;
            } else {
                out_vals[o] = rs_ord2f((u32)(a[i] >> 32));
                out_rows[o] = (long long)(~(u32)(a[i] & 0xffffffffull));
            }
        }
    }
}

template <int VEC>
__global__ void recall_rescore_warp_t(const float* __restrict__ users, const float* __restrict__ items, int dim,
                                      const long long* __restrict__ indptr, const long long* __restrict__ rows,
                                      int K, int n_users, float* __restrict__ out_vals,
                                      long long* __restrict__ out_rows) {
    extern __shared__ u64 rs_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int u = blockIdx.x * (blockDim.x >> 5) + warp;
    if (u >= n_users) return;  // a whole warp: no block barrier below
    const int dim_pad = (dim + 3) & ~3;
    unsigned char* mine = reinterpret_cast<unsigned char*>(rs_smem) +
                          (long long)warp * (8 * RS_WARP_KEYS + 4 * RS_ORD_STAGE + 4 * dim_pad + 4 * RS_WARP_KEYS);
    u64* keys = reinterpret_cast<u64*>(mine);
    float* st = reinterpret_cast<float*>(mine + 8 * RS_WARP_KEYS);
    float* uvec = st + RS_ORD_STAGE;
    int* rows32 = reinterpret_cast<int*>(uvec + dim_pad);
    const long long lo = indptr[u];
    const int cnt = (int)(indptr[u + 1] - lo);
    for (int c = lane; c < dim; c += 32) uvec[c] = users[(long long)u * dim + c];
#pragma unroll
    for (int t = 0; t < RS_WARP_KEYS / 32; ++t) {
        const int j = t * 32 + lane;
        const long long r = j < cnt ? __ldcs(rows + lo + j) : -1;
        rows32[j] = r >= 0 ? (int)r : -1;
    }
    __syncwarp();
    if (VEC)
        rs_gather_ordered(items, dim, uvec, rows32, cnt, st, keys, 0, 32);
    else
        rs_gather_ordered_scalar(items, dim, uvec, rows32, cnt, st, keys, 0, 32);
    __syncwarp();
    // Short lists sort fewer keys a lane: the route's k + m + 1 candidates are 27 at k = 10 (one a lane: 15
    // exchanges, not the 28 of four a lane over 128 keys, 101 of them empty) and 63 at k = 46 (two a lane).
    const int longest = cnt > K ? cnt : K;
    if (RS_WARP_SHORT && longest <= 32)
        rs_warp_finish<1>(keys, cnt, K, lane, u, out_vals, out_rows);
    else if (RS_WARP_SHORT && longest <= 64)
        rs_warp_finish<2>(keys, cnt, K, lane, u, out_vals, out_rows);
    else
        rs_warp_finish<4>(keys, cnt, K, lane, u, out_vals, out_rows);
}

// The fused exact kernel's float32 sums of gathered vectors (ORD above, for re-scoring that takes the gather path):
// out[u * w + j] = fmaf chain of users[u, :] and vecs[u, j, :], in order of dimension from 0. users: (n, dim), vecs:
// (n, w, dim), out: (n, w), float32, C-contiguous. One thread a score.
extern "C" __global__ void recall_ordered_dots(const float* __restrict__ users, const float* __restrict__ vecs,
                                               long long n_scores, int w, int dim, float* __restrict__ out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_scores) return;
    const float* u = users + (i / w) * dim;
    const float* v = vecs + i * dim;
    float acc = 0.0f;
    for (int d = 0; d < dim; ++d) acc = fmaf(__ldg(u + d), __ldg(v + d), acc);
    out[i] = acc;
}
