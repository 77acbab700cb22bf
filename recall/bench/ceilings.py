"""What the GPU can do at best, and the floors that follow for a workload.

``measure()`` (``recall bench --ceilings``) times large square matmuls in FP32, TF32, BF16 and FP16 and a
device-to-device copy; ``floors()`` turns those rates into the least time a workload could take:

- GEMM floor: 2 * n_users * n_items * dim FLOPs at the FP32 (exact) and BF16 (tensor-core) rates;
- HBM floor: every score written once and read once (4 + 4 bytes) at the measured copy bandwidth, which is what a
  search costs if the score matrix makes a round trip through memory instead of staying in L2.
"""
from __future__ import annotations

import statistics
from typing import Any

H200_DEFAULTS: dict[str, Any] = {
    "fp32_tflops": 50.8,
    "tf32_tflops": 404.0,
    "bf16_tflops": 773.0,
    "fp16_tflops": 745.0,
    "copy_tbps": 4.15,
    "source": "defaults for an H200 from shared/device/README.md (measured 2026-11-29), not measured in this run",
}
"""Ceilings of the project's H200, used when the GPU name matches "H200" and ``--ceilings`` was not given."""

MATMUL_N = 16384
"""Side of the square matmuls: 8.8 TFLOP each, long enough (>= 10 ms even at BF16 rates) to time reliably."""
COPY_BYTES = 4 << 30
"""Bytes of the copy benchmark's source buffer: far beyond L2, so it measures HBM."""


def _median_ms(fn: Any, repeat: int, timer: Any) -> float:
    fn()  # warm-up: cuBLAS heuristics, allocator
    return statistics.median(timer(fn) for _ in range(repeat))


def _torch_timer(torch: Any) -> Any:
    def time_ms(fn: Any) -> float:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop)
    return time_ms


def _cupy_timer(cupy: Any) -> Any:
    def time_ms(fn: Any) -> float:
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        return cupy.cuda.get_elapsed_time(start, stop)
    return time_ms


def measure(repeat: int = 5, n: int = MATMUL_N, copy_bytes: int = COPY_BYTES) -> dict[str, Any]:
    """Measure matmul rates and copy bandwidth on the current GPU (CUDA events, median of ``repeat`` runs).

    Uses torch where it imports (it has bfloat16 and a TF32 switch), else CuPy (FP32 and FP16 only; TF32 and BF16
    are then reported as None). The copy bandwidth counts bytes read plus bytes written.

    Returns
    -------
    dict
        ``fp32_tflops``, ``tf32_tflops``, ``bf16_tflops``, ``fp16_tflops`` (float or None), ``copy_tbps``,
        ``matmul_n``, ``copy_bytes``, ``repeat``, ``tool`` and ``source``.

    Raises
    ------
    BackendUnavailable
        Without a usable GPU.
    """
    from recall.backends import cuda_status
    from recall import BackendUnavailable

    usable, reason = cuda_status()
    if not usable:
        raise BackendUnavailable(f"--ceilings needs a GPU: {reason}")
    import cupy

    out: dict[str, Any] = {"matmul_n": n, "copy_bytes": copy_bytes, "repeat": repeat,
                           "source": "measured in this run"}
    flop = 2.0 * n ** 3
    try:
        import torch
        have_torch = torch.cuda.is_available()
    except Exception:
        have_torch = False
    if have_torch:
        timer = _torch_timer(torch)
        out["tool"] = f"torch {torch.__version__}"
        saved = torch.backends.cuda.matmul.allow_tf32
        try:
            for key, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                                     ("bf16", torch.bfloat16, False), ("fp16", torch.float16, False)):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                a = torch.randn(n, n, device="cuda", dtype=dtype)
                b = torch.randn(n, n, device="cuda", dtype=dtype)
                c = torch.empty(n, n, device="cuda", dtype=dtype)
                ms = _median_ms(lambda: torch.matmul(a, b, out=c), repeat, timer)
                out[f"{key}_tflops"] = flop / (ms * 1e-3) / 1e12
                del a, b, c
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved
            torch.cuda.empty_cache()
    else:
        timer = _cupy_timer(cupy)
        out["tool"] = f"cupy {cupy.__version__}"
        for key, dtype in (("fp32", cupy.float32), ("fp16", cupy.float16)):
            a = cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(dtype)
            b = cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(dtype)
            c = cupy.empty((n, n), dtype=dtype)
            ms = _median_ms(lambda: cupy.matmul(a, b, out=c), repeat, timer)
            out[f"{key}_tflops"] = flop / (ms * 1e-3) / 1e12
            del a, b, c
        # CuPy has no bfloat16 dtype, and its TF32 mode is fixed at import time (CUPY_TF32).
        out["tf32_tflops"] = None
        out["bf16_tflops"] = None
    timer = _cupy_timer(cupy)
    src = cupy.empty(copy_bytes // 4, dtype=cupy.float32)
    src.fill(1.0)
    dst = cupy.empty_like(src)
    ms = _median_ms(lambda: cupy.copyto(dst, src), repeat, timer)
    out["copy_tbps"] = 2.0 * copy_bytes / (ms * 1e-3) / 1e12
    del src, dst
    cupy.get_default_memory_pool().free_all_blocks()
    return out


def defaults_for(gpu_name: str | None) -> dict[str, Any] | None:
    """The recorded ceilings for ``gpu_name`` when it is an H200, else None (run ``--ceilings`` to measure)."""
    if gpu_name and "H200" in gpu_name:
        return dict(H200_DEFAULTS)
    return None


def floors(n_users: int, n_items: int, dim: int, ceilings: dict[str, Any] | None) -> dict[str, Any] | None:
    """Least seconds a full search could take: GEMM at FP32 and BF16 rates, HBM round trip of every score.

    Returns None without ceilings; a rate that is None gives a None floor.
    """
    if not ceilings:
        return None
    flop = 2.0 * n_users * n_items * dim
    score_bytes = 8.0 * n_users * n_items

    def at(rate: float | None, work: float) -> float | None:
        return work / (rate * 1e12) if rate else None

    return {"gemm_fp32_s": at(ceilings.get("fp32_tflops"), flop),
            "gemm_bf16_s": at(ceilings.get("bf16_tflops"), flop),
            "hbm_scores_s": at(ceilings.get("copy_tbps"), score_bytes),
            "source": ceilings.get("source")}
