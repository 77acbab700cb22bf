"""The fused exact kernel's float32 sums on the CPU: ``fma(u_0, v_0, 0)``, then ``fma(u_d, v_d, s)`` for every
further dimension in order, each rounded once to float32 (round to nearest even), as ``fmaf`` does.

Compiled by numba around LLVM's ``llvm.fma.f32`` (a fused multiply-add, correctly rounded on every target: the
processor's instruction where it has one). These are the sums of the GPU's fused kernel (``kernels/fused.cu``'s
``RecallDotTile``) bit for bit, and of BLAS's matrix products on the CPU where a product is large enough for its
blocked kernels (OpenBLAS on x86 keeps one accumulator per score and adds the dimensions to it in order, one FMA
each); its matrix-vector and small-matrix kernels sum in another order, which depends on the item's place in the
product (``NumpyBackend.gemm_strided_batched`` leaves those products to :func:`ordered_products`).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types, vectorize
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def _fma(typingctx, a, b, c):  # noqa: ARG001 (numba's signature)
    """``fmaf(a, b, c)``: float32 arguments, one rounding."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):  # noqa: ARG001
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32")
        return builder.call(fn, args)

    return sig, codegen


@vectorize(["float32(float32, float32, float32)"], nopython=True, cache=True)
def fma32(a, b, c):
    """``fmaf(a, b, c)`` elementwise: float32 ``a``, ``b``, ``c`` (broadcast) -> float32, rounded once."""
    return _fma(a, b, c)


@njit(nogil=True, cache=True)
def ordered_products(users, items, out):
    """``out[t] = users[t or 0] @ items[t].T`` as the FMA chains, from +0 (a chain never ends at -0: an exact
    cancellation gives +0): users (1 or b, n, D), items (b, w, D), out (b, n, w), all float32. Eight items at a
    time: eight independent chains, so that the FMAs' latency is hidden."""
    b, w, dim = items.shape
    n = users.shape[1]
    shared = users.shape[0] == 1
    for t in range(b):
        ut = 0 if shared else t
        for i in range(n):
            j0 = 0
            while j0 + 8 <= w:
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
                for d in range(dim):
                    x = users[ut, i, d]
                    a0 = _fma(x, items[t, j0, d], a0)
                    a1 = _fma(x, items[t, j0 + 1, d], a1)
                    a2 = _fma(x, items[t, j0 + 2, d], a2)
                    a3 = _fma(x, items[t, j0 + 3, d], a3)
                    a4 = _fma(x, items[t, j0 + 4, d], a4)
                    a5 = _fma(x, items[t, j0 + 5, d], a5)
                    a6 = _fma(x, items[t, j0 + 6, d], a6)
                    a7 = _fma(x, items[t, j0 + 7, d], a7)
                out[t, i, j0] = a0
                out[t, i, j0 + 1] = a1
                out[t, i, j0 + 2] = a2
                out[t, i, j0 + 3] = a3
                out[t, i, j0 + 4] = a4
                out[t, i, j0 + 5] = a5
                out[t, i, j0 + 6] = a6
                out[t, i, j0 + 7] = a7
                j0 += 8
            for j in range(j0, w):
                a = np.float32(0.0)
                for d in range(dim):
                    a = _fma(users[ut, i, d], items[t, j, d], a)
                out[t, i, j] = a


def ordered_dots(users: np.ndarray, vecs: np.ndarray) -> np.ndarray:
    """users (n, D) float32, vecs (n, w, D) float32 -> (n, w) float32: each user's FMA chain with each of its w
    vectors."""
    n, w, _ = vecs.shape
    out = np.empty((n, 1, w), np.float32)
    ordered_products(np.ascontiguousarray(users, np.float32)[:, None, :], np.ascontiguousarray(vecs, np.float32), out)
    return out.reshape(n, w)
