"""Compiling recall's CUDA kernels (``kernels/*.cu``) at run time with NVRTC through CuPy, once per device and
process (CuPy caches the binaries on disk, under ``~/.cupy/kernel_cache``; the first search of a fresh machine pays
the compilation: a few seconds)."""
from __future__ import annotations

import hashlib
import os
import threading
from importlib import resources
from pathlib import Path
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


#: The sources of :func:`selection_module`, in order.
SELECTION_SOURCES = ("topk.cu", "fused.cu", "fused_h.cu")


def selection_module() -> Any:
    """The exact top-k kernels (``topk.cu``) and the fused scoring kernels (``fused.cu``, ``fused_h.cu``), in one
    module: the fused kernels append to the candidate buffers that the merge kernels fold in."""
    return module(SELECTION_SOURCES)


def fast16_module() -> Any:
    """Fast mode's users' kernels (``fast16.cu``): built with ``--fmad=false``, so that the certificate's float64
    steps round as the reference's do (no product and sum fused)."""
    return module(("fast16.cu",), ("--fmad=false",))


#: The options CuPy's own run-time compilation passes (``cupy.RawModule``), which :func:`hopper_module` repeats.
_NVRTC_OPTIONS = ("--std=c++14", "-ftz=true", "--device-as-default-execution-space")


def hopper_module(names: tuple[str, ...], options: tuple[str, ...] = ()) -> Any:
    """The ``cupy.RawModule`` of the concatenated sources ``names`` built for sm_90a (Hopper's architecture-specific
    instructions, such as wgmma), or None where the current device is not of compute capability 9.0. CuPy's own
    compilation names the device's plain architecture (sm_90), where those instructions do not assemble, so this
    one calls NVRTC itself and keeps the binary on disk (``~/.cupy/kernel_cache``, or ``CUPY_CACHE_DIR``), keyed by
    the sources, the options and NVRTC's version."""
    import cupy

    if not on_hopper():
        return None
    key = (cupy.cuda.Device().id, "sm_90a", names, options)
    with _lock:
        if key not in _modules:
            _modules[key] = cupy.RawModule(path=str(_hopper_cubin(names, options)))
        return _modules[key]


def on_hopper() -> bool:
    """Whether the current device is of compute capability 9.0, where :func:`hopper_module` builds."""
    import cupy

    return cupy.cuda.Device().compute_capability == "90"


def _hopper_cubin(names: tuple[str, ...], options: tuple[str, ...]) -> Path:
    from cupy_backends.cuda.libs import nvrtc

    code = "".join(source(n) for n in names)
    opts = (*_NVRTC_OPTIONS, *options, "-arch=sm_90a")
    digest = hashlib.sha256(repr((code, opts, nvrtc.getVersion())).encode()).hexdigest()[:32]
    cache = Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")
    path = cache / f"recall-sm90a-{digest}.cubin"
    if path.exists():
        return path
    prog = nvrtc.createProgram(code, "recall_sm90a.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC could not build {', '.join(names)} for sm_90a: {e}\n"
                               f"{nvrtc.getProgramLog(prog)}") from e
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(cubin)
    os.replace(tmp, path)
    return path


#: fused_w.cu's kernels are built with these sources before them (the helpers and candidate layout they share), and
#: seed_w.cu's after them (fused_w.cu's tiles and products, topk.cu's margins).
HOPPER_FUSED_SOURCES = (*SELECTION_SOURCES, "fused_w.cu", "seed_w.cu")
#: The walk's kernels (walk_w.cu, ``EngineOptions.fused_walk``) after fused_w.cu's helpers, in a module of their own:
#: built only where a search asks for them.
HOPPER_WALK_SOURCES = (*HOPPER_FUSED_SOURCES, "walk_w.cu")


def hopper_fused_module() -> Any:
    """fused_w.cu's module for the current device (:func:`hopper_module`), or None off Hopper."""
    return hopper_module(HOPPER_FUSED_SOURCES)


def hopper_walk_module() -> Any:
    """walk_w.cu's module for the current device (:func:`hopper_module`), or None off Hopper."""
    return hopper_module(HOPPER_WALK_SOURCES)
