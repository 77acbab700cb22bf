"""Where a local job's workers run (recall.backends.placement): in this process, or one process per GPU or per share
of the cores; and the executor that starts them."""
from __future__ import annotations

import os

import pytest

from recall.backends import placement
from recall.backends.placement import plan_workers, split_cores
from recall.core.errors import BackendUnavailable, InputError
from recall.jobs.executors.local import InProcessExecutor, ProcessExecutor, local_executor


def test_cpu_placement() -> None:
    notices: list[str] = []
    (slot,) = plan_workers("cpu", 2, None, notices.append)
    assert slot.device == "cpu" and not slot.env
    assert notices == ["--gpus is ignored with --device cpu; use --workers N for several CPU worker processes"]
    assert isinstance(local_executor(device="cpu", gpus=None, workers=None, say=print), InProcessExecutor)
    n_cores = len(os.sched_getaffinity(0))
    if n_cores >= 2:
        slots = plan_workers("cpu", None, 2, notices.append)
        assert [s.name for s in slots] == ["cpu0", "cpu1"]
        assert sorted(c for s in slots for c in s.cores) == sorted(os.sched_getaffinity(0))
        assert not set(slots[0].cores) & set(slots[1].cores)
        assert all(s.env["CUDA_VISIBLE_DEVICES"] == "" for s in slots)
        ex = local_executor(device="cpu", gpus=None, workers=2, say=print)
        assert isinstance(ex, ProcessExecutor) and ex.names == ["cpu0", "cpu1"]
    with pytest.raises(InputError, match=f"--workers {n_cores + 1}: this process may use only {n_cores}"):
        split_cores(n_cores + 1)


def test_gpu_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    notices: list[str] = []
    monkeypatch.setattr(placement, "visible_gpus", lambda: ["3", "GPU-5a1b"])
    slots = plan_workers("auto", "all", 4, notices.append)
    assert [s.name for s in slots] == ["gpu3", "gpuGPU-5a1b"] and {s.device for s in slots} == {"gpu"}
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots] == ["3", "GPU-5a1b"]
    assert notices == ["--workers counts CPU workers and is ignored on GPUs; use --gpus N|all"]
    assert [s.device for s in plan_workers("gpu", 1, None, print)] == ["gpu"]
    with pytest.raises(InputError, match="--gpus 3: only 2 GPU"):
        plan_workers("gpu", 3, None, print)

    monkeypatch.setattr(placement, "visible_gpus", lambda: [])
    notices.clear()
    (slot,) = plan_workers("auto", 2, None, notices.append)
    assert slot.device == "cpu" and "no usable GPU" in notices[0]
    with pytest.raises(BackendUnavailable, match="--device gpu but no GPU is usable"):
        plan_workers("gpu", 2, None, print)
    assert [s.device for s in plan_workers("auto", None, None, print)] == ["auto"]
