"""Find out, once per process, whether a usable CUDA GPU is there, and if not, why not."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def cuda_status() -> tuple[bool, str]:
    """(usable, reason). ``reason`` names the device when usable, else says what is missing, in one line."""
    try:
        import cupy
    except ImportError as exc:
        return False, f"CuPy is not installed ({exc}); install the 'gpu' extra: pip install 'recall[gpu]'"
    except Exception as exc:  # a broken CUDA install raises all sorts of errors at import time
        return False, f"CuPy failed to import: {type(exc).__name__}: {exc}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"no usable CUDA driver or device: {type(exc).__name__}: {exc}"
    if n < 1:
        return False, "CUDA reports no GPU"
    try:
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        cupy.zeros(1, dtype=cupy.float32).sum().item()  # a real launch: catches a driver too old for the runtime
    except Exception as exc:
        return False, f"the GPU is not usable: {type(exc).__name__}: {exc}"
    return True, f"{name} (compute capability {props['major']}.{props['minor']})"


def visible_gpus() -> list[str]:
    """The CUDA devices this process may use, as values for a worker's ``CUDA_VISIBLE_DEVICES``.

    Counted without creating a CUDA context (``cudaGetDeviceCount``), so the caller holds no GPU memory. Entries of
    this process's own ``CUDA_VISIBLE_DEVICES`` (indices, UUIDs or MIG ids) are passed through.
    """
    import os

    try:
        import cupy

        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver: no GPU
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        return [x.strip() for x in env.split(",") if x.strip()][:n]
    return [str(i) for i in range(n)]
