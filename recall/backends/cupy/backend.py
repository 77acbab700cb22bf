"""The GPU backend: a fused float32 scoring-and-filtering kernel, cuBLAS through CuPy, exact top-k kernels, pinned
staging and streams.

Seeded searches (and those of very large k) score each user block against each item segment with a fused kernel
(:mod:`.fused`) that keeps only the scores above each user's threshold and never writes a score tile:
``recall_fused_filter`` (``kernels/fused.cu``) for exact mode's float32 vectors of at most 256 dimensions,
``recall_fused_filter_h`` (``kernels/fused_h.cu``, tensor cores) for fast mode's float16 ones of at most 128 columns
multiplied (on Hopper ``kernels/fused_w.cu``'s wgmma kernels, up to 144).
Elsewhere (wider vectors, multi-interest users, small catalogues), every item segment is one strided-batched GEMM
(the user block shared by all tiles of the batch: stride 0; :mod:`.blas`) writing a score tile, followed at once by
the selection kernels of ``kernels/topk.cu`` (:mod:`.selection`) reading it back. Blocks are pipelined on streams
(:mod:`.pipeline`). Per-user candidates are re-scored by one fused kernel (:mod:`.rescore`).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ...core import keys
from ...core.certificate import FastItems, FastUsers, output_scale, prepare_users, user_terms
from ...core.errors import ResourceError
from ...core.exclusions import Exclusions
from ...core.metrics import l2_finished, largest_row_norm, row_norms
from ...core.options import EngineOptions
from ...core.tiling import TilePlan, plan_tiles
from .. import candidates
from ..numpy.backend import tune_band
from ..protocol import PASS_SHARE
from . import blas, fused, kernels, rescore, transfers
from .items import FUSED_CHUNK, FUSED_TILE, DeviceItems
from .pipeline import BlockPipeline, PendingSearch, wire_dtype
from .selection import GpuTopK, Selection, fused_capacity, pow2

WIDE_PASS_SHARE = 0.25
"""``float16_pass_share`` of searches whose rows are wider than the fused float32 kernel takes (both searches GEMMs):
the float16 pass measured 0.11-0.15 of the float32 search (d = 384 and 1,024, 20k x 1M, H200 2026-12-04)."""

# Tilings `recall tune` tries on the GPU: score tiles of 32-512 MiB, from tiles that stay in the 50 MiB L2 of an
# H100/H200 (the selection kernels then read the GEMM's output from L2) to few, large calls (fewer launches; measured
# faster on the H200 for S1).
_TUNE_USERS = (1024, 2048, 4096)
_TUNE_ITEMS = ((4096, 2), (8192, 1), (8192, 2), (8192, 4), (16384, 4))
_TUNE_BAND = (32 << 20, 512 << 20)


USER_BLOCK = 4096
"""Users a block on the cuBLAS path, whose score tiles grow with the block: larger blocks were slower there (d = 256
fast mode's float16 GEMMs, 20k x 1M: 0.0452 s at 4,096, 0.0563 at 8,192, 0.0779 at 16,384; docs/benchmarks.md,
"Larger user blocks")."""
FUSED_USER_BLOCK = 32768
"""Users a block where the pass takes a fused kernel (the memory budget halves it where a block's state does not
fit: S1 and 1M x 100k keep 16,384): each block pays its own launches (threshold sample, fused kernels, merges, the
route's re-scoring), which a larger block shares out over more users (200k x 20k x 64, k = 100: 0.0174 s at 4,096,
0.0144 s at 16,384; S1 0.0788 and 0.0711 s). 32,768 against 16,384 (H100, 2026-12-06): the route 0.88-0.95x on
1M x 4,096 and 2M x 4,096, 1M x 20k x 32, 300k-500k x 20k, 20k x 20k; 0.93-1.01x on 200k x 20k, 100k x 4,096 and
50k x 20k; no cell slower beyond the noise (docs/benchmarks.md)."""
FUSED_SMALL_USER_BLOCK = 65536
FUSED_SMALL_ITEMS = 4096
"""Users a fused block where the catalogue has at most FUSED_SMALL_ITEMS items, whose candidate buffers then hold at
most as many keys a user (``selection.fused_capacity``): 65,536 users took 2.5-7.5% less time than 32,768 on seven
cells of 2,048-4,096 items (the route on 100k-2M users, ip, cosine and l2, k = 5-50; the float32 search 0-4% less;
H100, 2026-12-07, docs/benchmarks.md). Larger catalogues were not measured at this size (from 16,384 items the
budget halves it all the same)."""

STAGING_BYTES_PER_S = 13e9
"""The host's pace staging a search's excluded pairs (``staging_bound``): each block's item rows read as given and
written, in the wire's dtype, into pinned memory, then sent. Skewed 1M x 4,096 x 64 with 50 pairs a user (int64
given, int32 sent: 600 MB) kept the block loop 43.5 ms (the float32 search) and 47 ms (the route) on the H100
machine, 13-14 GB/s (2026-12-06 19:03 UTC, docs/benchmarks.md)."""
FLOAT32_FLOPS_PER_S = 2.5e13
"""The float32 search's pace on the device, two flops a column of a score (``staging_bound``): measured 2.1e13 on
1M x 20k x 32 l2, 2.5e13 on 1M x 4,096 x 64 and 4.3e13 on S1 (H100, docs/benchmarks.md). The faster the model takes
it, the shorter its float32 work and the sooner a float16 pass declines: it takes a middle value, and leaves the
route where the two are close (STAGING_MARGIN)."""
STAGING_MARGIN = 1.25
"""How much longer than the float32 search's modelled work on the device the host's staging must take before a
float16 pass declines for it (``staging_bound``)."""
STAGING_MIN_S = 0.01
"""Staging modelled shorter than this never declines a float16 pass: the route's own steps after its pass cost it
less than that (3.2 ms for 1M users, docs/benchmarks.md)."""


def staging_bound(n_users: int, n_items: int, width: int, pairs: int, itemsize: int) -> str | None:
    """``Backend.staging_bound`` on the GPU. The pipeline stages each block's excluded rows on the host (pinned
    copies) while the device searches the blocks before: where that staging outlasts the float32 search's own work,
    the float32 search hides under it, and a float16 pass saves nothing but adds its re-scoring and certificates
    after the host's last block. Skewed 1M x 4,096 x 64 ip with 50 pairs a user: the route 58.6 ms against the
    float32 search's 52.4 (GPU busy 13.0 and 24.2 ms); 1M x 20k x 32 l2 with as many: 58.2 against 97.9
    (docs/benchmarks.md). The model: the staged bytes (as given and as sent: ``pipeline.wire_dtype``) at
    STAGING_BYTES_PER_S against the float32 search's flops at FLOAT32_FLOPS_PER_S, STAGING_MARGIN and
    STAGING_MIN_S."""
    staged = pairs * (itemsize + np.dtype(wire_dtype(n_items)).itemsize)
    host_s = staged / STAGING_BYTES_PER_S
    device_s = 2.0 * n_users * n_items * width / FLOAT32_FLOPS_PER_S
    if host_s < STAGING_MIN_S or host_s < STAGING_MARGIN * device_s:
        return None
    return (f"the host stages {pairs:,} excluded pairs ({staged:,} bytes, about {host_s * 1e3:.0f} ms) while the "
            f"float32 search's work on the device is about {device_s * 1e3:.0f} ms: the staging sets the pace, and a "
            f"float16 pass would save nothing")


def preferred_width(dim: int, k: int) -> int:
    """Items per tile of the preferred tiling (:meth:`CupyBackend.preferred_tiles`, 4 tiles a GEMM call): 8,192, 16,384
    for vectors of 128 dimensions or more, at least 2 k rounded up to a power of two."""
    return max(16384 if dim >= 128 else 8192, pow2(2 * k))


def tune_candidates(heuristic: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    """The tilings ``recall tune`` tries on the GPU, the heuristic first."""
    return tune_band(_TUNE_USERS, _TUNE_ITEMS, _TUNE_BAND, heuristic)


def is_device_array(arr: Any) -> bool:
    """True for CuPy arrays and anything else that lives in device memory (``__dlpack__`` off the host)."""
    return hasattr(arr, "__cuda_array_interface__") or (
        hasattr(arr, "__dlpack_device__") and not isinstance(arr, np.ndarray) and arr.__dlpack_device__()[0] != 1
    )


def _shares(out: Any, arr: Any) -> bool:
    """Whether the device array ``out`` starts where the caller's device array ``arr`` does."""
    try:
        return int(out.data.ptr) == int(arr.__cuda_array_interface__["data"][0])
    except (AttributeError, KeyError, TypeError):
        return True  # cannot tell: assume it does (a copy is only slower)


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def nvml_driver_version() -> str | None:
    """The NVIDIA driver's version (e.g. "580.65.06") through NVML, or None where NVML cannot be loaded."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        buf = ctypes.create_string_buffer(96)
        ok = nvml.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(len(buf))) == 0
        nvml.nvmlShutdown()
        return buf.value.decode() if ok else None
    except (OSError, AttributeError):
        return None


class CupyBackend:
    """CuPy backend. Arrays are CuPy arrays on the current device; searches are queued on the backend's streams."""

    name = "gpu"
    asynchronous = True
    workers = 1  # blocks overlap on streams, not threads
    # A block of fewer users than the preferred block batches more item tiles a GEMM call, up to 2,048 x 32,768
    # scores (tiling.plan_tiles): an embedded engine's one user against 1M items runs one call and one filter
    # instead of 31 of each.
    few_users_area = 1 << 26

    def __getstate__(self) -> dict:
        """Not picklable: what it holds (streams, device memory) belongs to this process and device."""
        raise TypeError("a recall.Engine on the gpu backend cannot be pickled (its items live on the device): send "
                        "the item matrix (and ids) and build an Engine in each process")

    def __init__(self) -> None:
        import cupy

        self.xp = cupy
        self.device = cupy.cuda.Device()
        self.selection = Selection()
        self.pipeline = BlockPipeline(self)
        self.transfers = transfers.HostTransfers()
        self._alphas: dict[int, np.ndarray] = {}  # the fp16 GEMM's output scale per dimension (host scalars)
        self._identity: dict[str, str] | None = None

    @property
    def compute_stream(self) -> Any:
        return self.pipeline.compute_stream

    # -- arrays ----------------------------------------------------------------------------------------------------
    def module_of(self, arr: Any) -> Any:
        return self.xp if is_device_array(arr) else np

    def ingest(self, arr: Any, own: bool = False) -> Any:
        cupy = self.xp
        device = is_device_array(arr)
        if device and not hasattr(arr, "__cuda_array_interface__"):
            arr = cupy.from_dlpack(arr)  # e.g. a torch CUDA tensor, read in place
        try:
            if (isinstance(arr, np.ndarray) and arr.nbytes >= transfers.MIN_BYTES and arr.dtype.kind == "f"
                    and arr.ndim):
                return self.transfers.upload(arr, cupy.float32)  # a large host array: through pinned chunks
            out = cupy.ascontiguousarray(cupy.asarray(arr), dtype=cupy.float32)  # host arrays: one upload
            # A device input may come back as itself (or a view of the caller's memory): copy it when asked to own.
            return out.copy() if own and device and _shares(out, arr) else out
        except cupy.cuda.memory.OutOfMemoryError as exc:
            nbytes = int(np.prod(arr.shape)) * 4
            raise ResourceError(f"GPU out of memory: an array of shape {tuple(arr.shape)} (about {nbytes:,} bytes) "
                                f"does not fit; {self.free_memory():,} bytes free") from exc

    def asarray(self, arr: Any) -> Any:
        """``arr`` on the device, as C-contiguous int64 (integers) or float32."""
        cupy = self.xp
        arr = cupy.asarray(arr)
        return cupy.ascontiguousarray(arr, dtype=cupy.int64 if arr.dtype.kind in "iu" else cupy.float32)

    def largest_norm(self, vecs: Any) -> float:
        if not self._rows_launch_takes(vecs):
            return largest_row_norm(self.xp.get_array_module(vecs), vecs)
        # One launch and one 8-byte transfer, on the caller's stream as the users' checks were (for 200k users x 64
        # metrics.row_norms' array operations cost 17 launches: float64 copies, squares and sums a block of 65,536 rows,
        # then the largest).
        out = self.xp.zeros(1, dtype=self.xp.uint64)
        self._rows_launch("recall_largest_norm_sq", vecs, out, 4096)
        return math.sqrt(float(out.get().view(np.float64)[0]))

    def row_norms(self, vecs: Any) -> Any:
        if not self._rows_launch_takes(vecs):
            return row_norms(self.xp.get_array_module(vecs), vecs)
        # One launch (metrics.row_norms: a float64 square of every value written, then summed).
        out = self.xp.empty(int(vecs.shape[0]), dtype=self.xp.float64)
        self._rows_launch("recall_row_norms", vecs, out, 8192)
        return out

    def finish_l2(self, scores: Any, sq: Any) -> Any:
        # One elementwise kernel (a read and a write of the scores) where CuPy's array operations made 2·s and then
        # its difference (two reads, two writes, an array more): the same float32 arithmetic, 2·s exact and one
        # rounding (nvrtc may contract it to one fma: the same result, 2·s being exact).
        if isinstance(scores, np.ndarray) or scores.dtype != self.xp.float32 or sq.dtype != self.xp.float32:
            return l2_finished(self.xp.get_array_module(scores), scores, sq)
        return _l2_kernel(self.xp)(scores, sq[:, None])

    def _rows_launch_takes(self, vecs: Any) -> bool:
        """Whether norms.cu's kernels take ``vecs``: a device float32 (n, dim) matrix of unit column stride."""
        return (not isinstance(vecs, np.ndarray) and vecs.dtype == self.xp.float32 and vecs.ndim == 2
                and (not vecs.size or vecs.strides[1] == 4))

    def _rows_launch(self, name: str, vecs: Any, out: Any, most_blocks: int) -> None:
        """norms.cu's kernel ``name`` over the rows of ``vecs`` (:meth:`_rows_launch_takes`) into ``out``, on the
        caller's stream: a warp a row, 8 warps a block, at most ``most_blocks`` blocks (nothing without rows)."""
        n = int(vecs.shape[0])
        if n:
            kernel = kernels.module(("norms.cu",)).get_function(name)
            kernel((min(-(-n // 8), most_blocks),), (256,),
                   (vecs, np.int64(vecs.strides[0] // 4), np.int64(n), np.int32(vecs.shape[1]), out))

    def to_host(self, arr: Any) -> np.ndarray:
        if isinstance(arr, np.ndarray):
            return arr
        # Not while another thread captures a block's graph on the compute stream: synchronising a capturing stream
        # (or copying on the legacy stream meanwhile) fails that call and the capture.
        with self.pipeline.capture_lock:
            if arr.nbytes >= transfers.MIN_BYTES and arr.ndim:
                return self.transfers.download(arr, self.compute_stream)
            self.compute_stream.synchronize()
            return arr.get()

    def empty_out(self, shape: tuple, dtype: Any, host: bool) -> Any:
        import cupyx

        # Page-locked, so that each block's results can be copied back asynchronously while the next is searched.
        if host:
            return cupyx.empty_pinned(shape, dtype)
        # Device results are written (and merged, and read by later searches' floors) on the compute stream: taken
        # from its pool, so that once the caller lets them go their memory is reused only by work queued after
        # everything that still reads them. From the caller's stream's pool, a thread allocating there (the job's
        # item upload beside its early searches) could overwrite a part's results before the merge has read them.
        with self.pipeline.compute_stream:
            return self.xp.empty(shape, dtype)

    def store_rows(self, dest: Any, start: int, rows: np.ndarray) -> None:
        dest[start:start + rows.shape[0]].set(rows)

    # -- the device ------------------------------------------------------------------------------------------------
    def _name(self) -> str:
        props = self.xp.cuda.runtime.getDeviceProperties(self.device.id)
        return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])

    def describe(self) -> str:
        cupy = self.xp
        return (f"gpu {self.device.id}: {self._name()}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
                f"cupy {cupy.__version__}")

    def identity(self) -> dict[str, str]:
        if self._identity is None:
            try:
                runtime = self.xp.cuda.runtime
                driver = nvml_driver_version() or f"cuda {_cuda_version(runtime.driverGetVersion())}"
                self._identity = {"backend": self.name, "device": self._name(), "driver": driver,
                                  "runtime": f"cuda {_cuda_version(runtime.runtimeGetVersion())}"}
            except Exception as exc:  # a CUDA error here must not fail a search: key on what is known
                self._identity = {"backend": self.name, "device": f"unknown gpu ({type(exc).__name__})",
                                  "driver": "", "runtime": ""}
        return self._identity

    def free_memory(self) -> int:
        cupy = self.xp
        free, _total = cupy.cuda.runtime.memGetInfo()
        return int(free + cupy.get_default_memory_pool().free_bytes())

    def default_budget(self) -> int:
        return min(8 << 30, self.free_memory() // 4)

    def resident_bytes(self, n_items: int, dim: int) -> int:
        # The items, the fused kernel's transposed copy (rows rounded up to its tile, dims to its chunk) and the
        # float64 norms that threshold samples rank items by (DeviceItems.sample_rows).
        padded = -(-n_items // FUSED_TILE) * FUSED_TILE * (-(-dim // FUSED_CHUNK) * FUSED_CHUNK)
        return 4 * (n_items * dim + padded) + 8 * n_items

    def item_memory(self, budget: int) -> int | None:
        # What is free now, less the search's own budget and a tenth for the allocator and the other buffers.
        return max(0, int(0.9 * self.free_memory()) - budget)

    def state_bytes(self, k: int, n_items: int = 0) -> int:
        # top keys + candidates (the fused path's larger buffer) + results + per-user scalars, plus the pinned/device
        # staging of users (counted by the plan) for the pipeline slots.
        return 8 * k + 8 * fused_capacity(k, n_items) + 12 * k + 32

    def preferred_tiles(self, dim: int, k: int, dtype: Any, n_users: int, n_items: int,
                        options: EngineOptions) -> tuple[int, int, int]:
        # USER_BLOCK users (FUSED_USER_BLOCK where the pass takes a fused kernel) x (4 x 8192) items per
        # strided-batched call. A tile sized to stay in L2 (1024 x 8192, 32 MiB) needs 8x more calls, and on the
        # H200 the launches cost more than the HBM round trip they save: measured on S1 (100k x 1M x 64, graphs
        # on), 0.633 s at 1024 x (2 x 4096) against 0.589 s with 4 x 8192 items a call.
        # `recall tune` on the H200 (docs/benchmarks.md) found wider tiles better for long vectors (d=128, k=100:
        # 2048 x 16384 x 4, 1.04x) and larger user blocks for large k (d=64, k=1000: 4096 x 8192 x 4, 1.07x).
        # Blocks of 4,096 users at every k halve the launches of a user-heavy search: 1M x 100k x 64, k = 100,
        # 0.578 -> 0.538 s exact and 0.332 -> 0.298 s fast; S1 0.372 -> 0.359 s (docs/benchmarks.md, 23:3x).
        # Above k = 4,096, tiles of at least 2 k items: a call's four tiles are the fused path's room for a
        # threshold sample of 8 k items (selection.seed_size). At k = 8,192 on 10k x 1M x 64 that sample took the
        # search from 0.173 s (unseeded) to 0.115 s (docs/benchmarks.md).
        width = preferred_width(dim, k)
        # Whether the pass is fused does not hang on its user block (fused.applies): asked of the larger block's
        # plan before any budget.
        probe = plan_tiles(n_users, n_items, dim, k, 1 << 62, (FUSED_USER_BLOCK, width, 4), 0)
        fused_pass = self.fused_applies(probe, n_users, n_items, k, dim, dtype, options)
        if not fused_pass:
            return USER_BLOCK, width, 4
        return FUSED_SMALL_USER_BLOCK if n_items <= FUSED_SMALL_ITEMS else FUSED_USER_BLOCK, width, 4

    def tune_candidates(self, heuristic: tuple[int, int, int]) -> list[tuple[int, int, int]]:
        return tune_candidates(heuristic)

    def score_dtype(self, input_dtype: Any) -> Any:
        # Fast mode's GEMM writes float16 scores (scaled by certificate.output_scale): half the bytes written and
        # read back.
        return np.dtype(np.float16) if np.dtype(input_dtype) == np.float16 else np.dtype(np.float32)

    def pass_score_dtype(self, plan: TilePlan, n_users: int, n_items: int, k: int, width: int, dtype: Any,
                         options: EngineOptions) -> Any:
        if self.fused_applies(plan, n_users, n_items, k, width, dtype, options):
            return np.dtype(np.float32)
        return self.score_dtype(dtype)

    # -- the work --------------------------------------------------------------------------------------------------
    def load_items(self, prepared: Any, norms_rank: bool = False,
                   constant_column: tuple[int, float] | None = None,
                   bias_columns: tuple[int, int] | None = None, ranks: Any = None) -> DeviceItems:
        return DeviceItems(prepared, norms_rank, constant_column, bias_columns, ranks)

    def run_blocks(self, plan: TilePlan, users: Any, items: DeviceItems, n_items: int, k: int, excl: Exclusions,
                   out_vals: Any, out_rows: Any, options: EngineOptions, floor: Any = None,
                   left_out: Any = None, best_first: bool = True, need: int = 0) -> Any:
        return self.pipeline.run_blocks(plan, users, items, n_items, k, excl, out_vals, out_rows, options, floor,
                                        left_out, best_first, need)

    def queue_after(self, wait: Any) -> None:
        # The current stream waits for the search's events on the device; a wait without them (a streamed search's,
        # done when it returned) is called.
        if not isinstance(wait, PendingSearch):
            wait()
            return
        stream = self.xp.cuda.get_current_stream()
        for event in wait.events:
            stream.wait_event(event)

    def rescore(self, users: Any, items: DeviceItems, indptr: np.ndarray | int, rows: Any, k: int, budget: int,
                options: EngineOptions, ordered: bool = False) -> tuple[Any, Any, str]:
        cupy = self.xp
        n = int(users.shape[0])
        # The fused kernels write every one of a user's k results (-inf and -1 past its candidates); the gemm path
        # is given them filled.
        vals = cupy.empty((n, k), dtype=cupy.float32)
        out = cupy.empty((n, k), dtype=cupy.int64)
        users_d = self.asarray(users)
        rows = rows if isinstance(rows, np.ndarray) else cupy.ascontiguousarray(rows, dtype=cupy.int64)
        if options.rescore == "fused" and rescore.rescore_fused(users_d, items.vecs, indptr, rows, k, vals, out,
                                                                budget, ordered):
            return vals, out, "fused"
        vals.fill(-cupy.inf)
        out.fill(-1)
        candidates.rescore_gemm(self, users_d, items.vecs, indptr, rows, k, budget, vals, out,
                                rescore.ordered_dots if ordered else None)
        return vals, out, "gemm"

    def fast_users(self, users: Any, items: FastItems, half_scores: bool = False, shift: Any = None) -> FastUsers:
        # One launch, a warp 32 users (kernels/fast16.cu), for float32 rows of unit column stride (items rounded
        # about a centre too); else the array operations of certificate.prepare_users.
        cupy = self.xp
        n = int(users.shape[0])
        if users.dtype != cupy.float32 or users.ndim != 2 or (n and users.strides[1] != 4):
            return prepare_users(cupy, users, items, half_scores, shift)
        vecs16 = cupy.empty((n, items.width), dtype=cupy.float16)  # (the kernel writes every column)
        alpha, offset, bound = (cupy.empty(n, dtype=cupy.float64) for _ in range(3))
        if n:
            t = user_terms(items)
            sc = (*items.aux_scales, 1.0, 1.0, 1.0)[:3]
            kernel = kernels.fast16_module().get_function("recall_prepare_users")
            at = [-1 if c is None else c for c in (items.shift_at, items.bias_at, items.norms_at)]
            # (Without a shift the kernel reads none: any float64 array stands in for the pointer.)
            shift_d = alpha if shift is None else cupy.ascontiguousarray(shift, dtype=cupy.float64)
            kernel(((n + 255) // 256,), (256,),
                   (users, np.int64(users.strides[0] // 4), np.int32(n), np.int32(items.dot_dim), vecs16,
                    np.int32(items.width), shift_d, np.int32(shift is not None),
                    np.uint64(0) if items.centre is None else items.centre64,
                    np.float64(items.full_max_norm), np.uint64(0) if items.proj_at is None else items.proj_dir,
                    np.int32(-1 if items.proj_at is None else items.proj_at),
                    *(np.float64(t[name]) for name in ("proj_scale", "proj_max", "proj_err", "proj_w1_max",
                                                       "proj_w2_max")),
                    np.int32(t["proj_room"]), *(np.int32(c) for c in at),
                    np.int32(len(items.aux_scales)),
                    *(np.float64(t[name]) for name in ("beta", "cap_bias", "bias_scale", "gamma16", "gamma32", "rest0",
                                                       "flush", "max_norm", "max_resid", "bias_err_max", "bias_max",
                                                       "safety", "aux_user_max", "shift_item", "shift_user_max")),
                    np.int32(t["shift_room"]), *(np.float64(x) for x in sc), alpha, offset, bound))
        return FastUsers(vecs16, alpha, offset, bound, half_scores)

    def fused_applies(self, plan: TilePlan, n_users: int, n_items: int, k: int, width: int, dtype: Any,
                      options: EngineOptions) -> bool:
        """:func:`fused.applies` on this device: float16 rows up to the columns its float16 kernel multiplies
        (:func:`fused.half_max_width`; asked only of float16 searches, since it builds the wgmma kernels on Hopper)."""
        half_max = fused.FUSED_H_MAX_WIDTH
        if np.dtype(dtype) == np.float16:
            half_max = fused.half_max_width(bool(self.selection.fused_w), options)
        return fused.applies(plan, n_users, n_items, k, width, dtype, options, half_max)

    def certify_exact(self, plan: TilePlan, n_users: int, n_items: int, k: int, width: int,
                      options: EngineOptions) -> bool:
        # Where the exact search would run the fused kernel, whose sums the ordered re-scoring repeats: there the
        # float16 pass was 2.0-4.9x faster than the float32 one at every width measured, 64-256 (docs/benchmarks.md,
        # 2026-12-02). And where the rows are wider than that kernel takes: the float32 search is then cuBLAS's
        # GEMM, whose order of summation is its own choice per shape, so the route's ordered sums are as much exact
        # mode's scores as cuBLAS's (both exact float32 sums); the float16 pass there took 0.11-0.15 of the float32
        # search's time (d = 384 and 1,024, 20k x 1M, H200 2026-12-04, docs/benchmarks.md).
        if options.certified_exact == "off" or plan.interests is not None:
            return False
        return (not fused.covers(width, np.float32)
                or self.fused_applies(plan, n_users, n_items, k, width, np.float32, options))

    def staging_bound(self, n_users: int, n_items: int, width: int, pairs: int, itemsize: int) -> str | None:
        return staging_bound(n_users, n_items, width, pairs, itemsize)

    def float16_faster(self) -> bool:
        return True  # tensor cores (fused_h.cu, fused_w.cu; cuBLAS's half GEMM where neither applies)

    def float16_pass_share(self, n_users: int, n_items: int, k: int, width: int, options: EngineOptions) -> float:
        # Rows wider than the fused float32 kernel takes: both searches are GEMMs, the float16 one on tensor cores
        # (0.11-0.15 of the float32 search's time measured, d = 384 and 1,024; WIDE_PASS_SHARE leaves room).
        if not fused.covers(width, np.float32):
            return WIDE_PASS_SHARE
        return PASS_SHARE

    def starts_at_need(self, options: EngineOptions) -> bool:
        # Seeded passes at an estimate of the need-th best (pipeline.py); the walk keeps its own start.
        return options.seed_thresholds and options.seed_estimate and not options.fused_walk

    def select(self, scores: Any, rows: Any, k: int) -> tuple[Any, Any]:
        return rescore.select(scores, rows, k)

    def merge(self, parts: list[tuple[Any, Any, int]], k: int) -> tuple[Any, Any]:
        # On the compute stream: after the searches that fill the parts, before the searches queued next (whose
        # floors may come from this merge), and off the default stream, where a job uploads the items meanwhile.
        with self.compute_stream:
            return rescore.select(*keys.concat(self.xp, parts), k)

    def synchronize(self) -> None:
        with self.pipeline.capture_lock:
            self.pipeline.synchronize()
            self.device.synchronize()

    # -- primitives of the shared tiled loop (recall.backends.tiled) and candidate scoring -------------------------
    def gemm_strided_batched(self, users: Any, items: Any, out: Any) -> None:
        """``out[b] = users[b or 0] @ items[b].T`` on the current stream (see :func:`.blas.gemm_strided_batched`)."""
        capture = self.pipeline.compute_stream.ptr if self.pipeline.capturing else None
        blas.gemm_strided_batched(self.device.cublas_handle, users, items, out, self._half_alpha(items.shape[2]),
                                  capture)

    def _half_alpha(self, dim: int) -> np.ndarray:
        # One host scalar per dimension, kept alive: a captured graph holds the GEMM's pointer to it.
        if dim not in self._alphas:
            self._alphas[dim] = np.full(1, output_scale(dim), np.float32)
        return self._alphas[dim]

    def topk_new(self, n_users: int, k: int) -> GpuTopK:
        return GpuTopK.allocate(n_users, k)

    def topk_reset(self, state: GpuTopK, n_users: int) -> None:
        # The final merge of the previous block left every row empty; only the row count changes.
        state.n_users = n_users

    def topk_update(self, state: GpuTopK, scores: Any, item_start: int, n_items: int, excl_indptr: Any,
                    excl_items: Any) -> None:
        self.selection.update(state, scores, item_start, n_items, excl_indptr, excl_items)

    def topk_result(self, state: GpuTopK) -> tuple[Any, Any]:
        return self.selection.result(state)


@functools.cache
def _l2_kernel(cupy: Any) -> Any:
    """``Backend.finish_l2``'s elementwise kernel, made once a process."""
    return cupy.ElementwiseKernel("float32 s, float32 q", "float32 out", "out = 2.0f * s - q", "recall_finish_l2")
