"""Compiling recall's CUDA kernels (``kernels/*.cu``) at run time with NVRTC through CuPy, once per device and
process (CuPy caches the binaries on disk, under ``~/.cupy/kernel_cache``; the first search of a fresh machine pays
the compilation: a few seconds)."""
from __future__ import annotations

import threading
from importlib import resources
from typing import Any

_lock = threading.Lock()
_modules: dict[tuple, Any] = {}


def source(name: str) -> str:
    """The text of ``kernels/{name}``."""
    return resources.files("recall.backends.cupy").joinpath("kernels", name).read_text()


def module(names: tuple[str, ...], options: tuple[str, ...] = (), name_expressions: tuple[str, ...] = ()) -> Any:
    """The ``cupy.RawModule`` of the concatenated sources ``names`` for the current device, compiled once."""
    import cupy

    key = (cupy.cuda.Device().id, names, options, name_expressions)
    with _lock:
        if key not in _modules:
            code = "".join(source(n) for n in names)
            _modules[key] = cupy.RawModule(code=code, options=("--std=c++14", *options),
                                           name_expressions=list(name_expressions) or None)
        return _modules[key]


def selection_module() -> Any:
    """The exact top-k kernels (``topk.cu``) and the fused scoring kernels (``fused.cu``, ``fused_h.cu``), in one
    module: the fused kernels append to the candidate buffers that the merge kernels fold in."""
    return module(("topk.cu", "fused.cu", "fused_h.cu"))
