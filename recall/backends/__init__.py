"""Backend resolution: the one place that decides between the CPU and the GPU."""
from __future__ import annotations

import logging

from ..errors import BackendUnavailable, InputError
from .base import Backend
from .numpy_backend import NumpyBackend
from .probe import cuda_status

DEVICES = ("auto", "cpu", "gpu")
log = logging.getLogger("recall")
_warned_fallback = False


def resolve(device: str) -> Backend:
    """The backend for ``device``: "cpu", "gpu" or "auto" (the GPU when usable, else the CPU, said once).

    Raises
    ------
    InputError
        If ``device`` is not one of "auto", "cpu", "gpu".
    BackendUnavailable
        If ``device="gpu"`` and no GPU is usable; the message says why.
    """
    global _warned_fallback
    if device not in DEVICES:
        raise InputError(f"unknown device {device!r}: expected one of {', '.join(DEVICES)}")
    if device == "cpu":
        return NumpyBackend()
    usable, reason = cuda_status()
    if usable:
        from .cupy_backend import CupyBackend

        return CupyBackend()
    if device == "gpu":
        raise BackendUnavailable(f"device='gpu' but no GPU is usable: {reason}")
    if not _warned_fallback:
        log.warning("recall: no usable GPU (%s); running on the CPU", reason)
        _warned_fallback = True
    return NumpyBackend()


__all__ = ["Backend", "DEVICES", "resolve"]
