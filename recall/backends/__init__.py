"""Backend resolution: the one place that decides between the CPU and the GPU (see :mod:`.protocol`)."""
from __future__ import annotations

import logging
import os
from typing import Any

from ..core.checks import DEVICES, check_choice
from ..core.errors import BackendUnavailable
from .cupy.probe import cuda_status
from .numpy import NumpyBackend
from .protocol import Backend

log = logging.getLogger("recall")
_warned_fallback = False


def resolve(device: Any) -> Backend:
    """The backend for ``device``: "cpu", "gpu" or "auto" (the GPU when usable, else the CPU, said once); a backend
    object (from an earlier call) is returned as it is, so that several engines can share one device's streams.

    Raises
    ------
    InputError
        If ``device`` is not one of "auto", "cpu", "gpu" nor a backend.
    BackendUnavailable
        If ``device="gpu"`` and no GPU is usable; the message says why.
    """
    global _warned_fallback
    if hasattr(device, "run_blocks"):
        return device
    check_choice(device, DEVICES, "device")
    if device == "cpu":
        return NumpyBackend()
    usable, reason = cuda_status()
    if usable:
        from .cupy import CupyBackend

        return CupyBackend()
    if device == "gpu":
        raise BackendUnavailable(f"device='gpu' but no GPU is usable: {reason}")
    if not _warned_fallback:
        log.warning("recall: no usable GPU (%s); running on the CPU", reason)
        _warned_fallback = True
    return NumpyBackend()


def cpu_kernels_cache() -> tuple[bool, str] | None:
    """(whether numba's on-disk cache holds every compiled CPU kernel, the cache's folder); None where numba cannot
    say. The kernels (``cache=True``) are compiled on their first call after an install or an upgrade, which makes
    the first search of a fresh install take seconds (2.4 s for the top-k heap, 5 s for ``recall demo`` with its
    exclusions, on the 2-core development machine), and every later process load them in milliseconds."""
    try:
        from numba.core.registry import CPUDispatcher

        from ..core import exclusions
        from .numpy import heap, ordered

        kernels = [obj for module in (heap, exclusions, ordered) for obj in vars(module).values()
                   if isinstance(obj, CPUDispatcher) and hasattr(obj._cache, "_cache_file")]
        folder = os.path.commonpath([k.stats.cache_path for k in kernels]) if kernels else ""
        return all(os.path.exists(k._cache._cache_file._index_path) for k in kernels), folder
    except Exception:  # numba internals moved: no notice rather than a failure
        return None


def first_run_notice(device: str) -> str | None:
    """A line to show before the first search of a fresh install on the CPU, which compiles the kernels; None
    otherwise (the GPU's kernels are compiled by NVRTC and cached by CuPy in ``~/.cupy/kernel_cache``)."""
    if device == "gpu" or (device == "auto" and gpu_usable()):
        return None
    cached = cpu_kernels_cache()
    if cached is None or cached[0]:
        return None
    return (f"compiling the CPU kernels: the first run after an install takes a few seconds more (numba caches them "
            f"under {cached[1]})")


def gpu_usable() -> bool:
    """Whether ``resolve("auto")`` would pick the GPU (for choices made before an engine exists, e.g. how many
    worker processes to start)."""
    return cuda_status()[0]


__all__ = ["Backend", "DEVICES", "cpu_kernels_cache", "cuda_status", "first_run_notice", "gpu_usable", "resolve"]
