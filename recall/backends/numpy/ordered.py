"""The fused exact kernel's float32 sums on the CPU: ``fma(u_0, v_0, 0)``, then ``fma(u_d, v_d, s)`` for every
further dimension in order, each rounded once to float32 (round to nearest even), as ``fmaf`` does.

The CPU's scores are these wherever BLAS's blocked kernels compute them too (:func:`blas_sums`, probed once per
dimension): OpenBLAS on an AVX-512 Xeon keeps one accumulator per score and adds the dimensions in order, up to its
panel depth (448); deeper, it sums panel by panel, the same way for every score, and the CPU then scores every
product with BLAS's blocked kernels (:func:`blas_products`: rows padded where BLAS would take another kernel), so
that every score is still one float32 sum of its user and item wherever it is computed (then not the GPU's in-order
sum: the last bits may differ). Where BLAS's sums depend on the score's place in the product (OpenBLAS's Haswell
kernels, which it takes on an AMD EPYC under ``OPENBLAS_CORETYPE=Haswell``), every product is summed here, at about
half BLAS's speed (four rows at a time), and most searches of many users take BLAS's products first and re-score
what they keep here (``NumpyBackend._blas_first``).

Compiled by numba around LLVM's ``llvm.fma.f32`` (a fused multiply-add, correctly rounded on every target: the
processor's instruction where it has one). These are the sums of the GPU's fused kernel (``kernels/fused.cu``'s
``RecallDotTile``) bit for bit, and of BLAS's matrix products on the CPU where a product is large enough for its
blocked kernels where :func:`blas_sums` finds them "ordered"; its matrix-vector and small-matrix kernels sum in
another order, which depends on the item's place in the product (``NumpyBackend.gemm_strided_batched`` leaves those
products to :func:`ordered_products`).
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


#: Items a block of four rows sums at once in :func:`ordered_products` (each row's chains in a scratch row of this
#: many float32, 4 KiB: the four in the first-level cache), and the fewest rows and items it takes that form for.
ROW_BLOCK_ITEMS = 1024
ROW_BLOCK_MIN_ITEMS = 64


@njit(nogil=True, cache=True)
def _four_rows(u, items_t, out, i0, a0, a1, a2, a3):
    """Rows i0..i0+3 of ``u`` (n, D) against ``items_t`` (D, w), into ``out`` (n, w): dimension by dimension, each
    row's chains with ROW_BLOCK_ITEMS items held in a scratch row (``a0``..``a3``), the four sharing each load of the
    items' coordinates; the inner loop over items is one FMA a chain, which the compiler takes in vector registers
    (the same operation on every lane: each chain's sum is unchanged)."""
    dim, w = items_t.shape
    block = a0.shape[0]
    for j0 in range(0, w, block):
        nj = min(block, w - j0)
        for j in range(nj):
            a0[j] = np.float32(0.0)
            a1[j] = np.float32(0.0)
            a2[j] = np.float32(0.0)
            a3[j] = np.float32(0.0)
        for d in range(dim):
            x0, x1, x2, x3 = u[i0, d], u[i0 + 1, d], u[i0 + 2, d], u[i0 + 3, d]
            row = items_t[d, j0:j0 + nj]
            for j in range(nj):
                r = row[j]
                a0[j] = _fma(x0, r, a0[j])
                a1[j] = _fma(x1, r, a1[j])
                a2[j] = _fma(x2, r, a2[j])
                a3[j] = _fma(x3, r, a3[j])
        for j in range(nj):
            out[i0, j0 + j] = a0[j]
            out[i0 + 1, j0 + j] = a1[j]
            out[i0 + 2, j0 + j] = a2[j]
            out[i0 + 3, j0 + j] = a3[j]


@njit(nogil=True, cache=True)
def ordered_products(users, items, out):
    """``out[t] = users[t or 0] @ items[t].T`` as the FMA chains, from +0 (a chain never ends at -0: an exact
    cancellation gives +0): users (1 or b, n, D), items (b, w, D), out (b, n, w), all float32. Rows four at a time
    against the items transposed (:func:`_four_rows`: 20-27 G multiply-adds a second on a core of an AMD EPYC,
    3-4x the chains below) where there are four rows and ROW_BLOCK_MIN_ITEMS items; the other rows eight items at a
    time: eight independent chains, so that the FMAs' latency is hidden."""
    b, w, dim = items.shape
    n = users.shape[1]
    shared = users.shape[0] == 1
    blocked = n >= 4 and w >= ROW_BLOCK_MIN_ITEMS
    block = min(w, ROW_BLOCK_ITEMS)
    size = block if blocked else 0
    a0, a1, a2, a3 = np.empty(size, np.float32), np.empty(size, np.float32), np.empty(size, np.float32), \
        np.empty(size, np.float32)
    for t in range(b):
        ut = 0 if shared else t
        first = 0
        if blocked:
            items_t = np.ascontiguousarray(items[t].T)
            first = n - n % 4
            for i0 in range(0, first, 4):
                _four_rows(users[ut], items_t, out[t], i0, a0, a1, a2, a3)
        for i in range(first, n):
            j0 = 0
            while j0 + 8 <= w:
                a0_ = a1_ = a2_ = a3_ = a4 = a5 = a6 = a7 = np.float32(0.0)
                for d in range(dim):
                    x = users[ut, i, d]
                    a0_ = _fma(x, items[t, j0, d], a0_)
                    a1_ = _fma(x, items[t, j0 + 1, d], a1_)
                    a2_ = _fma(x, items[t, j0 + 2, d], a2_)
                    a3_ = _fma(x, items[t, j0 + 3, d], a3_)
                    a4 = _fma(x, items[t, j0 + 4, d], a4)
                    a5 = _fma(x, items[t, j0 + 5, d], a5)
                    a6 = _fma(x, items[t, j0 + 6, d], a6)
                    a7 = _fma(x, items[t, j0 + 7, d], a7)
                out[t, i, j0] = a0_
                out[t, i, j0 + 1] = a1_
                out[t, i, j0 + 2] = a2_
                out[t, i, j0 + 3] = a3_
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


BLOCKED_PRODUCT = 1 << 20
"""Multiply-adds above which a product of two or more rows and more than SMALL_OUTPUTS scores takes BLAS's blocked
kernels (OpenBLAS's small-matrix kernels take products of up to 10^6)."""
SMALL_OUTPUTS = 2048
"""Scores (rows x items) up to which BLAS may take a product to its small-matrix kernels whatever the multiply-adds
(OpenBLAS 0.3.31 on an AVX-512 Xeon: up to 1,200 scores of at least 32 dimensions, whose sums depend on the item's
place in the product)."""


def blocked_rows(n: int, w: int, dim: int) -> int:
    """Rows that a product of ``n`` rows against ``w`` items of ``dim`` dimensions needs for BLAS's blocked kernels:
    ``n`` itself where it is blocked already, else more (zero rows padded)."""
    return max(2, n, -(-(BLOCKED_PRODUCT + 1) // max(1, w * dim)), -(-(SMALL_OUTPUTS + 1) // max(1, w)))


def _probe_data(dim: int, rows: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """Users (1, rows, dim) and items (1, w, dim) of many exponents, so that another order of summation shows."""
    rng = np.random.default_rng(dim)
    users = (rng.standard_normal((1, rows, dim)) * np.exp2(rng.integers(-8, 8, (1, rows, dim)))).astype(np.float32)
    items = (rng.standard_normal((1, w, dim)) * np.exp2(rng.integers(-8, 8, (1, w, dim)))).astype(np.float32)
    return users, items


def _blas_equals_ordered(dim: int) -> bool:
    """Whether BLAS's blocked product of 64 items of ``dim`` dimensions with enough rows is the ordered sums, bit for
    bit."""
    users, items = _probe_data(dim, blocked_rows(64, 64, dim), 64)
    by_blas = np.matmul(users, items.transpose(0, 2, 1))
    ordered = np.empty_like(by_blas)
    ordered_products(users, items, ordered)
    return bool(np.array_equal(by_blas, ordered))


#: (first row, first item) of the windows :func:`_blas_place_free` compares with the whole product.
_WINDOWS = ((1, 0), (0, 1), (3, 5), (8, 16), (17, 40))


def _blas_place_free(dim: int) -> bool:
    """Whether BLAS's blocked kernels give every score of ``dim`` dimensions the same sum wherever it lies in the
    product: windows of a product, each at another row and item offset (:data:`_WINDOWS`), against the whole."""
    w = 64
    rows = blocked_rows(64, w, dim)
    users, items = _probe_data(dim, rows + 32, w + 64)
    whole = np.empty((1, rows + 32, w + 64), np.float32)
    blas_products(users, items, whole)
    for r, c in _WINDOWS:
        part = np.empty((1, rows, w), np.float32)
        blas_products(users[:, r:r + rows], items[:, c:c + w], part)
        if not np.array_equal(part, whole[:, r:r + rows, c:c + w]):
            return False
    return True


def blas_sums(dim: int) -> str:
    """How BLAS's blocked kernels sum products of ``dim`` dimensions, at the number of threads BLAS has now
    (OpenBLAS splits the dimensions by its threads too; ``NumpyBackend`` asks at the searches' one thread), from
    products of a few hundred rows, a millisecond or so:

    - ``"ordered"``: the ordered sums, bit for bit (OpenBLAS on an AVX-512 Xeon up to 448 dimensions);
    - ``"blocked"``: another order, but the same one for every score wherever it lies in the product (that BLAS
      deeper than its panels, which it sums panel by panel);
    - ``"placed"``: an order that depends on the score's place in the product (OpenBLAS 0.3.31's Haswell kernels,
      which it takes on an AMD EPYC with AVX-512: from 8 dimensions), so that neither BLAS's product nor a part of it
      can stand for the search's scores."""
    if _blas_equals_ordered(dim):
        return "ordered"
    return "blocked" if _blas_place_free(dim) else "placed"


def blas_products(users, items, out) -> None:
    """``out[t] = users[t or 0] @ items[t].T`` by BLAS's blocked kernels whatever the shape: users (1 or b, n, D),
    items (b, w, D), out (b, n, w), float32. A product BLAS would give its matrix-vector or small-matrix kernels
    (whose sums depend on the item's place in the product) is computed with zero rows padded up to a blocked one
    (:func:`blocked_rows`; one item: two)."""
    b, w, dim = items.shape
    n = users.shape[1]
    rows = blocked_rows(n, w, dim)
    if rows == n and w >= 2:
        np.matmul(users, items.transpose(0, 2, 1), out=out)
        return
    padded = np.zeros((users.shape[0], rows, dim), np.float32)
    padded[:, :n] = users
    if w < 2:
        items = np.concatenate([items, np.zeros((b, 2 - w, dim), np.float32)], axis=1)
    full = np.matmul(padded, items.transpose(0, 2, 1))
    out[...] = full[:, :n, :w]
