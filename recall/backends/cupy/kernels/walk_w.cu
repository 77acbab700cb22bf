// The walk: a float16 pass of a small K (fast mode's and the certified route's k + margin + 1 candidates, at most
// fused.py's WALK_MAX_K = 32) in which each block of 128 users scores the whole catalogue and keeps its users' K best in shared memory.
// No threshold sample, no candidate buffers, no merges: fused_w.cu's search of a million users against 4,096 items
// spent more of its time in the sample's GEMM and select and in the merges than in its products and filter. Compiled
// after fused_w.cu (its wgmma helpers and tile layout) in a Hopper module of its own (kernels.hopper_walk_module),
// only where a search asks for the walk (EngineOptions.fused_walk, off by default: slower than the segmented search
// as of 2026-12-06, docs/benchmarks.md); the results are the merge's final pass 2 (out_vals / out_rows of K a user,
// in no order, -inf and -1 past a user's candidates).
//
// The products are fused_w.cu's, tile by tile in the same wgmma sequence (the same float32 sums), and the block walks
// its tiles in order of rows. A thread holds 2 users' (h = 0, 1) 32 scores of each tile; the 4 lanes of a quad
// (t = lane % 4) hold a user's 128. Each user has a stage of B slots in shared memory (its scores' order-preserving
// keys, recall_f2ord, and their rows complemented, as recall_key's halves), which its quad alone reads and writes.
// A score passes where it is above the user's threshold (a register of each lane of the quad); the quad appends its
// survivors to the stage through a prefix sum of their counts. Where they do not fit, the warp selects a key at or
// below the stage's K-th best, with at most (B - K) / 3 more above it (recall_walk_compact: a radix select, half a
// warp on a user), keeps the keys at or above it, raises the threshold to its score, and tests the survivors left
// against it. Rows rise tile after tile, so a later item whose score equals the threshold's is never needed: keys
// order equal scores by row, lowest first, as the merge's do. The last step selects K again: the same K keys the segmented search's merges keep (the largest
// keys: ties by row).
//
// Excluded items (ex_ptr / ex_items, a user's sorted rows) are dropped before they are staged: the stage holds no
// key that the results could not.
// Stage slots a user: what two blocks an SM leave beside the users' tile and the item tiles (fused.py's walk_smem).
// An odd multiple of 4 (60 = 28 mod 32, 52 = 20 mod 32): the 8 users of a warp's call (rows g = 0..7 of 8) start on
// banks 4 apart, so that the quads' lanes, writing neighbouring slots, mostly meet other banks; at 64 they shared one.
#define RK_STAGE_OF(KS) ((KS) <= 4 ? 60 : 52)
#if defined(RK_COUNT)  // measurement only (scripts/lab/walk_profile.py): take calls, selections, keys staged
__device__ unsigned long long recall_walk_counts[3];
#define RK_COUNT_ADD(i, n) (t == 0 ? (void)atomicAdd(&recall_walk_counts[i], (unsigned long long)(n)) : (void)0)
#else
#define RK_COUNT_ADD(i, n) ((void)0)
#endif
// Item tiles in flight: three up to 48 columns, two above.
#define RK_STAGES_OF(KS) ((KS) <= 3 ? 3 : 2)

#define RK_ALL 0xffffffffu

// The filter's threshold for keys above `lo` (an order-preserving key of a finite float): a score passes where it
// is above it. -0 becomes the largest negative float, so that +0 (whose key is above -0's) passes; -0 passing too is
// harmless (its key is not above lo, and the next selection drops it).
__device__ __forceinline__ float recall_walk_threshold(u32 lo) {
    const float f = recall_ord2f(lo);
    return __float_as_uint(f) == 0x80000000u ? __uint_as_float(0x80000001u) : f;
}

// One user's stage: `cnt` keys in slots 0 .. cnt - 1 (the same in each lane of its quad), appended by the quad's
// lanes in the order of their prefix sum.
struct RecallWalkStage {
    u32* ord;   // recall_f2ord of each score
    u32* nrow;  // ~row
    int cnt;
};

// A selection and its keep on the stages of the quads of a warp whose `over` is set (the same in a quad's lanes),
// two users at a time, a half warp on each (a lane holds slots l, l + 16, l + 32, l + 48 of its user's stage, l =
// lane % 16, B <= 64): a radix select of the K-th largest key of the user's cnt > K, one bit a step from the highest
// in which its keys differ (each step 4 ballots), which stops as soon as at most K + slack keys lie at or above the
// range left (slack 0: it goes on to the K-th key itself, and where more than K share its score, selects among
// their rows); the stage is left with the keys at or above (lo, rlo), in their order, from slot 0. Returns, to the
// lanes of each quad selected, (lo, rlo, the keys kept); to the others (0, 0, their cnt). Every collective takes the
// whole warp, each loop going round while either half needs it: a quad's own bisection in divergent code, each step a
// count over its 4 lanes' slots and two shuffles, took 20 ms of 1M users x 4,096 items where the walk's products and
// filter took 2.8, a whole warp's radix select a user 14 (H100). Not inlined: the kernel calls it from each of its 8
// score groups a tile, and 8 inlined copies of a selection made a kernel of 16,240 instructions (fused_w.cu's:
// 1,416) whose fetches held it back.
struct RecallWalkKept {
    u32 lo, rlo;
    int cnt;
};

#define RK_HALF_SLOTS 4
__device__ __forceinline__ u32 recall_half_or(u32 x) {
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) x |= __shfl_xor_sync(RK_ALL, x, o);
    return x;
}

__device__ __forceinline__ u32 recall_half_and(u32 x) {
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) x &= __shfl_xor_sync(RK_ALL, x, o);
    return x;
}

// The rank-th largest of a half warp's values v[j] where c[j] (a radix select over the bits below those they all
// share), or where `slack` > 0 the lower end of the first range of values that holds it with at most rank + slack
// values (`exact` false). Leaves c[j] set on the values in that range (equal to it where exact) and rank to the rank
// within them; the half warp's lanes `on` alike.
__device__ __forceinline__ u32 recall_half_radix(const u32 (&v)[RK_HALF_SLOTS], bool (&c)[RK_HALF_SLOTS], int& rank,
                                                 int slack, bool on, unsigned hmask, bool& exact) {
    u32 o = 0u, a = 0xffffffffu;
    int n = 0;
#pragma unroll
    for (int j = 0; j < RK_HALF_SLOTS; ++j) {
        o |= c[j] ? v[j] : 0u;
        a &= c[j] ? v[j] : 0xffffffffu;
        n += __popc(__ballot_sync(RK_ALL, c[j]) & hmask);
    }
    o = recall_half_or(o);
    a = recall_half_and(a);
    int bit = o == a ? -1 : 31 - __clz(o ^ a);
    u32 prefix = bit < 0 ? a : (bit == 31 ? 0u : a & ~((2u << bit) - 1u));
    const bool early = slack > 0 && n - rank <= slack;  // the whole range already: its lower end (where they all
    exact = !(early && bit >= 0);                         // are the same value, that value)
    bool go = on && bit >= 0 && !early;
    while (__any_sync(RK_ALL, go)) {
        bool b[RK_HALF_SLOTS];
        int ones = 0;
#pragma unroll
        for (int j = 0; j < RK_HALF_SLOTS; ++j) {
            b[j] = go && c[j] && ((v[j] >> (bit & 31)) & 1u);
            ones += __popc(__ballot_sync(RK_ALL, b[j]) & hmask);
        }
        if (go) {
            if (ones >= rank) {
#pragma unroll
                for (int j = 0; j < RK_HALF_SLOTS; ++j) c[j] = b[j];
                prefix |= 1u << bit;
                n = ones;
            } else {
                rank -= ones;
#pragma unroll
                for (int j = 0; j < RK_HALF_SLOTS; ++j) c[j] = c[j] && !b[j];
                n -= ones;
            }
            --bit;
            if (bit >= 0 && slack > 0 && n - rank <= slack) {
                exact = false;
                go = false;
            }
            go = go && bit >= 0;
        }
    }
    return prefix;
}

__device__ __noinline__ RecallWalkKept recall_walk_compact(u32* sord, u32* srow, int B, int row_base, int cnt,
                                                           bool over, int K, int slack, int lane) {
    RecallWalkKept mine = {0u, 0u, cnt};
    unsigned todo = __ballot_sync(RK_ALL, over) & 0x11111111u;  // lane 4 g of each quad g selected
    const int half = lane >> 4, l = lane & 15;
    const unsigned hmask = half ? 0xffff0000u : 0x0000ffffu;
    const unsigned below = hmask & ((1u << lane) - 1u);
    while (todo != 0u) {
        const int q0 = __ffs(todo) - 1;
        todo &= todo - 1u;
        const int q1 = todo != 0u ? __ffs(todo) - 1 : -1;
        if (q1 >= 0) todo &= todo - 1u;
        const int q = half ? q1 : q0;  // this half's user: quad q / 4 (-1: none)
        const bool on = q >= 0;
        const int n = __shfl_sync(RK_ALL, cnt, on ? q : 0);
        u32* ord = sord + (row_base + (on ? q >> 2 : 0)) * B;
        u32* nrow = srow + (row_base + (on ? q >> 2 : 0)) * B;
        u32 o[RK_HALF_SLOTS], r[RK_HALF_SLOTS];
        bool c[RK_HALF_SLOTS];
#pragma unroll
        for (int j = 0; j < RK_HALF_SLOTS; ++j) {
            const int i = l + 16 * j;
            c[j] = on && i < n;
            o[j] = c[j] ? ord[i] : 0u;
            r[j] = c[j] ? nrow[i] : 0u;
        }
        int rank = K;
        bool exact;
        const u32 lo = recall_half_radix(o, c, rank, slack, on, hmask, exact);
        // Exact, c holds the keys of lo's score, and the K-th is the rank-th of them by row (the largest ~row).
        int tied = 0;
#pragma unroll
        for (int j = 0; j < RK_HALF_SLOTS; ++j) tied += __popc(__ballot_sync(RK_ALL, c[j]) & hmask);
        const bool by_row = on && exact && tied > rank;
        bool row_exact;
        u32 rlo = 0u;
        if (__any_sync(RK_ALL, by_row)) {
#pragma unroll
            for (int j = 0; j < RK_HALF_SLOTS; ++j) c[j] = c[j] && by_row;
            const u32 rr = recall_half_radix(r, c, rank, 0, by_row, hmask, row_exact);
            if (by_row) rlo = rr;
        }
        int base = 0, p[RK_HALF_SLOTS];
        bool k[RK_HALF_SLOTS];
#pragma unroll
        for (int j = 0; j < RK_HALF_SLOTS; ++j) {
            k[j] = on && l + 16 * j < n && (o[j] > lo || (o[j] == lo && r[j] >= rlo));
            const unsigned bal = __ballot_sync(RK_ALL, k[j]);
            p[j] = base + __popc(bal & below);
            base += __popc(bal & hmask);
        }
        __syncwarp(RK_ALL);  // every slot read before any is written
#pragma unroll
        for (int j = 0; j < RK_HALF_SLOTS; ++j)
            if (k[j]) {
                ord[p[j]] = o[j];
                nrow[p[j]] = r[j];
            }
        __syncwarp(RK_ALL);
        // Each half's result to its quad's lanes (lane 0 holds half 0's, lane 16 half 1's).
        const u32 lo0 = __shfl_sync(RK_ALL, lo, 0), lo1 = __shfl_sync(RK_ALL, lo, 16);
        const u32 rlo0 = __shfl_sync(RK_ALL, rlo, 0), rlo1 = __shfl_sync(RK_ALL, rlo, 16);
        const int kept0 = __shfl_sync(RK_ALL, base, 0), kept1 = __shfl_sync(RK_ALL, base, 16);
        if ((lane >> 2) == (q0 >> 2)) mine = {lo0, rlo0, kept0};
        if (q1 >= 0 && (lane >> 2) == (q1 >> 2)) mine = {lo1, rlo1, kept1};
    }
    return mine;
}

// A user's 8 scores s[q] (rows row0 + 8 (q >> 1) + (q & 1)) into its stage: `bits` the ones above its threshold th.
// Every lane of the warp calls it (the prefix sums shuffle across each quad); the quads whose survivors do not fit
// select, keep, raise th and test what is left, until all are staged or dropped.
__device__ __forceinline__ void recall_walk_take(const float (&s)[8], unsigned bits, int row0, RecallWalkStage& st,
                                                 float& th, int K, int B, int t, int lane, u32* sord, u32* srow,
                                                 int row_base) {
    while (__any_sync(RK_ALL, bits != 0u)) {
        const int c = __popc(bits);
        int p = c;  // the quad's inclusive prefix sum of the counts
        int y = __shfl_up_sync(RK_ALL, p, 1, 4);
        if (t >= 1) p += y;
        y = __shfl_up_sync(RK_ALL, p, 2, 4);
        if (t >= 2) p += y;
        const int tot = __shfl_sync(RK_ALL, p, 3, 4);
        const int room = B - st.cnt;
        int pos = st.cnt + p - c;
        while (bits != 0u && pos < B) {
            const int q = __ffs(bits) - 1;
            bits &= bits - 1u;
            float v = s[0];
#pragma unroll
            for (int r = 1; r < 8; ++r) v = q == r ? s[r] : v;
            st.ord[pos] = recall_f2ord(v);
            st.nrow[pos] = ~(u32)(row0 + 8 * (q >> 1) + (q & 1));
            ++pos;
        }
        __syncwarp(RK_ALL);
        st.cnt = min(B, st.cnt + tot);
        RK_COUNT_ADD(2, min(tot, room));
        const bool over = tot > room;  // the same in the quad's lanes
#if defined(RK_SKIP_COMPACT)  // measurement only: survivors past a full stage dropped, no selection
        if (over) bits = 0u;
        continue;
#endif
        if (__any_sync(RK_ALL, over)) {
            RK_COUNT_ADD(1, over ? 1 : 0);
            const RecallWalkKept kept = recall_walk_compact(sord, srow, B, row_base, st.cnt, over, K, (B - K) / 3,
                                                            lane);
            if (over) {
                st.cnt = kept.cnt;
                th = recall_walk_threshold(kept.lo);
                // This group's survivors left: those of keys from lo's score on, since rows within a group
                // interleave across the quad (a row below a kept one of the same score belongs among the K); later
                // groups' rows all lie above the stage's, so that they need scores above lo's (th).
                unsigned still = 0u;
#pragma unroll
                for (int q = 0; q < 8; ++q) still |= (recall_f2ord(s[q]) >= kept.lo ? 1u : 0u) << q;
                bits &= still;
            }
        }
    }
}

// `bits` (scores q of rows row0 + 8 (q >> 1) + (q & 1)) less the rows among a user's n_ex sorted excluded rows ex.
// Not inlined, as recall_walk_compact.
__device__ __noinline__ unsigned recall_walk_unexcluded(unsigned bits, int row0, const long long* ex, int n_ex) {
    for (unsigned b = bits; b != 0u; b &= b - 1u) {
        const int q = __ffs(b) - 1;
        if (recall_excluded(ex, n_ex, row0 + 8 * (q >> 1) + (q & 1))) bits &= ~(1u << q);
    }
    return bits;
}

template <int KS>
__device__ __forceinline__ void recall_walk_w_body(const half_bits* __restrict__ U, int n_users,
                                                   const half_bits* __restrict__ I, int n_items, int W, int K,
                                                   float* __restrict__ out_vals, long long* __restrict__ out_rows,
                                                   const long long* __restrict__ ex_ptr,
                                                   const long long* __restrict__ ex_items, int has_excl,
                                                   half_bits* smem) {
    constexpr int CH = 16 * KS;
    constexpr int STAGES = RK_STAGES_OF(KS);
    constexpr int B = RK_STAGE_OF(KS);
    constexpr unsigned TILE_BYTES = 2u * RW_TILE * CH + 16u * RW_SBO_PAD;  // as fused_w.cu's (recall_w_step)
    constexpr unsigned SBO = 16u * CH + RW_SBO_PAD;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int u0 = blockIdx.x * RW_TILE;
    const int n_tiles = (n_items + RW_TILE - 1) / RW_TILE;
    const unsigned u_base = recall_smem_addr(smem);
    const unsigned i_base = u_base + TILE_BYTES;

    const RecallWLoader<KS> load_tile(tid, W);  // fused_w.cu's tiles
    recall_w_prime<KS, STAGES>(load_tile, u_base, i_base, U, u0, n_users, I, n_items, n_tiles);

    const int wrow = (warp >> 2) * 64 + (warp & 3) * 16;
    const unsigned a_base = u_base + (unsigned)(warp >> 2) * 8u * SBO;
    u32* sord = reinterpret_cast<u32*>(reinterpret_cast<unsigned char*>(smem) + (1 + STAGES) * TILE_BYTES);
    u32* srow = sord + RW_TILE * B;
    RecallWalkStage stage[2];
    float th[2];
    const long long* ex[2];
    int n_ex[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = wrow + g + 8 * h, user = u0 + r;
        stage[h] = {sord + r * B, srow + r * B, 0};
        th[h] = user < n_users ? RECALL_NEG_INF : __int_as_float(0x7f800000);  // +inf past the users: none passes
        ex[h] = ex_items;
        n_ex[h] = 0;
        if (has_excl && user < n_users) {
            ex[h] = ex_items + ex_ptr[user];
            n_ex[h] = (int)(ex_ptr[user + 1] - ex_ptr[user]);
        }
    }

    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.0f;
    for (int s = 0; s < n_tiles; ++s) {
        recall_w_step<KS, STAGES>(d, load_tile, a_base, i_base, I, n_items, s, n_tiles);

        const int j0 = s * RW_TILE + 2 * t;  // d[4j + 2h + c] is item j0 + 8j + c
        const bool whole = s * RW_TILE + RW_TILE <= n_items;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int grp = 0; grp < 4; ++grp) {
                float s8[8];
#pragma unroll
                for (int q = 0; q < 8; ++q) s8[q] = d[16 * grp + 4 * (q >> 1) + 2 * h + (q & 1)];
                float m = s8[0];
#pragma unroll
                for (int q = 1; q < 8; ++q) m = fmaxf(m, s8[q]);
                unsigned bits = 0u;
                if (m > th[h]) {
#pragma unroll
                    for (int q = 0; q < 8; ++q) bits |= (s8[q] > th[h] ? 1u : 0u) << q;
                    const int row0 = j0 + 32 * grp;
                    if (!whole) {
#pragma unroll
                        for (int q = 0; q < 8; ++q)
                            if (row0 + 8 * (q >> 1) + (q & 1) >= n_items) bits &= ~(1u << q);
                    }
                    if (n_ex[h] > 0 && bits != 0u) bits = recall_walk_unexcluded(bits, row0, ex[h], n_ex[h]);
                }
#if defined(RK_NO_TAKE)  // measurement only: the products and the filter's tests, nothing staged
                if (__any_sync(0xffffffffu, bits != 0u)) th[h] = fmaxf(th[h], RECALL_NEG_INF);
#else
                if (__any_sync(0xffffffffu, bits != 0u)) {
                    RK_COUNT_ADD(0, 1);
                    recall_walk_take(s8, bits, j0 + 32 * grp, stage[h], th[h], K, B, t, lane, sord, srow,
                                     wrow + 8 * h);
                }
#endif
            }
    }

    // Exactly K keys a user (fewer where fewer items passed), written in slot order; -inf and -1 after them.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = wrow + g + 8 * h, user = u0 + r;
        RecallWalkStage& st = stage[h];
        const bool more = user < n_users && st.cnt > K;
        if (__any_sync(RK_ALL, more))
            st.cnt = recall_walk_compact(sord, srow, B, wrow + 8 * h, st.cnt, more, K, 0, lane).cnt;
        if (user >= n_users) continue;  // the quad's 4 lanes alike
        for (int i = t; i < K; i += 4) {
            const long long o = (long long)user * K + i;
            if (i < st.cnt) {
                out_vals[o] = recall_ord2f(st.ord[i]);
                out_rows[o] = (long long)(~st.nrow[i]);
            } else {
                out_vals[o] = RECALL_NEG_INF;
                out_rows[o] = -1;
            }
        }
    }
}

// recall_walk_w<KS>: rows of 16 KS columns multiplied, KS = 1 .. 5; grid ceil(n_users / 128) blocks of RW_THREADS.
#define RECALL_WALK_W_KERNEL(KS)                                                                                   \
    extern "C" __global__ void __launch_bounds__(RW_THREADS, 2)                                                    \
    recall_walk_w##KS(const half_bits* __restrict__ U, int n_users, const half_bits* __restrict__ I, int n_items,  \
                      int W, int K, float* __restrict__ out_vals, long long* __restrict__ out_rows,                \
                      const long long* __restrict__ ex_ptr, const long long* __restrict__ ex_items, int has_excl) { \
        extern __shared__ float4 recall_walk_w_smem[];                                                            \
        recall_walk_w_body<KS>(U, n_users, I, n_items, W, K, out_vals, out_rows, ex_ptr, ex_items, has_excl,       \
                               reinterpret_cast<half_bits*>(recall_walk_w_smem));                                 \
    }
RECALL_WALK_W_KERNEL(1)
RECALL_WALK_W_KERNEL(2)
RECALL_WALK_W_KERNEL(3)
RECALL_WALK_W_KERNEL(4)
RECALL_WALK_W_KERNEL(5)
