"""The CPU backend: GEMM through NumPy's BLAS, selection through the compiled heap kernels of ``recall.topk``."""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import scoring, topk


@dataclass
class _HeapState:
    vals: np.ndarray  # (capacity, k) float32 min-heaps, root = worst kept
    idx: np.ndarray  # (capacity, k) int64
    n_users: int
    k: int


class NumpyBackend:
    """NumPy/BLAS backend. Arrays are NumPy arrays; nothing is copied to a device."""

    name = "cpu"
    xp = np

    def __init__(self) -> None:
        # One user block per core; each block's GEMM runs on one BLAS thread (see compute_context).
        self.stats: dict = {}
        self.workers = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)

    def compute_context(self) -> contextlib.AbstractContextManager:
        """Limit BLAS to one thread while a search runs: parallelism comes from one block per core, and BLAS
        threads spinning beside the selection kernels would fight them for the same cores."""
        from threadpoolctl import threadpool_limits

        return threadpool_limits(limits=1, user_api="blas")

    def describe(self) -> str:
        return f"cpu ({os.cpu_count()} cores, numpy {np.__version__})"

    def score_dtype(self, input_dtype: Any) -> Any:
        return np.dtype(np.float32)  # float16 inputs (fast mode) are scored in float32 on the CPU

    def asarray(self, arr: Any) -> np.ndarray:
        if hasattr(arr, "get") and not isinstance(arr, np.ndarray):
            arr = arr.get()
        arr = np.asarray(arr)
        dtype = np.int64 if arr.dtype.kind in "iu" else np.float32
        return np.ascontiguousarray(arr, dtype=dtype)

    def asarray_raw(self, arr: Any) -> np.ndarray:
        """``arr`` as a NumPy array of its own dtype."""
        return np.asarray(arr.get() if hasattr(arr, "get") and not isinstance(arr, np.ndarray) else arr)

    def empty_out(self, shape: tuple, dtype: Any, host: bool) -> np.ndarray:
        return np.empty(shape, dtype)

    def to_host(self, arr: Any) -> np.ndarray:
        return np.asarray(arr)

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

    def state_bytes(self, k: int) -> int:
        return 12 * k

    def preferred_tiles(self, dim: int, k: int) -> tuple[int, int, int]:
        # A (128 x 2048) float32 tile is 1 MiB: it stays in one core's L2 between the GEMM that writes it and the
        # scan that reads it, and is still large enough for BLAS to run near its peak.
        return 128, 2048, 1

    def run_blocks(self, plan: "scoring.TilePlan", users: np.ndarray, items: np.ndarray, n_items: int, k: int,
                   excl: Any, out_vals: np.ndarray, out_rows: np.ndarray) -> None:
        wall = time.perf_counter()
        scoring.run_blocks(self, plan, users, items, n_items, k, excl, out_vals, out_rows)
        self.stats = {"blocks": -(-users.shape[0] // plan.user_block), "workers": plan.workers,
                      "wall_s": time.perf_counter() - wall,
                      "tiles": (plan.user_block, plan.item_tile, plan.tiles_per_call)}

    def gemm_strided_batched(self, users: np.ndarray, items: np.ndarray, out: np.ndarray) -> None:
        if users.dtype == np.float16:
            # Fast mode's arithmetic, emulated: float16 inputs, exact products, float32 accumulation.
            users, items = users.astype(np.float32), items.astype(np.float32)
        np.matmul(users, items.transpose(0, 2, 1), out=out)

    def topk_new(self, n_users: int, k: int) -> _HeapState:
        state = _HeapState(np.empty((n_users, k), np.float32), np.empty((n_users, k), np.int64), n_users, k)
        self.topk_reset(state, n_users)
        return state

    def topk_reset(self, state: _HeapState, n_users: int) -> None:
        state.n_users = n_users
        state.vals[:n_users] = -np.inf
        state.idx[:n_users] = -1

    def topk_update(self, state: _HeapState, scores: np.ndarray, item_start: int, n_items: int,
                    excl_indptr: np.ndarray, excl_items: np.ndarray) -> None:
        n = state.n_users
        topk.heap_update(scores, item_start, n_items, state.vals[:n], state.idx[:n], excl_indptr, excl_items)

    def topk_result(self, state: _HeapState) -> tuple[np.ndarray, np.ndarray]:
        n = state.n_users
        vals = np.empty((n, state.k), np.float32)
        idx = np.empty((n, state.k), np.int64)
        topk.heap_sort_rows(state.vals[:n], state.idx[:n], vals, idx)
        return vals, idx

    def synchronize(self) -> None:
        pass

    def rescore_select(self, scores: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The best k (score desc, lower row first) of each row of a padded candidate block (recall/rescore.py)."""
        from .. import rescore

        return rescore.select_keys(np, scores, rows, k)
