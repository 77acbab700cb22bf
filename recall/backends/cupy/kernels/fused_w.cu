// Fast mode's fused scoring and filtering on Hopper's warpgroup tensor-core instruction (wgmma, sm_90a): the same
// contract as fused_h.cu's recall_fused_filter_h (the same arguments, thresholds, candidate buffers and merge), with
// the products computed by wgmma.mma_async m64n128k16 (float16 inputs, float32 accumulation) instead of mma.sync.
// Compiled after topk.cu, fused.cu and fused_h.cu, in a module of its own built for sm_90a
// (kernels.hopper_module): the candidates it appends are folded in by fused_h.cu's recall_merge_fused_h.
//
// One block of RW_THREADS = 256 threads (two warpgroups) owns 128 users and walks `tiles_per_cta` tiles of 128 items.
// Each warpgroup multiplies its 64 users by the whole tile: KS = Wp / 16 wgmma of k = 16 a tile, both operands from
// shared memory. The users' 128 rows are copied once, for the whole walk (a user's row never changes); the items'
// come through a ring of RW_STAGES_OF(KS) tile buffers filled with cp.async, two tiles ahead (one where rows are
// wider than 96 columns and the ring holds two). Every tile is laid out in the instruction's canonical K-major
// layout without swizzle: 8 x 8 core matrices of 128 contiguous bytes (8 rows of 16 bytes), the core matrices of a
// row group side by side along k (LBO = 128 bytes), row groups CH * 16 bytes apart (SBO). Rows past the users or
// the items, and columns past W, are filled with zeros as they are copied.
//
// A thread then holds 2 users' (rows g and g + 8 of its warp's 16) scores of 32 items each: d[4j + 2h + c] is user
// g + 8h's score of item 8j + 2t + c (g = lane / 4, t = lane % 4), the accumulator layout of mma.m16n8 repeated over
// j = 0..15. Each user's 32 scores are tested in two groups of 16 (RW_GROUP) through their maximum, and a passing
// group's survivors are taken from a bit mask, as in fused_h.cu; they wait in the block's shared memory, a stage a user
// (RecallStaged), and go to the candidate buffers when the block is done. The float32 result of each score is the
// sum of exact products (float16 x float16 fits float32) in the tensor cores' order: the certificate's accumulation
// term (recall/core/certificate.py) covers any order.

#define RW_TILE 128
#define RW_THREADS 256
// Item tiles in flight: three up to 96 columns, two above (two blocks an SM either way: 80 KB at 80 columns,
// 96 KB at 128, 108 KB at 144).
#define RW_STAGES_OF(KS) ((KS) > 6 ? 2 : 3)
// Survivors a user's stage in shared memory holds (RecallStaged): what two blocks an SM leave beside the tiles, 8 bytes
// a key for 128 users (1,024 S bytes) and a count a user (512 bytes), within 113 KB a block (half an SM's 228 KB, less
// the 1 KB reserved a block): 96 at 16 columns, 80 at 32, 64 at 48, 48 at 64, 32 at 80, 16 at 96 and 128, 24 at 112,
// 4 at 144 (fused.py's wgmma_staged follows). A user's survivors past its stage take a global atomic each, so a wider
// stage spares the users that pass the most (l2 over 4,096 skewed items at k = 50: 26% of users pass more than 128
// scores, 32 a block of 8 tiles, counted on the CPU). RW_STAGE32 (measurement only, scripts/lab/kernel_profile.py's
// `stage32`): 32 at every width up to 80, as before 2026-12-07.
#if defined(RW_STAGE32)
#define RW_STAGED_OF(KS) ((KS) <= 5 ? 32 : (KS) == 7 ? 24 : (KS) <= 8 ? 16 : 4)
#else
#define RW_STAGED_OF(KS) \
    ((KS) == 1 ? 96 : (KS) == 2 ? 80 : (KS) == 3 ? 64 : (KS) == 4 ? 48 : (KS) == 5 ? 32 : (KS) == 7 ? 24 \
     : (KS) <= 8 ? 16 : 4)
#endif
// Measurement only (scripts/lab/kernel_profile.py's `sbo-pad16`, fused_w_check.py --defines): bytes of padding after
// each row group of 8 rows, so that the row groups of a tile start on other banks (a multiple of 16, at most 64; the
// stages then hold one survivor fewer a user, so that the kernel takes no more shared memory: fused.py's wgmma_smem
// counts neither).
#ifndef RW_SBO_PAD
#define RW_SBO_PAD 0
#endif
#ifndef RW_A_REGS
#define RW_A_REGS 0
#endif
// Scores of a user tested together through their maximum (recall_append_group's N): 16. Where k is a percent or so
// of the items (k = 50 of 4,096: 1.2% of the scores pass), nearly every group of a warp holds a survivor in some lane,
// and each group's survivors' bits and rounds are taken by the whole warp: two groups of 16 a user a tile cost fewer
// instructions than four of 8 (sass_epilogue.py: 17 + 52 + 37 a round against 13 + 27 + 32), and the route took
// 0.92-0.98x its time with groups of 8 on eight cells, k = 10 and 50, d = 32 and 64 (H100, docs/benchmarks.md).
// Measurement only: 4, 8 (before 2026-12-07) and 32 (scripts/lab/kernel_profile.py's `group4`, `group8`, `group32`).
#ifndef RW_GROUP
#define RW_GROUP 16
#endif

// A block's survivors kept in shared memory a user until the block is done (`out`): a survivor takes the next of
// its user's S slots with a shared-memory atomic; past S it goes to the candidate buffer as fused.cu's RecallPending
// sends it (a global atomic). Then each user's stage goes out with one global atomic. Where the pass keeps a
// percent or more of the items, most users have several survivors in a block's tiles: a global atomic each (on a
// counter every block of the user's row adds to, each survivor's store waiting for its slot) made the kernel
// 1.23-1.41x slower where 2-3% of the items pass (H200, docs/benchmarks.md), and no faster where few do.
template <int S>
struct RecallStaged {
    u64* stage;    // S keys a user of the block, from row 0
    int* count;    // survivors each user of the block took (past S too)
    int u0;        // the block's first user
    RecallPending pending;
    __device__ __forceinline__ void push(u64* __restrict__ cand, int* __restrict__ cnt, int C, int user, u64 key) {
        const int r = user - u0;
        const int pos = atomicAdd(&count[r], 1);
        if (pos < S)
            stage[r * S + pos] = key;
        else
            pending.push(cand, cnt, C, user, key);
    }
    // Measurement only (fused_h.cu's RH_GROUP_RESERVE): n places of the user's stage taken at once, then each key put
    // into its own (past S, into the candidate buffer as push sends it).
    __device__ __forceinline__ int reserve(int* __restrict__, int user, int n) {
        return atomicAdd(&count[user - u0], n);
    }
    __device__ __forceinline__ void put(u64* __restrict__ cand, int* __restrict__ cnt, int C, int user, int slot,
                                       u64 key) {
        if (slot < S)
            stage[(user - u0) * S + slot] = key;
        else
            pending.push(cand, cnt, C, user, key);
    }
    // After every thread's last push and a __syncthreads: thread pairs send each user's stage out (RW_THREADS = 2
    // users' worth of threads), and each thread its pending key.
    __device__ __forceinline__ void out(u64* __restrict__ cand, int* __restrict__ cnt, int C, int tid) {
        const int r = tid >> 1, half = tid & 1;
        const int n = min(count[r], S);
        int base = 0;
        if (n > 0 && half == 0) base = atomicAdd(&cnt[u0 + r], n);  // n > 0: a real user (others pass nothing)
        base = __shfl_sync(0xffffffffu, base, (tid & 31) & ~1);
        u64* dst = cand + (long long)(u0 + r) * C;
        for (int i = half; i < n; i += 2)
            if (base + i < C) dst[base + i] = stage[r * S + i];
        pending.flush(C);
    }
};

__device__ __forceinline__ void recall_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void recall_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void recall_wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void recall_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The shared-memory descriptor of an operand's 16 columns (k) at byte address `addr`: rows of the layout above.
template <int SBO>
__device__ __forceinline__ u64 recall_wgmma_desc(unsigned addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(128u >> 4) << 16) | ((u64)(SBO >> 4) << 32);  // LBO 128, SBO
}

// A warpgroup's 64 x 128 float32 accumulators (64 a thread) as the operands %0..%63 of a wgmma statement: its
// register list and its read-write operands.
#define RW_D64_REGS                                                                                                \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                    \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                          \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                          \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define RW_D64_OPERANDS                                                                                            \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),   \
    "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),        \
    "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),       \
    "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),       \
    "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),       \
    "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),       \
    "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),       \
    "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d (a warpgroup's 64 x 128 float32 tile, 64 a thread) = a b (accumulate == 0) or d + a b, k = 16: a (64 users) and b
// (128 items) from shared memory through their descriptors.
__device__ __forceinline__ void recall_wgmma_64x128(float* d, u64 desc_a, u64 desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
        RW_D64_REGS
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : RW_D64_OPERANDS
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

#if RW_A_REGS
// Measurement only (fused_w_check.py --defines -DRW_A_REGS=1, kernel_profile.py's `a-regs`): the users' operand
// from registers (wgmma's RS form), loaded once from their tile by ldmatrix, so that each product reads only the items'
// tile from shared memory. a[0..3]: the warp's m16k16 fragment of the k-step (mma.m16n8k16's A layout).
__device__ __forceinline__ void recall_wgmma_64x128_rs(float* d, const unsigned (&a)[4], u64 desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
        RW_D64_REGS
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : RW_D64_OPERANDS
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void recall_ldmatrix_x4(unsigned (&a)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(addr));
}
#endif

// 128 rows of M (n rows, W halves each) from row `row0` into the tile at `dst` in the layout above: thread tid copies
// row tid / 2's pieces tid % 2, tid % 2 + 2, ..., piece c of row r to core matrix (r / 8, c). Rows past n and pieces
// past W are zeros. fused_w.cu's, walk_w.cu's and seed_w.cu's tiles alike (rows of CH = 16 KS halves).
template <int KS>
struct RecallWLoader {
    int lr, lc, W;
    unsigned l_off;

    __device__ __forceinline__ RecallWLoader(int tid, int W_) : lr(tid >> 1), lc(tid & 1), W(W_) {
        static_assert(RW_THREADS == 2 * RW_TILE, "a thread copies half a row");
#if RW_SBO_PAD
        l_off = (unsigned)(lr >> 3) * (16u * 16 * KS + RW_SBO_PAD) + ((unsigned)lc << 7) + ((unsigned)(lr & 7) << 4);
#else
        l_off = ((unsigned)((lr >> 3) * 2 * KS + lc) << 7) + ((unsigned)(lr & 7) << 4);  // 2 KS pieces a row
#endif
    }

    __device__ __forceinline__ void operator()(unsigned dst, const half_bits* __restrict__ M, long long row0,
                                               int n) const {
        const bool row_ok = row0 + lr < n;
        const half_bits* src = row_ok ? M + (row0 + lr) * W + lc * 8 : M;
#pragma unroll
        for (int q = 0; q < KS; ++q) {  // KS pieces of 2 KS a thread
            const bool ok = row_ok && (lc + 2 * q) * 8 < W;
            recall_cp16_or_zero(dst + l_off + q * 256u, ok ? src + q * 16 : M, ok);
        }
    }
};

// The walk's and seed_w.cu's first copies: the block's 128 users' rows of U (n_users) from row u0 into the users'
// tile at u_base, and item tiles 0 .. STAGES - 2 of M (n rows, n_tiles tiles) into the ring at i_base, a commit group
// each (the users' tile with the first), for recall_w_step.
template <int KS, int STAGES>
__device__ __forceinline__ void recall_w_prime(const RecallWLoader<KS>& load_tile, unsigned u_base, unsigned i_base,
                                               const half_bits* __restrict__ U, int u0, int n_users,
                                               const half_bits* __restrict__ M, int n, int n_tiles) {
    constexpr unsigned TILE_BYTES = 2u * RW_TILE * 16 * KS + 16u * RW_SBO_PAD;
    load_tile(u_base, U, u0, n_users);
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < n_tiles) load_tile(i_base + st * TILE_BYTES, M, (long long)st * RW_TILE, n);
        recall_cp_commit();
    }
}

// A step of the walk and of seed_w.cu's sample over n_tiles item tiles of M (n rows) from row 0, through a ring of
// STAGES tile buffers at i_base that the caller primed with the first STAGES - 1: waits for tile s (every thread),
// queues tile s + STAGES - 1, and sets d (a warpgroup's 64 x 128) to the users' tile at a_base times tile s.
template <int KS, int STAGES>
__device__ __forceinline__ void recall_w_step(float* d, const RecallWLoader<KS>& load_tile, unsigned a_base,
                                              unsigned i_base, const half_bits* __restrict__ M, int n, int s,
                                              int n_tiles) {
    constexpr unsigned TILE_BYTES = 2u * RW_TILE * 16 * KS + 16u * RW_SBO_PAD;
    constexpr unsigned SBO = 16u * 16 * KS + RW_SBO_PAD;
    recall_cp_wait<STAGES - 2>();
    recall_fence_proxy_async();
    __syncthreads();  // tile s landed for every thread; nobody still reads the buffer refilled next
    if (s + STAGES - 1 < n_tiles)
        load_tile(i_base + (unsigned)((s + STAGES - 1) % STAGES) * TILE_BYTES, M, (long long)(s + STAGES - 1) * RW_TILE,
                  n);
    recall_cp_commit();
    const unsigned b_base = i_base + (unsigned)(s % STAGES) * TILE_BYTES;
    recall_wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
        recall_wgmma_64x128(d, recall_wgmma_desc<SBO>(a_base + ks * 256u), recall_wgmma_desc<SBO>(b_base + ks * 256u),
                            ks);
    recall_wgmma_commit();
    recall_wgmma_wait0();
}

// Dynamic shared memory: 128 users' rows, then RW_STAGES(KS) item tiles, each 128 rows of CH = 16 KS halves in the
// canonical layout above (fused.py's wgmma_smem).
template <int KS>
__device__ __forceinline__ void recall_fused_w_body(const half_bits* __restrict__ U, int n_users,
                                                    const half_bits* __restrict__ I, int n_items, int W,
                                                    int tile0, int n_tiles, int tiles_per_cta,
                                                    const float* __restrict__ thr, u64* __restrict__ cand, int C,
                                                    int* __restrict__ cnt, half_bits* smem) {
    constexpr int CH = 16 * KS;
    constexpr int STAGES = RW_STAGES_OF(KS);
    constexpr int STAGED = RW_STAGED_OF(KS) - (RW_SBO_PAD > 0);  // survivors a user's stage holds (one fewer
    // where row groups are padded: the same shared memory, two blocks an SM)
    constexpr unsigned TILE_BYTES = 2u * RW_TILE * CH + 16u * RW_SBO_PAD;  // a tile of 128 rows (users or items)
    constexpr unsigned SBO = 16u * CH + RW_SBO_PAD;                         // bytes from a row group of 8 to the next
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int u0 = blockIdx.y * RW_TILE;
    const int t_first = tile0 + blockIdx.x * tiles_per_cta;
    const int t_count = min(tiles_per_cta, tile0 + n_tiles - t_first);
    if (t_count <= 0) return;
    const unsigned u_base = recall_smem_addr(smem);
    const unsigned i_base = u_base + TILE_BYTES;

    const RecallWLoader<KS> load_tile(tid, W);
    load_tile(u_base, U, u0, n_users);  // with the first tile's group
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < t_count) load_tile(i_base + st * TILE_BYTES, I, (long long)(t_first + st) * RW_TILE, n_items);
        recall_cp_commit();
    }

    // The warp's 16 users: rows wrow .. wrow + 15 of the block; warpgroup warp / 4 multiplies rows 64 (warp / 4) ..
    const int wrow = (warp >> 2) * 64 + (warp & 3) * 16;
#if !RW_A_REGS
    const unsigned a_base = u_base + (unsigned)(warp >> 2) * 8u * SBO;
#endif
    // Thresholds change only in the merges between launches: read once. +inf past the users: none passes.
    float th[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int user = u0 + wrow + g + 8 * h;
        th[h] = user < n_users ? thr[user] : __int_as_float(0x7f800000);
    }

#if defined(RW_DIRECT_APPEND)  // measurement only (scripts/lab): a global atomic a survivor (shipped until 2026-12-04)
    RecallPending pending = {nullptr, 0, 0ull};
#else
    // The users' stages and counts after the tiles; the counts are zeroed before the loop's first barrier.
    unsigned char* tail = reinterpret_cast<unsigned char*>(smem) + (1 + STAGES) * TILE_BYTES;
    RecallStaged<STAGED> pending = {reinterpret_cast<u64*>(tail),
                                    reinterpret_cast<int*>(tail + 8 * RW_TILE * STAGED), u0, {nullptr, 0, 0ull}};
    if (tid < RW_TILE) pending.count[tid] = 0;
#endif
#if RW_A_REGS
    // The users' tile (in the first group) landed, then the warp's fragments of every k-step read from it: lane l
    // gives the address of row l % 8 of 8 x 8 matrix l / 8 (rows + 8 for odd l / 8, columns + 8 from l / 8 = 2).
    recall_cp_wait<STAGES - 2>();
    __syncthreads();
    unsigned ua[KS][4];
    {
        const int m = lane >> 3;
        const unsigned row_addr = u_base + (unsigned)((wrow >> 3) + (m & 1)) * SBO + ((unsigned)(m >> 1) << 7) +
                                  ((unsigned)(lane & 7) << 4);
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) recall_ldmatrix_x4(ua[ks], row_addr + ks * 256u);
    }
#endif
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.0f;
    for (int s = 0; s < t_count; ++s) {
        recall_cp_wait<STAGES - 2>();
        recall_fence_proxy_async();  // the bytes cp.async wrote are read by the tensor cores (the async proxy)
        __syncthreads();  // tile s has landed for every thread, and no warpgroup still reads the buffer refilled next
        if (s + STAGES - 1 < t_count)
            load_tile(i_base + (unsigned)((s + STAGES - 1) % STAGES) * TILE_BYTES, I,
                      (long long)(t_first + s + STAGES - 1) * RW_TILE, n_items);
        recall_cp_commit();
        const unsigned b_base = i_base + (unsigned)(s % STAGES) * TILE_BYTES;
        recall_wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < KS; ++ks)
#if RW_A_REGS
            recall_wgmma_64x128_rs(d, ua[ks], recall_wgmma_desc<SBO>(b_base + ks * 256u), ks);
#else
            recall_wgmma_64x128(d, recall_wgmma_desc<SBO>(a_base + ks * 256u), recall_wgmma_desc<SBO>(b_base + ks * 256u),
                                ks);
#endif
        recall_wgmma_commit();
        recall_wgmma_wait0();

        const int j0 = (t_first + s) * RW_TILE + 2 * t;  // item of d[0]; d[4j + 2h + c] is item j0 + 8j + c
        const bool whole = (t_first + s) * RW_TILE + RW_TILE <= n_items;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int grp = 0; grp < 32 / RW_GROUP; ++grp) {  // n8 tiles G/2 grp .. G/2 (grp + 1) - 1: G scores
                float sg[RW_GROUP];
#pragma unroll
                for (int q = 0; q < RW_GROUP; ++q) sg[q] = d[2 * RW_GROUP * grp + 4 * (q >> 1) + 2 * h + (q & 1)];
                recall_append_group(sg, th[h], u0 + wrow + g + 8 * h, j0 + 4 * RW_GROUP * grp, whole, n_items, pending,
                                    cand, cnt, C);
            }
    }
#if defined(RW_DIRECT_APPEND)
    pending.flush(C);
#else
    __syncthreads();  // every survivor staged
    pending.out(cand, cnt, C, tid);
#endif
}

// recall_fused_filter_w<16 KS>: rows of 16 KS columns multiplied (Wp), in one stage a tile; the arguments of
// fused_h.cu's kernels (Wp is the kernel's own).
#define RECALL_FUSED_W_KERNEL(KS)                                                                                  \
    extern "C" __global__ void __launch_bounds__(RW_THREADS, 2)                                                    \
    recall_fused_filter_w##KS(const half_bits* __restrict__ U, int n_users, const half_bits* __restrict__ I,        \
                              int n_items, int W, int Wp, int tile0, int n_tiles, int tiles_per_cta,               \
                              const float* __restrict__ thr, u64* __restrict__ cand, int C,                        \
                              int* __restrict__ cnt) {                                                             \
        extern __shared__ float4 recall_fused_w_smem[];                                                           \
        recall_fused_w_body<KS>(U, n_users, I, n_items, W, tile0, n_tiles, tiles_per_cta, thr, cand, C, cnt,        \
                                reinterpret_cast<half_bits*>(recall_fused_w_smem));                               \
    }
RECALL_FUSED_W_KERNEL(1)
RECALL_FUSED_W_KERNEL(2)
RECALL_FUSED_W_KERNEL(3)
RECALL_FUSED_W_KERNEL(4)
RECALL_FUSED_W_KERNEL(5)
RECALL_FUSED_W_KERNEL(6)
RECALL_FUSED_W_KERNEL(7)
RECALL_FUSED_W_KERNEL(8)
RECALL_FUSED_W_KERNEL(9)
