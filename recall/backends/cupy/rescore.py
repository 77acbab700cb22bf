"""Per-user candidate re-scoring in one kernel (``kernels/rescore.cu``): a thread block per user stages its candidate
rows, reads each candidate vector once from the resident item matrix, computes its dot product and keeps the best k
in shared memory with a radix select. The job is memory-bound; this path reads the candidate vectors once and writes
nothing but the results, where gather + GEMM writes and re-reads the gathered copy.

Launch shape, measured on the H200 on S5 (100k users x 1,000 own candidates x 64; docs/benchmarks.md): 128 threads
per user, each lane keeping 2 rows x 2 float4 loads in flight, registers capped at 40 (six blocks share an SM):
5.99 ms for the kernel, against 7.36 ms for 4 x 2 loads at 256 threads and 10.14 ms for the first kernel (index
loads in the gather loop, a full bitonic sort of each chunk).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...core import keys
from .. import candidates
from . import kernels

THREADS = 128
_UNROLL, _CHUNKS, _MAX_REGISTERS, _MAX_REGISTERS_STAGED = 2, 2, 40, 48
_SZ_TARGET = 4096  # keys held at once per user: candidates per chunk, up to this
_DEFAULT_SMEM = 48 * 1024


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _kernel(vec: bool, ordered: bool = False) -> Any:
    """The compiled ``recall_rescore_t`` for the current device; ``vec``: rows read as float4 (dim % 4 == 0);
    ``ordered``: the fused exact kernel's sums (one lane a candidate, its row read by its warp)."""
    # The same loads in flight per lane either way (ptxas, sm_90: 40 registers, no spills); ordered sums take one
    # lane a candidate, whose warp reads 32 rows' pieces into shared memory: with ``vec`` 4 float4 a lane at a time
    # (rs_gather_ordered), otherwise 8 floats (rs_gather_ordered_scalar). They need 48 registers (no spills; an
    # SM's registers still hold ten blocks of 128).
    regs = _MAX_REGISTERS_STAGED if ordered else _MAX_REGISTERS
    expr = f"recall_rescore_t<{_UNROLL}, {_CHUNKS}, {int(vec)}, {int(ordered)}>"
    mod = kernels.module(("rescore.cu",), (f"--maxrregcount={regs}",), (expr,))
    return mod.get_function(expr)


#: Re-scoring of lists of at most this many candidates, for k up to it, takes a warp a user
#: (``recall_rescore_warp_t``, rescore.cu's RS_WARP_KEYS) instead of a block.
WARP_KEYS = 128
_WARP_THREADS = 128  # four users a block


def _warp_kernel(vec: bool) -> Any:
    expr = f"recall_rescore_warp_t<{int(vec)}>"
    return kernels.module(("rescore.cu",), (), (expr,)).get_function(expr)


def warp_smem_bytes(dim: int) -> int:
    """Dynamic shared memory of a block of ``recall_rescore_warp_t`` (four warps, rescore.cu's layout): each warp's
    keys, stage, user's vector and rows."""
    return (_WARP_THREADS // 32) * (8 * WARP_KEYS + 4 * _ORD_STAGE + 4 * ((dim + 3) // 4 * 4) + 4 * WARP_KEYS)


def takes_warp(k: int, longest: int, dim: int) -> bool:
    """Whether a launch re-scores a warp a user: at most WARP_KEYS candidates a user, k <= WARP_KEYS, and the warps'
    shared memory within a block's default (dim up to 1,536). The warp sums in exact mode's order, so an unordered
    launch gets ordered sums there (float32 sums as exact): on 1M users x 4,096 items x 64 at k = 10 (27 candidates
    a user) fast mode took 0.0226 s in the block kernel where exact precision's route, the same passes with the warp,
    took 0.0207 s (H100, gpu-quick cell 25, docs/benchmarks.md)."""
    return dim > 0 and k <= WARP_KEYS and longest <= WARP_KEYS and warp_smem_bytes(dim) <= _DEFAULT_SMEM


def lanes(dim: int, ordered: bool = False) -> int:
    """Lanes per candidate: the fewest (a power of two <= 32) that cover the row in one round of ``_CHUNKS`` loads
    per lane, so that every load is issued before the first use. dim 64: 8 lanes x 2 float4; each warp load then
    reads four rows' 128-byte halves, whole cache lines. Ordered sums: 1 (a lane adds every product itself)."""
    if ordered:
        return 1
    chunks = dim // 4 if dim % 4 == 0 else dim
    return min(32, _pow2(-(-max(chunks, 1) // _CHUNKS)))


_ORD_STAGE = 32 * (32 + 4)  # floats a warp stages for ordered sums (RS_ORD_STAGE in rescore.cu)


def smem_bytes(sz: int, dim: int, ordered: bool = False, k_pad: int = 0) -> int:
    """Dynamic shared memory of one block (the layout in rescore.cu): SZ keys and 6 control words (8 bytes each),
    for ordered sums each warp's stage of 32 rows' pieces (at least max(SZ, K_pad) bytes: the duplicate flags reuse
    it), the user's vector, a scratch of 4 * SZ bytes or the selected K_pad keys if more (staged rows, then the
    selected keys), a 256-bin histogram, max(SZ, K_pad) duplicate flags (where there is no stage; SZ may be fewer
    than K_pad where every list is shorter than k). Ordered sums whose K_pad selected keys fit in the stage (K_pad up
    to 2,048) keep them there and the flags in the scratch, of 4 * SZ bytes or the flags' if more."""
    staged = ordered  # (the launcher never gives ordered sums precomputed scores)
    flags = -(-max(sz, k_pad) // 16) * 16  # the duplicate flags of the select's keys or of the K_pad selected
    room = 4 * _ORD_STAGE * (THREADS // 32)
    if staged and 8 * k_pad <= room:  # the selected keys in the stage, the flags in the scratch
        stage, scratch = room, max(4 * sz, flags)
    else:
        stage, scratch = (max(room, flags) if staged else 0), max(4 * sz, 8 * k_pad)
    return 8 * (sz + 6) + stage + 4 * ((dim + 3) // 4 * 4) + scratch + 4 * 256 + (0 if staged else flags)


def _max_smem() -> int:
    import cupy

    try:
        return int(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                        cupy.cuda.Device().id))
    except Exception:  # an older runtime without the attribute: the default every device has
        return _DEFAULT_SMEM


#: Keys a launch holds where every list fits in one chunk: the longest list rounded up to a multiple of this (the
#: kernel's sort takes any length there). At k = 2,048 the certified route's lists of 2,113 then take 2,144 keys:
#: with the selected keys in the stage (smem_bytes), 45,488 bytes of shared memory a block, five blocks an SM on a
#: Hopper (228 KB, 1 KB reserved a block), where 2,176 keys (a multiple of 128) would need 45,872 bytes and allow
#: four; 67 KB at 4,096 keys allowed three.
SZ_STEP = 32


def launch_config(k: int, dim: int, longest: int, ordered: bool = False) -> tuple[int, int, int] | None:
    """(K_pad, SZ, shared bytes) for a launch, or None when k needs more shared memory than the device has. SZ: the
    keys held at once, every list in one chunk where they fit in SZ_STEP-rounded room no larger than the chunked
    layout's (a power of two, at least 2 K_pad: the best so far beside the next chunk)."""
    k_pad = _pow2(k)
    chunked = max(2 * k_pad, min(_pow2(max(longest, 1)), _SZ_TARGET))
    whole = -(-max(longest, 1) // SZ_STEP) * SZ_STEP
    sz = min(whole, chunked)  # whole <= chunked: one chunk; else chunks of `chunked` keys
    smem = smem_bytes(sz, dim, ordered, k_pad)
    if smem > _DEFAULT_SMEM and smem > _max_smem():
        return None
    return k_pad, sz, smem


def _launch(users: Any, items: Any, dim: int, scores: Any, indptr: Any, rows: Any, k: int,
            cfg: tuple[int, int, int] | None, out_vals: Any, out_rows: Any, ordered: bool = False) -> None:
    """One ``recall_rescore_t`` launch over the users of ``indptr`` (``dim`` 0 when ``scores`` are given: no user
    vector in shared memory, which is how ``cfg`` was sized); ``cfg`` None: ``recall_rescore_warp_t``'s
    (``takes_warp``)."""
    n = int(indptr.size) - 1
    if n <= 0:
        return
    if cfg is None:  # a warp a user (takes_warp)
        _warp_kernel(dim % 4 == 0)((-(-n // (_WARP_THREADS // 32)),), (_WARP_THREADS,),
                                   (users, items, np.int32(dim), indptr, rows, np.int32(k), np.int32(n), out_vals,
                                    out_rows), shared_mem=warp_smem_bytes(dim))
        return
    k_pad, sz, smem = cfg
    kern = _kernel(dim % 4 == 0, ordered)
    threads = min(THREADS, int(kern.max_threads_per_block) // 32 * 32)
    if smem > _DEFAULT_SMEM:
        kern.max_dynamic_shared_size_bytes = smem
    scores_arg = scores if scores is not None else np.uint64(0)  # a null pointer: compute the dot products
    kern((n,), (threads,), (users, items, np.int32(dim), scores_arg, indptr, rows, np.int32(k), np.int32(k_pad),
                            np.int32(sz), np.int32(lanes(dim, ordered) if dim > 0 else 1), out_vals, out_rows),
         shared_mem=smem)


def rescore_fused(users: Any, items: Any, indptr: np.ndarray | int, rows: Any, k: int, out_vals: Any, out_rows: Any,
                  budget: int, ordered: bool = False) -> bool:
    """Score and select on the GPU in one kernel per block of users; False when k or n_items is beyond the kernel.

    users : (n, dim) float32 device; items : (n_items, dim) float32 device; indptr : host int64 (n + 1,), or an int
    w (every list w rows long); rows : int64 item rows, host or device; out_vals / out_rows : (n, k) device arrays,
    C-contiguous. Device rows are read in place; host rows are uploaded in blocks of users whose rows fit in
    ``budget``. ``ordered``: every score is the fused exact kernel's sum (``Backend.rescore``).
    """
    import cupy

    n_items, dim = int(items.shape[0]), int(items.shape[1])
    n = int(users.shape[0])
    width = candidates.list_width(indptr)
    if width is None:
        lengths = np.diff(indptr)
        longest = int(lengths.max()) if lengths.size else 1
    else:
        longest = max(width, 1) if n else 1
    warp = takes_warp(k, longest, dim)
    cfg = None if warp else launch_config(k, dim, longest, ordered)
    if (cfg is None and not warp) or n_items >= 2 ** 31:
        return False
    if not isinstance(rows, np.ndarray):
        # Lists of one length (the certified route's) have their offsets made on the device: the launch, queued
        # behind the pass that writes ``rows``, then waits for no copy from the host.
        offsets = (cupy.arange(n + 1, dtype=cupy.int64) * width if width is not None else cupy.asarray(indptr))
        _launch(users, items, dim, None, offsets, rows, k, cfg, out_vals, out_rows, ordered)
        return True
    indptr = candidates.csr_indptr(indptr, n)
    per_block = max(1, budget // 8)
    start = 0
    while start < n:
        # The most users from `start` whose candidate rows fit in the budget (at least one user).
        stop = int(np.searchsorted(indptr, indptr[start] + per_block, side="right")) - 1
        stop = min(n, max(stop, start + 1))
        lo, hi = int(indptr[start]), int(indptr[stop])
        _launch(users[start:stop], items, dim, None, cupy.asarray(indptr[start:stop + 1] - lo),
                cupy.asarray(rows[lo:hi]), k, cfg, out_vals[start:stop], out_rows[start:stop], ordered)
        start = stop
    return True


def select(scores: Any, rows: Any, k: int) -> tuple[Any, Any]:
    """``keys.select`` on the GPU: the rescore kernel fed with precomputed scores of a padded (n, width) block."""
    import cupy

    n, width = rows.shape
    cfg = launch_config(k, 0, width)
    if cfg is None:
        return keys.select(cupy, scores, rows, k)
    vals = cupy.empty((n, k), cupy.float32)
    out = cupy.empty((n, k), cupy.int64)
    indptr = cupy.arange(n + 1, dtype=cupy.int64) * width
    scores = cupy.ascontiguousarray(scores)
    _launch(scores, scores, 0, scores, indptr, cupy.ascontiguousarray(rows), k, cfg, vals, out)
    return vals, out


def ordered_dots(users: Any, vecs: Any) -> Any:
    """users (n, dim), vecs (n, w, dim) float32 device -> (n, w) float32: the fused exact kernel's sums
    (``recall_ordered_dots``), for the gather path of ``Backend.rescore(..., ordered=True)``."""
    import cupy

    n, w, dim = vecs.shape
    out = cupy.empty((n, w), cupy.float32)
    total = n * w
    if total:
        kern = kernels.module(("rescore.cu",), (), ()).get_function("recall_ordered_dots")
        kern((-(-total // 256),), (256,), (cupy.ascontiguousarray(users), cupy.ascontiguousarray(vecs),
                                         np.int64(total), np.int32(w), np.int32(dim), out))
    return out
