"""recall doctor: the report on the CPU (text and --json, every field), no GPU said in one line, failures explained in
one line with their fix (never a traceback), the FAISS "no kernel image" case, and the full GPU run (``gpu``)."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from recall.tools import doctor
from recall.backends.cupy import probe
from recall.cli.app import app

runner = CliRunner()

TOP_FIELDS = {"ok", "device", "gpu_usable", "gpu_status", "gpu_hint", "versions", "cuda", "gpus", "tune_cache",
              "checks", "seconds"}
VERSION_FIELDS = {"recall", "python", "numpy", "blas", "pyarrow", "cupy", "cupy_package", "numba", "torch", "faiss"}
CUDA_FIELDS = {"driver", "driver_cuda", "runtime", "cublas", "nvrtc"}
CHECK_FIELDS = {"name", "status", "summary", "detail", "data"}
NO_DEVICE = "no usable CUDA driver or device: CUDARuntimeError: cudaErrorNoDevice: no CUDA-capable device is detected"


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy importable (a stand-in module) but no GPU: what a laptop with cupy installed looks like."""
    monkeypatch.setattr(probe, "cuda_status", lambda: (False, NO_DEVICE))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(__version__="14.0.0"))
    monkeypatch.setattr(doctor, "_cupy_dist", lambda: "cupy-cuda12x")
    monkeypatch.setattr(doctor, "_gpu_hardware_present", lambda: False)


def test_doctor_cpu_json_has_every_field(cache_home: Path) -> None:
    result = runner.invoke(app, ["doctor", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) == TOP_FIELDS
    assert set(report["versions"]) == VERSION_FIELDS and set(report["cuda"]) == CUDA_FIELDS
    assert report["ok"] is True and report["device"] == "cpu" and report["gpus"] == []
    assert report["versions"]["recall"] and report["versions"]["numpy"] and report["versions"]["python"]
    assert report["tune_cache"] == {"path": str(cache_home / "recall" / "tune.json"), "status": "missing",
                                    "entries": 0}
    names = [c["name"] for c in report["checks"]]
    assert names[:2] == ["cpu-gemm-fp32", "topk-exact"] and names[-1] == "faiss"
    for check in report["checks"]:
        assert set(check) == CHECK_FIELDS and check["status"] in ("PASS", "SKIP"), check
    gemm = report["checks"][0]["data"]
    assert gemm["rel_err"] < doctor.FP32_LIMIT and gemm["gflops"] > 0
    assert gemm["blas_sums"] in ("ordered", "blocked", "placed")
    assert report["seconds"] < 30


@pytest.mark.parametrize("sums", ["ordered", "placed"])
def test_doctor_says_when_blas_sums_by_place(monkeypatch, sums) -> None:
    # A BLAS whose sums depend on a score's place passes (the CPU sums its scores itself) and says what it costs and
    # which setting may be behind it; one that sums in order says nothing more.
    from recall.backends import numpy as numpy_backend

    monkeypatch.setattr(numpy_backend, "blas_summation", lambda dim=64: sums)
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    check = doctor._check_cpu_gemm()
    assert check.status == "PASS" and check.data["blas_sums"] == sums and f"sums {sums}" in check.summary
    if sums == "placed":
        assert "OPENBLAS_CORETYPE=Haswell" in check.detail and "half BLAS's speed" in check.detail
    else:
        assert check.detail == ""


def test_doctor_text_without_gpu_says_so_in_one_line(no_gpu: None) -> None:
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    gpu_lines = [line for line in lines if line.startswith("GPU")]
    assert len(gpu_lines) == 1
    assert gpu_lines[0].startswith("GPU: none usable (") and "cudaErrorNoDevice" in gpu_lines[0]
    assert "no NVIDIA GPU on this machine" in gpu_lines[0] and "checking the CPU backend" in gpu_lines[0]
    assert "CuPy 14.0.0" in lines[0]
    assert any(line.startswith("PASS  topk-exact") for line in lines)
    assert lines[-1].startswith("all checks passed") and "on cpu" in lines[-1]
    assert "Traceback" not in result.output


def test_doctor_json_without_gpu(no_gpu: None) -> None:
    report = doctor.run("auto")
    assert report["ok"] and report["gpu_usable"] is False and report["gpu_status"] == NO_DEVICE
    assert report["gpu_hint"] == "no NVIDIA GPU on this machine" and report["device"] == "cpu"
    assert [c["name"] for c in report["checks"]] == ["cpu-gemm-fp32", "topk-exact", "faiss"]


def test_doctor_gpu_asked_for_but_none(no_gpu: None) -> None:
    result = runner.invoke(app, ["doctor", "--device", "gpu"])
    assert result.exit_code == 1
    fail = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fail) == 1 and "gpu" in fail[0] and "cudaErrorNoDevice" in fail[0]
    assert result.stdout.splitlines()[-1].startswith("1 check FAILED")


def test_doctor_gpu_present_but_cupy_broken_fails_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    reason = ("no usable CUDA driver or device: CUDARuntimeError: cudaErrorInsufficientDriver: CUDA driver version "
              "is insufficient for CUDA runtime version")
    monkeypatch.setattr(probe, "cuda_status", lambda: (False, reason))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(__version__="14.0.0"))
    monkeypatch.setattr(doctor, "_cupy_dist", lambda: "cupy-cuda12x")
    monkeypatch.setattr(doctor, "_gpu_hardware_present", lambda: True)
    report = doctor.run("auto")
    assert not report["ok"]
    (gpu,) = [c for c in report["checks"] if c["name"] == "gpu"]
    assert gpu["status"] == "FAIL" and "upgrade the driver" in gpu["detail"]


def test_a_failing_check_is_one_line_with_its_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> doctor.Check:
        raise ImportError("libcublas.so.12: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(doctor, "_check_cpu_gemm", broken)
    monkeypatch.setattr(doctor, "_cupy_dist", lambda: "cupy-cuda12x")
    result = runner.invoke(app, ["doctor", "--device", "cpu"])
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("FAIL  cpu-gemm-fp32"))
    assert "ImportError: libcublas.so.12: cannot open shared object file" in lines[i]
    assert "pip install 'cupy-cuda12x[ctk]'" in lines[i + 1]
    assert "Traceback" not in result.output
    report = json.loads(runner.invoke(app, ["doctor", "--device", "cpu", "--json"]).stdout)
    assert report["ok"] is False


@pytest.mark.parametrize("error, words", [
    ("ImportError: libcublas.so.12: cannot open shared object file: No such file or directory",
     ["libcublas (CUDA 12)", "pip install 'cupy-cuda12x[ctk]'", "LD_LIBRARY_PATH"]),
    ('DynamicLibNotFoundError: Failure finding "libnvrtc.so.13 or libnvrtc.so.12": No such file',
     ["libnvrtc", "cupy-cuda12x[ctk]"]),
    ("ImportError: /usr/lib/libcublasLt.so.12: undefined symbol: cublasLtSomething",
     ["libcublasLt is not the version cupy-cuda12x was built for"]),
    ("OSError: libcuda.so.1: cannot open shared object file", ["NVIDIA driver", "--gpus all"]),
    ("CUDARuntimeError: cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version",
     ["older than the CUDA runtime", "upgrade the driver"]),
    ("CUDARuntimeError: cudaErrorNoDevice: no CUDA-capable device is detected", ["CUDA_VISIBLE_DEVICES"]),
    ("RuntimeError: CUDA error: no kernel image is available for execution on the device", ["no GPU code"]),
])
def test_explain(monkeypatch: pytest.MonkeyPatch, error: str, words: list[str]) -> None:
    monkeypatch.setattr(doctor, "_cupy_dist", lambda: "cupy-cuda12x")
    line = doctor.explain(error)
    assert line is not None and "\n" not in line
    for word in words:
        assert word in line, line


def test_explain_names_the_cupy_for_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "_cupy_dist", lambda: "cupy-cuda12x")
    line = doctor.explain("ImportError: libcublas.so.12: cannot open shared object file", driver_cuda="13.0")
    assert "pip install 'cupy-cuda13x'" in line
    assert doctor.explain("ValueError: something else entirely") is None


def _fake_faiss(search_error: str | None) -> types.ModuleType:
    import numpy as np

    faiss = types.ModuleType("faiss")
    faiss.__version__ = "1.14.0"
    faiss.get_num_gpus = lambda: 1

    class StandardGpuResources:
        pass

    class GpuIndexFlatIP:
        def __init__(self, res: object, dim: int) -> None:
            self.xb = None

        def add(self, xb: np.ndarray) -> None:
            self.xb = xb

        def search(self, xq: np.ndarray, k: int) -> tuple:
            if search_error:
                raise RuntimeError(search_error)
            scores = xq.astype(np.float64) @ self.xb.astype(np.float64).T
            return None, np.argsort(-scores, axis=1, kind="stable")[:, :k]

    faiss.StandardGpuResources = StandardGpuResources
    faiss.GpuIndexFlatIP = GpuIndexFlatIP
    return faiss


H200 = [{"index": 0, "name": "NVIDIA H200", "compute_capability": "9.0"}]


def test_faiss_without_kernels_for_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    err = ("Error in virtual void faiss::gpu::StandardGpuResourcesImpl::initializeForDevice(int) at "
           "StandardGpuResources.cpp:367: CUDA error 209 no kernel image is available for execution on the device")
    monkeypatch.setitem(sys.modules, "faiss", _fake_faiss(err))
    check = doctor._check_faiss(True, H200)
    assert check.status == "FAIL" and "sm_90" in check.summary and "NVIDIA H200" in check.summary
    assert check.detail == "faiss-gpu-cu12 1.14 has no sm_90 code: install faiss-gpu>=1.15"


def test_faiss_gpu_search_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "faiss", _fake_faiss(None))
    check = doctor._check_faiss(True, H200)
    assert check.status == "PASS" and "sees 1 GPU" in check.summary and "correct" in check.summary


def test_faiss_cpu_build_on_a_gpu_machine_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    faiss = _fake_faiss(None)
    del faiss.StandardGpuResources
    monkeypatch.setitem(sys.modules, "faiss", faiss)
    check = doctor._check_faiss(True, H200)
    assert check.status == "SKIP" and "faiss-gpu>=1.15" in check.detail


def test_bf16_skipped_before_ampere() -> None:
    check = doctor._check_gemm_bf16({"bf16": False, "compute_capability": "7.5"})
    assert check.status == "SKIP" and "sm_75" in check.summary


def test_cublas_version_formats() -> None:
    assert doctor._cublas_version(130100) == "13.1.0"
    assert doctor._cublas_version(120903) == "12.9.3"
    assert doctor._cublas_version(11201) == "11.2.1"


@pytest.mark.gpu
def test_doctor_on_the_gpu() -> None:
    report = doctor.run("gpu")
    names = {c["name"]: c for c in report["checks"]}
    for name in ("cuda-libraries", "gpu-gemm-warmup", "gpu-gemm-fp32", "gpu-gemm-fp16", "topk-exact", "h2d-pinned"):
        assert names[name]["status"] == "PASS", names[name]
    assert names["gpu-gemm-bf16"]["status"] in ("PASS", "SKIP")
    assert "gpu" in names["topk-exact"]["data"]["backends"]
    assert report["cuda"]["runtime"] and report["cuda"]["cublas"] and report["gpus"][0]["name"]
    assert report["device"] == "gpu" and report["gpu_usable"]
    # FAISS may be absent or built without this GPU's code; that is its own check's business, not recall's.
    assert report["ok"] == (names["faiss"]["status"] != "FAIL")
