"""Per-user candidate re-scoring: each user against its own candidate item rows, keeping the best k.

Candidate lists come from other retrievers, business rules or a previous stage, one list per user, of any length.
``Engine.rescore`` scores every user only against its own candidates and returns the same ``SearchResult`` as
``Engine.search``: best first, ties to the lower item row, padded with (-1, -inf) where a user has fewer than k
distinct candidates. Duplicates in a list count once.

Two ways to run a block of users, behind the backend seam:

- **gather + GEMM** (every backend; the CPU's path): users sorted by list length are cut into blocks whose padded
  ``(users, longest list, dim)`` gather fits the memory budget; the block's candidate vectors are gathered, scored with
  ONE strided-batched GEMM (batch = users, one user row each: ``backend.gemm_strided_batched``), and each row's best
  k are selected by ``backend.rescore_select`` (64-bit keys that order like the tie rule).
- **fused** (backends with ``rescore_fused``: the GPU): one kernel per launch, one thread block per user, reads each
  candidate vector once from the resident item matrix, computes its dot product and keeps the best k in shared
  memory (``recall/kernels/rescore.cu``). The job is memory-bound; this path reads the candidate vectors once and
  writes nothing but the results, where gather + GEMM writes and re-reads the gathered copy.
  ``RECALL_RESCORE=gemm`` forces the GEMM path on the GPU too (to compare the two); ``RECALL_RESCORE_THREADS``
  (default 128) sets the fused kernel's threads per user and ``RECALL_RESCORE_VARIANT`` (default "select-lean", see
  ``VARIANTS``) its variant; ``scripts/gpu_rescore_sweep.py`` times them.

``rescore_files`` is the Parquet-to-Parquet job behind ``recall rescore``.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np
import pyarrow as pa

from . import metrics
from .errors import InputError
from .result import SearchResult, id_lookup

#: ``RECALL_RESCORE``: "fused" (default) or "gemm", the GPU's path (the CPU always gathers and runs the GEMM).
MODES = ("fused", "gemm")

# Workspace of the gather + GEMM path per padded candidate slot: the gathered vector, its score, its row (and the
# sorted copy of the rows), and the 64-bit keys of the selection with the copy the sort makes.
_SLOT_BYTES_FIXED = 4 + 8 + 8 + 16


def _mode() -> str:
    mode = os.environ.get("RECALL_RESCORE", "fused").strip().lower() or "fused"
    if mode not in MODES:
        raise InputError(f"RECALL_RESCORE={mode!r}: expected one of {', '.join(MODES)}")
    return mode




# --------------------------------------------------------------------------------------------------------------------
# Candidates


@dataclass(frozen=True)
class Candidates:
    """Candidate lists as CSR over user rows, validated (every row in range), duplicates still in.

    Attributes
    ----------
    indptr : np.ndarray of int64, shape (n_users + 1,)
        On the host: user ``u``'s candidates are ``rows[indptr[u]:indptr[u + 1]]``.
    rows : array of int64, shape (nnz,)
        Item rows; NumPy, or a device array when the caller passed device arrays to a GPU engine.
    """

    indptr: np.ndarray
    rows: Any

    @property
    def nnz(self) -> int:
        return int(self.indptr[-1])


def _is_device(arr: Any) -> bool:
    return hasattr(arr, "__cuda_array_interface__") and not isinstance(arr, np.ndarray)


def _host(arr: Any) -> np.ndarray:
    get = getattr(arr, "get", None)
    return get() if callable(get) and not isinstance(arr, np.ndarray) else np.asarray(arr)


def _int_rows(xp: Any, arr: Any, what: str) -> Any:
    """``arr`` as a 1-d int64 array of module ``xp``; InputError for anything but integers (empty is fine)."""
    arr = xp.asarray(arr) if xp is not np else np.asarray(_host(arr))
    if arr.size == 0:
        return xp.zeros(0, xp.int64)
    if arr.dtype.kind not in "iu":
        raise InputError(f"candidates: {what} must be integer item rows, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise InputError(f"candidates: {what} must be 1-d, got shape {tuple(arr.shape)}")
    if arr.dtype == np.uint64 and bool((arr > np.iinfo(np.int64).max).any()):
        arr = xp.minimum(arr, np.iinfo(np.int64).max)  # beyond any item row: reported as out of range below
    return xp.ascontiguousarray(arr.astype(xp.int64, copy=False))  # the GPU kernel reads it as flat memory


def normalise_candidates(candidates: Any, n_users: int, n_items: int, device_xp: Any = None) -> Candidates:
    """Turn ``candidates`` into validated CSR.

    Parameters
    ----------
    candidates : (indptr, item_rows) tuple, a sequence of ``n_users`` integer arrays, or an (n_users, width) matrix
        CSR: ``indptr`` (n_users + 1,) and ``item_rows`` (nnz,) integer arrays; or one array (or list) of item rows
        per user; or a 2-d integer matrix, one row of candidates per user. Host arrays, or device arrays when
        ``device_xp`` is given (they then stay on the device).
    n_users, n_items : int
    device_xp : module, optional
        The device array module (CuPy) of a GPU engine; None keeps everything on the host.

    Raises
    ------
    InputError
        A malformed CSR pair, a wrong number of lists, non-integer rows, or an item row out of range (the message
        names the user row, the position in its list and the row).
    """
    if isinstance(candidates, tuple) and len(candidates) == 2:
        indptr_in, rows_in = candidates
        on_device = device_xp is not None and _is_device(rows_in)
        xp = device_xp if on_device else np
        indptr = np.asarray(_host(indptr_in))
        if indptr.dtype.kind not in "iu" or indptr.ndim != 1:
            raise InputError(f"candidates: indptr must be a 1-d integer array, got dtype {indptr.dtype} and shape "
                             f"{indptr.shape}")
        indptr = indptr.astype(np.int64)
        rows = _int_rows(xp, rows_in, "item_rows")
        if indptr.shape != (n_users + 1,):
            raise InputError(f"candidates: indptr has {indptr.size} entries, expected n_users + 1 = {n_users + 1}")
        if indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] != rows.size:
            raise InputError("candidates: indptr must start at 0, never decrease and end at len(item_rows)")
    elif getattr(candidates, "ndim", None) == 2:
        # A (n_users, width) matrix: every user has ``width`` candidates (a retriever's fixed-size output).
        on_device = device_xp is not None and _is_device(candidates)
        xp = device_xp if on_device else np
        arr = candidates if on_device else np.asarray(_host(candidates))
        if arr.shape[0] != n_users:
            raise InputError(f"candidates: a matrix of {arr.shape[0]} rows for {n_users} users (one row per user)")
        rows = _int_rows(xp, xp.ascontiguousarray(arr).reshape(-1), "item_rows")
        indptr = np.arange(n_users + 1, dtype=np.int64) * int(arr.shape[1])
    elif isinstance(candidates, (list, tuple)) or (hasattr(candidates, "__len__") and not hasattr(candidates, "shape")):
        lists = list(candidates)
        if len(lists) != n_users:
            raise InputError(f"candidates: got {len(lists)} lists for {n_users} users (one list per user row)")
        on_device = device_xp is not None and len(lists) > 0 and all(_is_device(a) for a in lists)
        xp = device_xp if on_device else np
        parts = []
        for u, lst in enumerate(lists):
            lst = lst if on_device or isinstance(lst, np.ndarray) or _is_device(lst) else np.asarray(lst)
            if getattr(lst, "ndim", 1) != 1:
                raise InputError(f"candidates: the list of user row {u} must be 1-d, got shape {tuple(lst.shape)}")
            parts.append(_int_rows(xp, lst, f"the list of user row {u}"))
        indptr = np.zeros(n_users + 1, np.int64)
        np.cumsum([p.size for p in parts], out=indptr[1:])
        rows = xp.concatenate(parts) if parts else xp.zeros(0, xp.int64)
    else:
        raise InputError(f"candidates must be a CSR pair (indptr, item_rows) or a list of item-row arrays, one per "
                         f"user; got {type(candidates).__name__}")
    if rows.size:
        bad = (rows < 0) | (rows >= n_items)
        if bool(bad.any()):
            pos = int(xp.argmax(bad))
            user = int(np.searchsorted(indptr, pos, side="right") - 1)
            raise InputError(f"candidates: user row {user} has item row {int(rows[pos])} at position "
                             f"{pos - int(indptr[user])} of its list, out of range for {n_items} items")
    return Candidates(indptr, rows)


# --------------------------------------------------------------------------------------------------------------------
# Engine.rescore


def rescore(engine: Any, user_vecs: Any, candidates: Any, k: int) -> SearchResult:
    """Each user's best ``k`` among its own candidates; see :meth:`recall.Engine.rescore`."""
    from .engine import _check_matrix, check_k

    k = check_k(k)
    xp = engine._xp_for(user_vecs)
    users = _check_matrix(xp, user_vecs, "user_vecs", engine.dim)
    n_users = int(users.shape[0])
    engine._check_overflow(xp, users)
    device_xp = None if engine.backend.xp is np else engine.backend.xp
    cands = normalise_candidates(candidates, n_users, engine.n_items, device_xp)
    vals, rows = _run(engine, metrics.prepare_users(engine.metric, xp, users), cands, k)
    if xp is np:
        vals, rows = engine.backend.to_host(vals), engine.backend.to_host(rows)
    vals = metrics.finish_scores(engine.metric, xp, vals, users)
    return SearchResult(indices=rows, scores=vals, ids=engine._map_ids(rows))


def _run(engine: Any, users: Any, cands: Candidates, k: int) -> tuple[Any, Any]:
    """(scores in inner-product space, item rows), each (n_users, k), on the backend."""
    backend, xp = engine.backend, engine.backend.xp
    n_users = int(users.shape[0])
    vals = xp.full((n_users, k), -xp.inf, dtype=xp.float32)
    rows = xp.full((n_users, k), -1, dtype=xp.int64)
    wall = time.perf_counter()
    mode, path = _mode(), "none"
    if n_users and cands.nnz:
        fused = getattr(backend, "rescore_fused", None)
        if fused is not None and mode == "fused" and fused(users, engine._items, cands.indptr, cands.rows, k,
                                                               vals, rows, engine.memory_budget):
            path = "fused"
        else:
            _gemm_path(engine, users, cands, k, vals, rows)
            path = "gemm"
    engine.stats = {"rescore_path": path, "users": n_users, "candidates": cands.nnz,
                    "wall_s": time.perf_counter() - wall}
    return vals, rows


def _padded_rows(rxp: Any, rows: Any, starts: np.ndarray, lengths: np.ndarray, width: int) -> Any:
    """(len(starts), width) int64 of module ``rxp``: row ``i`` holds ``rows[starts[i]:starts[i] + lengths[i]]``,
    then -1."""
    offs = np.arange(width, dtype=np.int64)
    pos = starts[:, None] + offs[None, :]
    valid = offs[None, :] < lengths[:, None]
    pos = np.where(valid, pos, 0)
    if rxp is not np:
        pos, valid = rxp.asarray(pos), rxp.asarray(valid)
    return rxp.where(valid, rows[pos], -1)


def _drop_duplicate_rows(xp: Any, rows_pad: Any) -> Any:
    """Sort each row of a padded (n, width) block and blank (-1) every repeat of an item row: a duplicate must count
    once, and it is removed before scoring because BLAS may score two copies of a row at different positions of a
    block with different rounding (edge kernels), which would defeat a de-duplication by score."""
    rows_pad.sort(axis=1)
    if rows_pad.shape[1] > 1:
        tail = rows_pad[:, 1:]
        rows_pad[:, 1:] = xp.where((tail == rows_pad[:, :-1]) & (tail >= 0), -1, tail)
    return rows_pad


def _gemm_path(engine: Any, users: Any, cands: Candidates, k: int, out_vals: Any, out_rows: Any) -> None:
    """Gather + one strided-batched GEMM per block of users + selection, blocks sized to the memory budget."""
    backend, xp = engine.backend, engine.backend.xp
    items = engine._items
    dim = int(items.shape[1])
    users_b = backend.asarray(users)
    indptr = cands.indptr
    lengths = np.diff(indptr)
    rxp = np if isinstance(cands.rows, np.ndarray) else xp
    slot_bytes = 4 * dim + _SLOT_BYTES_FIXED
    user_bytes = 4 * dim + 40 * k  # the user's row, its results and their selection scratch
    budget = int(engine.memory_budget)
    cap = max(1, budget // slot_bytes)
    max_users = max(1, min(budget // user_bytes, 65_535))  # also within every cuBLAS's batch-count limit
    # Short lists first: a block's users then have similar lengths, so padding to the block's longest costs little.
    nonempty = np.flatnonzero(lengths > 0)
    order = nonempty[np.argsort(lengths[nonempty], kind="stable")]
    ls = lengths[order]
    i = 0
    while i < order.size:
        if ls[i] > cap:
            for u in order[i:]:  # every user from here on has more candidates than one block holds
                _long_user(engine, users_b, cands, int(u), k, cap, out_vals, out_rows)
            return
        # The largest block [i, j) whose padded size (j - i) * ls[j - 1] fits: ls is sorted, so bisect.
        lo, hi = i + 1, min(order.size, i + max_users)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (mid - i) * int(ls[mid - 1]) <= cap:
                lo = mid
            else:
                hi = mid - 1
        j = lo
        block = order[i:j]
        width = int(ls[j - 1])
        rows_pad = backend.asarray(_padded_rows(rxp, cands.rows, indptr[block], lengths[block], width))
        rows_pad = _drop_duplicate_rows(xp, rows_pad)
        sel = backend.asarray(block)
        vals, rows = _score_block(backend, users_b[sel], items, rows_pad, k)
        out_vals[sel] = vals
        out_rows[sel] = rows
        i = j


def _score_block(backend: Any, users: Any, items: Any, rows_pad: Any, k: int) -> tuple[Any, Any]:
    """The best k of each user's padded candidate block: gather, one strided-batched GEMM, select."""
    xp = backend.xp
    n, width = rows_pad.shape
    dim = int(items.shape[1])
    gathered = items[xp.maximum(rows_pad, 0)]  # (n, width, dim): padding gathers row 0 and is ignored below
    scores = xp.empty((n, 1, width), dtype=xp.float32)
    backend.gemm_strided_batched(users.reshape(n, 1, dim), gathered, scores)
    return backend.rescore_select(scores.reshape(n, width), rows_pad, k)


def _long_user(engine: Any, users_b: Any, cands: Candidates, u: int, k: int, cap: int, out_vals: Any,
               out_rows: Any) -> None:
    """A user whose list alone exceeds a block: de-duplicate it whole, then score it in chunks, merging the best k."""
    backend, xp = engine.backend, engine.backend.xp
    lo, hi = int(cands.indptr[u]), int(cands.indptr[u + 1])
    rows = xp.unique(backend.asarray(cands.rows[lo:hi]))  # sorted and unique: chunks cannot share a row
    best_v = best_r = None
    for c0 in range(0, int(rows.size), cap):
        chunk = rows[c0:c0 + cap].reshape(1, -1)
        v, r = _score_block(backend, users_b[u:u + 1], engine._items, chunk, k)
        if best_v is not None:
            v, r = select_keys(xp, xp.concatenate([best_v, v], axis=1), xp.concatenate([best_r, r], axis=1), k)
        best_v, best_r = v, r
    out_vals[u] = best_v[0]
    out_rows[u] = best_r[0]


# --------------------------------------------------------------------------------------------------------------------
# Selection by 64-bit keys (any array module)


def _keys(xp: Any, scores: Any, rows: Any) -> Any:
    """uint64 keys that order like the tie rule (score desc, lower row first); 0 where ``rows`` < 0.

    High 32 bits: the float32 score mapped to an unsigned integer that sorts like the float (-0.0 folded into +0.0,
    so that equal scores are decided by the row alone); low 32 bits: ~row. The packing of recall/kernels/*.cu."""
    scores = xp.where(scores == 0, xp.float32(0), scores).astype(xp.float32, copy=False)
    bits = scores.view(xp.uint32)
    ordered = xp.where(bits & xp.uint32(0x80000000), ~bits, bits | xp.uint32(0x80000000)).astype(xp.uint64)
    keys = (ordered << xp.uint64(32)) | (~rows.astype(xp.uint32)).astype(xp.uint64)
    return xp.where(rows < 0, xp.uint64(0), keys)


def _unpack(xp: Any, keys: Any) -> tuple[Any, Any]:
    hi = (keys >> xp.uint64(32)).astype(xp.uint32)
    vals = xp.where(hi & xp.uint32(0x80000000), hi & xp.uint32(0x7FFFFFFF), ~hi).view(xp.float32)
    rows = (~(keys & xp.uint64(0xFFFFFFFF)).astype(xp.uint32)).astype(xp.int64)
    empty = keys == 0
    return xp.where(empty, xp.float32(-np.inf), vals).astype(xp.float32), xp.where(empty, -1, rows)


def select_keys(xp: Any, scores: Any, rows: Any, k: int) -> tuple[Any, Any]:
    """The best k (score desc, lower row first) of each row of a candidate block, padded with (-inf, -1).

    Parameters
    ----------
    xp : module
        numpy or cupy, the module of the arrays.
    scores : array of float32, shape (n, width)
    rows : array of int64, shape (n, width)
        Item rows, -1 for an empty slot; no row twice within a row of the block.
    k : int

    Returns
    -------
    (scores (n, k) float32, rows (n, k) int64), best first.
    """
    n, width = rows.shape
    keys = _keys(xp, scores, rows)
    if width > k:
        keys = xp.partition(keys, width - k, axis=1)[:, width - k:]
    keys = xp.sort(keys, axis=1)[:, ::-1]
    if keys.shape[1] < k:
        keys = xp.concatenate([keys, xp.zeros((n, k - keys.shape[1]), xp.uint64)], axis=1)
    return _unpack(xp, xp.ascontiguousarray(keys))


# --------------------------------------------------------------------------------------------------------------------
# The GPU kernel (called by the CuPy backend's rescore_fused / rescore_select)

_THREADS = 128
_SZ_TARGET = 4096  # keys held at once per user: candidates per chunk, up to this
_DEFAULT_SMEM = 48 * 1024
_module_lock = threading.Lock()
_modules: dict[tuple[int, str, bool], Any] = {}


@dataclass(frozen=True)
class KernelVariant:
    """One instantiation of ``recall_rescore_t`` (recall/kernels/rescore.cu) and how it is launched.

    Attributes
    ----------
    stage : bool
        Copy each chunk's item rows into shared memory (int32) before the gather, so that no index load sits in front
        of each round of vector loads.
    select : bool
        Radix-select the K best and sort only those; False: bitonic-sort the whole chunk (the original kernel).
    unroll, chunks : int
        Each lane keeps ``unroll`` rows x ``chunks`` 16-byte (or 4-byte) pieces of loads in flight before any
        arithmetic.
    lanes : {"wide", "narrow"}
        "wide": ``chunks`` pieces per lane per row (G = 8 lanes for dim 64: each warp load covers whole 128-byte lines,
        with 3 shuffles per candidate instead of 4); "narrow": :func:`lanes_per_candidate` (one piece per lane).
    max_registers : int or None
        NVRTC's ``--maxrregcount`` for the variant (None: the compiler's choice). Registers per thread decide how many
        blocks share an SM (65,536 registers each); the caps compile without spills (nvcc 13,
        sm_90): "select" 56 -> 4 blocks of 256 threads, "select-lean" 40 -> 6.
    """

    stage: bool
    select: bool
    unroll: int
    chunks: int
    lanes: str
    max_registers: int | None

    def name_expression(self, vec: bool) -> str:
        return (f"recall_rescore_t<{int(self.stage)}, {int(self.select)}, {self.unroll}, {self.chunks}, "
                f"{int(vec)}>")

    def lanes_for(self, dim: int) -> int:
        return lanes_per_candidate(dim) if self.lanes == "narrow" else _wide_lanes(dim, self.chunks)


#: ``RECALL_RESCORE_VARIANT``: the fused kernel's variant (default "select-lean"). "legacy" is the original algorithm
#: (index loads in the gather loop, a full bitonic sort of each chunk); scripts/gpu_rescore_sweep.py times them all.
VARIANTS: dict[str, KernelVariant] = {
    "select": KernelVariant(stage=True, select=True, unroll=4, chunks=2, lanes="wide", max_registers=56),
    "select-lean": KernelVariant(stage=True, select=True, unroll=2, chunks=2, lanes="wide", max_registers=40),
    "select-narrow": KernelVariant(stage=True, select=True, unroll=4, chunks=1, lanes="narrow", max_registers=56),
    "sort": KernelVariant(stage=True, select=False, unroll=4, chunks=2, lanes="wide", max_registers=64),
    "legacy": KernelVariant(stage=False, select=False, unroll=4, chunks=1, lanes="narrow", max_registers=None),
}
# Measured on the H200 (docs/benchmarks.md, scripts/gpu_rescore_sweep.py on S5): select-lean at 128 threads, 5.99 ms
# for the kernel (select at 256 threads: 7.36 ms; legacy at 256: 10.14 ms).
DEFAULT_VARIANT = "select-lean"


def _variant_name() -> str:
    name = os.environ.get("RECALL_RESCORE_VARIANT", "").strip().lower() or DEFAULT_VARIANT
    if name not in VARIANTS:
        raise InputError(f"RECALL_RESCORE_VARIANT={name!r}: expected one of {', '.join(VARIANTS)}")
    return name


def _kernel(variant: str | None = None, vec: bool = True) -> Any:
    """The compiled ``recall_rescore_t`` of ``variant`` (default: ``RECALL_RESCORE_VARIANT``) for the current device;
    ``vec``: rows read as float4 (dim % 4 == 0). Compiled once per device, variant and ``vec`` in a process (NVRTC
    compiles only the instantiation asked for; CuPy caches the binary on disk)."""
    import cupy

    name = variant or _variant_name()
    var = VARIANTS[name]
    dev = cupy.cuda.Device().id
    with _module_lock:
        key = (dev, name, bool(vec))
        if key not in _modules:
            source = resources.files("recall.kernels").joinpath("rescore.cu").read_text()
            options: tuple[str, ...] = ("--std=c++14",)
            if var.max_registers:
                options += (f"--maxrregcount={var.max_registers}",)
            expr = var.name_expression(bool(vec))
            module = cupy.RawModule(code=source, options=options, name_expressions=[expr])
            _modules[key] = module.get_function(expr)
        return _modules[key]


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _threads() -> int:
    """Threads per user's block: ``RECALL_RESCORE_THREADS`` (a multiple of 32, 32 to 1024), default 128."""
    text = os.environ.get("RECALL_RESCORE_THREADS", "").strip()
    if not text:
        return _THREADS
    if not text.isdigit() or int(text) % 32 or not 32 <= int(text) <= 1024:
        raise InputError(f"RECALL_RESCORE_THREADS={text!r}: expected a multiple of 32 from 32 to 1024")
    return int(text)


def lanes_per_candidate(dim: int) -> int:
    """Threads that share one candidate's dot product: the largest power of two <= 32 that leaves few idle lanes.

    Each lane reads 16 bytes (a float4) of the row per step when dim % 4 == 0, else 4 bytes; G lanes read G
    consecutive chunks, so a row is read in full 32-byte sectors whenever G >= 2."""
    chunks = dim // 4 if dim % 4 == 0 else dim
    for g in (32, 16, 8, 4, 2):
        if -(-chunks // g) * g <= 1.2 * chunks:
            return g
    return 1


def _wide_lanes(dim: int, per_lane: int) -> int:
    """Lanes per candidate when each lane loads ``per_lane`` pieces of a row before any arithmetic: the fewest (a
    power of two <= 32) that cover the row in one round, so that every load is issued before the first use. dim 64:
    8 lanes x 2 float4; each warp load then reads four rows' 128-byte halves, whole cache lines."""
    chunks = dim // 4 if dim % 4 == 0 else dim
    return min(32, _pow2(-(-max(chunks, 1) // per_lane)))


def _smem_bytes(sz: int, dim: int) -> int:
    """Dynamic shared memory of one block (the layout in rescore.cu): SZ keys and 6 control words (8 bytes each),
    the user's vector, a 4 * SZ byte scratch (staged rows, then the selected keys), a 256-bin histogram, SZ duplicate
    flags."""
    return 8 * (sz + 6) + 4 * ((dim + 3) // 4 * 4) + 4 * sz + 4 * 256 + sz


def _max_smem() -> int:
    import cupy

    try:
        return int(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                        cupy.cuda.Device().id))
    except Exception:  # an older runtime without the attribute: the default every device has
        return _DEFAULT_SMEM


def _launch_config(k: int, dim: int, longest: int) -> tuple[int, int, int] | None:
    """(K_pad, SZ, shared bytes) for a launch, or None when k needs more shared memory than the device has."""
    k_pad = _pow2(k)
    sz = max(2 * k_pad, min(_pow2(max(longest, 1)), _SZ_TARGET))
    smem = _smem_bytes(sz, dim)
    if smem > _DEFAULT_SMEM and smem > _max_smem():
        return None
    return k_pad, sz, smem


def launch_shape(dim: int, variant: str | None = None) -> tuple[Any, int, int]:
    """(kernel, threads per block, lanes per candidate) of a fused launch for ``dim``: ``RECALL_RESCORE_THREADS``,
    lowered to what the compiled variant can launch (a variant with many registers per thread may not run 1,024)."""
    name = variant or _variant_name()
    kern = _kernel(name, dim % 4 == 0)
    threads = min(_threads(), int(kern.max_threads_per_block) // 32 * 32)
    return kern, threads, VARIANTS[name].lanes_for(dim) if dim > 0 else 1


def _launch(users: Any, items: Any, dim: int, scores: Any, indptr: Any, rows: Any, k: int,
            cfg: tuple[int, int, int], out_vals: Any, out_rows: Any) -> None:
    """One ``recall_rescore_t`` launch over the users of ``indptr`` (``dim`` 0 when ``scores`` are given: no user
    vector in shared memory, which is how ``cfg`` was sized)."""
    n = int(indptr.size) - 1
    if n <= 0:
        return
    k_pad, sz, smem = cfg
    kern, threads, lanes = launch_shape(dim)
    if smem > _DEFAULT_SMEM:
        kern.max_dynamic_shared_size_bytes = smem
    scores_arg = scores if scores is not None else np.uint64(0)  # a null pointer: compute the dot products
    kern((n,), (threads,), (users, items, np.int32(dim), scores_arg, indptr, rows, np.int32(k), np.int32(k_pad),
                            np.int32(sz), np.int32(lanes), out_vals, out_rows),
         shared_mem=smem)


def fused_device(backend: Any, users: Any, items: Any, indptr: np.ndarray, rows: Any, k: int, out_vals: Any,
                 out_rows: Any, budget: int) -> bool:
    """Score and select on the GPU in one kernel per block of users; False when k or n_items is beyond the kernel.

    users : (n, dim) float32 (host or device); items : (n_items, dim) float32 on the device; indptr : host int64
    (n + 1,); rows : int64 item rows, host or device; out_vals / out_rows : (n, k) device arrays, C-contiguous.
    Device rows are read in place; host rows are uploaded in blocks of users whose rows fit in ``budget``.
    """
    cupy = backend.xp
    n_items, dim = int(items.shape[0]), int(items.shape[1])
    lengths = np.diff(indptr)
    cfg = _launch_config(k, dim, int(lengths.max()) if lengths.size else 1)
    if cfg is None or n_items >= 2 ** 31:
        return False
    users_d = backend.asarray(users)
    if not isinstance(rows, np.ndarray):
        _launch(users_d, items, dim, None, cupy.asarray(indptr), rows, k, cfg, out_vals, out_rows)
        return True
    per_block = max(1, budget // 8)
    start = 0
    n = lengths.size
    while start < n:
        # The most users from `start` whose candidate rows fit in the budget (at least one user).
        stop = int(np.searchsorted(indptr, indptr[start] + per_block, side="right")) - 1
        stop = min(n, max(stop, start + 1))
        lo, hi = int(indptr[start]), int(indptr[stop])
        _launch(users_d[start:stop], items, dim, None, cupy.asarray(indptr[start:stop + 1] - lo),
                cupy.asarray(rows[lo:hi]), k, cfg, out_vals[start:stop], out_rows[start:stop])
        start = stop
    return True


def select_device(backend: Any, scores: Any, rows: Any, k: int) -> tuple[Any, Any]:
    """``select_keys`` on the GPU: the rescore kernel fed with precomputed scores of a padded (n, width) block."""
    cupy = backend.xp
    n, width = rows.shape
    cfg = _launch_config(k, 0, width)
    if cfg is None:
        return select_keys(cupy, scores, rows, k)
    vals = cupy.empty((n, k), cupy.float32)
    out = cupy.empty((n, k), cupy.int64)
    indptr = cupy.arange(n + 1, dtype=cupy.int64) * width
    scores = cupy.ascontiguousarray(scores)
    _launch(scores, scores, 0, scores, indptr, cupy.ascontiguousarray(rows), k, cfg, vals, out)
    return vals, out


# --------------------------------------------------------------------------------------------------------------------
# Parquet: the candidates file and the job behind `recall rescore`


@dataclass(frozen=True)
class CandidateFile:
    """A candidates Parquet file mapped to row positions of the users' and the items' files.

    Attributes
    ----------
    user_rows : np.ndarray of int64, shape (n,)
        The users the file names (known ids only), ascending: the users file's order.
    indptr : np.ndarray of int64, shape (n + 1,)
    item_rows : np.ndarray of int64, shape (nnz,)
        User ``user_rows[i]``'s candidates are ``item_rows[indptr[i]:indptr[i + 1]]``, in file order, duplicates
        still in (the engine counts them once).
    n_pairs : int
        (user, item) pairs in the file (list elements, or rows of the pair form).
    n_unknown : int
        Of those, pairs skipped because their user id or item id is in neither embedding file.
    """

    user_rows: np.ndarray
    indptr: np.ndarray
    item_rows: np.ndarray
    n_pairs: int
    n_unknown: int


def _candidate_column(pf: Any, path: str) -> str:
    """"item_ids" (a list per row) or "item_id" (one pair per row); InputError naming the columns found."""
    from .io.parquet import _column_names

    schema = pf.schema_arrow
    names = set(schema.names)
    has_list, has_pair = "item_ids" in names, "item_id" in names
    if "user_id" not in names or has_list == has_pair:
        raise InputError(f"{path}: candidate columns are {_column_names(schema)}; expected 'user_id' with 'item_ids' "
                         f"(a list of item ids per row) or 'user_id' with 'item_id' (one pair per row)")
    if has_list:
        t = schema.field("item_ids").type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
            raise InputError(f"{path}: column 'item_ids' has type {t}, expected a list of item ids")
    return "item_ids" if has_list else "item_id"


def read_candidates(path: str | os.PathLike, user_ids: np.ndarray, item_ids: np.ndarray) -> CandidateFile:
    """Read a candidates Parquet file (``user_id``, ``item_ids`` list; or ``user_id``, ``item_id`` pairs).

    A user may appear on several rows: its lists are concatenated. Ids must have the embeddings' types (integers with
    integers, strings with strings). Unknown user or item ids are skipped and counted.

    Parameters
    ----------
    path : str or PathLike
    user_ids, item_ids : np.ndarray
        The ids of the users' and the items' files, in file order (int64, or object for strings).

    Raises
    ------
    InputError
        Unreadable file, missing or mistyped columns, a null user id, list or item id (naming the row), id types
        that do not match the embeddings'.
    """
    from .io.parquet import (READ_BATCH_ROWS, _first, _iter_batches, _lookup, _match_type, flatten_id_lists,
                             open_parquet)

    path = os.fspath(path)
    user_ids, item_ids = np.asarray(user_ids), np.asarray(item_ids)
    pf = open_parquet(path, "candidates")
    col = _candidate_column(pf, path)
    # Ids are checked batch by batch and looked up once per column at the end (one hash table of the ids, not one
    # per batch).
    user_parts, item_parts, length_parts = [], [], []
    row = 0
    for batch in _iter_batches(pf, path, ["user_id", col], READ_BATCH_ROWS):
        users, items = batch.column(0), batch.column(1)
        for c, name in ((users, "user_id"), (items, col)):
            if c.null_count:
                raise InputError(f"{path}: row {row + _first(c.is_null().to_numpy(zero_copy_only=False))} has a "
                                 f"null {name}")
        user_parts.append(_match_type(path, "user_id", users, user_ids, "users'", row))
        if col == "item_ids":
            items, lengths = flatten_id_lists(path, items, row)
            length_parts.append(lengths)
        item_parts.append(_match_type(path, col, items, item_ids, "items'", row))
        row += batch.num_rows
    empty = np.zeros(0, np.int64)
    row_users = _lookup(pa.chunked_array(user_parts), user_ids) if user_parts else empty
    pair_users = np.repeat(row_users, np.concatenate(length_parts)) if length_parts else row_users
    pair_items = _lookup(pa.chunked_array(item_parts), item_ids) if item_parts else empty
    known = (pair_users >= 0) & (pair_items >= 0)
    present = np.unique(row_users[row_users >= 0])  # a named user gets a (maybe empty) row of output
    order = np.argsort(pair_users[known], kind="stable")  # grouped by user, file order within a user
    users_k, items_k = pair_users[known][order], pair_items[known][order]
    indptr = np.searchsorted(users_k, np.append(present, np.iinfo(np.int64).max)).astype(np.int64)
    indptr[-1] = users_k.size
    return CandidateFile(present.astype(np.int64), indptr, items_k.astype(np.int64), int(pair_users.size),
                         int(pair_users.size - known.sum()))


@dataclass(frozen=True)
class RescoreSummary:
    """What :func:`rescore_files` did: users and candidates scored, the k, metric and device, timings, skipped ids."""

    users: int
    candidates: int
    items: int
    dim: int
    k: int
    metric: str
    device: str
    device_detail: str
    seconds: float
    candidate_pairs: int
    unknown_candidates: int
    out_path: str

    @property
    def users_per_s(self) -> float:
        return self.users / self.seconds if self.seconds > 0 else float("inf")

    def line(self) -> str:
        """The one-line summary the CLI prints."""
        return (f"rescored {self.users:,} users x {self.candidates:,} own candidates (of {self.items:,} items), "
                f"dim {self.dim}, k {self.k}, metric {self.metric}, on {self.device} in {self.seconds:.2f} s "
                f"({self.users_per_s:,.0f} users/s) -> {self.out_path}")


def rescore_files(users_path: str | os.PathLike, items_path: str | os.PathLike,
                  candidates_path: str | os.PathLike, out_path: str | os.PathLike, k: int, metric: str = "ip",
                  id_col: str = "id", vec_col: str = "embedding", device: str = "auto",
                  memory_budget: int | None = None, batch_size: int | None = None) -> RescoreSummary:
    """Re-score each user's candidates from Parquet files and write its top-k to a candidates Parquet file.

    Parameters
    ----------
    users_path, items_path : str or PathLike
        Embedding files (id + vector columns, as for ``recall score``).
    candidates_path : str or PathLike
        ``user_id`` with ``item_ids`` (a list per row; a user may have several rows), or ``user_id`` with ``item_id``
        pairs. Unknown ids are skipped and counted (``RescoreSummary.unknown_candidates``); duplicates count once.
    out_path : str or PathLike
        ``user_id``, ``item_ids``, ``scores``: one row per user named in the candidates file, in the users file's
        order, best first; written to a temporary file and renamed into place when complete.
    k : int
    metric, id_col, vec_col, device, memory_budget
        As for :func:`recall.pipeline.score_files`.
    batch_size : int, optional
        Users per engine call (default: sized from k and dim).

    Raises
    ------
    InputError
        Any bad file, row, id type or argument (naming file, row and id); nothing is written.
    ResourceError, BackendUnavailable
        As for ``recall score``.
    """
    from .io import CandidateWriter, check_output_path, inspect_embeddings, read_embeddings
    from .io.parquet import _fmt_id, open_parquet
    from .pipeline import auto_batch_size, check_job_args, load_engine

    t_start = time.perf_counter()
    k = check_job_args(k, metric, device, batch_size)
    users_path, items_path, candidates_path = (os.fspath(p) for p in (users_path, items_path, candidates_path))
    out = check_output_path(out_path, (users_path, items_path, candidates_path))
    users_info = inspect_embeddings(users_path, id_col, vec_col)
    items_info = inspect_embeddings(items_path, id_col, vec_col)
    if users_info.dim is not None and items_info.dim is not None and users_info.dim != items_info.dim:
        raise InputError(f"{users_path}: vectors have dimension {users_info.dim}, but the items ({items_path}) have "
                         f"dimension {items_info.dim}")
    _candidate_column(open_parquet(candidates_path, "candidates"), candidates_path)

    items, engine, _ = load_engine(items_path, id_col, vec_col, metric, device, memory_budget)
    users = read_embeddings(users_path, id_col, vec_col)
    if len(users) and users.dim != engine.dim:
        raise InputError(f"{users_path}: row 0 (id {_fmt_id(users.ids[0])}) has dimension {users.dim}, expected "
                         f"{engine.dim} (the items' dimension, {items_path})")
    cands = read_candidates(candidates_path, users.ids, items.ids)
    if metric == "cosine" and cands.user_rows.size:
        zero = ~users.vectors[cands.user_rows].any(axis=1)
        if zero.any():
            r = int(cands.user_rows[int(np.argmax(zero))])
            raise InputError(f"{users_path}: row {r} (id {_fmt_id(users.ids[r])}) is a zero vector, which has no "
                             f"direction for metric 'cosine'")
    n = int(cands.user_rows.size)
    batch = int(batch_size) if batch_size is not None else auto_batch_size(k, engine.dim)
    id_type = {True: pa.string(), False: pa.int64()}
    item_ids = id_lookup(items.ids)
    with CandidateWriter(out, id_type[users.ids.dtype == object], id_type[items.ids.dtype == object]) as writer:
        for start in range(0, n, batch):
            stop = min(start + batch, n)
            sel = cands.user_rows[start:stop]
            lo, hi = int(cands.indptr[start]), int(cands.indptr[stop])
            res = engine.rescore(users.vectors[sel], (cands.indptr[start:stop + 1] - lo, cands.item_rows[lo:hi]), k)
            writer.write(res.to_arrow(users.ids[sel], item_ids))
    return RescoreSummary(users=n, candidates=int(cands.item_rows.size), items=engine.n_items, dim=engine.dim, k=k,
                          metric=metric, device=engine.device, device_detail=engine.backend.describe(),
                          seconds=time.perf_counter() - t_start, candidate_pairs=cands.n_pairs,
                          unknown_candidates=cands.n_unknown, out_path=str(out_path))
