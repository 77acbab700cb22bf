// The users' check before a search (CupyBackend.largest_norm): the largest squared Euclidean norm of the rows of a
// float32 (n, dim) matrix of unit column stride, in one launch. One warp a row (rows strided over the grid's warps),
// the squares summed in float64 (exact products of float32 values; the sum's order is this kernel's own), the warp's
// largest kept as the bits of a double: non-negative doubles order as their bit patterns, and a NaN's bits (either
// sign) exceed +inf's, so that a row with a NaN or an infinity makes the result NaN or +inf. *out starts at 0.
//
// A row's squares summed by its warp (every lane gets the sum): each lane's squares of columns lane, lane + 32, ... in
// float64 (exact products of float32 values), then the lanes' sums by a butterfly. Both kernels below sum so.
__device__ __forceinline__ double recall_row_sq(const float* __restrict__ row, int dim, int lane) {
    double s = 0.0;
    for (int i = lane; i < dim; i += 32) {
        const double v = (double)row[i];
        s += v * v;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

extern "C" __global__ void __launch_bounds__(256)
recall_largest_norm_sq(const float* __restrict__ vecs, long long stride, long long n, int dim,
                       unsigned long long* __restrict__ out) {
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const int lane = threadIdx.x & 31;
    unsigned long long best = 0ull;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n; r += warps) {
        const double s = recall_row_sq(vecs + r * stride, dim, lane);
        const unsigned long long bits = (unsigned long long)__double_as_longlong(s);
        best = bits > best ? bits : best;
    }
    if (lane == 0 && best != 0ull) atomicMax(out, best);
}

// Row norms (CupyBackend.row_norms: cosine's scaling, l2's finished scores): the Euclidean norm of each row of a
// float32 (n, dim) matrix of unit column stride, into float64 out (n,), in one launch. One warp a row (rows strided
// over the grid's warps), summed by recall_row_sq: the order is this kernel's own, recall_largest_norm_sq's
// (metrics.row_norms' array operations, a float64 square of every value written to memory and then summed, made the
// certified route 2.9-4.7% slower on 1M-2M l2 and cosine users x 4,096 items, H100, docs/benchmarks.md).
extern "C" __global__ void __launch_bounds__(256)
recall_row_norms(const float* __restrict__ vecs, long long stride, long long n, int dim, double* __restrict__ out) {
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const int lane = threadIdx.x & 31;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n; r += warps) {
        const double s = recall_row_sq(vecs + r * stride, dim, lane);
        if (lane == 0) out[r] = sqrt(s);
    }
}
