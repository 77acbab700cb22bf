"""``recall doctor``: ten seconds of certainty that the stack works, and is the one expected, before a long job.

It reports versions (recall, Python, NumPy, pyarrow, CuPy, numba, torch, FAISS), the CUDA driver, runtime, cuBLAS
and NVRTC versions, and every GPU (name, compute capability, memory, tensor cores, bf16). Then it runs checks, each
PASS, FAIL or SKIP with the figure it measured:

- ``cpu-gemm-fp32``: NumPy's float32 GEMM against a float64 reference (relative error < 1e-5), and its rate;
- ``topk-exact``: ``recall.Engine`` on a small case with many ties (integer vectors: every score exact), identical to
  a float64 oracle on every backend here (CPU; GPU exact and fast), and on normal data within float32 rounding;
- on a GPU: ``cuda-libraries`` (cuBLAS, cuRAND, NVRTC load and initialise), ``gpu-gemm-warmup`` (first call vs
  steady state, and the FP32 rate), ``gpu-gemm-fp32`` (< 1e-5), ``gpu-gemm-fp16`` and ``gpu-gemm-bf16`` (error in
  their expected range), ``h2d-pinned`` (pinned host-to-device bandwidth);
- ``faiss``: when installed, its version, whether it sees the GPU and has kernels for it (a tiny GpuIndexFlatIP
  search).

A library that fails to load (a missing or mismatched libcublas, libnvrtc, a driver older than the runtime) is a
FAIL explained in one line with its fix, never a traceback. Without a GPU (``device="auto"``) the report says so in
one line, checks the CPU backend, and passes.
"""
from __future__ import annotations

import functools
import importlib.metadata as metadata
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..core.errors import one_line

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
FP32_LIMIT = 1e-5
"""Largest relative (Frobenius) error of a float32 GEMM against float64; float32 gives about 1e-7 at these sizes."""
FP16_LIMIT = 1e-2
"""Float16 inputs and output: unit roundoff 2^-11 = 4.9e-4, so a relative error of a few 1e-4; over 1e-2 is broken."""
BF16_LIMIT = 5e-2
"""Bfloat16: unit roundoff 2^-8 = 3.9e-3, so a few 1e-3; over 5e-2 is broken."""
H2D_MIN_GBPS = 2.0
"""Pinned host-to-device copies slower than this mean something is wrong (PCIe 3.0 x16 gives about 12 GB/s)."""


@dataclass
class Check:
    """One check: its name, PASS / FAIL / SKIP, the measured figure (one line), why or how to fix (one line)."""

    name: str
    status: str
    summary: str
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


# -- explaining failures --------------------------------------------------------------------------------------------

_SONAME = re.compile(r"(lib[A-Za-z0-9_+-]+?)\.so(?:\.(\d+))?")


#: The reason a machine without NVIDIA hardware gives (doctor's GPU line leads with it).
_NO_GPU = "no NVIDIA GPU on this machine"


@functools.lru_cache(maxsize=1)
def _cupy_dist() -> str | None:
    """The installed CuPy distribution's name (e.g. "cupy-cuda12x"), without importing CuPy."""
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "cupy" or name.startswith("cupy-"):
            return name
    return None


def _cupy_cuda_major() -> int | None:
    m = re.match(r"cupy-cuda(\d+)x", _cupy_dist() or "")
    return int(m.group(1)) if m else None


def explain(error: BaseException | str, driver_cuda: str | None = None) -> str | None:
    """One line saying what a CUDA / library error means and how to fix it; None when it is not one we know.

    Parameters
    ----------
    error : exception or str
    driver_cuda : str, optional
        The CUDA version the driver supports (e.g. "13.0"), to name the CuPy that would fit.
    """
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    major = _cupy_cuda_major()
    dist = _cupy_dist() or "cupy"
    want = f"CUDA {major}" if major else "its CUDA"
    ctk = f"pip install '{dist}[ctk]'" if major else "pip install 'cupy-cuda12x[ctk]' (or cupy-cuda13x[ctk])"
    other = ""
    if driver_cuda and major and not driver_cuda.startswith(f"{major}."):
        other = f", or the CuPy for this driver's CUDA {driver_cuda}: pip install 'cupy-cuda{driver_cuda.split('.')[0]}x'"
    lowered = text.lower()
    if "no kernel image is available" in lowered:
        return ("a library has no GPU code for this GPU's architecture (no kernel image): install a build compiled "
                "for it")
    if "insufficientdriver" in lowered.replace(" ", "") or "driver version is insufficient" in lowered:
        return (f"the NVIDIA driver is older than the CUDA runtime {dist} uses: upgrade the driver, or install the "
                f"CuPy for the driver's CUDA version")
    if "nodevice" in lowered.replace(" ", "") or "no cuda-capable device" in lowered:
        return "no CUDA device is visible: check CUDA_VISIBLE_DEVICES, and that a container was started with --gpus"
    m = _SONAME.search(text)
    if m and ("cannot open shared object" in lowered or "no such file" in lowered or "not found" in lowered
              or "failure finding" in lowered or "undefined symbol" in lowered):
        lib = m.group(1)
        if lib in ("libcuda", "libnvidia-ml"):
            return (f"the NVIDIA driver's {lib}.so is not found: install the NVIDIA driver (in a container: the "
                    f"NVIDIA Container Toolkit and --gpus all)")
        if "undefined symbol" in lowered:
            return (f"{lib} is not the version {dist} was built for (undefined symbol): point LD_LIBRARY_PATH at "
                    f"{want}'s libraries, or {ctk}")
        return (f"{lib} ({want}) is not installed or not on the library path: {ctk} (CUDA libraries from PyPI), "
                f"or install the CUDA Toolkit {major or ''}{'.x' if major else ''} and add its lib64 to "
                f"LD_LIBRARY_PATH{other}").replace("Toolkit .x", "Toolkit")
    if "cublas_status_not_initialized" in lowered:
        return "cuBLAS could not initialise: usually the GPU is out of memory, or the driver and libcublas mismatch"
    if "nvrtc" in lowered and ("error" in lowered or "fail" in lowered):
        return f"NVRTC (the CUDA runtime compiler CuPy compiles kernels with) is missing or broken: {ctk}"
    return None


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {one_line(exc)}"


def _failed(name: str, exc: BaseException, driver_cuda: str | None = None) -> Check:
    hint = explain(exc, driver_cuda)
    return Check(name, FAIL, _one_line(exc)[:300], hint or "", {"error": _one_line(exc)})


# -- versions and devices -------------------------------------------------------------------------------------------

def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    """recall, Python, NumPy, pyarrow, CuPy, numba, torch, FAISS (None when not installed), and NumPy's BLAS."""
    from ..backends.numpy import blas_name
    from ..core.version import __version__

    try:
        import pyarrow
        arrow: str | None = pyarrow.__version__
    except ImportError:
        arrow = None
    cupy_version = None
    dist = _cupy_dist()
    if dist:
        try:
            import cupy
            cupy_version = cupy.__version__
        except Exception:  # broken CUDA installs fail at import in many ways; cuda-libraries says which
            cupy_version = f"{_dist_version(dist)} (does not import)"
    faiss_version = _dist_version("faiss-gpu", "faiss-gpu-cu12", "faiss-gpu-cu11", "faiss-cpu", "faiss")
    if faiss_version is None and "faiss" in sys.modules:
        faiss_version = getattr(sys.modules["faiss"], "__version__", None)
    return {"recall": __version__, "python": sys.version.split()[0], "numpy": np.__version__, "blas": blas_name(),
            "pyarrow": arrow, "cupy": cupy_version, "cupy_package": dist, "numba": _dist_version("numba"),
            "torch": _dist_version("torch"), "faiss": faiss_version}


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _cublas_version(v: int) -> str:
    # CUBLAS_VERSION is major*10000 + minor*100 + patch since cuBLAS 12, major*1000 + minor*100 + patch before.
    if v >= 100000:
        return f"{v // 10000}.{(v // 100) % 100}.{v % 100}"
    return f"{v // 1000}.{(v // 100) % 10}.{v % 100}"


def _gpu_hardware_present() -> bool:
    """Whether the OS shows an NVIDIA GPU at all (device nodes or the driver's proc entry), CUDA aside."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0") or os.path.isdir("/proc/driver/nvidia")


def _cuda_info() -> dict[str, Any]:
    from ..backends.cupy.backend import nvml_driver_version

    info: dict[str, Any] = {"driver": None, "driver_cuda": None, "runtime": None, "cublas": None, "nvrtc": None}
    import cupy

    info["driver"] = nvml_driver_version()
    info["driver_cuda"] = _cuda_version(cupy.cuda.runtime.driverGetVersion())
    info["runtime"] = _cuda_version(cupy.cuda.runtime.runtimeGetVersion())
    return info


def _gpus() -> list[dict[str, Any]]:
    import cupy

    out = []
    for i in range(cupy.cuda.runtime.getDeviceCount()):
        props = cupy.cuda.runtime.getDeviceProperties(i)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        with cupy.cuda.Device(i):
            free, total = cupy.cuda.runtime.memGetInfo()
        major, minor = int(props["major"]), int(props["minor"])
        out.append({"index": i, "name": name, "compute_capability": f"{major}.{minor}", "memory_total": int(total),
                    "memory_free": int(free), "tensor_cores": major >= 7, "bf16": major >= 8,
                    "l2_bytes": int(props.get("l2CacheSize", 0)), "multiprocessors": int(props["multiProcessorCount"])})
    return out


# -- checks ---------------------------------------------------------------------------------------------------------

def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref))


def _check_cpu_gemm() -> Check:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 256)).astype(np.float32)
    b = rng.standard_normal((256, 512)).astype(np.float32)
    err = _rel_err(a @ b, a.astype(np.float64) @ b.astype(np.float64))
    n = 1024
    x = rng.standard_normal((n, n)).astype(np.float32)
    x @ x  # warm-up: BLAS threads start
    times = []
    for _ in range(3):
        start = time.perf_counter()
        x @ x
        times.append(time.perf_counter() - start)
    gflops = 2.0 * n ** 3 / statistics.median(times) / 1e9
    from ..backends.numpy import blas_summation

    sums = blas_summation(64)
    status = PASS if err < FP32_LIMIT else FAIL
    detail = "" if status == PASS else "NumPy's BLAS computes float32 products wrongly: reinstall NumPy"
    if status == PASS and sums == "placed":
        coretype = os.environ.get("OPENBLAS_CORETYPE")
        detail = ("BLAS sums a score in an order that depends on its place in the product"
                  + (f" (OPENBLAS_CORETYPE={coretype})" if coretype else "")
                  + ": CPU searches sum their scores themselves, at about half BLAS's speed"
                  + ("; without OPENBLAS_CORETYPE, OpenBLAS may pick kernels that sum in order" if coretype else ""))
    return Check("cpu-gemm-fp32", status, f"rel err {err:.1e} (limit {FP32_LIMIT:.0e}); {gflops:.1f} GFLOP/s "
                 f"({n}^3 float32); sums {sums}", detail, {"rel_err": err, "gflops": gflops, "blas_sums": sums})


def _oracle_topk(users: np.ndarray, items: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Float64 top-k, ties to the lower item row (a stable sort of the negated scores)."""
    scores = users.astype(np.float64) @ items.astype(np.float64).T
    rows = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return rows, scores


def _within_rounding(rows: np.ndarray, scores64: np.ndarray, k: int) -> bool:
    """Every returned item's exact score reaches the exact k-th best, up to float32 rounding; rows unique."""
    kth = -np.sort(-scores64, axis=1)[:, k - 1]
    got = np.take_along_axis(scores64, rows, axis=1)
    tol = 1e-5 * float(np.abs(scores64).max())
    unique = all(len(set(r.tolist())) == k for r in rows)
    return bool(unique and (got >= kth[:, None] - tol).all() and (np.diff(got, axis=1) <= tol).all())


def _check_topk(gpu: bool) -> Check:
    from ..engine import Engine

    rng = np.random.default_rng(7)
    n_users, n_items, dim, k = 300, 5000, 32, 20
    # Integer vectors: every score is an exact small integer in float32 and float64, so there are many ties and a
    # single right answer (ties to the lower item row) that every backend must reproduce bit for bit.
    ties_u = rng.integers(-2, 3, (n_users, dim)).astype(np.float32)
    ties_i = rng.integers(-2, 3, (n_items, dim)).astype(np.float32)
    norm_u = rng.standard_normal((n_users, dim)).astype(np.float32)
    norm_i = rng.standard_normal((n_items, dim)).astype(np.float32)
    want, _ = _oracle_topk(ties_u, ties_i, k)
    _, norm_scores = _oracle_topk(norm_u, norm_i, k)

    runs = [("cpu", "cpu", "exact")]
    if gpu:
        runs += [("gpu", "gpu", "exact"), ("gpu-fast", "gpu", "fast")]
    bad, times = [], {}
    for label, device, precision in runs:
        kwargs = {"precision": precision} if precision != "exact" else {}
        eng = Engine(ties_i, device=device, tune="off", **kwargs)
        start = time.perf_counter()
        got = eng.search(ties_u, k).indices
        first = time.perf_counter() - start
        start = time.perf_counter()
        eng.search(ties_u, k)
        times[label] = (first, time.perf_counter() - start)
        if not np.array_equal(np.asarray(got), want):
            n_bad = int((np.asarray(got) != want).any(axis=1).sum())
            bad.append(f"{label}: {n_bad} of {n_users} users differ from the float64 oracle (ties data)")
        eng = Engine(norm_i, device=device, tune="off", **kwargs)
        if not _within_rounding(np.asarray(eng.search(norm_u, k).indices), norm_scores, k):
            bad.append(f"{label}: not the exact top-k on normal data")
    cold = "; ".join(f"{label} first search {a * 1e3:.0f} ms, then {b * 1e3:.1f} ms" for label, (a, b) in times.items())
    labels = ", ".join(label for label, _, _ in runs)
    if bad:
        return Check("topk-exact", FAIL, "; ".join(bad), "a backend returns wrong results: report it with this "
                     "output (recall doctor --json)", {"errors": bad, "times": times})
    return Check("topk-exact", PASS, f"{labels} identical to the float64 oracle ({n_users} users x {n_items:,} items "
                 f"x {dim}, k={k}, many ties; normal data exact to float32 rounding)", cold,
                 {"backends": [label for label, _, _ in runs], "first_and_steady_s": times})


def _check_libraries(cuda: dict[str, Any]) -> Check:
    import cupy

    found = []
    from cupy_backends.cuda.libs import cublas  # loads libcublas

    handle = cupy.cuda.device.get_cublas_handle()
    cuda["cublas"] = _cublas_version(int(cublas.getVersion(handle)))
    found.append(f"cuBLAS {cuda['cublas']}")
    from cupy_backends.cuda.libs import curand  # noqa: F401 - loads libcurand (cupy.random, bench data)

    found.append("cuRAND")
    major, minor = cupy.cuda.nvrtc.getVersion()
    cuda["nvrtc"] = f"{major}.{minor}"
    found.append(f"NVRTC {cuda['nvrtc']}")
    start = time.perf_counter()
    from ..backends.cupy import CupyBackend, kernels

    backend = CupyBackend()  # compiles (or loads from CuPy's cache) recall's selection kernels with NVRTC
    hopper = bool(backend.selection.fused_w)  # and on Hopper the wgmma kernels, built for sm_90a
    compile_s = time.perf_counter() - start
    if kernels.on_hopper() and not hopper:
        return Check("cuda-libraries", FAIL, f"NVRTC {cuda['nvrtc']} could not build recall's wgmma kernels for "
                     "sm_90a (searches run the slower mma.sync kernel)", "install CuPy for CUDA 12 or 13 (NVRTC 12+)",
                     {"kernels_s": compile_s, "sm90a": False})
    built = "recall's kernels built" + (" (the wgmma ones for sm_90a too)" if hopper else "")
    return Check("cuda-libraries", PASS, ", ".join(found) + f" load; {built}",
                 f"kernel build or cache load {compile_s * 1e3:.0f} ms", {"kernels_s": compile_s, "sm90a": hopper})


def _events_ms(cupy: Any, fn: Callable[[], Any], stream: Any = None) -> float:
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    fn()
    stop.record(stream)
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop)


def _check_gemm_warmup(gpu: dict[str, Any]) -> Check:
    import cupy

    n = 8192 if gpu["memory_free"] > (4 << 30) else 2048
    a = cupy.random.standard_normal((n, n), dtype=cupy.float32)
    b = cupy.random.standard_normal((n, n), dtype=cupy.float32)
    c = cupy.empty((n, n), dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    cupy.matmul(a, b, out=c)
    cupy.cuda.Device().synchronize()
    first = time.perf_counter() - start
    steady = statistics.median(_events_ms(cupy, lambda: cupy.matmul(a, b, out=c)) for _ in range(5)) / 1e3
    tflops = 2.0 * n ** 3 / steady / 1e12
    del a, b, c
    cupy.get_default_memory_pool().free_all_blocks()
    return Check("gpu-gemm-warmup", PASS, f"first call {first * 1e3:.0f} ms, steady {steady * 1e3:.2f} ms: "
                 f"{tflops:.1f} TFLOP/s float32 ({n}^3)",
                 "the first call pays for loading cuBLAS's kernels; a long job pays it once",
                 {"n": n, "first_s": first, "steady_s": steady, "tflops": tflops})


def _gemm_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((512, 256)).astype(np.float32)
    b = rng.standard_normal((256, 512)).astype(np.float32)
    return a, b, a.astype(np.float64) @ b.astype(np.float64)


def _check_gemm_fp32() -> Check:
    import cupy

    a, b, ref = _gemm_inputs()
    err = _rel_err(cupy.asnumpy(cupy.asarray(a) @ cupy.asarray(b)), ref)
    detail = ""
    if err >= FP32_LIMIT:
        detail = ("float32 GEMM is not float32-accurate"
                  + (": CUPY_TF32 is set, so CuPy multiplies in TF32; unset it" if os.environ.get("CUPY_TF32") == "1"
                     else ": the GPU, driver or cuBLAS computes wrongly"))
    return Check("gpu-gemm-fp32", PASS if err < FP32_LIMIT else FAIL,
                 f"rel err {err:.1e} (limit {FP32_LIMIT:.0e}, 512x256 @ 256x512)", detail, {"rel_err": err})


def _check_gemm_fp16() -> Check:
    import cupy

    a, b, ref = _gemm_inputs()
    got = cupy.asarray(a).astype(cupy.float16) @ cupy.asarray(b).astype(cupy.float16)
    err = _rel_err(cupy.asnumpy(got), ref)
    ok = err < FP16_LIMIT
    return Check("gpu-gemm-fp16", PASS if ok else FAIL,
                 f"rel err {err:.1e} (expected a few 1e-4, limit {FP16_LIMIT:.0e})",
                 "" if ok else "float16 GEMM is far less accurate than float16 allows: the GPU or cuBLAS is broken",
                 {"rel_err": err})


def _check_gemm_bf16(gpu: dict[str, Any]) -> Check:
    if not gpu["bf16"]:
        return Check("gpu-gemm-bf16", SKIP, f"sm_{gpu['compute_capability'].replace('.', '')} has no bfloat16 "
                     f"(needs compute capability 8.0)")
    try:
        import torch
    except ImportError:
        return Check("gpu-gemm-bf16", SKIP, "torch is not installed (CuPy has no bfloat16 dtype)")
    if not torch.cuda.is_available():
        return Check("gpu-gemm-bf16", SKIP, f"torch {torch.__version__} does not see the GPU")
    a, b, ref = _gemm_inputs()
    ta = torch.from_numpy(a).cuda().to(torch.bfloat16)
    tb = torch.from_numpy(b).cuda().to(torch.bfloat16)
    err = _rel_err((ta @ tb).float().cpu().numpy(), ref)
    ok = err < BF16_LIMIT
    return Check("gpu-gemm-bf16", PASS if ok else FAIL,
                 f"rel err {err:.1e} (expected a few 1e-3, limit {BF16_LIMIT:.0e}; torch {torch.__version__})",
                 "" if ok else "bfloat16 GEMM is far less accurate than bfloat16 allows", {"rel_err": err})


def _check_h2d(gpu: dict[str, Any]) -> Check:
    import cupy
    import cupyx

    nbytes = (256 << 20) if gpu["memory_free"] > (2 << 30) else (32 << 20)
    host = cupyx.empty_pinned((nbytes // 4,), dtype=np.float32)
    host.fill(0.0)
    probe_at = slice(None, None, 1 << 16)
    host[probe_at] = np.arange(host[probe_at].size, dtype=np.float32)
    dev = cupy.empty(host.size, dtype=cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    dev.set(host, stream=stream)  # warm-up
    stream.synchronize()
    ms = statistics.median(_events_ms(cupy, lambda: dev.set(host, stream=stream), stream) for _ in range(5))
    gbps = nbytes / (ms * 1e-3) / 1e9
    intact = bool(np.array_equal(cupy.asnumpy(dev[probe_at]), host[probe_at]))
    ok = intact and gbps >= H2D_MIN_GBPS
    detail = "" if ok else ("the copy corrupted data" if not intact else
                            f"under {H2D_MIN_GBPS:.0f} GB/s: check the PCIe link (nvidia-smi -q | grep -i -A2 'link')")
    return Check("h2d-pinned", PASS if ok else FAIL, f"{gbps:.1f} GB/s host to device, pinned ({nbytes >> 20} MiB, "
                 f"median of 5)", detail, {"gbps": gbps, "bytes": nbytes})


def _check_faiss(gpu_usable: bool, gpus: list[dict[str, Any]]) -> Check:
    try:
        import faiss
    except ImportError:
        return Check("faiss", SKIP, "not installed (only the benchmark baseline needs it: faiss-cpu, or "
                     "faiss-gpu>=1.15 for the GPU)")
    version = getattr(faiss, "__version__", "?")
    rng = np.random.default_rng(3)
    xb = rng.standard_normal((1000, 16)).astype(np.float32)
    xq = rng.standard_normal((5, 16)).astype(np.float32)
    want = np.argsort(-(xq.astype(np.float64) @ xb.astype(np.float64).T), axis=1, kind="stable")[:, :5]
    n_gpus = int(faiss.get_num_gpus()) if hasattr(faiss, "get_num_gpus") else 0
    has_gpu_code = hasattr(faiss, "StandardGpuResources")
    data = {"version": version, "gpus_seen": n_gpus, "gpu_build": has_gpu_code}
    if not gpu_usable:
        index = faiss.IndexFlatIP(16)
        index.add(xb)
        _, got = index.search(xq, 5)
        ok = np.array_equal(got, want)
        return Check("faiss", PASS if ok else FAIL, f"faiss {version}: CPU IndexFlatIP search "
                     f"{'correct' if ok else 'WRONG'}", "", data)
    if not has_gpu_code:
        return Check("faiss", SKIP, f"faiss {version} has no GPU support (a CPU build)",
                     "for the GPU baseline install faiss-gpu>=1.15", data)
    if n_gpus < 1:
        return Check("faiss", FAIL, f"faiss {version} is a GPU build but sees no GPU",
                     "its CUDA does not match this driver: install a faiss-gpu built for this CUDA (faiss-gpu>=1.15 "
                     "is built for CUDA 12)", data)
    cc = gpus[0]["compute_capability"].replace(".", "") if gpus else "?"
    try:
        res = faiss.StandardGpuResources()
        index = faiss.GpuIndexFlatIP(res, 16)
        index.add(xb)
        _, got = index.search(xq, 5)
    except Exception as exc:
        if "no kernel image is available" in str(exc):
            return Check("faiss", FAIL, f"faiss {version} sees {n_gpus} GPU(s) but has no kernels for sm_{cc} "
                         f"({gpus[0]['name'] if gpus else 'this GPU'})",
                         "faiss-gpu-cu12 1.14 has no sm_90 code: install faiss-gpu>=1.15", data)
        return Check("faiss", FAIL, f"faiss {version}: GPU search failed: {_one_line(exc)[:200]}",
                     explain(exc) or "", data)
    ok = np.array_equal(got, want)
    return Check("faiss", PASS if ok else FAIL, f"faiss {version}: sees {n_gpus} GPU(s); GpuIndexFlatIP search on "
                 f"sm_{cc} {'correct' if ok else 'WRONG'}", "", data)


# -- the report -----------------------------------------------------------------------------------------------------

def _guarded(name: str, fn: Callable[[], Check], driver_cuda: str | None = None) -> Check:
    try:
        return fn()
    except Exception as exc:  # every failure is a FAIL line with an explanation, never a traceback
        return _failed(name, exc, driver_cuda)


def run(device: str = "auto") -> dict[str, Any]:
    """Collect versions and devices and run every check that applies.

    Parameters
    ----------
    device : {"auto", "cpu", "gpu"}
        "auto": GPU checks when a GPU is usable, CPU checks always; "cpu": CPU only; "gpu": no usable GPU is a
        failure.

    Returns
    -------
    dict
        JSON-serialisable: ``ok``, ``device``, ``gpu_usable``, ``gpu_status``, ``gpu_hint``, ``versions``, ``cuda``,
        ``gpus``, ``tune_cache``, ``checks`` (name, status, summary, detail, data), ``seconds``.
    """
    from ..backends.cupy import probe
    from ..core.errors import InputError
    from ..engine.tuning import cache_info

    if device not in ("auto", "cpu", "gpu"):
        raise InputError(f"unknown device {device!r}: expected one of auto, cpu, gpu")
    started = time.perf_counter()
    report: dict[str, Any] = {"ok": True, "device": "cpu", "gpu_usable": False, "gpu_status": None,
                              "gpu_hint": None, "versions": versions(),
                              "cuda": {"driver": None, "driver_cuda": None, "runtime": None, "cublas": None,
                                       "nvrtc": None},
                              "gpus": [], "tune_cache": cache_info(), "checks": [], "seconds": None}
    checks: list[Check] = []
    usable = False
    if device != "cpu":
        usable, reason = probe.cuda_status()
        report["gpu_usable"], report["gpu_status"] = usable, reason
        if not usable:
            present = _gpu_hardware_present()
            hint = explain(reason) if present else _NO_GPU
            report["gpu_hint"] = hint
            if device == "gpu" or (present and report["versions"]["cupy"]):
                # Asked for, or there is a GPU and CuPy but they do not work together: that is a failure.
                checks.append(Check("gpu", FAIL, f"no usable GPU: {reason}", hint or ""))
    driver_cuda = None
    if usable:
        report["device"] = "gpu"
        try:
            report["cuda"].update(_cuda_info())
            report["gpus"] = _gpus()
            driver_cuda = report["cuda"]["driver_cuda"]
        except Exception as exc:
            checks.append(_failed("gpu-info", exc))
    checks.append(_guarded("cpu-gemm-fp32", _check_cpu_gemm))
    if usable and report["gpus"]:
        gpu0 = report["gpus"][0]
        libs = _guarded("cuda-libraries", lambda: _check_libraries(report["cuda"]), driver_cuda)
        checks.append(libs)
        if libs.status == PASS:
            checks += [_guarded("gpu-gemm-warmup", lambda: _check_gemm_warmup(gpu0), driver_cuda),
                       _guarded("gpu-gemm-fp32", _check_gemm_fp32, driver_cuda),
                       _guarded("gpu-gemm-fp16", _check_gemm_fp16, driver_cuda),
                       _guarded("gpu-gemm-bf16", lambda: _check_gemm_bf16(gpu0), driver_cuda)]
    gpu_topk = usable and all(c.status == PASS for c in checks if c.name == "cuda-libraries")
    checks.append(_guarded("topk-exact", lambda: _check_topk(gpu_topk), driver_cuda))
    if usable and report["gpus"] and gpu_topk:
        checks.append(_guarded("h2d-pinned", lambda: _check_h2d(report["gpus"][0]), driver_cuda))
    checks.append(_guarded("faiss", lambda: _check_faiss(gpu_topk, report["gpus"]), driver_cuda))
    if report["versions"]["faiss"] is None and "faiss" in sys.modules:
        report["versions"]["faiss"] = getattr(sys.modules["faiss"], "__version__", None)
    report["checks"] = [asdict(c) for c in checks]
    report["ok"] = all(c.status != FAIL for c in checks)
    report["seconds"] = time.perf_counter() - started
    return report


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def render(report: dict[str, Any]) -> list[str]:
    """The report as lines of text for a terminal."""
    v = report["versions"]

    def show(x: Any) -> str:
        return "-" if x is None else str(x)

    lines = [f"recall {v['recall']} · Python {v['python']} · NumPy {v['numpy']} ({show(v['blas'])}) · pyarrow "
             f"{show(v['pyarrow'])} · CuPy {show(v['cupy'])} · numba {show(v['numba'])} · torch {show(v['torch'])} · "
             f"FAISS {show(v['faiss'])}"]
    c = report["cuda"]
    if report["gpu_usable"]:
        driver = f"driver {show(c['driver'])} (CUDA {show(c['driver_cuda'])})"
        lines.append(f"CUDA: {driver} · runtime {show(c['runtime'])} · cuBLAS {show(c['cublas'])} · "
                     f"NVRTC {show(c['nvrtc'])}")
        for g in report["gpus"]:
            lines.append(f"GPU {g['index']}: {g['name']} · sm_{g['compute_capability'].replace('.', '')} · "
                         f"{_gib(g['memory_total'])} total, {_gib(g['memory_free'])} free · tensor cores "
                         f"{'yes' if g['tensor_cores'] else 'no'} · bf16 {'yes' if g['bf16'] else 'no'}")
    elif report["gpu_status"] is not None:
        # The machine's own reason first: advice to install the gpu extra cannot help where there is no GPU.
        if report["gpu_hint"] == _NO_GPU:
            lines.append(f"GPU: none usable ({_NO_GPU}; {report['gpu_status']}); checking the CPU backend")
        else:
            hint = f" [{report['gpu_hint']}]" if report["gpu_hint"] else ""
            lines.append(f"GPU: none usable ({report['gpu_status']}){hint}; checking the CPU backend")
    else:
        lines.append("GPU: not checked (--device cpu)")
    t = report["tune_cache"]
    lines.append(f"tune cache: {show(t['path'])} ({t['status']}, {t['entries']} entries)")
    width = max((len(ch["name"]) for ch in report["checks"]), default=0)
    for ch in report["checks"]:
        lines.append(f"{ch['status']}  {ch['name']:<{width}}  {ch['summary']}")
        if ch["detail"]:
            lines.append(f"      {'':<{width}}  {ch['detail']}")
    n_fail = sum(ch["status"] == FAIL for ch in report["checks"])
    n_pass = sum(ch["status"] == PASS for ch in report["checks"])
    n_skip = sum(ch["status"] == SKIP for ch in report["checks"])
    verdict = "all checks passed" if not n_fail else f"{n_fail} check{'s' if n_fail > 1 else ''} FAILED"
    lines.append(f"{verdict}: {n_pass} passed, {n_fail} failed, {n_skip} skipped, on {report['device']}, in "
                 f"{report['seconds']:.1f} s")
    return lines


__all__ = ["Check", "explain", "render", "run", "versions"]
