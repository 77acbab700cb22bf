"""Backend resolution: the one place that decides between the CPU and the GPU (see :mod:`.protocol`)."""
from __future__ import annotations

import logging
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


def gpu_usable() -> bool:
    """Whether ``resolve("auto")`` would pick the GPU (for choices made before an engine exists, e.g. how many
    worker processes to start)."""
    return cuda_status()[0]


__all__ = ["Backend", "DEVICES", "cuda_status", "gpu_usable", "resolve"]
