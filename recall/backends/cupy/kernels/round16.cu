// Fast mode's users in float16 (certificate.round16, the arithmetic of record): one warp a row of n rows of d float32
// values (row strides vstride and ostride, in elements), each scaled by its row's power of two s (exact in float64)
// and rounded to the nearest float16 (one rounding, from float64), written to out16; and per row, in float64, the
// norms of the row v, of its rounding residual a - v (a = the float16 value / s, exact) and of a. The NumPy form of
// the same on CuPy arrays made each of these a pass of its own over an (n, d) float64 array (a dozen, with their
// launches: 3.1 ms of a 27 ms search of 200k users x 64 dimensions on the H200, docs/benchmarks.md). The sums differ
// from NumPy's in order only (relative 2^-50 or so, far inside the certificate's 1% safety: certificate._SAFETY).
extern "C" __global__ void __launch_bounds__(256)
recall_round16(const float* __restrict__ vecs, long long vstride, unsigned short* __restrict__ out16,
               long long ostride, const double* __restrict__ scale, int n, int d, double* __restrict__ norm,
               double* __restrict__ resid, double* __restrict__ norm16) {
    const int r = blockIdx.x * 8 + (int)(threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= n) return;  // the whole warp
    const double s = scale[r];
    const float* row = vecs + (long long)r * vstride;
    unsigned short* out = out16 + (long long)r * ostride;
    double sv = 0.0, se = 0.0, sa = 0.0;
    for (int i = lane; i < d; i += 32) {
        const double v = (double)row[i];
        unsigned short h;
        asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(v * s));
        out[i] = h;
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        const double a = (double)f / s, e = a - v;
        sv += v * v;
        se += e * e;
        sa += a * a;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        sv += __shfl_xor_sync(0xffffffffu, sv, o);
        se += __shfl_xor_sync(0xffffffffu, se, o);
        sa += __shfl_xor_sync(0xffffffffu, sa, o);
    }
    if (lane == 0) {
        norm[r] = sqrt(sv);
        resid[r] = sqrt(se);
        norm16[r] = sqrt(sa);
    }
}
