"""The GPU backend: a fused float32 scoring-and-filtering kernel, cuBLAS through CuPy, exact top-k kernels, pinned
staging and streams.

Exact mode (float32 vectors of at most 256 dimensions, seeded searches) scores each user block against each item
segment with ``recall_fused_filter`` (``recall/kernels/fused.cu``), which keeps only the scores above each user's
threshold and never writes a score tile. Elsewhere (fast mode's float16 inputs, wider vectors, multi-interest users,
small catalogues), every item segment is one strided-batched GEMM (the user block shared by all tiles of the batch:
stride 0) writing a score tile, followed at once by the selection kernels of ``recall/kernels/topk.cu`` reading it
back. Blocks are pipelined on streams: the copy stream stages the next blocks' users (and exclusions) from pinned
host memory while the compute stream searches the current one. After the first block, a block's whole sequence of
launches is replayed as a CUDA graph, so that a search of many small tiles is not bound by Python's launch overhead.
``run_blocks(wait=False)`` returns once every block is queued (``Engine.search_async``).
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np

from .. import scoring
from ..errors import ResourceError

log = logging.getLogger("recall")

_OP_N, _OP_T = 0, 1
_CUDA_R_32F, _CUDA_R_16F = 0, 2
_CUBLAS_COMPUTE_32F = 68  # float32 accumulation (not the _FAST_16F variant, which would accumulate in float16)
_CUBLAS_GEMM_DEFAULT = -1
_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)
_MERGE_THREADS = 256
#: Staging slots of the block pipeline (``RECALL_SLOTS``): the host stages (and queues) up to this many blocks ahead
#: of the device, so that the device has that much work queued while the host prepares the next search
#: (Engine.search_async) or another thread holds the GIL.
_SLOTS = max(2, int(os.environ.get("RECALL_SLOTS", "4")))
_FILTER_THREADS = 256

_module_lock = threading.Lock()
_modules: dict[int, Any] = {}


def _kernels() -> Any:
    """The compiled selection kernels for the current device (compiled once per device and process)."""
    import cupy

    dev = cupy.cuda.Device().id
    with _module_lock:
        if dev not in _modules:
            kernels = resources.files("recall.kernels")
            source = kernels.joinpath("topk.cu").read_text() + kernels.joinpath("fused.cu").read_text()
            _modules[dev] = cupy.RawModule(code=source, options=("--std=c++14",))
        return _modules[dev]


_cublas_lib: Any = None


_P, _I, _LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
_CUBLAS_ARGTYPES = {
    "cublasSgemmStridedBatched": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _LL, _P, _I, _LL, _P, _P, _I, _LL, _I],
    "cublasGemmStridedBatchedEx": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _LL, _P, _I, _I, _LL, _P, _P, _I, _I, _LL,
                                   _I, _I, _I],
}


def _captured_cublas(stream_ptr: int, name: str, args: tuple) -> None:
    """Call cuBLAS function ``name`` through ctypes, on the libcublas CuPy has loaded (found in /proc/self/maps),
    on the stream being captured: CuPy's bindings refuse cuBLAS calls during capture, cuBLAS itself allows them."""
    global _cublas_lib
    if _cublas_lib is None:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libcublas.so" in line})
        if not paths:
            raise RuntimeError("libcublas is not loaded in this process")
        lib = ctypes.CDLL(paths[0])
        lib.cublasSetStream_v2.argtypes = [_P, _P]
        lib.cublasSetPointerMode_v2.argtypes = [_P, _I]
        for fn, types in _CUBLAS_ARGTYPES.items():
            getattr(lib, fn).argtypes = types
        _cublas_lib = lib
    lib = _cublas_lib
    handle = args[0]
    for status in (lib.cublasSetStream_v2(handle, stream_ptr), lib.cublasSetPointerMode_v2(handle, 0),
                   getattr(lib, name)(*args)):
        if status != 0:
            raise RuntimeError(f"cuBLAS call failed during graph capture: status {status}")


def _candidate_capacity(k: int) -> int:
    # Room for several tiles' survivors between merges; a merge runs once a user's buffer is half full.
    return max(4096, 4 * k)


def _fused_capacity(k: int) -> int:
    # The fused path cannot rescan a score tile when a user's buffer overflows (it recomputes the segment's scores,
    # slowly), so its buffer holds about all the survivors a seeded search passes: k * n_items / sample size.
    return _pow2(max(16384, 32 * k))


#: Tile geometry of recall_fused_filter (fused.cu): 128 x 128 scores per tile, 32 dimensions per chunk.
_FUSED_TILE = 128
_FUSED_CHUNK = 32
_FUSED_THREADS = 256
_FUSED_MAX_DIM = 256  # the users' vectors of a block stay in shared memory: 128 x 256 floats at most


def seed_size(n_items: int, k: int, capacity: int) -> int:
    """Items in a block's threshold sample (see ``recall_seed_done``), or 0 where seeding does not pay: the sample
    costs ``size / n_items`` of the search's GEMM work and leaves about ``k * n_items / size`` scores per user to pass
    the filter over the whole search."""
    size = min(capacity, max(8192, 32 * k))
    if size < 4 * k or n_items < 8 * size or os.environ.get("RECALL_SEED", "1") == "0":
        return 0
    return size


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class GpuTopK:
    """Running top-k of one block of users on the device (see topk.cu for the meaning of each array)."""

    k: int
    n_users: int  # rows of this block that are real users (the arrays hold capacity rows)
    capacity: int
    cand_capacity: int
    top: Any
    n_valid: Any
    thr: Any
    cand: Any
    cnt: Any
    base: Any
    out_vals: Any
    out_rows: Any

    @classmethod
    def allocate(cls, capacity: int, k: int, cand_capacity: int = 0) -> "GpuTopK":
        import cupy

        c = cand_capacity or _candidate_capacity(k)
        state = cls(k, capacity, capacity, c,
                    top=cupy.zeros((capacity, k), cupy.uint64), n_valid=cupy.zeros(capacity, cupy.int32),
                    thr=cupy.full(capacity, -cupy.inf, cupy.float32), cand=cupy.zeros((capacity, c), cupy.uint64),
                    cnt=cupy.zeros(capacity, cupy.int32), base=cupy.zeros(capacity, cupy.int32),
                    out_vals=cupy.empty((capacity, k), cupy.float32), out_rows=cupy.empty((capacity, k), cupy.int64))
        return state

    def clear(self) -> None:
        """Empty every row (the final merge also leaves its rows empty; this recovers from an interrupted search)."""
        self.n_valid.fill(0)
        self.thr.fill(-np.inf)
        self.cnt.fill(0)
        self.base.fill(0)


@dataclass
class _Slot:
    """One of the :data:`_SLOTS` staging slots of the block pipeline."""

    users: Any  # device (capacity, dim) float32
    floor: Any  # device (capacity,) float32: the block's score floors, when the search has them
    ex_ptr: Any  # device (capacity + 1,) int64
    ex_items: Any  # device (max exclusions per block,) int64
    host_users: Any  # pinned (capacity, dim) float32
    host_ptr: Any  # pinned (capacity + 1,) int64
    host_items: Any  # pinned, like ex_items
    staged: Any  # event: this slot's uploads are done
    consumed: Any  # event: the compute stream no longer reads this slot
    graph: Any = None
    graph_key: tuple = field(default_factory=tuple)


@dataclass
class _Workspace:
    key: tuple
    max_excl: int
    state: GpuTopK
    scores: Any
    slots: list
    sample: Any = None  # (size, dim): the threshold sample's item rows, refreshed by every search
    users_t: Any = None  # fused path: (padded dim, padded capacity) the block's users transposed, zero-padded
    fetched: Any = None  # event: the last search's last results have left state.out_vals (None: nothing pending)


class CupyBackend:
    """CuPy backend. Arrays are CuPy arrays on the current device."""

    name = "gpu"
    workers = 1  # blocks overlap on streams, not threads

    def __init__(self) -> None:
        import cupy

        self.xp = cupy
        self.device = cupy.cuda.Device()
        self.compute_stream = cupy.cuda.Stream(non_blocking=True)
        self.copy_stream = cupy.cuda.Stream(non_blocking=True)
        # Results go back on a stream of their own, so that fetching block i never delays staging block i + _SLOTS.
        self.fetch_stream = cupy.cuda.Stream(non_blocking=True)
        self.use_graphs = os.environ.get("RECALL_CUDA_GRAPHS", "1") != "0"
        # Fast mode's GEMM writes float16 scores (scaled by fast.output_scale): half the bytes written and read back.
        self.half_scores = os.environ.get("RECALL_HALF_SCORES", "1") != "0"
        self._alphas: dict[int, np.ndarray] = {}  # the GEMM's output scale per dimension (host scalars)
        self.stats: dict[str, float] = {}
        mod = _kernels()
        # Selection kernels by score type: float32 tiles, or float16 tiles of fast mode.
        self._mask = {np.dtype(np.float32): mod.get_function("recall_mask_excluded"),
                      np.dtype(np.float16): mod.get_function("recall_mask_excluded_h")}
        self._filter = {np.dtype(np.float32): mod.get_function("recall_filter"),
                        np.dtype(np.float16): mod.get_function("recall_filter_h")}
        self._merge = {np.dtype(np.float32): mod.get_function("recall_merge"),
                       np.dtype(np.float16): mod.get_function("recall_merge_h")}
        self._seed_done = mod.get_function("recall_seed_done")
        self._fused = mod.get_function("recall_fused_filter")
        self._merge_fused = mod.get_function("recall_merge_fused")
        # Exact mode scores and filters in one kernel (fused.cu) where it applies: "auto" (seeded searches of float32
        # vectors of at most 256 dimensions), "force" (also unseeded: tests), "off" (always cuBLAS + filter).
        self.fused_mode = os.environ.get("RECALL_FUSED", "auto")
        self.fused_segment = int(os.environ.get("RECALL_FUSED_SEGMENT", "65536"))  # items between merges
        self.fused_tiles_per_cta = int(os.environ.get("RECALL_FUSED_TPC", "8"))
        # Candidates a user holds before the merge after a segment folds them in (0: max(k, 256)). Early merges
        # raise the threshold: the seed's k-th best sampled score is about the (k * n_items / sample)-th best
        # overall, while after one merge the threshold is the k-th best of a whole segment, so later segments pass
        # (and append with a global atomic) a fraction of the scores.
        self.fused_merge_at = int(os.environ.get("RECALL_FUSED_MERGE_AT", "0"))
        # Users per block at least (recall/early.py raises it for its searches of a part of the items, which are short
        # enough per block that the host's launching would otherwise hold the device back).
        self.min_user_block = 0
        self._items_t: Any = None  # fused path: (items, key, items transposed (padded dim, padded rows))
        self._fused_smem_limit = 0
        self._merge_smem_limit = 0
        self._capturing = False
        self._ws: dict[tuple, _Workspace] = {}

    # -- description and memory -------------------------------------------------------------------------------
    def describe(self) -> str:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(self.device.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return f"gpu {self.device.id}: {name}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, cupy {cupy.__version__}"

    def free_memory(self) -> int:
        import cupy

        free, _total = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        return int(free + pool.free_bytes())

    def default_budget(self) -> int:
        return min(8 << 30, self.free_memory() // 4)

    def state_bytes(self, k: int) -> int:
        # top keys + candidates (the fused path's larger buffer) + results + per-user scalars, plus the pinned/device
        # staging of users (counted by the plan) for the pipeline slots.
        return 8 * k + 8 * _fused_capacity(k) + 12 * k + 32

    def preferred_tiles(self, dim: int, k: int) -> tuple[int, int, int]:
        env = os.environ.get("RECALL_GPU_TILES")
        if env:
            users, width, tiles = (int(x) for x in env.split(","))
            return users, width, tiles
        # 2048 users x (4 x 8192) items per strided-batched call. A tile sized to stay in L2 (1024 x 8192, 32 MiB)
        # needs 8x more calls, and on the H200 the launches cost more than the HBM round trip they save: measured
        # on S1 (100k x 1M x 64, graphs on), 0.633 s at 1024 x (2 x 4096) against 0.589 s at this tiling.
        # `recall tune` on the H200 (docs/benchmarks.md) found wider tiles better for long vectors (d=128, k=100:
        # 2048 x 16384 x 4, 1.04x) and larger user blocks for large k (d=64, k=1000: 4096 x 8192 x 4, 1.07x).
        users = 4096 if k >= 512 else 2048
        width = 16384 if dim >= 128 else 8192
        return max(users, self.min_user_block), width, 4

    def compute_context(self) -> Any:
        return self.compute_stream

    # -- arrays -----------------------------------------------------------------------------------------------
    def asarray(self, arr: Any) -> Any:
        cupy = self.xp
        if not hasattr(arr, "__cuda_array_interface__") and hasattr(arr, "__dlpack__") \
                and not isinstance(arr, np.ndarray):
            arr = cupy.from_dlpack(arr)
        try:
            arr = cupy.asarray(arr)
            dtype = cupy.int64 if arr.dtype.kind in "iu" else cupy.float32
            return cupy.ascontiguousarray(arr, dtype=dtype)
        except cupy.cuda.memory.OutOfMemoryError as exc:
            nbytes = int(np.prod(arr.shape)) * 8
            raise ResourceError(f"GPU out of memory: an array of shape {tuple(arr.shape)} (about {nbytes:,} bytes) "
                                f"does not fit; {self.free_memory():,} bytes free") from exc

    def asarray_raw(self, arr: Any) -> Any:
        return self.xp.asarray(arr)

    def empty_out(self, shape: tuple, dtype: Any, host: bool) -> Any:
        import cupyx

        # Page-locked, so that each block's results can be copied back asynchronously while the next is searched.
        return cupyx.empty_pinned(shape, dtype) if host else self.xp.empty(shape, dtype)

    def to_host(self, arr: Any) -> np.ndarray:
        if isinstance(arr, np.ndarray):
            return arr
        self.compute_stream.synchronize()
        return arr.get()

    def synchronize(self) -> None:
        """Wait for everything queued on the backend's streams: compute, staging and result fetches."""
        self.compute_stream.synchronize()
        self.copy_stream.synchronize()
        self.fetch_stream.synchronize()

    # -- primitives (run on the current stream: the compute stream inside run_blocks) -------------------------
    def gemm_strided_batched(self, users: Any, items: Any, out: Any) -> None:
        """``out[b] = users[b or 0] @ items[b].T`` with one ``cublasSgemmStridedBatched``.

        cuBLAS is column-major: a row-major (n, T) tile is a column-major (T, n) matrix, so each batch computes
        ``out[b]ᵀ = items[b] · usersᵀ`` — A = items[b] (column-major d x T, transposed), B = users (d x n).
        """
        from cupy_backends.cuda.libs import cublas

        tiles, width, dim = items.shape
        n = users.shape[1]
        stride_users = 0 if users.shape[0] == 1 else n * dim
        handle = self.device.cublas_handle
        if users.dtype == np.float16:
            # Fast mode: float16 inputs on the tensor cores, float32 accumulation; float32 output, or float16 output
            # scaled by fast.output_scale (a power of two, so that every score fits float16's range).
            half_out = out.dtype == np.float16
            alpha = self._half_alpha(dim) if half_out else _ONE
            args = (handle, _OP_T, _OP_N, width, n, dim,
                    alpha.ctypes.data, items.data.ptr, _CUDA_R_16F, dim, width * dim,
                    users.data.ptr, _CUDA_R_16F, dim, stride_users,
                    _ZERO.ctypes.data, out.data.ptr, _CUDA_R_16F if half_out else _CUDA_R_32F, width, n * width,
                    tiles, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
            if self._capturing:
                _captured_cublas(self.compute_stream.ptr, "cublasGemmStridedBatchedEx", args)
                return
            cublas.setPointerMode(handle, 0)
            cublas.gemmStridedBatchedEx(*args)
            return
        args = (handle, _OP_T, _OP_N, width, n, dim,
                _ONE.ctypes.data, items.data.ptr, dim, width * dim,
                users.data.ptr, dim, stride_users,
                _ZERO.ctypes.data, out.data.ptr, width, n * width,
                tiles)
        if self._capturing:
            # CuPy's bindings refuse cuBLAS calls while a stream is being captured, although cuBLAS itself
            # supports capture; make the same call on the same handle through the library CuPy loaded.
            _captured_cublas(self.compute_stream.ptr, "cublasSgemmStridedBatched", args)
            return
        cublas.setPointerMode(handle, 0)  # alpha and beta are host scalars (CuPy may leave device mode set)
        cublas.sgemmStridedBatched(*args)

    def _half_alpha(self, dim: int) -> np.ndarray:
        # One host scalar per dimension, kept alive: a captured graph holds the GEMM's pointer to it.
        from .. import fast

        if dim not in self._alphas:
            self._alphas[dim] = np.full(1, fast.output_scale(dim), np.float32)
        return self._alphas[dim]

    def score_dtype(self, input_dtype: Any) -> Any:
        """The dtype of score tiles for GEMM inputs of ``input_dtype``."""
        return np.dtype(np.float16) if np.dtype(input_dtype) == np.float16 and self.half_scores else np.dtype(np.float32)

    def topk_new(self, n_users: int, k: int) -> GpuTopK:
        return GpuTopK.allocate(n_users, k)

    def topk_reset(self, state: GpuTopK, n_users: int) -> None:
        # The final merge of the previous block left every row empty; only the row count changes.
        state.n_users = n_users

    def topk_update(self, state: GpuTopK, scores: Any, item_start: int, n_items: int, excl_indptr: Any,
                    excl_items: Any) -> None:
        tiles, n, width = scores.shape
        if excl_items.size:
            self._mask[scores.dtype](((n + 127) // 128,), (128,),
                                     (scores, np.int32(n), np.int32(width), np.int32(tiles), np.int32(item_start),
                                      np.int32(1), excl_indptr, excl_items))
        self._filter[scores.dtype]((n, tiles), (_FILTER_THREADS,),
                     (scores, np.int32(n), np.int32(width), np.int32(item_start), np.int32(n_items), state.thr,
                      state.cand, np.int32(state.cand_capacity), state.cnt))
        self._launch_merge(state, scores, n, width, tiles, item_start, n_items, final=False)

    def topk_seed(self, state: GpuTopK, users: Any, sample: Any, first: int, stride: int, scores_buf: Any,
                  excl_indptr: Any, excl_items: Any) -> None:
        """Start every user's threshold at its k-th best score over ``sample`` (item rows first + j * stride):
        a lower bound of the final k-th best, so that later tiles pass few scores to the merge whatever the item
        order. The sample tile goes through the filter and a forced merge like a segment; the state is left empty."""
        n, dim = users.shape
        size = sample.shape[0]
        scores = scores_buf[: n * size].reshape(1, n, size)
        self.gemm_strided_batched(users.reshape(1, n, dim), sample.reshape(1, size, dim), scores)
        grid = ((n + 127) // 128,)
        if excl_items.size:
            self._mask[scores.dtype](grid, (128,), (scores, np.int32(n), np.int32(size), np.int32(1), np.int32(first),
                                                    np.int32(stride), excl_indptr, excl_items))
        self._filter[scores.dtype]((n, 1), (_FILTER_THREADS,),
                     (scores, np.int32(n), np.int32(size), np.int32(0), np.int32(size), state.thr,
                      state.cand, np.int32(state.cand_capacity), state.cnt))
        self._launch_merge(state, scores, n, size, 1, 0, size, final=False, force=True)
        self._seed_done(grid, (128,), (np.int32(n), np.int32(state.k), state.n_valid, state.thr, state.cnt,
                                       state.base))

    def topk_result(self, state: GpuTopK) -> tuple[Any, Any]:
        n = state.n_users
        self._launch_merge(state, state.out_vals, n, 1, 1, 0, 0, final=True)
        return state.out_vals[:n], state.out_rows[:n]

    def _merge_smem(self, k: int) -> tuple[int, int]:
        """(K_pad, dynamic shared memory bytes) of a merge for k, the merge kernels allowed that much."""
        k_pad = _pow2(k)
        smem = 8 * k_pad
        if smem > 48 * 1024 and smem > self._merge_smem_limit:
            for fn in (*self._merge.values(), self._merge_fused):
                fn.max_dynamic_shared_size_bytes = smem
            self._merge_smem_limit = smem
        return k_pad, smem

    def _launch_merge(self, state: GpuTopK, scores: Any, n: int, width: int, tiles: int, item_start: int,
                      n_items: int, final: bool, force: bool = False) -> None:
        k_pad, smem = self._merge_smem(state.k)
        merge = self._merge[scores.dtype]
        merge((n,), (_MERGE_THREADS,),
                    (state.top, state.n_valid, state.thr, state.cand, state.cnt, state.base, scores,
                     np.int32(n), np.int32(width), np.int32(tiles), np.int32(item_start), np.int32(n_items),
                     np.int32(state.k),
                     np.int32(k_pad), np.int32(state.cand_capacity), np.int32(-1 if force else state.cand_capacity // 2),
                     np.int32(1 if final else 0), state.out_vals, state.out_rows),
                    shared_mem=smem)

    # -- the fused path: exact scores filtered in the GEMM's registers (fused.cu) ------------------------------
    def _fused_applies(self, plan: scoring.TilePlan, n_items: int, k: int, dim: int, dtype: Any) -> bool:
        if self.fused_mode == "off" or np.dtype(dtype) != np.float32 or dim > _FUSED_MAX_DIM \
                or plan.interests is not None:
            return False
        return self.fused_mode == "force" or seed_size(n_items, k, plan.item_tile * plan.tiles_per_call) > 0

    def _transpose_items(self, items: Any, n_items: int, dim: int) -> Any:
        """The items transposed into (dim rounded up to 32, rows rounded up to 128), zero-padded, on the compute
        stream: the fused kernel's operand. Kept for the next search of the same array (an engine's items never
        change, and the array is held, so its memory cannot be reused by another meanwhile); rebuilt for another."""
        dp = -(-dim // _FUSED_CHUNK) * _FUSED_CHUNK
        shape = (dp, -(-n_items // _FUSED_TILE) * _FUSED_TILE)
        cached = self._items_t
        if cached is not None and cached[0] is items and cached[1] == (shape, n_items, dim):
            return cached[2]
        with self.compute_stream:
            if cached is None or cached[2].shape != shape:
                self.compute_stream.synchronize()  # no queued search reads the old one any more
                self._items_t = cached = None  # let the old one go first
                items_t = self.xp.zeros(shape, np.float32)
            else:
                # The same room, refilled after the searches queued before it on this stream; zero the padding
                # an earlier array of more columns may have left.
                items_t = cached[2]
                items_t[dim:, :] = 0
                items_t[:, n_items:] = 0
            items_t[:dim, :n_items] = items[:n_items].T
        self._items_t = (items, (shape, n_items, dim), items_t)
        return items_t

    def _fused_search(self, ws: "_Workspace", users: Any, items_t: Any, n_items: int, state: GpuTopK,
                      ex_ptr: Any, ex_items: Any, has_excl: bool) -> None:
        """Score one block's n users against every item with recall_fused_filter, a segment of items per launch,
        each followed by a merge (which recomputes the segment for a user whose buffer overflowed)."""
        n, dim = users.shape
        users_t = ws.users_t
        users_t[:dim, :n] = users.T
        dp, ldu = users_t.shape
        smem = 4 * _FUSED_TILE * (dp + 2 * _FUSED_CHUNK)
        if smem > 48 * 1024 and smem > self._fused_smem_limit:
            self._fused.max_dynamic_shared_size_bytes = smem
            self._fused_smem_limit = smem
        tiles = -(-n_items // _FUSED_TILE)
        seg = max(1, self.fused_segment // _FUSED_TILE)
        per_cta = max(1, self.fused_tiles_per_cta)
        for t0 in range(0, tiles, seg):
            nt = min(seg, tiles - t0)
            self._fused((-(-nt // per_cta), -(-n // _FUSED_TILE)), (_FUSED_THREADS,),
                        (users_t, np.int32(ldu), items_t, np.int64(items_t.shape[1]), np.int32(dp), np.int32(t0),
                         np.int32(nt), np.int32(per_cta), np.int32(n_items), np.int32(n), state.thr, state.cand,
                         np.int32(state.cand_capacity), state.cnt), shared_mem=smem)
            start = t0 * _FUSED_TILE
            self._launch_merge_fused(state, users_t, items_t, n, start, min(nt * _FUSED_TILE, n_items - start),
                                     n_items, False, ex_ptr, ex_items, has_excl)
        self._launch_merge_fused(state, users_t, items_t, n, 0, 0, n_items, True, ex_ptr, ex_items, has_excl)

    def _launch_merge_fused(self, state: GpuTopK, users_t: Any, items_t: Any, n: int, item_start: int, n_tile: int,
                            n_items: int, final: bool, ex_ptr: Any, ex_items: Any, has_excl: bool) -> None:
        k_pad, smem = self._merge_smem(state.k)
        c = state.cand_capacity
        merge_at = min(self.fused_merge_at or max(state.k, 256), c // 2)
        self._merge_fused((n,), (_MERGE_THREADS,),
                          (state.top, state.n_valid, state.thr, state.cand, state.cnt, state.base, users_t,
                           np.int32(users_t.shape[1]), items_t, np.int64(items_t.shape[1]), np.int32(users_t.shape[0]),
                           np.int32(item_start), np.int32(n_tile), np.int32(n_items), np.int32(state.k),
                           np.int32(k_pad), np.int32(c), np.int32(merge_at), np.int32(1 if final else 0),
                           state.out_vals, state.out_rows, ex_ptr, ex_items, np.int32(1 if has_excl else 0)),
                          shared_mem=smem)

    # -- the block pipeline -----------------------------------------------------------------------------------
    def run_blocks(self, plan: scoring.TilePlan, users: Any, items: Any, n_items: int, k: int, excl: Any,
                   out_vals: Any, out_rows: Any, wait: bool = True, floor: Any = None) -> Any:
        """Search every block (see the base protocol). With ``wait`` False, return once every block is queued (the
        users and exclusions copied into staging buffers) with a callable that waits for this search alone and
        returns its stats: the next search may be queued before then, and the device runs both without a gap.

        ``floor``: a device float32 (n_users,) of inner-product scores, or None. A user's threshold starts there
        (instead of at the seed of the threshold sample), so that only items scoring above it are returned (fewer
        than k where fewer do): for a search of the rows after others whose k-th best is known (recall/early.py),
        items at or below it cannot enter the top k."""
        import cupy

        wall = time.perf_counter()
        n_users, dim = users.shape
        cap = plan.user_block
        blocks = [(s, min(s + cap, n_users)) for s in range(0, n_users, cap)]
        max_excl = max(1, max(int(excl.indptr[e] - excl.indptr[s]) for s, e in blocks))
        has_excl = excl.items.size > 0
        host_users = isinstance(users, np.ndarray)
        fused = self._fused_applies(plan, n_items, k, dim, users.dtype)
        # The fused path keeps score room for the threshold sample only.
        sample = seed_size(n_items, k, plan.item_tile * plan.tiles_per_call) if plan.interests is None else 0
        ws = self._workspace(plan, k, dim, max_excl, users.dtype, fused, max(1, sample) if fused else None)
        state, scores_buf, slots = ws.state, ws.scores, ws.slots
        stats = {"blocks": len(blocks), "graph_blocks": 0}
        compute, copy, fetch = self.compute_stream, self.copy_stream, self.fetch_stream
        host_out = isinstance(out_vals, np.ndarray)  # page-locked host results (empty_out), filled block by block
        # Our streams do not synchronise with the caller's: order them after whatever produced the inputs and
        # the output arrays (the item upload, the caller's device users, the allocation of out_vals).
        ready = cupy.cuda.get_current_stream().record()
        compute.wait_event(ready)
        copy.wait_event(ready)
        seed = self._refresh_sample(ws, plan, items, n_items, k, dim)
        stats["seed_sample"] = 0 if seed is None else seed[0].shape[0]
        items_t = self._transpose_items(items, n_items, dim) if fused else None
        stats["fused"] = fused
        # Event: the previous block's results have left state.out_vals for the host (of the previous search, for the
        # first block: it may still be fetching).
        fetched = ws.fetched
        timing = []  # (h2d start, h2d end, compute start, compute end[, d2h end]) events per block

        for i, (start, stop) in enumerate(blocks):
            slot = slots[i % len(slots)]
            n = stop - start
            ev = [cupy.cuda.Event() for _ in range(4)]
            # Stage: wait until the compute stream is done with this slot (block i - _SLOTS), then upload.
            slot.consumed.synchronize()  # the pinned buffers are rewritten by the host below
            ptr, ex_items = excl.block(start, stop)
            slot.host_ptr[: n + 1] = ptr
            slot.host_ptr[n + 1:] = ptr[-1]  # rows past the block's end are empty
            slot.host_items[: ex_items.size] = ex_items
            with copy:
                if host_users:
                    ev[0].record(copy)
                    slot.host_users[:n] = users[start:stop]
                    slot.users.set(slot.host_users, stream=copy)
                else:
                    copy.wait_event(compute.record())  # device users may come from work queued on compute
                    ev[0].record(copy)  # after the wait: h2d_s times the copies, not the wait
                    slot.users[:n] = users[start:stop]
                slot.ex_ptr.set(slot.host_ptr, stream=copy)
                if has_excl:
                    slot.ex_items.set(slot.host_items, stream=copy)
                if floor is not None:
                    slot.floor[:n] = floor[start:stop]
                ev[1].record(copy)
                slot.staged.record(copy)
            with compute:
                compute.wait_event(slot.staged)
                if fetched is not None:
                    compute.wait_event(fetched)  # this block's final merge rewrites state.out_vals
                ev[2].record(compute)
                self._search_slot(slot, i, plan, items, n_items, state, scores_buf, n, has_excl, stats, seed,
                                  ws if fused else None, items_t, floor is not None)
                if not host_out:
                    out_vals[start:stop, :k] = state.out_vals[:n]
                    out_rows[start:stop, :k] = state.out_rows[:n]
                ev[3].record(compute)
                slot.consumed.record(compute)
            if host_out:
                with fetch:
                    fetch.wait_event(ev[3])
                    state.out_vals[:n].get(stream=fetch, out=out_vals[start:stop], blocking=False)
                    state.out_rows[:n].get(stream=fetch, out=out_rows[start:stop], blocking=False)
                    fetched = fetch.record()
                    ev.append(fetched)
            timing.append(ev)
        ws.fetched = fetched
        done = (compute.record(), fetch.record())

        def finish() -> dict:
            with self.device:
                for event in done:
                    event.synchronize()
                elapsed = time.perf_counter() - wall
                busy = sum(cupy.cuda.get_elapsed_time(e[2], e[3]) for e in timing) / 1e3
                h2d = sum(cupy.cuda.get_elapsed_time(e[0], e[1]) for e in timing) / 1e3
                d2h = sum(cupy.cuda.get_elapsed_time(e[3], e[4]) for e in timing if len(e) > 4) / 1e3
            stats.update(wall_s=elapsed, gpu_busy_s=busy, h2d_s=h2d, d2h_s=d2h,
                         busy_fraction=busy / elapsed if elapsed > 0 else 0.0,
                         tiles=(plan.user_block, plan.item_tile, plan.tiles_per_call))
            self.stats = stats
            return stats

        if not wait:
            return finish
        finish()
        return None

    def _workspace(self, plan: scoring.TilePlan, k: int, dim: int, max_excl: int, dtype: Any,
                   fused: bool = False, score_width: int | None = None) -> "_Workspace":
        """The device and pinned buffers of a search, kept for the next search of the same shape (an embedded
        engine answering many calls allocates, and captures its graphs, once). The fused path needs score room for
        the threshold sample only, and a larger candidate buffer."""
        import cupy

        key = (plan, k, dim, np.dtype(dtype), fused, score_width)
        ws = self._ws.get(key)
        if ws is not None and ws.max_excl >= max_excl:
            with self.compute_stream:  # after a search still running on it (run_blocks(wait=False))
                ws.state.clear()  # the last final merge emptied it, unless that search was interrupted
            return ws
        # Keep at most two shapes (fast mode alternates its wide half-precision pass and the exact fallback);
        # let the others go before taking new buffers, once no queued search still uses them.
        self.synchronize()
        self._ws.pop(key, None)
        while len(self._ws) >= 2:
            self._ws.pop(next(iter(self._ws)))
        width = plan.item_tile * plan.tiles_per_call if score_width is None else score_width
        need = (4 * plan.user_block * width + plan.user_block * self.state_bytes(k) + 2 * 4 * plan.user_block * dim)
        try:
            state = GpuTopK.allocate(plan.user_block, k, _fused_capacity(k) if fused else 0)
            scores = cupy.empty(plan.user_block * width, self.score_dtype(dtype))
            slots = [self._slot(plan.user_block, dim, max_excl, dtype) for _ in range(_SLOTS)]
        except cupy.cuda.memory.OutOfMemoryError as exc:
            raise ResourceError(
                f"GPU out of memory allocating a {need:,}-byte search workspace ({plan.user_block} users x "
                f"{plan.item_tile * plan.tiles_per_call} items per tile, k={k}); {self.free_memory():,} bytes free: "
                f"lower memory_budget"
            ) from exc
        self._ws[key] = _Workspace(key, max_excl, state, scores, slots)
        if fused:
            self._ws[key].users_t = cupy.zeros((-(-dim // _FUSED_CHUNK) * _FUSED_CHUNK,
                                                -(-plan.user_block // _FUSED_TILE) * _FUSED_TILE), np.float32)
        return self._ws[key]

    def _slot(self, cap: int, dim: int, max_excl: int, dtype: Any) -> _Slot:
        import cupy
        import cupyx

        return _Slot(users=cupy.zeros((cap, dim), dtype), floor=cupy.full(cap, -np.inf, np.float32),
                     ex_ptr=cupy.zeros(cap + 1, cupy.int64),
                     ex_items=cupy.zeros(max_excl, cupy.int64),
                     host_users=cupyx.zeros_pinned((cap, dim), dtype),
                     host_ptr=cupyx.zeros_pinned(cap + 1, np.int64), host_items=cupyx.zeros_pinned(max_excl, np.int64),
                     staged=cupy.cuda.Event(disable_timing=True), consumed=cupy.cuda.Event(disable_timing=True))

    def _refresh_sample(self, ws: _Workspace, plan: scoring.TilePlan, items: Any, n_items: int, k: int,
                        dim: int) -> tuple[Any, int, int] | None:
        """Copy this search's threshold sample (every stride-th item row from first) into the workspace's buffer, on
        the compute stream; None where the search is not seeded (small catalogues, multi-interest blocks)."""
        size = seed_size(n_items, k, plan.item_tile * plan.tiles_per_call)
        if not size or plan.interests is not None:
            return None
        if ws.sample is None or ws.sample.shape != (size, dim):
            ws.sample = self.xp.empty((size, dim), items.dtype)
        stride = n_items // size
        first = stride // 2
        with self.compute_stream:
            ws.sample[...] = items[first: first + stride * size: stride]
        return ws.sample, first, stride

    def _search_slot(self, slot: _Slot, i: int, plan: scoring.TilePlan, items: Any, n_items: int, state: GpuTopK,
                     scores_buf: Any, n: int, has_excl: bool, stats: dict, seed: Any, fused_ws: Any,
                     items_t: Any, has_floor: bool = False) -> None:
        """One block of n users. The cuBLAS path always runs over the slot's full capacity of rows (rows past the
        real users are ignored), so that every block runs the same launches and the graph captured for a slot
        replays for each of its blocks; the fused path (``fused_ws`` set) scores the real rows only, and runs a
        short last block eagerly."""
        ex_items = slot.ex_items if has_excl else slot.ex_items[:0]
        cap = slot.users.shape[0]
        rows = n if fused_ws is not None else cap

        def launches() -> None:
            users = slot.users[:rows]
            self.topk_reset(state, rows)
            if has_floor:
                # The floor (the k-th best of the rows searched before) stands in for the threshold sample's seed.
                state.thr[:rows] = slot.floor[:rows]
            elif seed is not None:
                self.topk_seed(state, users, *seed, scores_buf, slot.ex_ptr, ex_items)
            if fused_ws is None:
                scoring.search_block(self, plan, users, items, n_items, state, scores_buf, slot.ex_ptr, ex_items)
                self.topk_result(state)
            else:
                self._fused_search(fused_ws, users, items_t, n_items, state, slot.ex_ptr, slot.ex_items, has_excl)

        # The first block runs eagerly: it compiles and loads everything the capture must not have to.
        if not self.use_graphs or (i == 0 and slot.graph is None) or rows != cap:
            launches()
            return
        # The workspace (and so every other pointer, the sample buffer included) is fixed per slot.
        key = (id(items), n_items, has_excl, seed is not None, None if items_t is None else items_t.data.ptr,
               has_floor)
        if slot.graph is None or slot.graph_key != key:
            slot.graph = self._capture(launches)
            slot.graph_key = key
        if slot.graph is None:
            launches()
        else:
            slot.graph.launch(self.compute_stream)
            stats["graph_blocks"] += 1

    def _capture(self, launches: Any) -> Any:
        stream = self.compute_stream
        try:
            stream.begin_capture()
            self._capturing = True
            try:
                launches()
            finally:
                self._capturing = False
                graph = stream.end_capture()
            return graph
        except Exception as exc:  # capture is an optimisation: never fail a search for it
            log.warning("recall: CUDA graph capture failed (%s: %s); launching eagerly", type(exc).__name__, exc)
            self.use_graphs = False
            return None

    # -- per-user candidate re-scoring (recall/rescore.py, recall/kernels/rescore.cu) ------------------------------
    def rescore_fused(self, users: Any, items: Any, indptr: np.ndarray, rows: Any, k: int, out_vals: Any,
                      out_rows: Any, budget: int) -> bool:
        """Gather, score and select each user's own candidates in one kernel; False when k is beyond it."""
        from .. import rescore

        return rescore.fused_device(self, users, items, indptr, rows, k, out_vals, out_rows, budget)

    def rescore_select(self, scores: Any, rows: Any, k: int) -> tuple[Any, Any]:
        """The best k (score desc, lower row first) of each row of a padded candidate block (recall/rescore.py)."""
        from .. import rescore

        return rescore.select_device(self, scores, rows, k)
