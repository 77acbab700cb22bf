"""The CPU backend: GEMM through NumPy's BLAS over small tiles, selection through the compiled heap kernels of
:mod:`recall.backends.numpy.heap`, one user block per core."""
from __future__ import annotations

import contextlib
import os
import platform
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...core import host_threads, keys
from ...core.certificate import FastItems, FastUsers, gamma32, output_scale, prepare_users, seed_margin
from ...core.errors import ResourceError
from ...core.exclusions import Exclusions
from ...core.metrics import l2_finished, largest_row_norm, row_norms
from ...core.options import EngineOptions
from ...core.results import to_numpy
from ...core.tiling import TilePlan
from .. import candidates, tiled
from ..protocol import PASS_SHARE
from . import heap
from .ordered import SMALL_OUTPUTS, blas_products, blas_sums, ordered_products

# Tilings `recall tune` tries on the CPU: score tiles (4 bytes a score) of 256 KiB - 4 MiB bracket a core's L2.
_TUNE_USERS = (128, 256, 512, 1024)
_TUNE_ITEMS = ((512, 1), (1024, 1), (2048, 1))
_TUNE_BAND = (256 << 10, 4 << 20)


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_name() -> str:
    """NumPy's BLAS, e.g. "scipy-openblas 0.3.29" ("blas" where NumPy cannot say)."""
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name')} {blas.get('version', '')}".strip()
    except Exception:  # older NumPy has no mode="dicts": the BLAS is then named by NumPy's version alone
        return "blas"


def tune_band(users: tuple[int, ...], items: tuple[tuple[int, int], ...], band: tuple[int, int],
              heuristic: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    """The heuristic first, then every (users, width, tiles) of the grid whose score tile lies inside ``band``."""
    low, high = band
    out = [tuple(heuristic)]
    for ub in users:
        for width, tiles in items:
            if low <= 4 * ub * width * tiles <= high and (ub, width, tiles) not in out:
                out.append((ub, width, tiles))
    return out  # type: ignore[return-value]


_RANKED_ARRAYS = 8
"""Item arrays whose norms a CPU backend keeps for its threshold samples."""


class _MatrixVector:
    """A backend whose products are NumPy's as it calls BLAS (one row: the matrix-vector kernel, whose sums are
    within the same bound as the ordered ones but not equal to them), the rest its own: ``NumpyBackend._blas_first``'s
    first pass."""

    def __init__(self, backend: "NumpyBackend") -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    @staticmethod
    def gemm_strided_batched(users: np.ndarray, items: np.ndarray, out: np.ndarray) -> None:
        np.matmul(users, items.transpose(0, 2, 1), out=out)


def _memory_key(arr: np.ndarray) -> tuple:
    return (arr.__array_interface__["data"][0], arr.shape, arr.strides)


SMALL_PRODUCT = 1 << 18
"""Products of one row (a user against its own candidates, a block's last user), of at most this many multiply-adds
(rows x items x dimensions) or of at most ``ordered.SMALL_OUTPUTS`` scores are summed by
``ordered.ordered_products``, larger ones by BLAS. Every score is then the same float32 sum of its user and item
wherever it is computed (identical items score alike, and the tie rule holds between them; the re-scoring's scores
are the search's): BLAS's blocked kernels add the dimensions in order, one FMA each, as the ordered products do (up
to the depth of their panels: ``ordered.blas_sums``; deeper rows take BLAS's blocked sums everywhere,
``ordered.blas_products``, and where its sums depend on the score's place every product is the ordered kernel's),
while its matrix-vector kernel (one row) and its small-matrix kernels (OpenBLAS 0.3.31 on
the development machine: products of up to 1,200 scores and 10^6 multiply-adds, and of up to 32,768 multiply-adds)
sum in an order that depends on the item's place in the product (docs/reference.md, "Scores"). The ordered kernel
runs at about 3.9 G multiply-adds a second on a core of the development machine, against BLAS's matrix-vector
kernel's 12 G and its blocked kernels' more (``scripts/lab/cpu_sums.py``). A search of one user takes the
matrix-vector kernel and re-scores what it keeps (``NumpyBackend._blas_first``)."""
ONE_USER_MARGIN = 16
"""Items a search whose first pass is BLAS's own products keeps beyond k a user, re-scored with the ordered sums
(``NumpyBackend._blas_first``)."""
BLAS_FIRST_MAX_K = 256
BLAS_FIRST_MIN_ITEMS = 16384
"""Where BLAS sums by place, searches of many users take its products first (``NumpyBackend._blas_first``) at k up to
BLAS_FIRST_MAX_K against catalogues of BLAS_FIRST_MIN_ITEMS or more; the others the ordered kernel's. AMD EPYC, 2
cores, OpenBLAS's Haswell kernels (docs/benchmarks.md, 2026-12-07): 20k x 100k x 64 ip k = 10 1.22 s against 2.13,
20k x 100k x 32 k = 100 0.98 against 1.26, 5k x 100k x 128 k = 50 0.61 against 1.05; but 100k x 4,096 x 32 l2 k = 10
0.41 against 0.37 (the products cheap beside the selection of 26 a user for 10) and 20k x 100k x 32 l2 k = 1,000
5.6 against 3.6 (half the users searched again: 16 past k = 1,000 of skewed norms lie inside the bound)."""
_RESCORE_VALUES = 1 << 22
"""Coordinates of the candidates ``NumpyBackend._blas_first`` gathers at once to re-score them (16 MiB)."""
SEED_SCRATCH_VALUES = 1 << 18
"""Sampled scores a worker holds at once (1 MiB), whatever the sample's size."""
SEED_MIN_K = 300
"""Searches of smaller k are not seeded on the CPU: a heap's threshold rises with its first k items anyway, and at
k = 100-256 a seed costs what it saves (docs/benchmarks.md)."""
ESTIMATE_SIGMAS = 4
"""An estimate of a user's k-th best (``NumpyBackend._seed``) allows for this many standard deviations of the
number of sampled items above it (about Poisson): a user whose estimate lies above its k-th best is searched again."""


def seed_size(n_items: int, k: int, seeded: bool = True, requested: int = 0) -> int:
    """Items in a CPU search's threshold sample, or 0 where it is not seeded (k below :data:`SEED_MIN_K`). Without a
    seed a user's threshold rises slowly over the first tiles (a buffer's, from ``heap.BUFFER_MIN_K`` on, only at
    each cut): it takes about k·(1 + ln(n_items / k)) pairs, and a seed of the k-th best over s items spares it
    about k·ln(s / k) of them. The rule: 8 k items rounded up to a power of two, or the largest power of two at most
    an eighth of the catalogue where that is less (the sample's products cost 1/8 of the search's at most), if that
    is at least 4 k items; else, where k is large for the catalogue, 4 k items rounded up to a power of two if that
    is at most a third of it (its selection costs more than its products then); else none. 2 cores, 100k items x 64,
    interleaved medians, strided samples (docs/benchmarks.md; under ip, with half the sample from the largest norms,
    k = 1,000 took 0.72-0.81 of the unseeded time): k = 1,000 from 8,192 items 2.05 -> 1.72 s, k = 2,048 from 8,192
    1.59 -> 1.28 s, k = 639 from 8,192 1.48 -> 1.30 s, k = 4,096 from 16,384 2.02-2.08 -> 1.84 s, k = 8,192 from
    32,768 1.60-1.79 -> 1.42 s. ``requested``: ``EngineOptions.seed_sample``, taken from catalogues of at least
    twice it, and at least 2 k."""
    if not seeded or k < SEED_MIN_K:
        return 0
    if requested:
        return requested if requested >= 2 * k and n_items >= 2 * requested else 0
    size = min(1 << (8 * k - 1).bit_length(), 1 << max(0, (n_items // 8).bit_length() - 1))
    if size >= 4 * k:
        return size
    size = 1 << (4 * k - 1).bit_length()  # k large for the catalogue: 4 k items, up to a third of it
    return size if 3 * size <= n_items else 0


@dataclass
class _Seed:
    """A search's threshold sample: the sampled items' rows (sorted), vectors and float64 norms, and the margin
    (a, z) of ``certificate.seed_margin`` for the width they are scored at."""

    rows: np.ndarray
    vecs: np.ndarray
    norms: np.ndarray
    a: float
    z: float
    rank: int = 0  # the sampled rank a user's threshold starts at: an estimate of its k-th best (0: k, a bound)


@dataclass
class _HeapState:
    keys: np.ndarray  # (capacity, k) uint64 min-heaps of packed (score, row) keys, root = worst kept; or, for
    #                   k >= heap.BUFFER_MIN_K, (capacity, 2k) buffers of keys, counts[u] of them in use
    thr: np.ndarray  # (capacity,) float32: each user's threshold
    n_users: int
    k: int
    counts: np.ndarray | None = None


def _done(stats: dict) -> Any:
    return lambda: stats


_controller: Any = None
_controller_lock = threading.Lock()


def _blas_controller() -> Any:
    """threadpoolctl's controller of the BLAS libraries loaded in this process, made on first use. NumPy's BLAS, the
    one the search calls, is loaded with NumPy, before any search."""
    global _controller
    with _controller_lock:
        if _controller is None:
            from threadpoolctl import ThreadpoolController

            _controller = ThreadpoolController()
        return _controller


_limit_lock = threading.Lock()
_limit_users = 0  # searches of this process inside _one_blas_thread now
_limiter: Any = None  # their shared threadpoolctl limiter: made by the first to enter, restored by the last to leave


@contextlib.contextmanager
def _one_blas_thread() -> Any:
    """BLAS limited to one thread while any search of this process runs, and the limit the process had restored
    when the last one ends. Each search taking and restoring a limit of its own (threadpoolctl's ``limit``) raced:
    one restoring two threads while another still ran, and the last left the process at one thread for good."""
    global _limit_users, _limiter
    with _limit_lock:
        if _limiter is None:
            _limiter = _blas_controller().limit(limits=1, user_api="blas")
        _limit_users += 1
    try:
        yield
    finally:
        with _limit_lock:
            _limit_users -= 1
            if _limit_users == 0:
                limiter, _limiter = _limiter, None
                limiter.restore_original_limits()


_blas_sums: dict[int, str] = {}  # dimensions -> ordered.blas_sums() at one BLAS thread, once probed


def blas_summation(dim: int = 64) -> str:
    """How BLAS sums products of ``dim`` dimensions (``ordered.blas_sums``: "ordered", "blocked", or "placed", where
    a score's sum depends on its place and the CPU sums its scores itself, slower), at one thread, as the searches
    run BLAS; probed once per process and dimension."""
    got = _blas_sums.get(dim)
    if got is None:
        with _one_blas_thread():
            got = _blas_sums[dim] = blas_sums(dim)
    return got


def _after_fork_in_child() -> None:
    """A forked child runs none of its parent's searches: none counted, the locks new (a parent's thread may have
    held one at the fork). A limit inherited from searches in flight (BLAS at one thread) is kept, not touched here
    (no BLAS call in a fork handler), and restored when the child's own first search ends."""
    global _limit_lock, _controller_lock, _limit_users
    _limit_lock, _controller_lock = threading.Lock(), threading.Lock()
    _limit_users = 0
    for backend in list(_backends):
        backend._pool_lock, backend._ranked_lock = threading.Lock(), threading.Lock()


_backends: weakref.WeakSet = weakref.WeakSet()  # every NumpyBackend of this process, for _after_fork_in_child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class NumpyBackend:
    """NumPy/BLAS backend. Arrays are NumPy arrays; nothing is copied to a device; searches run when called."""

    name = "cpu"
    xp = np
    asynchronous = False
    # Each tile is a BLAS call and a selection pass: a block of few users widens its item tiles up to score tiles
    # of 1 MiB, a core's L2 (1 user x 100k items x 64, k=100: 1.50 ms at 512 items a tile, 0.87 ms at 8,192;
    # 32 users: 6.69 ms at 512, 6.19 ms at 8,192, 6.49 ms at 100,000; docs/benchmarks.md).
    few_users_area = 1 << 18
    #: Fast mode's emulation (``EngineOptions.fast_emulation``) with the GPU's float16 score tiles, as its cuBLAS
    #: path keeps them (passes of k above 4,096, rows wider than its float16 kernels multiply): each float16 GEMM's
    #: result scaled by ``certificate.output_scale`` and rounded to float16. For tests and ``scripts/lab`` only.
    float16_tiles = False

    def __init__(self) -> None:
        # One user block per core; each block's GEMM runs on one BLAS thread (see compute_context).
        self.workers = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
        self._identity: dict[str, str] | None = None
        self._pool: tuple[int, ThreadPoolExecutor] | None = None  # (the pid that made it, the pool)
        self._pool_lock = threading.Lock()
        _backends.add(self)
        # Item arrays loaded with ``norms_rank``, by their memory (address, shape, strides): the rows of their
        # threshold samples by (size, items), each ranked by the items' norms once. A few arrays at a time (an
        # engine's items, its filtered views, fast mode's copy); a key reused by another array of the same shape only
        # gets rows ranked by stale norms, and any rows of real items still make a valid seed.
        self._ranked: dict[tuple, dict[tuple[int, int], np.ndarray]] = {}
        self._ranked_lock = threading.Lock()  # engines searched from several threads load items (filtered views)
        self._norms: dict[tuple, float] = {}  # _largest_norm's, by (id of a live item array, items)

    def __getstate__(self) -> dict:
        """Pickled (an Engine sent to a spawned process, a Spark executor) without what belongs to this process: its
        thread pool and locks, the norms kept for threshold samples, the machine's identity (its cores: the
        unpickled backend counts the cores of the process it is unpickled in)."""
        return {"backend": self.name}  # not empty: pickle calls __setstate__ only for a true state

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    # -- arrays ----------------------------------------------------------------------------------------------------
    def module_of(self, arr: Any) -> Any:
        return np

    def ingest(self, arr: Any, own: bool = False) -> np.ndarray:
        if hasattr(arr, "get") and not isinstance(arr, np.ndarray):
            return np.ascontiguousarray(arr.get(), dtype=np.float32)  # a device array: the copy is ours
        if own:
            return np.array(arr, dtype=np.float32, order="C", copy=True)
        return np.ascontiguousarray(arr, dtype=np.float32)

    def asarray(self, arr: Any) -> np.ndarray:
        """``arr`` as a C-contiguous int64 (integers) or float32 NumPy array."""
        arr = to_numpy(arr)
        return np.ascontiguousarray(arr, dtype=np.int64 if arr.dtype.kind in "iu" else np.float32)

    def largest_norm(self, vecs: Any) -> float:
        return largest_row_norm(np, vecs)

    def row_norms(self, vecs: Any) -> np.ndarray:
        return row_norms(np, vecs)

    def finish_l2(self, scores: Any, sq: Any) -> np.ndarray:
        return l2_finished(np, scores, sq)

    def to_host(self, arr: Any) -> np.ndarray:
        return to_numpy(arr)

    def empty_out(self, shape: tuple, dtype: Any, host: bool) -> np.ndarray:
        return np.empty(shape, dtype)

    def store_rows(self, dest: np.ndarray, start: int, rows: np.ndarray) -> None:
        dest[start:start + rows.shape[0]] = rows

    # -- the device ----------------------------------------------------------------------------------------------
    def describe(self) -> str:
        return f"cpu ({os.cpu_count()} cores, numpy {np.__version__})"

    def identity(self) -> dict[str, str]:
        # Made once: the tune cache's key reads it at every search (/proc/cpuinfo and NumPy's build configuration
        # took 0.1-0.2 ms a call).
        if self._identity is None:
            self._identity = {"backend": self.name, "device": f"{cpu_model()} x{self.workers}",
                              "driver": f"numpy {np.__version__}", "runtime": blas_name()}
        return self._identity

    def free_memory(self) -> int:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 8 << 30

    def default_budget(self) -> int:
        return min(1 << 30, self.free_memory() // 4)

    def state_bytes(self, k: int, n_items: int = 0) -> int:
        return 16 * k + 12 if k >= heap.BUFFER_MIN_K else 8 * k + 4

    def resident_bytes(self, n_items: int, dim: int) -> int:
        return 4 * n_items * dim

    def item_memory(self, budget: int) -> int | None:
        return None  # the items are searched where they are

    def preferred_tiles(self, dim: int, k: int, dtype: Any, n_users: int, n_items: int,
                        options: EngineOptions) -> tuple[int, int, int]:
        # The more users a block holds, the better the BLAS amortises its packing of each item tile, until the
        # block's heaps (8 bytes a kept pair) crowd its score tile out of the core's cache: up to 1,024 users while
        # their heaps fit in 1 MiB, and a score tile of at least 1 MiB (cpu-small, 2 cores, 2026-12-01: k=100
        # 1,024 x 512 1.10 s against 1.19 s for 512 x 512). From heap.BUFFER_MIN_K on, the users' buffers are
        # written in order rather than sifted, and blocks of about 256 users with tiles of 2,048 items did best for
        # k = 1,000 to 8,192 (development machine, 2026-12-05, docs/benchmarks.md: 500 x 1M x 256 at k = 2,048,
        # 1.17 s in blocks of 250 against 1.35-1.47 s in blocks of 128; 5,000 x 100k x 64 at k = 1,000, 0.71
        # against 0.78 s; at k = 4,096 and 8,192 within 5% of each other from 64 to 500 users).
        if k >= heap.BUFFER_MIN_K:
            user_block, item_tile = 256, 2048
        else:
            user_block, item_tile = 1024, 0
            while user_block > 128 and user_block * 8 * k > 1 << 20:
                user_block //= 2
        if n_users > user_block:
            # Blocks of one size, as many on every core: one block a core more than the others leaves the other
            # cores idle for a block's time (5,000 users in blocks of 1,024: three blocks on one core, two on the
            # other). Wide vectors keep blocks this large: halving the block for each doubling of d above 128 (to 128
            # users at d = 768), as this rule did, re-packed each item tile for every 128 users (development
            # machine, 2 cores, 2026-12-05, docs/benchmarks.md: 2,000 x 100k x 768, 1.39 s in blocks of 128 against
            # 1.02 s in two of 1,000).
            # Not below 128 users (a few hundred users on many cores: the tiling plan shares those out itself).
            per_core = -(-n_users // (user_block * self.workers))
            even = -(-n_users // (per_core * self.workers))
            user_block = even if even >= min(user_block, 128) else user_block
        return user_block, item_tile or max(512, (1 << 18) // user_block), 1

    def tune_candidates(self, heuristic: tuple[int, int, int]) -> list[tuple[int, int, int]]:
        return tune_band(_TUNE_USERS, _TUNE_ITEMS, _TUNE_BAND, heuristic)

    def score_dtype(self, input_dtype: Any) -> Any:
        if self.float16_tiles and np.dtype(input_dtype) == np.float16:
            return np.dtype(np.float16)
        return np.dtype(np.float32)  # float16 inputs (fast mode) are scored in float32 on the CPU

    def pass_score_dtype(self, plan: TilePlan, n_users: int, n_items: int, k: int, width: int, dtype: Any,
                         options: EngineOptions) -> Any:
        return self.score_dtype(dtype)

    def compute_context(self) -> contextlib.AbstractContextManager:
        """Limit BLAS to one thread while a search runs: parallelism comes from one block per core, and BLAS
        threads spinning beside the selection kernels would fight them for the same cores. The BLAS libraries are
        found once per process (:func:`_blas_controller`): finding them reads ``/proc/self/maps``, 1 ms a call,
        most of a one-user search of 20,000 items (docs/benchmarks.md)."""
        return _one_blas_thread()

    def executor(self) -> ThreadPoolExecutor:
        """The pool of ``workers`` threads a search's tasks run on, kept for the next search (a pool started per
        search made one user against 100,000 items take 1.18-1.28 ms, against 0.78-0.84 ms now, docs/benchmarks.md).
        A process forked from this one makes its own: a pool's threads do not survive a fork."""
        with self._pool_lock:
            if self._pool is None or self._pool[0] != os.getpid():
                self._pool = (os.getpid(), ThreadPoolExecutor(self.workers, thread_name_prefix="recall",
                                                              initializer=host_threads.run_passes_here))
            return self._pool[1]

    # -- the work ------------------------------------------------------------------------------------------------
    def load_items(self, prepared: Any, norms_rank: bool = False,
                   constant_column: tuple[int, float] | None = None,
                   bias_columns: tuple[int, int] | None = None, ranks: Any = None) -> np.ndarray:
        # constant_column, bias_columns, ranks: unused, the CPU seeds float32 searches only (``_seed``), whose vectors
        # hold no such columns (fast mode's float16 rows are not seeded here).
        if norms_rank:
            key = _memory_key(prepared)
            with self._ranked_lock:
                self._ranked.pop(key, None)
                self._ranked[key] = {}
                while len(self._ranked) > _RANKED_ARRAYS:
                    self._ranked.pop(next(iter(self._ranked)))
        return prepared

    def run_blocks(self, plan: TilePlan, users: np.ndarray, items: np.ndarray, n_items: int, k: int,
                   excl: Exclusions, out_vals: np.ndarray, out_rows: np.ndarray, options: EngineOptions,
                   floor: Any = None, left_out: Any = None, best_first: bool = True, need: int = 0) -> Any:
        # ``floor`` is an optimisation the heap search does without: every item above it is found either way. Its
        # thresholds are lower bounds, so no item it leaves out scores above a user's k-th result: ``left_out`` -inf
        # (and ``need`` is not used).
        # Its heaps come out sorted whatever ``best_first`` asks.
        if left_out is not None:
            left_out[:] = -np.inf
        if n_items > heap.MAX_ROWS + 1:
            raise ResourceError(f"the CPU backend searches at most {heap.MAX_ROWS + 1:,} items at once, got "
                                f"{n_items:,}; split the catalogue (recall batch --item-shards)")
        wall = time.perf_counter()
        stats: dict = {}
        if (users.dtype == np.float32 and plan.interests is None and k < n_items
                and (users.shape[0] == 1 or (k <= BLAS_FIRST_MAX_K and n_items >= BLAS_FIRST_MIN_ITEMS
                                             and blas_summation(int(users.shape[1])) == "placed"))):
            seed = self._blas_first(plan, users, items, n_items, k, excl, out_vals, out_rows, options, stats)
        else:
            seed = (self._seed(plan, items, n_items, k, options, estimate=True, users=users)
                    if users.dtype == np.float32 else None)
            tiled.run_blocks_threaded(self, plan, users, items, n_items, k, excl, out_vals, out_rows, seed)
            if seed is not None and seed.rank:
                # A user whose threshold started at an estimate and that holds k items above it has its k best: any
                # item left out scored at most the threshold, below all of them. One that holds fewer (the estimate
                # lay above its k-th best, or fewer than k items are left to it) is searched again from the bound.
                short = np.flatnonzero(out_rows[:, k - 1] < 0)
                if short.size:
                    vals = np.empty((short.size, k), np.float32)
                    rows = np.empty((short.size, k), np.int64)
                    tiled.run_blocks_threaded(self, plan, np.ascontiguousarray(users[short]), items, n_items, k,
                                              excl.subset(short), vals, rows, self._seed(plan, items, n_items, k,
                                                                                         options, users=users))
                    out_vals[short], out_rows[short] = vals, rows
                stats.update(seed_estimate=seed.rank, estimate_short_users=int(short.size))
        return _done({"blocks": -(-users.shape[0] // plan.user_block), "workers": plan.workers,
                      "seed_sample": 0 if seed is None else int(seed.rows.size),
                      "item_parts": len(tiled.item_ranges(n_items, plan)) if plan.interests is None else 1,
                      "wall_s": time.perf_counter() - wall,
                      "tiles": (plan.user_block, plan.item_tile, plan.tiles_per_call), **stats})

    def _blas_first(self, plan: TilePlan, users: np.ndarray, items: np.ndarray, n_items: int, k: int,
                    excl: Exclusions, out_vals: np.ndarray, out_rows: np.ndarray, options: EngineOptions,
                    stats: dict) -> Any:
        """A search whose first pass is BLAS's own products: one user (BLAS's matrix-vector kernel, a third of the
        time its ordered sums take: ``scripts/lab/cpu_sums.py``), or any number where BLAS's sums depend on the
        score's place (``ordered.blas_sums``: "placed"; its blocked kernels, at about twice the ordered kernel's
        speed). It keeps ONE_USER_MARGIN more than k a user; those are re-scored with the ordered sums
        (``gemm_strided_batched``'s) and the best k taken, where a bound proves that no item left out could reach
        them: each of the two sums is within gamma_D |u| |v| of the exact product (any order of summation, Higham's
        bound), so an item left out scores at most the least kept one plus twice that, with |v| the items' largest
        norm. The users for whom that does not hold (scores that close: ties, duplicated items) are searched again
        with the ordered sums. ``stats["one_user"]`` says which for one user (``"certified"`` or ``"ordered"``),
        ``stats["blas_searched_again"]`` counts them for more. Returns the threshold sample."""
        n, dim = int(users.shape[0]), int(users.shape[1])
        wide = min(k + ONE_USER_MARGIN, n_items)
        vals = np.empty((n, wide), np.float32)
        rows = np.empty((n, wide), np.int64)
        # Many users start at an estimate of each one's wide-th best, as the other searches do (run_blocks): a user
        # that holds fewer than ``wide`` items above it is searched again below.
        seed = self._seed(plan, items, n_items, wide, options, estimate=n > 1, users=users)
        tiled.run_blocks_threaded(_MatrixVector(self), plan, users, items, n_items, wide, excl, vals, rows, seed)
        estimated = seed is not None and bool(seed.rank)
        gamma = gamma32(dim)
        largest = self._largest_norm(items, n_items)
        again = []
        step = max(1, _RESCORE_VALUES // (wide * dim))  # users re-scored at once: their candidates' rows gathered
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            kept = rows[lo:hi]
            exact = np.empty((hi - lo, 1, wide), np.float32)  # the search's own sums of the kept items
            self.gemm_strided_batched(users[lo:hi, None, :], np.ascontiguousarray(items[np.maximum(kept, 0)]), exact)
            exact = np.where(kept >= 0, exact.reshape(hi - lo, wide), np.float32(-np.inf))
            best_vals, best_rows = keys.select(np, exact, kept, k)
            out_vals[lo:hi], out_rows[lo:hi] = best_vals, best_rows
            # A user that kept fewer than ``wide`` kept every item it may get (nothing left out), unless its start
            # was an estimate, which may have lain above its wide-th best.
            full = kept[:, -1] >= 0
            norms = np.linalg.norm(users[lo:hi].astype(np.float64), axis=1)
            bound = 2 * gamma * norms * largest + 2 * dim * 2.0 ** -149  # (products that underflow)
            fails = full & ~(best_vals[:, k - 1].astype(np.float64) > vals[lo:hi, -1].astype(np.float64) + bound)
            if estimated:
                fails |= ~full
            again.extend((lo + np.flatnonzero(fails)).tolist())
        if n == 1:
            stats["one_user"] = "ordered" if again else "certified"
        else:
            stats["blas_searched_again"] = len(again)
        if again:
            idx = np.asarray(again, np.int64)
            seed = self._seed(plan, items, n_items, k, options, users=users)
            sub_vals = np.empty((idx.size, k), np.float32)
            sub_rows = np.empty((idx.size, k), np.int64)
            tiled.run_blocks_threaded(self, plan, np.ascontiguousarray(users[idx]), items, n_items, k,
                                      excl.subset(idx), sub_vals, sub_rows, seed)
            out_vals[idx], out_rows[idx] = sub_vals, sub_rows
        return seed

    def _largest_norm(self, items: np.ndarray, n_items: int) -> float:
        """The largest norm of the first ``n_items`` items (float64, rounded up), kept for the next search of the
        same array object for as long as it lives (by its id, which no other array takes while it lives: unlike
        the threshold samples' key, an address and shape that a new array may reuse, a stale norm here would make
        the bound wrong)."""
        key = (id(items), n_items)
        got = self._norms.get(key)
        if got is None:
            got = float(row_norms(np, items[:n_items]).max()) * (1 + 2.0 ** -20)  # above its own rounding
            with self._ranked_lock:
                if not any(k[0] == key[0] for k in self._norms):
                    weakref.finalize(items, self._forget_norms, key[0])
                self._norms[key] = got
        return got

    def _forget_norms(self, array_id: int) -> None:
        with self._ranked_lock:
            for key in [k for k in self._norms if k[0] == array_id]:
                del self._norms[key]

    def _seed(self, plan: TilePlan, items: np.ndarray, n_items: int, k: int, options: EngineOptions,
              estimate: bool = False, users: np.ndarray | None = None) -> Any:
        """The search's threshold sample (None: unseeded): ranked at k, a lower bound of each user's k-th best (the
        ranking's rows found from a probe of ``users``, ``_sample_rows``); or,
        with ``estimate`` (and ``options.seed_estimate``), as many evenly spread items ranked at an estimate of it:
        about k·size/n_items of a sample of ``size`` score above the k-th best, ESTIMATE_SIGMAS standard deviations
        more are allowed for (a bound's sample where that rank is not below k: no fewer scores would pass)."""
        size = 0 if plan.interests is not None or plan.item_parts > 1 else seed_size(
            n_items, k, options.seed_thresholds, options.seed_sample)
        if not size:
            return None
        rank = 0
        if estimate and options.seed_estimate:
            mean = k * size / n_items
            rank = max(1, int(np.ceil(mean + ESTIMATE_SIGMAS * np.sqrt(mean) + ESTIMATE_SIGMAS)))
            rank = rank if rank < k else 0
        rows = tiled.sample_rows(np, n_items, size) if rank else self._sample_rows(items, n_items, size, users, k)
        vecs = np.ascontiguousarray(items[rows])
        a, _r, z = seed_margin(int(items.shape[1]), False, False)
        return _Seed(rows, vecs, row_norms(np, vecs), a, z, rank)

    def _sample_rows(self, items: np.ndarray, n_items: int, size: int, users: np.ndarray | None = None,
                     rank: int = 0) -> np.ndarray:
        """``tiled.sample_rows`` of the first ``n_items`` items: for items loaded with ``norms_rank``, some of the
        largest norms (how many: ``tiled.probed_even_every`` of ``users`` started at their ``rank``-th best), ranked
        at the first seeded search of that size and kept; else evenly spread rows."""
        samples = self._ranked.get(_memory_key(items))
        if samples is None:
            return tiled.sample_rows(np, n_items, size)
        rows = samples.get((size, n_items))
        if rows is None:
            rows = samples[(size, n_items)] = tiled.ranked_rows(np, users, items, n_items, size,
                                                                row_norms(np, items[:n_items]), rank)[0]
        return rows

    def seed_scratch(self, seed: _Seed, user_block: int) -> np.ndarray:
        """A worker's room for scores of ``seed``'s items: a block's users in groups of at most
        :data:`SEED_SCRATCH_VALUES` scores (a sample of 65,536 items is 256 KiB a user)."""
        return np.empty((min(user_block, max(1, SEED_SCRATCH_VALUES // seed.rows.size)), seed.rows.size),
                        np.float32)

    def topk_seed(self, state: _HeapState, users: np.ndarray, seed: _Seed, scratch: np.ndarray,
                  excl_indptr: np.ndarray, excl_items: np.ndarray) -> None:
        """Start the (reset) block's thresholds at its users' k-th best over ``seed`` (``heap.seed_buffers``; a
        heap is then filled with keys of that score, ``heap.seed_heaps``)."""
        n = users.shape[0]
        norms = row_norms(np, users)
        for lo in range(0, n, scratch.shape[0]):
            hi = min(n, lo + scratch.shape[0])
            scores = scratch[:hi - lo]
            np.matmul(users[lo:hi], seed.vecs.T, out=scores)
            heap.seed_buffers(scores, seed.rows, seed.norms, norms[lo:hi], seed.a, seed.z, seed.rank or state.k,
                              excl_indptr[lo:hi + 1], excl_items, state.thr[lo:hi])
        if state.counts is None:
            heap.seed_heaps(state.keys[:n], state.thr[:n])

    def rescore(self, users: Any, items: np.ndarray, indptr: np.ndarray | int, rows: Any, k: int, budget: int,
                options: EngineOptions, ordered: bool = False) -> tuple[np.ndarray, np.ndarray, str]:
        n = int(users.shape[0])
        vals = np.full((n, k), -np.inf, dtype=np.float32)
        out = np.full((n, k), -1, dtype=np.int64)
        # Ordered or not: each user's candidates are one product of one row, which gemm_strided_batched sums as the
        # search does (the ordered kernel, or BLAS's blocked sums deeper than its panels).
        candidates.rescore_gemm(self, users, items, indptr, self.asarray(rows), k, budget, vals, out)
        return vals, out, "gemm"

    def fast_users(self, users: Any, items: FastItems, half_scores: bool = False, shift: Any = None) -> FastUsers:
        return prepare_users(np, users, items, half_scores, shift)

    def certify_exact(self, plan: TilePlan, n_users: int, n_items: int, k: int, width: int,
                      options: EngineOptions) -> bool:
        # The CPU's exact scores come from BLAS, whose order of summation is its own: "on" emulates the GPU's
        # certified route (the fused kernel's sums) for tests; "auto" never takes it (no tensor cores to gain from).
        return options.certified_exact == "on"

    def staging_bound(self, n_users: int, n_items: int, width: int, pairs: int, itemsize: int) -> str | None:
        return None  # the workers read the pairs where they are: nothing staged

    def float16_faster(self) -> bool:
        return False  # float16 inputs are widened to float32 and multiplied by the same BLAS (gemm_strided_batched)

    def float16_pass_share(self, n_users: int, n_items: int, k: int, width: int, options: EngineOptions) -> float:
        return PASS_SHARE  # fast mode here emulates the GPU's arithmetic (options.fast_emulation): no pass to model

    def starts_at_need(self, options: EngineOptions) -> bool:
        return False  # the CPU keeps the certificate's margin: a smaller one saves the GPU's merges, not the CPU's work

    def select(self, scores: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return keys.select(np, scores, rows, k)

    def merge(self, parts: list[tuple[Any, Any, int]], k: int) -> tuple[np.ndarray, np.ndarray]:
        return keys.select(np, *keys.concat(np, parts), k)

    def synchronize(self) -> None:
        pass

    def queue_after(self, wait: Any) -> None:
        pass  # run_blocks is done when it returns

    # -- primitives of the shared tiled loop (recall.backends.tiled) and candidate scoring -------------------------
    def gemm_strided_batched(self, users: np.ndarray, items: np.ndarray, out: np.ndarray) -> None:
        if users.dtype == np.float16:
            # Fast mode's arithmetic, emulated: float16 inputs, exact products, float32 accumulation.
            self._float32_gemm(users.astype(np.float32), items.astype(np.float32), out)
            if self.float16_tiles:
                # (kept in the float32 buffer the selection reads)
                out[...] = (out * np.float32(output_scale(items.shape[2]))).astype(np.float16)
            return
        self._float32_gemm(users, items, out)

    def _float32_gemm(self, users: np.ndarray, items: np.ndarray, out: np.ndarray) -> None:
        rows, width, dim = users.shape[-2], items.shape[-2], items.shape[-1]
        sums = blas_summation(dim)
        if sums == "blocked":
            # Deeper than BLAS's panels: its blocked kernels' sums for every product (docs/reference.md, "Scores"),
            # at one thread, as a search runs them (how OpenBLAS splits the dimensions depends on its threads).
            with _one_blas_thread():
                blas_products(users, items, out)
        elif (sums == "placed" or rows == 1 or rows * width * dim <= SMALL_PRODUCT
              or rows * width <= SMALL_OUTPUTS):
            ordered_products(users, items, out)
        else:
            np.matmul(users, items.transpose(0, 2, 1), out=out)

    def topk_new(self, n_users: int, k: int) -> _HeapState:
        if k >= heap.BUFFER_MIN_K:
            keys, thr, counts = heap.new_buffers(n_users, k)
            state = _HeapState(keys, thr, n_users, k, counts)
        else:
            state = _HeapState(*heap.new_heaps(n_users, k), n_users, k)
        return state

    def topk_reset(self, state: _HeapState, n_users: int) -> None:
        state.n_users = n_users
        if state.counts is None:
            heap.reset_heaps(state.keys[:n_users], state.thr[:n_users])
        else:
            heap.reset_buffers(state.counts[:n_users], state.thr[:n_users])

    def topk_update(self, state: _HeapState, scores: np.ndarray, item_start: int, n_items: int,
                    excl_indptr: np.ndarray, excl_items: np.ndarray) -> None:
        n = state.n_users
        if state.counts is None:
            heap.heap_update(scores, item_start, n_items, state.keys[:n], state.thr[:n], excl_indptr, excl_items)
        else:
            heap.buffer_update(scores, item_start, n_items, state.keys[:n], state.counts[:n], state.thr[:n],
                               state.k, excl_indptr, excl_items)

    def topk_result(self, state: _HeapState) -> tuple[np.ndarray, np.ndarray]:
        n = state.n_users
        vals = np.empty((n, state.k), np.float32)
        idx = np.empty((n, state.k), np.int64)
        if state.counts is None:
            heap.heap_sort_rows(state.keys[:n], vals, idx)
        else:
            heap.buffer_sort_rows(state.keys[:n], state.counts[:n], vals, idx)
        return vals, idx
