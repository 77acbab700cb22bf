// Exact running top-k on the GPU, fed by cuBLAS score tiles (compiled at run time by NVRTC through CuPy).
//
// A (score, item row) pair is packed into one 64-bit key that orders exactly like the tie rule:
//   high 32 bits: the float score mapped to an unsigned integer that sorts like the float;
//   low 32 bits:  ~item_row, so that a lower row (the winner of a tie) gives a larger key.
// Keys of real pairs are never 0, so 0 marks an empty slot. Larger key = better pair.
//
// Per search block of U users the state is, per user: the K best keys so far (unsorted), how many are valid, and
// the score of the worst of them (the threshold; -inf until K are held). Per score tile:
//   recall_mask_excluded  sets excluded (user, item) scores to -inf (recall_mask_sampled: in a threshold sample's);
//   recall_filter         appends keys of scores above the user's threshold to a per-user candidate buffer;
//   recall_merge          folds candidates into the state (exact radix select) once the buffer is half full, or
//                         rescans the tile when the buffer overflowed; with `final` set it writes results (sorted, or
//                         as selected where the caller re-ranks them).
// Before its first segment a block may be seeded (recall_seed): its users' K-th best score over a sample of the
// items is a lower bound of the final K-th best, so the filter passes few scores from the first tile on, and
// item orders that raise the scores tile after tile (the worst case for a running threshold) cost little more.

typedef unsigned long long u64;
typedef unsigned int u32;

#define RECALL_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ u32 recall_f2ord(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float recall_ord2f(u32 o) {
    u32 b = (o & 0x80000000u) ? (o & 0x7fffffffu) : ~o;
    return __uint_as_float(b);
}

__device__ __forceinline__ u64 recall_key(float s, int row) {
    return ((u64)recall_f2ord(s) << 32) | (u64)(~(u32)row);
}

// Score tiles hold float32 (exact mode) or float16 (fast mode; kept as raw 16-bit words, converted with one PTX
// instruction, so that no CUDA header is needed at run-time compilation).
typedef unsigned short half_bits;

__device__ __forceinline__ float recall_load(const float* p, long long i) { return p[i]; }

__device__ __forceinline__ float recall_load(const half_bits* p, long long i) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p[i]));
    return f;
}

__device__ __forceinline__ void recall_store_neg_inf(float* p, long long i) { p[i] = RECALL_NEG_INF; }

__device__ __forceinline__ void recall_store_neg_inf(half_bits* p, long long i) { p[i] = (half_bits)0xfc00u; }

// Four consecutive scores from p + i (i a multiple of 4): one 16-byte load of float32, one 8-byte load of float16.
__device__ __forceinline__ void recall_load4(const float* p, int i, float v[4]) {
    const float4 q = *reinterpret_cast<const float4*>(p + i);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}

__device__ __forceinline__ void recall_load4(const half_bits* p, int i, float v[4]) {
    const uint2 q = *reinterpret_cast<const uint2*>(p + i);
    const half_bits h[4] = {(half_bits)(q.x & 0xffffu), (half_bits)(q.x >> 16), (half_bits)(q.y & 0xffffu),
                            (half_bits)(q.y >> 16)};
#pragma unroll
    for (int c = 0; c < 4; ++c) asm("cvt.f32.f16 %0, %1;" : "=f"(v[c]) : "h"(h[c]));
}

// One thread per user: walk the user's sorted exclusions that fall inside this score tile, whose column j (over the B
// tiles of T columns) is item row item_start + j. ex_ptr has U + 1 entries (rows past the block's last user are
// empty).
template <typename S>
__device__ void recall_mask_body(S* __restrict__ scores, int U, int T, int B, int item_start,
                                 const long long* __restrict__ ex_ptr, const long long* __restrict__ ex_items) {
    int u = blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= U) return;
    long long lo = ex_ptr[u], hi = ex_ptr[u + 1];
    long long stop = (long long)item_start + (long long)B * T;
    // first exclusion >= item_start
    long long a = lo, b = hi;
    while (a < b) {
        long long m = (a + b) >> 1;
        if (ex_items[m] < item_start) a = m + 1; else b = m;
    }
    for (long long e = a; e < hi; ++e) {
        long long j = ex_items[e];
        if (j >= stop) break;
        long long off = j - item_start;
        long long tile = off / T;
        recall_store_neg_inf(scores, (tile * U + u) * (long long)T + (off - tile * T));
    }
}

extern "C" __global__ void recall_mask_excluded(float* __restrict__ scores, int U, int T, int B, int item_start,
                                                const long long* __restrict__ ex_ptr,
                                                const long long* __restrict__ ex_items) {
    recall_mask_body(scores, U, T, B, item_start, ex_ptr, ex_items);
}

extern "C" __global__ void recall_mask_excluded_h(half_bits* __restrict__ scores, int U, int T, int B,
                                                  int item_start, const long long* __restrict__ ex_ptr,
                                                  const long long* __restrict__ ex_items) {
    recall_mask_body(scores, U, T, B, item_start, ex_ptr, ex_items);
}

// The threshold sample's scores (U, T): column c holds item row rows[c] (T sorted, distinct rows). One thread a user
// looks each of its excluded items up in the rows (a binary search from where the last one was found: both lists
// rise) and sets the score of each one sampled to -inf.
template <typename S>
__device__ void recall_mask_sampled_body(S* __restrict__ scores, int U, int T, const long long* __restrict__ rows,
                                         const long long* __restrict__ ex_ptr,
                                         const long long* __restrict__ ex_items) {
    int u = blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= U) return;
    int a = 0;
    for (long long e = ex_ptr[u]; e < ex_ptr[u + 1] && a < T; ++e) {
        const long long j = ex_items[e];
        int b = T;
        while (a < b) {
            const int m = (a + b) >> 1;
            if (rows[m] < j) a = m + 1; else b = m;
        }
        if (a < T && rows[a] == j) recall_store_neg_inf(scores, (long long)u * T + a);
    }
}

extern "C" __global__ void recall_mask_sampled(float* __restrict__ scores, int U, int T,
                                               const long long* __restrict__ rows,
                                               const long long* __restrict__ ex_ptr,
                                               const long long* __restrict__ ex_items) {
    recall_mask_sampled_body(scores, U, T, rows, ex_ptr, ex_items);
}

extern "C" __global__ void recall_mask_sampled_h(half_bits* __restrict__ scores, int U, int T,
                                                 const long long* __restrict__ rows,
                                                 const long long* __restrict__ ex_ptr,
                                                 const long long* __restrict__ ex_items) {
    recall_mask_sampled_body(scores, U, T, rows, ex_ptr, ex_items);
}

// A block's threshold sample: grid (U), THREADS threads a user (256, or 512 or 1,024 for held rows longer than
// 256 threads hold: selection.seed_threads). The K-th best of the user's sampled scores
// (a row of T, excluded items already -inf) is the score of K real items, so the final K-th best is >= it, up to
// the rounding by which the search's own score of an item may lie below the sample's (another GEMM, another order of
// the sums): each sampled score s of item j is first lowered by that much, A P_j + R |s| + Z with P_j >= sum_i
// |u_i v_ji| (the caller's bound, certificate.seed_margin), rounding down, so that the K-th best of the lowered scores
// is a lower bound whichever items the sample holds. P_j = |u| |v_j| (|u| the norm of the user's row of W in `users`,
// |v_j| = vnorm[j], rounded up) by Cauchy-Schwarz, but for a column CC that every item holds at the same value CV
// (fast mode's shift column, 2^15: certificate.FastItems.shift_at; CC < 0: none), whose product |u_CC| CV is taken on
// its own (added to Z), |u| and |v_j| then the norms of the rows without it: through the whole rows the shift column
// multiplied the user's whole norm, and on 200k x 100k x 32 l2 with heavy-tailed item norms every user started below
// 93% of the items (H200, docs/benchmarks.md). Likewise the columns [BL, BH) (fast mode's l2 bias parts,
// certificate.FastItems.bias_columns; BL == BH: none), where every user holds one large value and each item its own
// small bias: their products are bounded on their own by Hölder, max_i |u_i| times sum_i |v_ji| (vbias[j], rounded
// up), and |u|, |v_j| are the norms without them. Through the whole rows the users' bias entries (8,192 scaled, against
// dot entries near 3) multiplied the items' bound columns (thousands): on 200k x 100k x 32 l2 with heavy-tailed item
// norms P_j was about 590 times sum_i |u_i v_ji|, and about 4,070 items a user passed the float16 pass's filter where
// its estimate's rank meant about 2,700. The threshold starts at the float just below a key at or below that
// K-th best, so that scores equal to it pass the strict `score > threshold` test until K items are held. A user with
// fewer than K finite sampled scores keeps -inf. Nothing goes through the candidate buffers, and the state is left
// empty.
//
// The key is found by one radix select on the lowered scores' order-preserving keys (recall_seed_select), whichever
// path the row takes. A first pass finds the keys' range and count; the select then starts below the leading bits
// that every key of the row shares (scores that crowd a few binades would put nearly every key in one bin of a
// 12-bit histogram of those bits, whose shared-memory adds then serialise), takes digits of up to 12 bits, each a
// histogram in shared memory of the keys that match the digits fixed so far (one shared atomic a key) scanned with
// warp shuffles, and stops at the first digit that brings it within K / 8 keys of the K-th: the threshold then lies below
// the K-th best lowered sampled score, with at most K + K / 8 sampled scores at or above it (one digit below the
// shared bits is nearly always that close). The paths differ only in where the keys come from:
//   held     rows of T <= 32 THREADS scores, T a multiple of 4 (RecallSeedHeld): each thread reads and lowers its
//            scores once, 4 at a time, and keeps its 32 keys in registers for every pass (rows of 8,193 to 32,768
//            take blocks of 512 or 1,024 threads for it: a 16,384-score row streamed was read twice or more);
//   streamed longer rows (up to 65,536 scores: large-k samples) and rows of T not a multiple of 4 (RecallSeedRow):
//            every pass (the range's, then one a digit, usually one or two) reads the row from global memory again
//            and lowers it again, 4 scores a thread at a time where T is a multiple of 4, else 1; no key is held.
//
// A smaller rank (KE > 0, KE < K: fast mode's float16 passes, whose certificate checks every user against its start,
// selection.start_rank): the threshold starts at the KE-th best sampled score, a lower bound of the user's KE-th best
// (the certificate's need, fewer than the K the pass keeps), or over a sample of evenly spaced rows an *estimate* of
// its need-th best, KE chosen (selection.estimate_rank) so that for nearly every user at least that many items of the
// whole catalogue score above it: about KE n / size items pass the filter instead of the K n / size a lower bound of
// the K-th lets through. A user whose start lay above its K-th best ends with fewer than K items, and its caller
// knows its start (Backend.run_blocks' left_out). The same select, at another rank.
#define RECALL_SEED_THREADS 256
#define RECALL_SEED_HELD 8  // 16-byte loads a thread holds: 32 keys

// What a user's sampled score of item j is lowered by (above): au vnorm[j] + ab vbias[j] + r32 |s| + z32, each step
// rounded up, au = A |u|, ab = A max |u_b| (0 and vbias unread without a bias group), z32 = Z + A |u_CC| CV.
struct RecallSeedMargin {
    const float* __restrict__ vnorm;
    const float* __restrict__ vbias;  // nullptr: no bias group
    float au, ab, r32, z32;

    // A sampled score lowered by its margin, rounding down (-inf, +inf and NaN as they are).
    __device__ __forceinline__ float lower(float s, float vn, float vb) const {
        if (!(s > RECALL_NEG_INF) || isinf(s)) return s;
        return __fsub_rd(s, __fmaf_ru(au, vn, __fmaf_ru(ab, vb, __fmaf_ru(r32, fabsf(s), z32))));
    }

    __device__ __forceinline__ float lower(float s, int i) const {
        return lower(s, vnorm[i], vbias != nullptr ? vbias[i] : 0.0f);
    }

    // Sampled scores i .. i + 3 of a row (16-byte aligned), each lowered by its margin.
    template <typename S>
    __device__ __forceinline__ void load4(const S* row, int i, float v[4]) const {
        recall_load4(row, i, v);
        const float4 n4 = *reinterpret_cast<const float4*>(vnorm + i);
        const float4 b4 = vbias != nullptr ? *reinterpret_cast<const float4*>(vbias + i) : make_float4(0, 0, 0, 0);
        v[0] = lower(v[0], n4.x, b4.x);
        v[1] = lower(v[1], n4.y, b4.y);
        v[2] = lower(v[2], n4.z, b4.z);
        v[3] = lower(v[3], n4.w, b4.w);
    }
};

// A user's value x in column i into the margin's terms: its largest |u_i| in the bias columns [BL, BH), |u_CC| (uc),
// the sum of squares (float64: each square and sum of float values) of the other columns.
__device__ __forceinline__ void recall_seed_column(int i, double x, int CC, int BL, int BH, double& sq, double& ub,
                                                   double& uc) {
    if (i >= BL && i < BH) ub = fmax(ub, fabs(x));
    else if (i == CC) uc = fabs(x);
    else sq += x * x;
}

// A thread's share of a user's row of W in `users` (columns first, first + step, ...; the caller reduces over its
// block or warp): recall_seed_column's sums of its columns (|u_CC| is recall_seed_margin's to read).
template <typename V>
__device__ __forceinline__ void recall_seed_user_part(const V* __restrict__ urow, int W, int CC, int BL, int BH,
                                                      int first, int step, double& sq, double& ub) {
    double uc = 0.0;
    for (int i = first; i < W; i += step) recall_seed_column(i, recall_load(urow, i), CC, BL, BH, sq, ub, uc);
}

// A user's margin from the reduced sums: A |u| and A max |u_b| (0 without bias columns), each rounded up, and Z
// grown by A |u_CC| CV (uc: |u_CC|, 0 without a constant column). PHI (certificate.flush_factor; 0 for float16
// vectors): one GEMM may read float32 inputs below 2^-126 as 0 where the other keeps them, phi (|u| + |v_j|) more.
__device__ __forceinline__ RecallSeedMargin recall_seed_margin_of(const float* vnorm, const float* vbias, int BL,
                                                                  int BH, double CV, double A, double R, double Z,
                                                                  double sq, double ub, double uc, double phi) {
    const bool bias = BH > BL;
    const double norm = sqrt(sq);
    return {vnorm, bias ? vbias : nullptr, __double2float_ru(A * norm + phi),
            bias ? __double2float_ru(A * ub) : 0.0f, __double2float_ru(R),
            __double2float_ru(Z + A * uc * CV + phi * norm)};
}

// The same, |u_CC| read from the user's row `urow` of W; phi = certificate.flush_factor(W) for float32 vectors (the
// products and sums of float16 ones never leave float32's normal range).
template <typename V>
__device__ __forceinline__ RecallSeedMargin recall_seed_margin(const V* __restrict__ urow, int W, const float* vnorm,
                                                               const float* vbias, int CC, double CV, int BL, int BH,
                                                               double A, double R, double Z, double sq, double ub) {
    const double uc = CC >= 0 && CC < W ? fabs((double)recall_load(urow, CC)) : 0.0;
    const double phi = sizeof(V) == 4 ? 1.01 * sqrt((double)W) * ldexp(1.0, -126) : 0.0;
    return recall_seed_margin_of(vnorm, vbias, BL, BH, CV, A, R, Z, sq, ub, uc, phi);
}

// A lowered score's key; 0 (no key) for -inf and NaN.
__device__ __forceinline__ u32 recall_seed_key(float v) { return v > RECALL_NEG_INF ? recall_f2ord(v) : 0u; }

// The range of a thread's keys (kmax, kmin, of the keys other than 0) and how many there are.
struct RecallSeedRange {
    u32 kmax, kmin;
    int count;

    __device__ __forceinline__ void operator()(u32 key) {
        if (key != 0u) {
            kmax = max(kmax, key);
            kmin = min(kmin, key);
            ++count;
        }
    }
};

// One digit's histogram: adds a key of the row (at least kmin, so not 0) that matches the digits fixed so far (the
// bits of `high` equal to prefix's) to the bin of its next `bins` bits below `shift`: one shared-memory atomic a key.
// Aggregating a warp's equal bins first (__match_any_sync) cost more than it saved once the select starts below the
// shared bits, on every row tried on the H200, tie-heavy ones too (the counts, and so the thresholds, are the same);
// with both changes a k = 1,000 search's selects (20k users x 32,768 sampled scores) take 2.8 ms, not 6.6 ms
// (docs/benchmarks.md). (It tests key >= kmin rather than key != 0: the compiler would reuse the range pass's
// `key != 0` of the 32 held keys, holding them in registers through the select: with nvcc 13.0 for sm_90, 80
// registers and 48 bytes of spills a thread against 64 and none.)
struct RecallSeedDigit {
    int* hist; u32 kmin, prefix, high; int shift, bins;

    __device__ __forceinline__ void operator()(u32 key) const {
        if (key >= kmin && (key & high) == prefix) atomicAdd(&hist[(key >> shift) & (u32)(bins - 1)], 1);
    }
};

// Where a thread's keys come from. A source's each(f) calls f(key) on every key of the thread, and on 0 (no key) for
// the places past the row's end (every f ignores key 0).
//
// The held path's: 4 * RECALL_SEED_HELD keys in registers, read and lowered once by load() (THREADS: the block's).
template <int THREADS>
struct RecallSeedHeld {
    u32 keys[4 * RECALL_SEED_HELD];

    template <typename S>
    __device__ __forceinline__ void load(const S* row, const RecallSeedMargin& mg, int T) {
#pragma unroll
        for (int r = 0; r < RECALL_SEED_HELD; ++r) {
            const int i = (r * THREADS + (int)threadIdx.x) * 4;
            float v[4] = {RECALL_NEG_INF, RECALL_NEG_INF, RECALL_NEG_INF, RECALL_NEG_INF};
            if (i < T) mg.load4(row, i, v);
#pragma unroll
            for (int q = 0; q < 4; ++q) keys[4 * r + q] = recall_seed_key(v[q]);
        }
    }

    template <typename F>
    __device__ __forceinline__ void each(F& f) const {
#pragma unroll
        for (int q = 0; q < 4 * RECALL_SEED_HELD; ++q) f(keys[q]);
    }
};

// The streamed path's: the row itself, read and lowered again on every call, 4 scores a thread at a time where T is
// a multiple of 4 (16-byte loads of float32, 8-byte of float16), 1 otherwise; the trip count depends on T alone.
template <typename S, int THREADS>
struct RecallSeedRow {
    const S* row; RecallSeedMargin mg; int T;

    template <typename F>
    __device__ __forceinline__ void each(F& f) const {
        if ((T & 3) == 0) {
            for (int i0 = 0; i0 < T; i0 += 4 * THREADS) {
                const int i = i0 + 4 * (int)threadIdx.x;
                float v[4] = {RECALL_NEG_INF, RECALL_NEG_INF, RECALL_NEG_INF, RECALL_NEG_INF};
                if (i < T) mg.load4(row, i, v);
#pragma unroll
                for (int q = 0; q < 4; ++q) f(recall_seed_key(v[q]));
            }
        } else {
            for (int i0 = 0; i0 < T; i0 += THREADS) {
                const int i = i0 + (int)threadIdx.x;
                f(i < T ? recall_seed_key(mg.lower(recall_load(row, i), i)) : 0u);
            }
        }
    }
};

// A key at or below the K-th largest of the keys of the block's threads (counted with multiplicity), with at most
// K + K / 8 of them at or above it, given that at least K keys are non-zero, that every non-zero key lies in
// [kmin, kmax] and that kmax is one of them: the select stops at the first digit whose bin holding the K-th key holds
// at most K / 8 keys below it, and returns that bin's lowest key (a threshold sample is a lower bound, and one digit
// of 12 bits below the shared ones is nearly always that close); past the last digit it is the K-th key itself. Every
// thread calls it; the result is every thread's. hist: 4,096 ints of shared memory, part: one int per warp.
template <int THREADS, typename Keys>
__device__ __forceinline__ u32 recall_seed_select(const Keys& keys, u32 kmax, u32 kmin, int K, int* hist, int* part,
                                                  u32* s_prefix, int* s_want, int* s_below) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 diff = kmax ^ kmin;
    if (diff == 0) return kmax;  // one key everywhere
    int remaining = 32 - __clz(diff);  // the low bits in which keys differ; the bits above are kmax's
    u32 prefix = remaining == 32 ? 0u : kmax & ~((1u << remaining) - 1u);
    int want = K;  // the rank, from the top, of the K-th best among the keys matching prefix
    while (remaining > 0) {
        const int digit = min(12, remaining);
        const int shift = remaining - digit;
        const int bins = 1 << digit;
        const u32 high = remaining == 32 ? 0u : ~((1u << remaining) - 1u);  // the bits fixed so far
        for (int b = tid; b < bins; b += THREADS) hist[b] = 0;
        __syncthreads();
        const RecallSeedDigit add = {hist, kmin, prefix, high, shift, bins};
        keys.each(add);
        __syncthreads();
        // Thread t sums its share of the bins, counted from the top bin down; a scan (warp shuffles, then the warps'
        // totals) says where each share starts, and the thread whose share holds rank `want` walks its bins.
        const int per = (bins + THREADS - 1) / THREADS;
        const int hi = bins - 1 - tid * per;  // this thread's bins: hi, hi - 1, ..., down to 0 at most
        int sum = 0;
        for (int j = 0; j < per && hi - j >= 0; ++j) sum += hist[hi - j];
        int incl = sum;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
        }
        if (lane == 31) part[warp] = incl;
        __syncthreads();
        for (int w = 0; w < warp; ++w) incl += part[w];
        const int before = incl - sum;
        if (before < want && want <= incl) {
            int seen = before;
            for (int j = 0; j < per && hi - j >= 0; ++j) {
                const int c = hist[hi - j];
                if (seen + c >= want) {
                    *s_prefix = prefix | ((u32)(hi - j) << shift);
                    *s_want = want - seen;
                    *s_below = c - (want - seen);  // the bin's keys below the K-th
                    break;
                }
                seen += c;
            }
        }
        __syncthreads();
        prefix = *s_prefix;
        want = *s_want;
        const int below = *s_below;
        remaining = shift;
        __syncthreads();  // s_prefix, s_want, s_below and part are rewritten by the next digit
        if (below <= (K >> 3)) break;  // the bin's lowest key (the low bits of prefix are 0) is close enough
    }
    return prefix;
}

// The user's threshold from its keys (a source above) and its thread's range: the block's range and count first (per
// warp in shared memory, hist being free until the select clears it; every thread combines the warps'), then -inf
// where fewer than K keys, else the float just below the selected key: the K-th best's (a lower bound), or with
// 0 < KE < K the KE-th best's (the estimate, above).
template <int THREADS, typename Keys>
__device__ __forceinline__ void recall_seed_threshold(const Keys& keys, RecallSeedRange range, int K, int KE,
                                                      float* __restrict__ thr, int* hist, int* part, u32* s_prefix,
                                                      int* s_want, int* s_below) {
    const int tid = threadIdx.x, lane = tid & 31;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        range.kmax = max(range.kmax, __shfl_xor_sync(0xffffffffu, range.kmax, o));
        range.kmin = min(range.kmin, __shfl_xor_sync(0xffffffffu, range.kmin, o));
        range.count += __shfl_xor_sync(0xffffffffu, range.count, o);
    }
    if (lane == 0) {
        hist[tid >> 5] = (int)range.kmax;
        hist[THREADS / 32 + (tid >> 5)] = (int)range.kmin;
        hist[2 * (THREADS / 32) + (tid >> 5)] = range.count;
    }
    __syncthreads();
    u32 kmax = 0u, kmin = 0xffffffffu;
    int count = 0;
    for (int w = 0; w < THREADS / 32; ++w) {
        kmax = max(kmax, (u32)hist[w]);
        kmin = min(kmin, (u32)hist[THREADS / 32 + w]);
        count += hist[2 * (THREADS / 32) + w];
    }
    __syncthreads();  // hist is cleared by the select
    if (count < K) {  // fewer than K finite sampled scores
        if (tid == 0) *thr = RECALL_NEG_INF;
        return;
    }
    const int rank = KE > 0 && KE < K ? KE : K;
    u32 low = recall_seed_select<THREADS>(keys, kmax, kmin, rank, hist, part, s_prefix, s_want, s_below);
    // A bin's lowest key may lie below every finite float's (the bins of the most negative scores): -FLT_MAX.
    low = max(low, recall_f2ord(-3.402823466e38f));
    if (tid == 0) *thr = nextafterf(recall_ord2f(low), RECALL_NEG_INF);
}

template <int THREADS, typename S, typename V>
__device__ void recall_seed_body(const S* __restrict__ scores, int T, int K, float* __restrict__ thr,
                                 const V* __restrict__ users, int W, const float* __restrict__ vnorm,
                                 const float* __restrict__ vbias, int BL, int BH, int CC, double CV, double A,
                                 double R, double Z, int KE) {
    __shared__ int hist[4096];
    __shared__ int part[THREADS / 32];
    __shared__ u32 s_prefix;
    __shared__ int s_want, s_below;
    __shared__ double s_sq[THREADS / 32], s_ub[THREADS / 32];
    const int u = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
    const S* row = scores + (long long)u * T;
    const V* urow = users + (long long)u * W;
    double sq = 0.0, ub = 0.0;  // the user's squared norm but columns CC's and [BL, BH)'s; its largest |u_b|
    recall_seed_user_part(urow, W, CC, BL, BH, tid, THREADS, sq, ub);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        sq += __shfl_down_sync(0xffffffffu, sq, o);
        ub = fmax(ub, __shfl_down_sync(0xffffffffu, ub, o));
    }
    if (lane == 0) {
        s_sq[tid >> 5] = sq;
        s_ub[tid >> 5] = ub;
    }
    __syncthreads();
    sq = 0.0;
    ub = 0.0;
    for (int w = 0; w < THREADS / 32; ++w) {  // every thread, in the same order: the same margin everywhere
        sq += s_sq[w];
        ub = fmax(ub, s_ub[w]);
    }
    const RecallSeedMargin mg = recall_seed_margin(urow, W, vnorm, vbias, CC, CV, BL, BH, A, R, Z, sq, ub);
    RecallSeedRange range = {0u, 0xffffffffu, 0};
    if ((T & 3) == 0 && T <= 4 * RECALL_SEED_HELD * THREADS) {
        RecallSeedHeld<THREADS> held;
        held.load(row, mg, T);
        held.each(range);
        recall_seed_threshold<THREADS>(held, range, K, KE, thr + u, hist, part, &s_prefix, &s_want, &s_below);
    } else {
        const RecallSeedRow<S, THREADS> streamed = {row, mg, T};
        streamed.each(range);
        recall_seed_threshold<THREADS>(streamed, range, K, KE, thr + u, hist, part, &s_prefix, &s_want, &s_below);
    }
}

// By the type of the sampled scores and of the users' vectors: float32 and float32 (exact mode), float16 tiles of
// float16 vectors (fast mode's cuBLAS path), float32 scores of float16 vectors (fast mode's fused path); by the
// block's threads (the suffix: none 256, else 512 or 1,024), so that rows of up to 32 keys a thread are held (the
// launcher's selection.seed_threads). KE: the estimate's rank (0: the K-th best, a lower bound).
#define RECALL_SEED_KERNEL(NAME, S, V, THREADS)                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                             \
    NAME(const S* __restrict__ scores, int T, int K, float* __restrict__ thr, const V* __restrict__ users, int W,      \
         const float* __restrict__ vnorm, const float* __restrict__ vbias, int BL, int BH, int CC, double CV,         \
         double A, double R, double Z, int KE) {                                                                      \
        recall_seed_body<THREADS>(scores, T, K, thr, users, W, vnorm, vbias, BL, BH, CC, CV, A, R, Z, KE);            \
    }
#define RECALL_SEED_KERNELS(SUFFIX, THREADS)                                                                         \
    RECALL_SEED_KERNEL(recall_seed##SUFFIX, float, float, THREADS)                                                   \
    RECALL_SEED_KERNEL(recall_seed_h##SUFFIX, half_bits, half_bits, THREADS)                                         \
    RECALL_SEED_KERNEL(recall_seed_fh##SUFFIX, float, half_bits, THREADS)
RECALL_SEED_KERNELS(, RECALL_SEED_THREADS)
RECALL_SEED_KERNELS(512, 512)
RECALL_SEED_KERNELS(1024, 1024)

// The same threshold for a small rank (K, or KE where it estimates, at most 8 M = 128), one warp a user
// (RECALL_SEED_WARP_USERS users a block: grid ceil(U / that)): a block a user spends most of a short row's time in
// its histograms' clears, scans and barriers (200k users x 2,048 sampled scores at rank 30: 5.5 ms on the H200, more
// than the float16 products of 20k items; this select 1.5 ms, docs/benchmarks.md). Each lane reads and lowers its
// share of the row once (4 scores at a time where T is a multiple of 4, lane by lane 16 bytes apart) and keeps its M
// largest keys, sorted, in registers; the rank-th largest key of the row is found by bisection on the key's value
// over those 32 M keys, each step one count a lane and a warp sum. The kept keys are a subset of the row's, so their
// rank-th largest is at or below the row's; it is the row's exactly unless some lane dropped a key at or above it
// (its M-th kept key is), which for a row in no particular order is rare (a lane holds about rank / 32 of the row's
// best, at most M / 4): then the bisection goes on from there counting the whole row, read again each step. So the
// threshold starts just below the row's rank-th best lowered key itself, never lower; -inf where the row holds fewer
// than K finite scores.
#define RECALL_SEED_WARP_USERS 8

__device__ __forceinline__ int recall_warp_sum(int x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ u32 recall_warp_max(u32 x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// Key k into M keys sorted largest first: it moves every smaller one down a place, each place set by two comparisons
// and no branch (k at or below key[M - 1], 0 too, changes nothing). recall_seed_warp's lanes and seed_w.cu's.
template <int M>
__device__ __forceinline__ void recall_seed_push(u32 (&key)[M], u32 k) {
#pragma unroll
    for (int j = M - 1; j > 0; --j) key[j] = key[j] >= k ? key[j] : (key[j - 1] >= k ? k : key[j - 1]);
    key[0] = max(key[0], k);
}

// A lane's M largest keys, largest first (0: an empty place), and how many non-zero keys it was given. A key that
// enters moves every smaller one down a place (recall_seed_push): a bubble that
// stopped where the key belonged (a data-dependent exit at each place) took 3.4 ms to keep 200k users' 16 of 64
// keys a lane, this 1.0 ms (reading and lowering alone 0.38 ms; H200, scripts/lab/seed_warp_variants.py).
template <int M>
struct RecallSeedLaneTop {
    u32 key[M];
    int count;

    __device__ __forceinline__ void operator()(u32 k) {
        if (k == 0u) return;
        ++count;
        if (k <= key[M - 1]) return;
        recall_seed_push(key, k);
    }

    __device__ __forceinline__ int at_least(u32 x) const {
        int c = 0;
#pragma unroll
        for (int j = 0; j < M; ++j) c += key[j] >= x ? 1 : 0;
        return c;
    }
};

// Counts a lane's keys at or above x.
struct RecallSeedCount {
    u32 x;
    int count;

    __device__ __forceinline__ void operator()(u32 k) { count += k >= x ? 1 : 0; }
};

// A lane's share of the row: f(key) on every lowered score's key (0 for -inf and NaN).
template <typename S, typename F>
__device__ __forceinline__ void recall_seed_lane_each(const S* row, const RecallSeedMargin& mg, int T, int lane,
                                                      F& f) {
    if ((T & 3) == 0) {
        for (int i = 4 * lane; i < T; i += 128) {
            float v[4];
            mg.load4(row, i, v);
#pragma unroll
            for (int q = 0; q < 4; ++q) f(recall_seed_key(v[q]));
        }
    } else {
        for (int i = lane; i < T; i += 32) f(recall_seed_key(mg.lower(recall_load(row, i), i)));
    }
}

// Ranks a warp-a-user select takes by popping its lanes' largest keys (recall_seed_warp_body), above it by bisection.
#define RECALL_SEED_POP_RANK 32

template <typename S, typename V, int M>
__device__ void recall_seed_warp_body(const S* __restrict__ scores, int U, int T, int K, float* __restrict__ thr,
                                      const V* __restrict__ users, int W, const float* __restrict__ vnorm,
                                      const float* __restrict__ vbias, int BL, int BH, int CC, double CV, double A,
                                      double R, double Z, int KE) {
    const int lane = threadIdx.x & 31;
    const int u = blockIdx.x * RECALL_SEED_WARP_USERS + (int)(threadIdx.x >> 5);
    if (u >= U) return;  // the whole warp
    const S* row = scores + (long long)u * T;
    const V* urow = users + (long long)u * W;
    double sq = 0.0, ub = 0.0;  // as recall_seed_body's (the sum in another order: a margin of its own)
    recall_seed_user_part(urow, W, CC, BL, BH, lane, 32, sq, ub);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
        ub = fmax(ub, __shfl_xor_sync(0xffffffffu, ub, o));
    }
    const RecallSeedMargin mg = recall_seed_margin(urow, W, vnorm, vbias, CC, CV, BL, BH, A, R, Z, sq, ub);
    RecallSeedLaneTop<M> top;
#pragma unroll
    for (int j = 0; j < M; ++j) top.key[j] = 0u;
    top.count = 0;
    recall_seed_lane_each(row, mg, T, lane, top);
    if (recall_warp_sum(top.count) < K) {  // fewer than K finite sampled scores
        if (lane == 0) thr[u] = RECALL_NEG_INF;
        return;
    }
    const int rank = KE > 0 && KE < K ? KE : K;
    // The largest x with at least `rank` keys at or above it: lo always has that many (1: every finite key, at least
    // K >= rank of the row's), hi never (one past the largest key).
    u32 lo = 1u;
    const unsigned long long past = (unsigned long long)recall_warp_max(top.key[0]) + 1ull;  // the row's largest key
    unsigned long long hi = past;
    const u32 smallest_kept = top.key[M - 1];  // read before the pops shift the keys
    if (recall_warp_sum(top.at_least(1u)) >= rank) {
#if !defined(RECALL_SEED_BISECT)  // measurement only (tests): the bisection at every rank, as before 2026-12-05
        // Up to rank RECALL_SEED_POP_RANK, the rank-th largest kept key taken by popping the warp's largest kept key
        // rank times (a warp max, and the lowest lane holding it shifts its keys up a place) instead of about 32
        // bisection steps of M comparisons and a warp sum each. The same key: the rank-th largest of the kept keys,
        // ties counted. The route 0.5-4% faster at k = 10 and 100 (H100, docs/benchmarks.md).
        if (rank <= RECALL_SEED_POP_RANK) {
            for (int r = 0; r < rank; ++r) {
                lo = recall_warp_max(top.key[0]);
                if (lane == __ffs(__ballot_sync(0xffffffffu, top.key[0] == lo)) - 1) {
#pragma unroll
                    for (int j = 0; j < M - 1; ++j) top.key[j] = top.key[j + 1];
                    top.key[M - 1] = 0u;
                }
            }
        } else
#endif
        {
            while (hi - lo > 1ull) {
                const u32 mid = lo + (u32)((hi - lo) >> 1);
                if (recall_warp_sum(top.at_least(mid)) >= rank) lo = mid; else hi = mid;
            }
        }
    }
    // A lane that dropped a key at or above lo (its M-th kept key is): the kept keys' count may be short there, so
    // the bisection goes on over the whole row (lo holds rank keys of the row as it held them of the subset).
    if (__any_sync(0xffffffffu, smallest_kept >= lo)) {
        hi = past;
        while (hi - lo > 1ull) {
            const u32 mid = lo + (u32)((hi - lo) >> 1);
            RecallSeedCount c = {mid, 0};
            recall_seed_lane_each(row, mg, T, lane, c);
            if (recall_warp_sum(c.count) >= rank) lo = mid; else hi = mid;
        }
    }
    // A key below every finite float's (the most negative scores' bins): -FLT_MAX, as recall_seed_threshold.
    const u32 low = max(lo, recall_f2ord(-3.402823466e38f));
    if (lane == 0) thr[u] = nextafterf(recall_ord2f(low), RECALL_NEG_INF);
}

// M = 16 (ranks up to 128), by the type of the sampled scores and of the users' vectors, as recall_seed's. (M = 32,
// for ranks up to 256, was slower than the block select: 200k users x 8,192 sampled scores at rank 131 8.0 ms
// against 6.4-6.7 ms, 20k x 16,384 at rank 256 1.54 against 1.49-1.51 ms; H200, docs/benchmarks.md.) The suffix 8:
// M = 8, for small ranks (selection.SEED_WARP_SMALL_RANK): each key a lane keeps costs M places, and a lane holds
// more than 8 of a row's best 64 rarely (the whole-row bisection above covers it when it does).
#define RECALL_SEED_WARP(name, S, V, M)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * RECALL_SEED_WARP_USERS)                                        \
    name(const S* __restrict__ scores, int U, int T, int K, float* __restrict__ thr, const V* __restrict__ users,    \
         int W, const float* __restrict__ vnorm, const float* __restrict__ vbias, int BL, int BH, int CC, double CV, \
         double A, double R, double Z, int KE) {                                                                      \
        recall_seed_warp_body<S, V, M>(scores, U, T, K, thr, users, W, vnorm, vbias, BL, BH, CC, CV, A, R, Z, KE);    \
    }
RECALL_SEED_WARP(recall_seed_warp, float, float, 16)
RECALL_SEED_WARP(recall_seed_warp_h, half_bits, half_bits, 16)
RECALL_SEED_WARP(recall_seed_warp_fh, float, half_bits, 16)
RECALL_SEED_WARP(recall_seed_warp8, float, float, 8)
RECALL_SEED_WARP(recall_seed_warp_h8, half_bits, half_bits, 8)
RECALL_SEED_WARP(recall_seed_warp_fh8, float, half_bits, 8)

// Grid (U, B): one block scans one user's row of one tile. Survivors are appended with one atomic per warp.
template <typename S>
__device__ void recall_filter_body(const S* __restrict__ scores, int U, int T, int item_start, int n_items,
                                   const float* __restrict__ thr, u64* __restrict__ cand, int C,
                                   int* __restrict__ cnt) {
    const int u = blockIdx.x, b = blockIdx.y;
    const S* row = scores + ((long long)b * U + u) * (long long)T;
    const float t = thr[u];
    const int row0 = item_start + b * T;
    const int lane = threadIdx.x & 31;
    const bool vec = (T & 3) == 0;
    for (int i0 = 0; i0 < T; i0 += blockDim.x * 4) {
        const int i = i0 + threadIdx.x * 4;
        float v[4];
        if (vec && i + 3 < T) {
            recall_load4(row, i, v);
        } else {
#pragma unroll
            for (int c = 0; c < 4; ++c) v[c] = (i + c < T) ? recall_load(row, i + c) : RECALL_NEG_INF;
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const bool pass = v[c] > t && row0 + i + c < n_items;
            const unsigned m = __ballot_sync(0xffffffffu, pass);
            if (m) {
                const int leader = __ffs(m) - 1;
                int pos0 = 0;
                if (lane == leader) pos0 = atomicAdd(&cnt[u], __popc(m));
                pos0 = __shfl_sync(0xffffffffu, pos0, leader);
                if (pass) {
                    const int pos = pos0 + __popc(m & ((1u << lane) - 1u));
                    if (pos < C) cand[(long long)u * C + pos] = recall_key(v[c], row0 + i + c);
                }
            }
        }
    }
}

extern "C" __global__ void recall_filter(const float* __restrict__ scores, int U, int T, int item_start,
                                         int n_items, const float* __restrict__ thr, u64* __restrict__ cand, int C,
                                         int* __restrict__ cnt) {
    recall_filter_body(scores, U, T, item_start, n_items, thr, cand, C, cnt);
}

extern "C" __global__ void recall_filter_h(const half_bits* __restrict__ scores, int U, int T, int item_start,
                                           int n_items, const float* __restrict__ thr, u64* __restrict__ cand,
                                           int C, int* __restrict__ cnt) {
    recall_filter_body(scores, U, T, item_start, n_items, thr, cand, C, cnt);
}

// The scores of the tile being merged, for the overflow rescan: read back from a score tile (cuBLAS path)...
template <typename S>
struct RecallScoreTile {
    const S* scores; int U; int T; int u;
    __device__ __forceinline__ float at(int i) const {
        const int tile = i / T;
        return recall_load(scores, ((long long)tile * U + u) * (long long)T + (i - tile * T));
    }
};

// ...or recomputed from the embeddings (fused path, recall_fused_filter in fused.cu), with the same FMA sequence as
// that kernel so that every score comes out bit for bit the same; exclusions are checked here, since no tile was
// masked. uT is (Dp, ldu) users, iT is (Dp, ldi) items, both transposed and zero-padded to Dp; the first Dk
// dimensions are multiplied, as the kernel does.
struct RecallDotTile {
    const float* uT; int ldu; const float* iT; long long ldi; int Dk; int u; int item_start;
    __device__ __forceinline__ float at(int i) const {
        const long long j = (long long)item_start + i;
        float acc = 0.0f;
        for (int k = 0; k < Dk; ++k) acc = fmaf(uT[(long long)k * ldu + u], iT[k * ldi + j], acc);
        return acc;
    }
};

// Whether item row is among a user's n_ex sorted excluded rows ex.
__device__ __forceinline__ bool recall_excluded(const long long* ex, long long n_ex, long long row) {
    long long a = 0, b = n_ex;
    while (a < b) {
        const long long m = (a + b) >> 1;
        if (ex[m] < row) a = m + 1; else b = m;
    }
    return a < n_ex && ex[a] == row;
}

template <typename Tile>
struct RecallSources {
    const u64* top; int n_top;
    const u64* cand; int n_cand;
    Tile tile; int n_tile; int item_start; int n_items; float thr;
    const long long* ex; long long n_ex;  // the user's sorted excluded rows, where the tile was not masked
};

template <typename Tile>
__device__ __forceinline__ u64 recall_key_at(const RecallSources<Tile>& s, int i) {
    if (i < s.n_top) return s.top[i];
    i -= s.n_top;
    if (i < s.n_cand) return s.cand[i];
    i -= s.n_cand;
    const int row = s.item_start + i;
    if (row >= s.n_items) return 0ull;
    const float v = s.tile.at(i);
    return (v > s.thr && !recall_excluded(s.ex, s.n_ex, row)) ? recall_key(v, row) : 0ull;
}

// The threads that merge one user: a whole block (WARP false), or one warp of a block of RECALL_MERGE_WARPS
// (recall_merge_warp_body's users whose keys do not fit its registers).
#define RECALL_MERGE_WARPS 8
template <bool WARP>
struct RecallMergeGroup {
    static constexpr int SLOTS = WARP ? RECALL_MERGE_WARPS : 1;
    __device__ __forceinline__ static int slot() { return WARP ? (int)(threadIdx.x >> 5) : 0; }
    __device__ __forceinline__ static int rank() { return WARP ? (int)(threadIdx.x & 31) : (int)threadIdx.x; }
    __device__ __forceinline__ static int size() { return WARP ? 32 : (int)blockDim.x; }
    __device__ __forceinline__ static void sync() {
        if (WARP) __syncwarp(); else __syncthreads();
    }
};

struct RecallMergeShared {
    u64 prefix, mask, min, lo, hi;
    int want, done, count, n, shift;
};

// One group (a block, or a warp) per user u. Dynamic shared memory: K_pad keys a group (K_pad = next power of two
// >= K). The tile (the last n_tile items from item_start) is rescanned only when the candidate buffer overflowed.
// With ex_ptr set (the fused path, whose scores were never masked), candidates of excluded items are dropped here.
template <typename Tile, bool WARP>
__device__ void recall_merge_body(int u, u64* __restrict__ top, int* __restrict__ n_valid, float* __restrict__ thr,
                                  u64* __restrict__ cand, int* __restrict__ cnt, int* __restrict__ base,
                                  Tile tile, int n_tile, int item_start, int n_items,
                                  int K, int K_pad, int C, int high_water, int final_pass,
                                  float* __restrict__ out_vals, long long* __restrict__ out_rows,
                                  const long long* __restrict__ ex_ptr, const long long* __restrict__ ex_items) {
    typedef RecallMergeGroup<WARP> G;
    extern __shared__ u64 sel_all[];
    __shared__ u32 hist_all[G::SLOTS][256];
    __shared__ RecallMergeShared shared_all[G::SLOTS];
    u64* sel = sel_all + (long long)G::slot() * K_pad;
    u32* hist = hist_all[G::slot()];
    RecallMergeShared& sh = shared_all[G::slot()];
    const int tid = G::rank(), nthreads = G::size();

    const int c = cnt[u];
    const bool overflow = c > C;
    if (!final_pass && !overflow && c <= high_water) {
        // Not worth a merge yet: the candidates stay, and the next tile appends after them.
        if (tid == 0) base[u] = c;
        return;
    }
    RecallSources<Tile> src;
    src.top = top + (long long)u * K;
    src.n_top = n_valid[u];
    src.cand = cand + (long long)u * C;
    // On overflow the buffer holds this tile's survivors only in part: keep the earlier tiles' candidates and
    // rescan this tile's row (still resident, or recomputed) instead.
    src.n_cand = overflow ? base[u] : c;
    src.tile = tile;
    src.n_tile = overflow ? n_tile : 0;
    src.item_start = item_start; src.n_items = n_items;
    src.thr = thr[u];
    const int total = src.n_top + src.n_cand + src.n_tile;
    src.ex = nullptr;
    src.n_ex = 0;
    if (ex_ptr != nullptr && ex_ptr[u + 1] > ex_ptr[u]) {
        src.ex = ex_items + ex_ptr[u];
        src.n_ex = ex_ptr[u + 1] - ex_ptr[u];
        u64* mine = cand + (long long)u * C;
        for (int i = tid; i < src.n_cand; i += nthreads) {
            if (recall_excluded(src.ex, src.n_ex, (long long)(~(u32)(mine[i] & 0xffffffffull)))) mine[i] = 0ull;
        }
        G::sync();
    }

    const int lane = tid & 31;
    const unsigned full = 0xffffffffu;
    if (tid == 0) { sh.lo = ~0ull; sh.hi = 0; sh.n = 0; sh.want = K; sh.done = 0; sh.count = 0; sh.min = ~0ull; }
    G::sync();
    // Every loop over the keys runs the same trip count in every thread, so that warps vote and shuffle whole.
    // First: how many keys there are, and the lowest and highest; the digits they share need no histogram.
    {
        u64 lo = ~0ull, hi = 0ull;
        int n = 0;
        for (int i0 = 0; i0 < total; i0 += nthreads) {
            const u64 key = i0 + tid < total ? recall_key_at(src, i0 + tid) : 0ull;
            if (key != 0ull) { lo = min(lo, key); hi = max(hi, key); ++n; }
        }
        for (int off = 16; off > 0; off >>= 1) {
            lo = min(lo, __shfl_xor_sync(full, lo, off));
            hi = max(hi, __shfl_xor_sync(full, hi, off));
            n += __shfl_xor_sync(full, n, off);
        }
        if (lane == 0 && n > 0) { atomicMin(&sh.lo, lo); atomicMax(&sh.hi, hi); atomicAdd(&sh.n, n); }
    }
    G::sync();
    if (tid == 0) {
        if (sh.n <= K) {
            sh.done = 2;  // every valid key is kept
        } else {
            // Keys are unique, so the lowest and highest differ: start at the digit of their highest differing bit.
            const int top_bit = 63 - __clzll((long long)(sh.lo ^ sh.hi));
            const int shift = top_bit & ~7;
            sh.mask = shift == 56 ? 0ull : ~((1ull << (shift + 8)) - 1ull);
            sh.prefix = sh.hi & sh.mask;
            sh.shift = shift;
        }
    }
    G::sync();
    // Radix select of the K-th largest key, 8 bits at a time; stops as soon as every key sharing the chosen prefix
    // is needed (keys are unique, so it stops at the latest on the last digit).
    for (int shift = sh.shift; !sh.done && shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += nthreads) hist[i] = 0;
        G::sync();
        const u64 prefix = sh.prefix, mask = sh.mask;
        for (int i0 = 0; i0 < total; i0 += nthreads) {
            const u64 key = i0 + tid < total ? recall_key_at(src, i0 + tid) : 0ull;
            const bool match = key != 0ull && (key & mask) == prefix;
            const u32 bin = (u32)(key >> shift) & 255u;
            const unsigned voters = __ballot_sync(full, match);
            if (match) {
                // One shared-memory atomic per distinct digit in the warp: near-equal scores share their leading
                // digits, and a plain atomic per key would serialise on one counter.
                const unsigned peers = __match_any_sync(voters, bin);
                if (lane == __ffs(peers) - 1) atomicAdd(&hist[bin], (u32)__popc(peers));
            }
        }
        G::sync();
        if (tid < 32) {
            // Warp 0 finds the digit: lane l sums bins 255 - 8l down to 248 - 8l, a scan over lanes adds up the keys
            // above, and the first lane to reach the wanted count walks its 8 bins.
            u32 c[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) { c[j] = hist[255 - 8 * lane - j]; sum += c[j]; }
            u32 incl = sum;
            for (int off = 1; off < 32; off <<= 1) {
                const u32 v = __shfl_up_sync(full, incl, off);
                if (lane >= off) incl += v;
            }
            const int want = sh.want;
            const int first = __ffs(__ballot_sync(full, incl >= (u32)want)) - 1;
            if (lane == first) {
                u32 above = incl - sum;
                int j = 0;
                while (j < 7 && above + c[j] < (u32)want) above += c[j++];
                const int digit = 255 - 8 * lane - j;
                sh.prefix = prefix | ((u64)digit << shift);
                sh.mask = mask | (0xffull << shift);
                sh.want = want - (int)above;
                if (c[j] == (u32)(want - (int)above)) sh.done = 1;
            }
        }
        G::sync();
    }
    const u64 prefix = sh.prefix, mask = sh.mask;
    const bool take_all = sh.done == 2;
    for (int i0 = 0; i0 < total; i0 += nthreads) {
        const u64 key = i0 + tid < total ? recall_key_at(src, i0 + tid) : 0ull;
        const bool take = key != 0ull && (take_all || (key & mask) >= prefix);
        const unsigned takers = __ballot_sync(full, take);
        if (takers) {
            int pos = 0;
            if (lane == 0) pos = atomicAdd(&sh.count, __popc(takers));
            pos = __shfl_sync(full, pos, 0) + __popc(takers & ((1u << lane) - 1u));
            if (take) sel[pos] = key;
            u64 least = take ? key : ~0ull;
            for (int off = 16; off > 0; off >>= 1) least = min(least, __shfl_xor_sync(full, least, off));
            if (lane == 0) atomicMin(&sh.min, least);
        }
    }
    G::sync();
    const int n_sel = sh.count;

    if (!final_pass) {
        for (int i = tid; i < n_sel; i += nthreads) top[(long long)u * K + i] = sel[i];
        if (tid == 0) {
            n_valid[u] = n_sel;
            // Fewer than K held: the threshold stays (-inf, or the block's seed from its threshold sample).
            if (n_sel == K) thr[u] = recall_ord2f((u32)(sh.min >> 32));
            cnt[u] = 0;
            base[u] = 0;
        }
        return;
    }
    // Final: sort descending (bitonic, padded with empty keys) and write scores and rows, best first; with
    // final_pass 2 the K kept are written as selected, in no order (for a caller that re-ranks them: fast mode's
    // pass, whose candidates are re-scored; at K = 1,251 the sort is 66 phases of 2,048 keys a user).
    const bool best_first = final_pass == 1;
    if (best_first) {
        for (int i = n_sel + tid; i < K_pad; i += nthreads) sel[i] = 0ull;
        G::sync();
    }
    for (int size = 2; best_first && size <= K_pad; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < (K_pad >> 1); i += nthreads) {
                const int lo = 2 * i - (i & (stride - 1));
                const int hi = lo + stride;
                const bool desc = (lo & size) == 0;
                const u64 a = sel[lo], b2 = sel[hi];
                if ((a < b2) == desc) { sel[lo] = b2; sel[hi] = a; }
            }
            G::sync();
        }
    }
    for (int r = tid; r < K; r += nthreads) {
        const u64 key = r < n_sel ? sel[r] : 0ull;
        const long long o = (long long)u * K + r;
        if (key == 0ull) {
            out_vals[o] = RECALL_NEG_INF;
            out_rows[o] = -1;
        } else {
            out_vals[o] = recall_ord2f((u32)(key >> 32));
            out_rows[o] = (long long)(~(u32)(key & 0xffffffffull));
        }
    }
    if (tid == 0) {
        n_valid[u] = 0;
        thr[u] = RECALL_NEG_INF;
        cnt[u] = 0;
        base[u] = 0;
    }
}

// The least key recall_merge_warp_body keeps of n > K unique keys (lo and hi their least and largest, in every lane;
// key[r] of lane l the key r * 32 + l, 0 where there is none, none at r >= R; and the n_extra keys at `extra`, read
// from memory at every count: the keys past the registers, RECALL_MERGE_STREAM_MAX in all at most): a value with
// exactly K keys at or above it, bits fixed from the highest in which the keys differ, two a step (one warp-wide sum
// of three counts, 10 bits each: at most 1,023 keys), stopping at the first value with exactly K keys at or above
// it. The keys at or above it are the K largest whichever value is found (RECALL_MERGE_BITWISE, measurement only:
// one bit a step, one count of every HELD register, as before 2026-12-07).
template <int R, int HELD>
__device__ __forceinline__ u64 recall_warp_least(const u64 (&key)[HELD], u64 lo, u64 hi, int K,
                                                 const u64* __restrict__ extra = nullptr, int n_extra = 0) {
    static_assert(R <= HELD && 32 * HELD < 1024, "the counts' 10-bit fields");
    const int lane = threadIdx.x & 31;
    const int top_bit = 63 - __clzll((long long)(lo ^ hi));
    u64 least = top_bit == 63 ? 0ull : hi & ~((2ull << top_bit) - 1ull);
#if defined(RECALL_MERGE_BITWISE)
    for (int b = top_bit; b >= 0; --b) {
        const u64 trial = least | (1ull << b);
        int above = 0;
#pragma unroll
        for (int r = 0; r < HELD; ++r) above += key[r] >= trial ? 1 : 0;
        for (int i = lane; i < n_extra; i += 32) above += extra[i] >= trial ? 1 : 0;
        above = recall_warp_sum(above);
        if (above >= K) {
            least = trial;
            if (above == K) break;
        }
    }
#else
    int b = top_bit;
    for (; b >= 1; b -= 2) {
        // Trials t1 < t2 < t3: bit b - 1, bit b, both, above least; their counts fall as they rise.
        const u64 t1 = least | (1ull << (b - 1)), t2 = least | (1ull << b), t3 = t1 | t2;
        int packed = 0;
#pragma unroll
        for (int r = 0; r < R; ++r)
            packed += (key[r] >= t1 ? 1 : 0) + (key[r] >= t2 ? 1 << 10 : 0) + (key[r] >= t3 ? 1 << 20 : 0);
        for (int i = lane; i < n_extra; i += 32) {
            const u64 k = extra[i];
            packed += (k >= t1 ? 1 : 0) + (k >= t2 ? 1 << 10 : 0) + (k >= t3 ? 1 << 20 : 0);
        }
        packed = recall_warp_sum(packed);
        const int c1 = packed & 1023, c2 = (packed >> 10) & 1023, c3 = packed >> 20;
        const int c = c3 >= K ? c3 : c2 >= K ? c2 : c1;
        if (c >= K) {
            least = c3 >= K ? t3 : c2 >= K ? t2 : t1;
            if (c == K) return least;
        }
    }
    if (b == 0) {  // an odd number of bits: the last alone
        const u64 trial = least | 1ull;
        int above = 0;
#pragma unroll
        for (int r = 0; r < R; ++r) above += key[r] >= trial ? 1 : 0;
        for (int i = lane; i < n_extra; i += 32) above += extra[i] >= trial ? 1 : 0;
        if (recall_warp_sum(above) >= K) least = trial;
    }
#endif
    return least;
}

// recall_merge_body one warp a user: where the user's buffer did not overflow and its keys (those it keeps and its
// candidates) number at most 32 HELD, each lane holds HELD of them in registers and the warp finds the K-th largest
// two bits a step (recall_warp_least: how many keys lie at or above three trial values, one warp-wide sum a step),
// with no shared memory but the sort of a final pass that writes best first. A user of more keys, up to
// RECALL_MERGE_STREAM_MAX, with nothing excluded, holds its first 32 HELD so and the rest are read from its buffer at
// each count (a few steps, from L1: l2 over 4,096 skewed items at k = 50 sends 4.7% of users more than 256 keys,
// counted on the CPU); the others take recall_merge_body's radix select, one warp a user. The same keys kept, the same
// threshold and results. Dynamic shared memory: K_pad keys a warp. RECALL_MERGE_NO_STREAM (measurement only,
// scripts/lab/kernel_profile.py's `merge-radix`): the radix select past 32 HELD keys, as before 2026-12-07.
#define RECALL_MERGE_STREAM_MAX 1023  // recall_warp_least's counts: 10 bits each
template <typename Tile, int HELD>
__device__ void recall_merge_warp_body(int u, u64* __restrict__ top, int* __restrict__ n_valid,
                                       float* __restrict__ thr, u64* __restrict__ cand, int* __restrict__ cnt,
                                       int* __restrict__ base, Tile tile, int n_tile, int item_start, int n_items,
                                       int K, int K_pad, int C, int high_water, int final_pass,
                                       float* __restrict__ out_vals, long long* __restrict__ out_rows,
                                       const long long* __restrict__ ex_ptr,
                                       const long long* __restrict__ ex_items) {
    const int lane = threadIdx.x & 31;
    const unsigned full = 0xffffffffu;
    const int c = cnt[u];
    const int n_top = n_valid[u];
    const bool any_ex = ex_ptr != nullptr && ex_ptr[u + 1] > ex_ptr[u];
#if defined(RECALL_MERGE_NO_STREAM)
    const int most = 32 * HELD;
#else
    // Kept keys (at most K <= 64) always land in the registers: only candidates are streamed.
    const int most = any_ex ? 32 * HELD : RECALL_MERGE_STREAM_MAX;
#endif
    if (c > C || n_top + c > most) {
        recall_merge_body<Tile, true>(u, top, n_valid, thr, cand, cnt, base, tile, n_tile, item_start, n_items, K,
                                      K_pad, C, high_water, final_pass, out_vals, out_rows, ex_ptr, ex_items);
        return;
    }
    if (!final_pass && c <= high_water) {
        if (lane == 0) base[u] = c;
        return;
    }
    const long long* ex = nullptr;
    long long n_ex = 0;
    if (any_ex) {
        ex = ex_items + ex_ptr[u];
        n_ex = ex_ptr[u + 1] - ex_ptr[u];
    }
    const int total = n_top + c;
#if defined(RECALL_MERGE_NO_STREAM)
    const int in_regs = total;
    constexpr int n_extra = 0;
#else
    const int in_regs = min(total, 32 * HELD);
    const int n_extra = total - in_regs;
#endif
    const int rounds = (in_regs + 31) >> 5;  // the registers in use, the same in every lane
    const u64* kept = top + (long long)u * K;
    const u64* fresh = cand + (long long)u * C;
    // The keys past the registers (candidates only, none excluded), read from the buffer where they are.
    const u64* extra = fresh + (32 * HELD - n_top);
    u64 key[HELD];
    u64 lo = ~0ull, hi = 0ull;
    int held = 0;
#pragma unroll
    for (int r = 0; r < HELD; ++r) {
        const int i = r * 32 + lane;
        u64 k = 0ull;
        if (i < n_top) {
            k = kept[i];
        } else if (i < total) {
            k = fresh[i - n_top];
            if (n_ex > 0 && recall_excluded(ex, n_ex, (long long)(~(u32)(k & 0xffffffffull)))) k = 0ull;
        }
        key[r] = k;
        if (k != 0ull) { lo = min(lo, k); hi = max(hi, k); ++held; }
    }
    for (int i = lane; i < n_extra; i += 32) {
        const u64 k = extra[i];
        if (k != 0ull) { lo = min(lo, k); hi = max(hi, k); ++held; }
    }
    const int n = recall_warp_sum(held);
    // The least key kept: 1 (every valid key) where there are at most K; else the K-th largest, found from the
    // highest bit in which the keys differ (keys are unique), stopping at the first trial value with exactly K keys
    // at or above it.
    u64 least = 1ull;
    if (n > K) {
        for (int off = 16; off > 0; off >>= 1) {
            lo = min(lo, __shfl_xor_sync(full, lo, off));
            hi = max(hi, __shfl_xor_sync(full, hi, off));
        }
        // The registers that hold keys (rounds, the same in every lane) decide the count's width: the route's k = 10
        // pass meets 27 to about 160 keys a user, one to five rounds of HELD = 8.
        if (rounds <= 1)
            least = recall_warp_least<1>(key, lo, hi, K);
        else if (rounds <= 2)
            least = recall_warp_least<2>(key, lo, hi, K);
        else if (rounds <= 4)
            least = recall_warp_least<4>(key, lo, hi, K);
        else if (n_extra == 0)
            least = recall_warp_least<HELD>(key, lo, hi, K);
        else
            least = recall_warp_least<HELD>(key, lo, hi, K, extra, n_extra);
    }
    // Each lane's kept keys at their places: in the state (a fold), in the results (a final pass in no order), or
    // in shared memory to be sorted (best first).
    extern __shared__ u64 sel_all[];
    u64* sel = sel_all + (long long)(threadIdx.x >> 5) * K_pad;
    const bool best_first = final_pass == 1;
    int placed = 0;
    u64 smallest = ~0ull;
    // A round of 32 keys, one a lane (the same `placed` in every lane): those at or above `least` at their places.
    auto place = [&](u64 k) {
        const bool take = k >= least && k != 0ull;
        const unsigned takers = __ballot_sync(full, take);
        const int pos = placed + __popc(takers & ((1u << lane) - 1u));
        if (take) {
            smallest = min(smallest, k);
            if (!final_pass) {
                top[(long long)u * K + pos] = k;
            } else if (best_first) {
                sel[pos] = k;
            } else {
                const long long o = (long long)u * K + pos;
                out_vals[o] = recall_ord2f((u32)(k >> 32));
                out_rows[o] = (long long)(~(u32)(k & 0xffffffffull));
            }
        }
        placed += __popc(takers);
    };
#pragma unroll
    for (int r = 0; r < HELD; ++r)
        if (r < rounds) place(key[r]);
    for (int i0 = 0; i0 < n_extra; i0 += 32) place(i0 + lane < n_extra ? extra[i0 + lane] : 0ull);
    if (!final_pass) {
        if (lane == 0) {
            n_valid[u] = placed;
            cnt[u] = 0;
            base[u] = 0;
        }
        // Fewer than K held: the threshold stays (-inf, or the block's seed from its threshold sample).
        if (placed == K) {
            for (int off = 16; off > 0; off >>= 1) smallest = min(smallest, __shfl_xor_sync(full, smallest, off));
            if (lane == 0) thr[u] = recall_ord2f((u32)(smallest >> 32));
        }
        return;
    }
    if (best_first) {
        // A bitonic sort of the K_pad keys in shared memory (recall_merge_body's), largest first, empty keys (0)
        // last: at most a pair a lane a phase.
        for (int i = placed + lane; i < K_pad; i += 32) sel[i] = 0ull;
        __syncwarp();
        for (int size = 2; size <= K_pad; size <<= 1) {
            for (int stride = size >> 1; stride > 0; stride >>= 1) {
                for (int i = lane; i < (K_pad >> 1); i += 32) {
                    const int a = 2 * i - (i & (stride - 1)), b = a + stride;
                    const bool desc = (a & size) == 0;
                    const u64 x = sel[a], y = sel[b];
                    if ((x < y) == desc) { sel[a] = y; sel[b] = x; }
                }
                __syncwarp();
            }
        }
        for (int r = lane; r < placed; r += 32) {
            const long long o = (long long)u * K + r;
            out_vals[o] = recall_ord2f((u32)(sel[r] >> 32));
            out_rows[o] = (long long)(~(u32)(sel[r] & 0xffffffffull));
        }
    }
    for (int r = placed + lane; r < K; r += 32) {
        const long long o = (long long)u * K + r;
        out_vals[o] = RECALL_NEG_INF;
        out_rows[o] = -1;
    }
    if (lane == 0) {
        n_valid[u] = 0;
        thr[u] = RECALL_NEG_INF;
        cnt[u] = 0;
        base[u] = 0;
    }
}

extern "C" __global__ void recall_merge(u64* __restrict__ top, int* __restrict__ n_valid, float* __restrict__ thr,
                                        u64* __restrict__ cand, int* __restrict__ cnt, int* __restrict__ base,
                                        const float* __restrict__ scores, int U, int T, int B, int item_start,
                                        int n_items, int K, int K_pad, int C, int high_water, int final_pass,
                                        float* __restrict__ out_vals, long long* __restrict__ out_rows) {
    const RecallScoreTile<float> tile = {scores, U, T, (int)blockIdx.x};
    recall_merge_body<RecallScoreTile<float>, false>((int)blockIdx.x, top, n_valid, thr, cand, cnt, base, tile, B * T,
                                                     item_start, n_items, K, K_pad, C, high_water, final_pass,
                                                     out_vals, out_rows, nullptr, nullptr);
}

extern "C" __global__ void recall_merge_h(u64* __restrict__ top, int* __restrict__ n_valid, float* __restrict__ thr,
                                          u64* __restrict__ cand, int* __restrict__ cnt, int* __restrict__ base,
                                          const half_bits* __restrict__ scores, int U, int T, int B, int item_start,
                                          int n_items, int K, int K_pad, int C, int high_water, int final_pass,
                                          float* __restrict__ out_vals, long long* __restrict__ out_rows) {
    const RecallScoreTile<half_bits> tile = {scores, U, T, (int)blockIdx.x};
    recall_merge_body<RecallScoreTile<half_bits>, false>((int)blockIdx.x, top, n_valid, thr, cand, cnt, base, tile,
                                                         B * T, item_start, n_items, K, K_pad, C, high_water,
                                                         final_pass, out_vals, out_rows, nullptr, nullptr);
}

// The merge of the fused path: the segment's n_tile items from item_start are recomputed on overflow, and excluded
// items are dropped when has_excl (ex_ptr then has an entry per user of the block, plus one).
extern "C" __global__ void recall_merge_fused(u64* __restrict__ top, int* __restrict__ n_valid,
                                              float* __restrict__ thr, u64* __restrict__ cand, int* __restrict__ cnt,
                                              int* __restrict__ base, const float* __restrict__ uT, int ldu,
                                              const float* __restrict__ iT, long long ldi, int Dk, int item_start,
                                              int n_tile, int n_items, int K, int K_pad, int C, int high_water,
                                              int final_pass, float* __restrict__ out_vals,
                                              long long* __restrict__ out_rows, const long long* __restrict__ ex_ptr,
                                              const long long* __restrict__ ex_items, int has_excl) {
    const RecallDotTile tile = {uT, ldu, iT, ldi, Dk, (int)blockIdx.x, item_start};
    recall_merge_body<RecallDotTile, false>((int)blockIdx.x, top, n_valid, thr, cand, cnt, base, tile, n_tile,
                                            item_start, n_items, K, K_pad, C, high_water, final_pass, out_vals,
                                            out_rows, has_excl ? ex_ptr : nullptr, ex_items);
}

// The same one warp a user (recall_merge_warp_body), RECALL_MERGE_WARPS users a block of U: HELD keys a lane in
// registers (the kernel's suffix).
#define RECALL_MERGE_FUSED_WARP(NAME, HELD)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * RECALL_MERGE_WARPS)                                            \
    NAME(u64* __restrict__ top, int* __restrict__ n_valid, float* __restrict__ thr, u64* __restrict__ cand,          \
         int* __restrict__ cnt, int* __restrict__ base, const float* __restrict__ uT, int ldu,                       \
         const float* __restrict__ iT, long long ldi, int Dk, int item_start, int n_tile, int n_items, int K,        \
         int K_pad, int C, int high_water, int final_pass, float* __restrict__ out_vals,                             \
         long long* __restrict__ out_rows, const long long* __restrict__ ex_ptr,                                     \
         const long long* __restrict__ ex_items, int has_excl, int U) {                                              \
        const int u = (int)blockIdx.x * RECALL_MERGE_WARPS + (int)(threadIdx.x >> 5);                                \
        if (u >= U) return;                                                                                          \
        const RecallDotTile tile = {uT, ldu, iT, ldi, Dk, u, item_start};                                            \
        recall_merge_warp_body<RecallDotTile, HELD>(u, top, n_valid, thr, cand, cnt, base, tile, n_tile, item_start, \
                                                    n_items, K, K_pad, C, high_water, final_pass, out_vals, out_rows,\
                                                    has_excl ? ex_ptr : nullptr, ex_items);                          \
    }

RECALL_MERGE_FUSED_WARP(recall_merge_fused_w8, 8)
RECALL_MERGE_FUSED_WARP(recall_merge_fused_w16, 16)
