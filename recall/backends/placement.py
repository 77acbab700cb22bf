"""Where a job's workers run on this host: one in this process, one process per GPU, or processes pinned to
disjoint shares of the CPU cores. The device questions (how many GPUs, which cores) are answered here, below the
seam; the executors above only start what this plans."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.errors import BackendUnavailable, InputError
from .cupy.probe import cuda_status, visible_gpus


@dataclass(frozen=True)
class WorkerSlot:
    """One worker: its name, the device its engine asks for, and (for a worker process) the environment it must be
    born with (``CUDA_VISIBLE_DEVICES``, thread counts) and the cores it is pinned to."""

    name: str
    device: str
    env: dict[str, str] = field(default_factory=dict)
    cores: list[int] | None = None


def split_cores(n: int) -> list[list[int]]:
    """This process's cores in ``n`` contiguous, nearly equal groups (neighbouring ids share caches and NUMA nodes).

    Raises
    ------
    InputError
        ``n`` exceeds the number of cores.
    """
    cores = sorted(os.sched_getaffinity(0))
    if n > len(cores):
        raise InputError(f"--workers {n}: this process may use only {len(cores)} CPU core(s)")
    size, extra = divmod(len(cores), n)
    groups, start = [], 0
    for i in range(n):
        stop = start + size + (1 if i < extra else 0)
        groups.append(cores[start:stop])
        start = stop
    return groups


def _cpu_slots(workers: int | None) -> list[WorkerSlot]:
    n = workers or 1
    if n == 1:
        return [WorkerSlot("0", "cpu")]
    slots = []
    for i, g in enumerate(split_cores(n)):
        threads = str(len(g))
        env = {"OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
               "NUMBA_NUM_THREADS": threads, "CUDA_VISIBLE_DEVICES": ""}
        slots.append(WorkerSlot(f"cpu{i}", "cpu", env, g))
    return slots


def plan_workers(device: str, gpus: int | str | None, workers: int | None,
                 say: Callable[[str], None]) -> list[WorkerSlot]:
    """The workers of a local job: one slot runs in this process (no environment of its own), several run as
    processes.

    - ``device="cpu"``: ``workers`` processes (default 1, in this process); ``gpus`` is ignored with a notice.
    - a GPU: ``gpus`` (N or "all") workers, one process per GPU (default 1, in this process); ``workers`` is ignored.
    - ``device="auto"``: the GPUs when there are any, else the CPU, with a notice if ``gpus`` was given.

    Raises
    ------
    InputError
        More GPUs or CPU workers asked for than there are.
    BackendUnavailable
        ``device="gpu"`` and no GPU.
    """
    if device == "cpu":
        if gpus is not None:
            say("--gpus is ignored with --device cpu; use --workers N for several CPU worker processes")
        return _cpu_slots(workers)
    if device == "auto" and gpus in (None, 1) and workers in (None, 1):
        return [WorkerSlot("0", "auto")]  # the engine picks, and says so once when it falls back to the CPU
    ids = visible_gpus()
    if not ids:
        if device == "gpu":
            raise BackendUnavailable(f"--device gpu but no GPU is usable: {cuda_status()[1]}")
        if gpus is not None:
            say("no usable GPU: --gpus is ignored, running on the CPU")
        return _cpu_slots(workers)
    if workers is not None:
        say("--workers counts CPU workers and is ignored on GPUs; use --gpus N|all")
    n = len(ids) if gpus == "all" else int(gpus or 1)
    if n > len(ids):
        raise InputError(f"--gpus {n}: only {len(ids)} GPU(s) are visible to this process")
    if n == 1:
        return [WorkerSlot("0", device)]
    return [WorkerSlot(f"gpu{ids[i]}", "gpu", {"CUDA_VISIBLE_DEVICES": ids[i]}) for i in range(n)]


def plan_actors(device: str, gpus: int | str | None, workers: int | None, cluster_gpus: int,
                say: Callable[[str], None]) -> tuple[str, int]:
    """(device, count) of a Ray job's actors on a cluster of ``cluster_gpus`` GPUs: GPU actors (one GPU each) when
    asked for or, with ``device="auto"``, when the cluster has GPUs; else CPU actors.

    Raises
    ------
    InputError
        More GPUs asked for than the cluster has.
    BackendUnavailable
        ``device="gpu"`` and the cluster has no GPU.
    """
    use_gpu = device == "gpu" or (device == "auto" and cluster_gpus > 0)
    if not use_gpu:
        if gpus is not None:
            say("--gpus is ignored on CPU actors (the cluster has no GPU, or --device cpu); use --workers N for "
                "several CPU actors")
        return "cpu", int(workers or 1)
    if cluster_gpus == 0:
        raise BackendUnavailable("--device gpu but the Ray cluster has no GPU")
    if workers is not None:
        say("--workers counts CPU actors and is ignored on GPUs; use --gpus N|all")
    n = cluster_gpus if gpus == "all" else int(gpus or 1)
    if n > cluster_gpus:
        raise InputError(f"--gpus {n}: the Ray cluster has {cluster_gpus} GPU(s)")
    return "gpu", n
