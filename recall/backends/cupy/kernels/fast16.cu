// Fast mode's users in float16, with what their certificates need (certificate.prepare_users, the arithmetic of
// record, whose symbols this follows): one launch for all (a warp 32 users, below). Per user u of n (rows of
// `users`, float32, row stride ustride; the first D0 columns the dot part), into out16 (n, W) float16 (every column
// written):
//   alpha = 2^(13 - floor(log2 max|y_i|)) (1 for a zero row), capped at cap_bias (the bias's cap; +inf without) and,
//           with a shift S_u, at 2^floor(shift_room - log2 max(|S_u|, 2^-900)) (exactly, from the exponents);
//   the dot part fl16(alpha y_i) (one rounding, from float64), and in float64 |y|, |delta y|, |a|;
//   p, q, rest; the shift column sigma_u = fl16(clip(-S_u alpha beta / 2^15)) and offset A_u; the bias columns e_u;
//   the bound columns' factors (rounded up to float16), or the bound through the items' maxima where they do not fit;
//   for items rounded about a centre c (float64, D0 values; null where not centred), y.c and sum |y_i c_i| as the
//   warp's sums: the shift is taken in scores of y.(x - c), y.c comes back through the offset, and the float32
//   scores' own error goes with |y|.|x| (its own bound column, or the items' largest norm);
//   users split along the centre's direction (proj_dir, float64, D0 values; null where not split): p = y.c^ summed
//   column by column (each lane its own user's, in the reference's order), the dot part then holds y' = y - p c^
//   (alpha from y', capped at 2^floor(proj_room - log2 max(|p|, 2^-900))), the columns proj_at.. the two float16
//   parts (P1, P2, P1) of P = p alpha beta / proj_scale, and the bound their terms.
// Every float64 step is the reference's own, in its order (the module is built with --fmad=false, so that no product
// and sum fuse), except the sums over a row (the norms, y.c and sum |y_i c_i|; not p, which each lane sums in
// order), which run in another order (relative 2^-50 or so: far inside the certificate's 1% safety,
// certificate._SAFETY; the centre's own error term, D0 2^-52 sum |y_i c_i|, holds for a sum in any order). The NumPy
// form on CuPy arrays cost about 75 launches a block of users (3.0 ms of a 22 ms search of 200k users x 64
// dimensions on the H200, docs/benchmarks.md).
#define F16_TINY 5.9604644775390625e-08  // 2^-24
#define F16_MAX 65504.0

__device__ __forceinline__ unsigned short fast16_f16(double x) {
    unsigned short h;
    asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(x));
    return h;
}

__device__ __forceinline__ double fast16_f64(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return (double)f;
}

// A float32 value in float64, exactly, subnormals too (a conversion built with -ftz would flush them to 0).
__device__ __forceinline__ double fast16_widen(float f) {
    const unsigned b = __float_as_uint(f);
    if ((b & 0x7f800000u) != 0u) return (double)f;
    const double m = ldexp((double)(b & 0x7fffffu), -149);
    return (b >> 31) ? -m : m;
}

// floor(log2 x) of a positive finite double, exactly.
__device__ __forceinline__ int fast16_floor_log2(double x) {
    int e;
    frexp(x, &e);  // x = m 2^e, m in [0.5, 1)
    return e - 1;
}

// certificate._up16: a float16 value >= v (v >= 0, float64).
__device__ __forceinline__ unsigned short fast16_up(double v) {
    if (!(v > 0.0)) return 0;
    return fast16_f16(fmin(v * (1.0 + 0.0009765625) + F16_TINY, F16_MAX));
}

// 2^floor(room - log2 m), m = max(|x|, 2^-900), at most 2^1000 (certificate._room_cap): room - ceil(log2 m), from
// the exponent (m = frac 2^e, frac in [0.5, 1): ceil(log2 m) = e - (frac == 0.5)).
__device__ __forceinline__ double fast16_room_cap(double x, int room) {
    int e;
    const double frac = frexp(fmax(fabs(x), ldexp(1.0, -900)), &e);
    return ldexp(1.0, min(room - (e - (frac == 0.5 ? 1 : 0)), 1000));
}

__device__ __forceinline__ double fast16_warp_sum(double x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// A warp owns 32 users (a block 256): it converts their rows one at a time, all lanes over the columns, and lane i
// keeps user i's maximum and sums; then each lane runs its own user's remaining steps (the shift, bias and bound
// columns, alpha, offset, the bound) at once. A warp a user left those steps to lane 0 alone, 31 lanes idle through
// some 400 float64 instructions: 0.78 ms for 1M users x 64 dimensions, mostly that tail (H100, docs/benchmarks.md).
// The columns past D0 are written here too (zeros, then the tail's own), so the caller need not zero `out16`.
// (At least 3 blocks an SM: ptxas then takes 72 registers; held to 64 for 4, it spilled 8 bytes once the centre came.)
extern "C" __global__ void __launch_bounds__(256, 3)
recall_prepare_users(const float* __restrict__ users, long long ustride, int n, int D0,
                     unsigned short* __restrict__ out16, int W, const double* __restrict__ shift, int shifted,
                     const double* __restrict__ centre, double full_max_norm,
                     const double* __restrict__ proj_dir, int proj_at, double proj_scale, double proj_max,
                     double proj_err, double proj_w1_max, double proj_w2_max, int proj_room,
                     int shift_at, int bias_at, int norms_at, int n_aux,
                     double beta, double cap_bias, double bias_scale, double gamma16, double gamma32, double rest0,
                     double flush, double max_norm, double max_resid, double bias_err_max, double bias_max,
                     double safety, double aux_user_max, double shift_item, double shift_user_max, int shift_room,
                     double sc0, double sc1, double sc2,
                     double* __restrict__ alpha_out, double* __restrict__ offset_out, double* __restrict__ bound_out) {
    const int lane = threadIdx.x & 31;
    const int first = (blockIdx.x * 8 + (int)(threadIdx.x >> 5)) * 32;
    if (first >= n) return;  // the whole warp
    const int last = min(first + 32, n);
    // This lane's user's (first + lane) sums and scale, kept as the warp passes it.
    double my_sv = 0.0, my_se = 0.0, my_sa = 0.0, my_alpha = 1.0, my_s = 0.0, my_yc = 0.0, my_ya = 0.0, my_sf = 0.0;
    // p = y.c^ of this lane's user, column by column: the order of the reference's sum.
    double my_p = 0.0;
    if (proj_dir && first + lane < last) {
        const float* row = users + (long long)(first + lane) * ustride;
        for (int i = 0; i < D0; ++i) my_p = my_p + fast16_widen(row[i]) * proj_dir[i];
    }
    for (int u = first; u < last; ++u) {
        const float* row = users + (long long)u * ustride;
        unsigned short* out = out16 + (long long)u * W;
        const double pu = __shfl_sync(0xffffffffu, my_p, u - first);
        double mx = 0.0;  // in float64, as every step below: no float32 operation flushes a subnormal to 0 (-ftz)
        double yc = 0.0, ya = 0.0;  // y.c and sum |y_i c_i| (centred items)
        for (int i = lane; i < D0; i += 32) {
            const double v = fast16_widen(row[i]);
            mx = fmax(mx, fabs(proj_dir ? v - pu * proj_dir[i] : v));
            if (centre) {
                const double c = centre[i];
                yc += v * c;
                ya += fabs(v) * fabs(c);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        if (centre) {
            yc = fast16_warp_sum(yc);
            ya = fast16_warp_sum(ya);
        }
        double alpha = mx > 0.0 ? ldexp(1.0, 13 - fast16_floor_log2(mx)) : 1.0;
        alpha = fmin(alpha, cap_bias);
        if (proj_dir) alpha = fmin(alpha, fast16_room_cap(pu, proj_room));
        // A shift asked for in scores of y.x is one of y.(x - c) less y.c.
        const double s_u = shifted ? shift[u] - yc : 0.0;
        if (shifted) alpha = fmin(alpha, fast16_room_cap(s_u, shift_room));
        // a / alpha as a product where alpha is a power of two (always, but for a cap_bias that is not): its
        // reciprocal is then exact (alpha, at most 2^1000, is a normal float64), and each product rounds the
        // quotient's exact value as the division does.
        int e_alpha;
        const bool pow2 = frexp(alpha, &e_alpha) == 0.5;
        const double inv = 1.0 / alpha;
        double sv = 0.0, se = 0.0, sa = 0.0, sf = 0.0;  // sv over what the dot part holds (y'), sf over y
        for (int i = lane; i < D0; i += 32) {
            const double y = fast16_widen(row[i]);
            const double v = proj_dir ? y - pu * proj_dir[i] : y;
            const unsigned short h = fast16_f16(v * alpha);
            out[i] = h;
            const double a = pow2 ? fast16_f64(h) * inv : fast16_f64(h) / alpha, e = a - v;
            sv += v * v;
            se += e * e;
            sa += a * a;
            sf += y * y;
        }
        for (int i = D0 + lane; i < W; i += 32) out[i] = 0;
        sv = fast16_warp_sum(sv);
        se = fast16_warp_sum(se);
        sa = fast16_warp_sum(sa);
        if (proj_dir) sf = fast16_warp_sum(sf);
        if (lane == u - first) {
            my_sv = sv;
            my_se = se;
            my_sa = sa;
            my_sf = sf;
            my_alpha = alpha;
            my_s = s_u;
            my_yc = yc;
            my_ya = ya;
        }
    }
    __syncwarp();  // the zeros past D0 before the columns below
    const int u = first + lane;
    if (u >= last) return;
    unsigned short* out = out16 + (long long)u * W;
    const double alpha = my_alpha, s_u = my_s;
    const double ab = alpha * beta;
    const double norm = sqrt(my_sv), resid = sqrt(my_se), norm16 = sqrt(my_sa);
    const double full = proj_dir ? sqrt(my_sf) : norm;  // |y| (norm: |y'| where split)
    // The factor of n_v; centred, of n'_v, and g = gamma32 |y| + flush that of the vectors' own n_v (the float32
    // scores; flush: certificate.flush_factor, inputs below 2^-126 read as 0); split, y' - (y - p c^) adds
    // 2^-52 (|p| + |y'|).
    const double g = gamma32 * full + flush;
    double p = centre ? resid + gamma16 * norm16 : resid + gamma16 * norm16 + g;
    if (proj_dir) p = p + 2.220446049250313080847263336181640625e-16 * (fabs(my_p) + norm);
    const double q = norm + resid + gamma16 * norm16;              // the factor of r_v
    double rest = rest0 + flush * full, offset = 0.0;
    if (shift_at >= 0 && shifted) {
        const double sigma = fmin(fmax(-s_u * ab / shift_item, -shift_user_max), shift_user_max);
        const unsigned short h = fast16_f16(sigma);
        out[shift_at] = h;
        offset = fast16_f64(h) * shift_item / ab;
        rest = rest + gamma16 * fabs(offset);
    }
    if (centre) {
        // y.c in float64 within D0 2^-53 sum |y_i c_i| of its value (taken twice); A_u - y.c and the certificate's
        // float64 steps at its magnitude round by a few 2^-53 of |A_u| + |y.c| (taken 2^-50).
        rest = rest + D0 * 2.220446049250313080847263336181640625e-16 * my_ya
                    + 8.8817841970012523233890533447265625e-16 * (fabs(offset) + fabs(my_yc));
        offset = offset - my_yc;
    }
    if (proj_dir) {
        // P = p alpha beta / proj_scale in two float16 parts against the items' (W1, W1, W2).
        const double big = my_p * ab / proj_scale;
        const unsigned short h1 = fast16_f16(big);
        const double p1 = fast16_f64(h1);
        const unsigned short h2 = fast16_f16(big - p1);
        const double p2 = fast16_f64(h2);
        out[proj_at] = h1;
        out[proj_at + 1] = h2;
        out[proj_at + 2] = h1;
        const double missed = fabs(p1 + p2 - big) * proj_scale / ab;  // |p~ - p|
        rest = rest + (missed * proj_max + fabs(my_p) * proj_err
                       + (fabs(p2) * proj_w2_max + gamma16 * (fabs(p1) + fabs(p2)) * (proj_w1_max + proj_w2_max)) / ab);
    }
    bool kept = true;
    double through_bias = gamma32 * bias_max;
    if (bias_at >= 0) {
        const double e_u = ab / bias_scale;
        kept = e_u >= F16_TINY;
        const unsigned short h = fast16_f16(kept ? e_u : 0.0);
        out[bias_at] = h;
        out[bias_at + 1] = h;
        through_bias = kept ? bias_err_max : bias_max * (1 + gamma32);
    }
    double through = p * max_norm + q * max_resid + through_bias + rest;
    if (centre) through = through + g * full_max_norm;
    const double through_max = safety * through;
    alpha_out[u] = alpha;
    offset_out[u] = offset;
    if (norms_at < 0) {
        bound_out[u] = through_max;
        return;
    }
    // The third column: the bias's (1) or, centred (never with a bias), the vectors' own norms' (g).
    const double factor[3] = {p, q, centre ? g : 1.0}, sc[3] = {sc0, sc1, sc2};
    unsigned short col[3] = {0, 0, 0};
    bool fits = kept;
#pragma unroll
    for (int j = 0; j < 3; ++j) {
        if (j < n_aux) {
            col[j] = fast16_up(safety * factor[j] * ab / sc[j]);
            fits = fits && fast16_f64(col[j]) <= aux_user_max;
        }
    }
#pragma unroll
    for (int j = 0; j < 3; ++j) {
        if (j < n_aux) out[norms_at + j] = fits ? col[j] : (unsigned short)0;
    }
    // The columns' 1% pays for their own accumulation term (certificate's docstring): R_u is rest alone.
    bound_out[u] = fits ? safety * rest : through_max;
}

// One more than the last column in which some row of `h` (n rows of w float16, C order) holds a value other than
// +-0, into *last (atomicMax; 0 before the launch; left 0 where every value is 0): the columns a fused float16 pass
// multiplies (fused.multiplied_width). One warp a row at a time, each lane every 32nd column.
extern "C" __global__ void __launch_bounds__(256)
recall_last_column(const unsigned short* __restrict__ h, long long n, int w, int* __restrict__ last) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    int best = 0;
    for (long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < n; r += warps) {
        const unsigned short* row = h + r * w;
        for (int c = lane; c < w; c += 32)
            if (row[c] & 0x7fffu) best = max(best, c + 1);
    }
    for (int o = 16; o; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
    if (lane == 0 && best) atomicMax(last, best);
}
