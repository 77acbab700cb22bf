"""Workers on this host: in this process (one GPU, or the CPU), or one spawned process per GPU / per share of cores
(planned by ``recall.backends.placement``).

Processes, not threads: each GPU worker must see exactly one device, and ``CUDA_VISIBLE_DEVICES`` is read once, when
CUDA initialises in a process. Each worker process is started with the ``spawn`` method (a fresh interpreter: no
CUDA state, no locks or threads inherited from the parent) with ``CUDA_VISIBLE_DEVICES`` already set in its
environment, so whatever imports CuPy there sees only its GPU. Shards go through one queue that every worker reads
when it is free: a slow shard does not hold the others back. Workers are killed with the parent (Linux
``PR_SET_PDEATHSIG``): after a kill -9 of the job, no orphan keeps writing into the output directory.

On the CPU one worker uses every core (the CPU backend runs one user block per core), so ``--workers N`` is only
worth it on large hosts (several NUMA nodes): each of the N processes is pinned to a disjoint share of the cores.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import queue
import signal
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from ...backends.placement import WorkerSlot, plan_workers
from ...core.errors import BackendUnavailable, InputError, ResourceError
from ..batch.worker import BatchError, JobSpec, ShardScorer, ShardTask

_POLL_S = 0.2
_JOIN_S = 10.0
#: Errors a worker re-raises in the parent as themselves (the CLI turns them into exit code 2).
_USER_ERRORS = {cls.__name__: cls for cls in (InputError, ResourceError, BackendUnavailable)}


def describe_error(exc: BaseException) -> tuple[str, str, str]:
    """(class name, message, traceback text) of a worker's exception, for the parent to rebuild."""
    return type(exc).__name__, str(exc), "".join(traceback.format_exception(exc))


def rebuild_error(worker: str, shard: str | None, cls: str, message: str, tb: str) -> BaseException:
    """The parent's exception for a worker's failure: user errors as themselves, others as BatchError."""
    if cls in _USER_ERRORS:
        return _USER_ERRORS[cls](message)
    where = f" on shard {shard}" if shard else " while loading the items"
    return BatchError(f"worker {worker} failed{where}: {cls}: {' '.join(message.split())}\n{tb}".rstrip())


class InProcessExecutor:
    """One worker in this process: the plain ``recall batch`` on one GPU or on the CPU."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.n_workers = 1

    def run(self, spec: JobSpec, tasks: list[ShardTask], job: Any) -> None:
        scorer = ShardScorer(spec, self.device, worker="0")
        job.worker_ready(scorer.info)
        score_in_turn(scorer, tasks, job)


def score_in_turn(scorer: Any, tasks: list[ShardTask], job: Any) -> None:
    """Score ``tasks`` one after the other with ``scorer`` (its ``score(task, progress)``), reporting each to
    ``job``; a bad shard is reported and the others are still scored."""
    for task in tasks:
        try:
            result = scorer.score(task, progress=job.users)
        except InputError as exc:
            job.shard_failed(task.name, task.path, str(exc))
            continue
        job.shard_done(result)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit now if it already has."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _worker_signals() -> None:
    """SIGTERM (the parent stopping its workers) unwinds the worker, so that the shard being written leaves no
    temporary file; SIGINT (Ctrl-C reaches the whole process group) is the parent's to handle."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worker_main(name: str, spec: JobSpec, device: str, cores: list[int] | None, tasks: Any, results: Any,
                 parent_pid: int) -> None:
    """A worker process: load the items once, then score shards from ``tasks`` until a None arrives."""
    _worker_signals()
    _die_with_parent(parent_pid)
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        scorer = ShardScorer(spec, device, worker=name)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        results.put(("error", name, None, *describe_error(exc)))
        return
    results.put(("ready", name, scorer.info))
    while True:
        task = tasks.get()
        if task is None:
            return
        results.put(("start", name, task.name))
        try:
            result = scorer.score(task, progress=lambda n: results.put(("users", name, n)))
        except InputError as exc:  # a bad shard: reported, and the worker takes the next one
            results.put(("bad", name, task.name, task.path, str(exc)))
            continue
        except BaseException as exc:  # noqa: BLE001
            results.put(("error", name, task.name, *describe_error(exc)))
            return
        results.put(("done", name, result))


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` in this process for the length of a ``Process.start()``: a spawned child inherits it from birth."""
    old = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class ProcessExecutor:
    """One spawned process per worker slot, shards handed out through a shared queue.

    Parameters
    ----------
    slots : list of WorkerSlot
        Each worker's name ("gpu0", "cpu1"), the device its engine runs on ("gpu": a worker whose GPU is unusable
        fails loudly rather than falling back to the CPU), the environment it is born with and its cores.
    """

    def __init__(self, slots: list[WorkerSlot]) -> None:
        self.slots = slots
        self.names = [s.name for s in slots]
        self.n_workers = len(slots)

    def run(self, spec: JobSpec, tasks: list[ShardTask], job: Any) -> None:
        ctx = mp.get_context("spawn")
        task_q, result_q = ctx.Queue(), ctx.Queue()
        for task in tasks:
            task_q.put(task)
        for _ in self.names:
            task_q.put(None)
        procs: dict[str, Any] = {}
        try:
            for slot in self.slots:
                with _environ(slot.env):
                    proc = ctx.Process(target=_worker_main, name=f"recall-batch-{slot.name}", daemon=True,
                                       args=(slot.name, spec, slot.device, slot.cores, task_q, result_q,
                                             os.getpid()))
                    proc.start()
                procs[slot.name] = proc
            ready = self._collect(tasks, job, procs, result_q)
            # Workers that were ready take their None and exit; one still loading the items when the last shard
            # finished has nothing left to do and is stopped below.
            for name, proc in procs.items():
                if name in ready:
                    proc.join(_JOIN_S)
        finally:
            for proc in procs.values():
                if proc.is_alive():
                    proc.terminate()
            for proc in procs.values():
                proc.join(_JOIN_S)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            task_q.cancel_join_thread()
            result_q.cancel_join_thread()

    @staticmethod
    def _collect(tasks: list[ShardTask], job: Any, procs: dict[str, Any], result_q: Any) -> set[str]:
        """Handle the workers' messages until every task is done; returns the names of the workers that were ready."""
        pending = len(tasks)
        current: dict[str, str] = {}
        ready: set[str] = set()
        while pending:
            try:
                msg = result_q.get(timeout=_POLL_S)
            except queue.Empty:
                # Only once the queue is drained: a worker's last messages may arrive after it has exited.
                for name, proc in procs.items():
                    if proc.exitcode is not None and proc.exitcode != 0:
                        code = proc.exitcode
                        how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else \
                            f"exited with code {code}"
                        where = f"while scoring {current[name]}" if name in current else "before taking a shard"
                        raise BatchError(f"worker {name} (pid {proc.pid}) {how} {where}; rerun the same command to "
                                         f"resume")
                if all(p.exitcode is not None for p in procs.values()):
                    raise BatchError(f"every worker exited with {pending} shard(s) left")
                continue
            kind, name = msg[0], msg[1]
            if kind == "ready":
                ready.add(name)
                job.worker_ready(msg[2])
            elif kind == "start":
                current[name] = msg[2]
            elif kind == "users":
                job.users(msg[2])
            elif kind == "done":
                current.pop(name, None)
                job.shard_done(msg[2])
                pending -= 1
            elif kind == "bad":
                current.pop(name, None)
                job.shard_failed(*msg[2:])
                pending -= 1
            elif kind == "error":
                raise rebuild_error(name, *msg[2:])
        return ready


def local_executor(*, device: str, gpus: int | str | None, workers: int | None,
                   say: Callable[[str], None]) -> Any:
    """The executor for ``--engine local`` (see :func:`recall.jobs.executors.make_executor`): the workers
    ``recall.backends.placement.plan_workers`` plans, in this process or one process each."""
    slots = plan_workers(device, gpus, workers, say)
    if len(slots) == 1:
        return InProcessExecutor(slots[0].device)
    return ProcessExecutor(slots)
