"""The environment a benchmark ran in, so that every number in a report can be traced to its machine."""
from __future__ import annotations

import datetime as _dt
import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ..backends.numpy import blas_name, cpu_model


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source_digest(package: Path | None = None) -> str:
    """A short digest of the recall package's sources (its .py and .cu files, by path and content): names the code a
    run measured when the machine's copy has no up-to-date git history. The same digest of a commit's package
    (``git archive <commit> recall | tar -x -C DIR``, then ``source_digest(DIR / "recall")``) says whether a run
    measured that commit."""
    root = Path(__file__).resolve().parents[1] if package is None else Path(package)
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cu") and "__pycache__" not in p.parts):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _gpu(info: dict[str, Any]) -> None:
    from recall.backends import cuda_status

    usable, reason = cuda_status()
    info["gpu_usable"] = usable
    info["gpu_status"] = reason
    if not usable:
        return
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"]
    info["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
    info["gpu_memory_bytes"] = int(props["totalGlobalMem"])
    info["gpu_compute_capability"] = f"{props['major']}.{props['minor']}"
    info["gpu_count"] = int(cupy.cuda.runtime.getDeviceCount())
    info["cuda_driver_api"] = _cuda_version(cupy.cuda.runtime.driverGetVersion())
    info["cuda_runtime"] = _cuda_version(cupy.cuda.runtime.runtimeGetVersion())
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    info["driver"] = smi.splitlines()[0] if smi else None


def collect(device: str) -> dict[str, Any]:
    """Date, machine, load and library versions; GPU name, driver and CUDA versions when ``device == "gpu"``.

    Returns
    -------
    dict
        JSON-serialisable; a library that is missing is recorded as None.
    """
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        # Load before the run: on a shared machine, other work on the same cores makes every CPU time slower.
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "numpy": np.__version__,
        "blas": blas_name(),
        "openblas_env": {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS")},
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    try:
        from recall import __version__
        info["recall"] = __version__
    except ImportError:
        info["recall"] = None
    # The revision of the recall package itself, whatever the current directory is.
    src = Path(__file__).resolve().parents[2]
    commit = _run(["git", "rev-parse", "--short", "HEAD"], cwd=src)
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=src)
    info["git_commit"] = None if commit is None else commit + ("+dirty" if dirty else "")
    info["recall_sources"] = source_digest()
    try:
        import faiss
        info["faiss"] = faiss.__version__
        info["faiss_gpu"] = hasattr(faiss, "StandardGpuResources")
        info["faiss_omp_threads"] = faiss.omp_get_max_threads()
    except Exception:
        info["faiss"] = None
    try:
        import numba
        info["numba"] = numba.__version__
        info["numba_threads"] = numba.config.NUMBA_NUM_THREADS
    except Exception:
        info["numba"] = None
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
    except Exception:
        info["torch"] = None
    try:
        import cupy
        info["cupy"] = cupy.__version__
    except Exception:
        info["cupy"] = None
    if device == "gpu":
        _gpu(info)
    return info
