"""Workers on this host: in this process (one GPU, or the CPU), or one spawned process per GPU / per share of cores
(planned by ``recall.backends.placement``).

Processes, not threads: each GPU worker must see exactly one device, and ``CUDA_VISIBLE_DEVICES`` is read once, when
CUDA initialises in a process. Each worker process is started with the ``spawn`` method (a fresh interpreter: no
CUDA state, no locks or threads inherited from the parent) with ``CUDA_VISIBLE_DEVICES`` already set in its
environment, so whatever imports CuPy there sees only its GPU. Each worker has a pipe of its own to the parent
(:mod:`.channel`), which hands the next shard to whichever worker is free: a slow shard does not hold the others
back, and a worker that dies, however it dies, is seen at once as its pipe's end-of-file. Workers are killed with the parent (Linux
``PR_SET_PDEATHSIG``): after a kill -9 of the job, no orphan keeps writing into the output directory.

On the CPU one worker uses every core (the CPU backend runs one user block per core), so ``--workers N`` is only
worth it on large hosts (several NUMA nodes): each of the N processes is pinned to a disjoint share of the cores.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from typing import Any

from ...backends.placement import WorkerSlot, plan_workers
from ...core.errors import BackendUnavailable, InputError, ResourceError, one_line
from ...core.signals import raising_signals
from ..batch.worker import BatchError, JobSpec, ShardScorer, ShardTask
from .channel import Channel

_POLL_S = 0.2
_JOIN_S = 10.0
#: How long a worker stopped by SIGTERM waits for its last message (the error it reports) to be written.
_STOPPED_FLUSH_S = 2.0
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
    return BatchError(f"worker {worker} failed{where}: {cls}: {one_line(message)}\n{tb}".rstrip())


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


@contextlib.contextmanager
def _worker_signals() -> Iterator[None]:
    """SIGTERM (the parent stopping its workers) unwinds the worker (``raising_signals``: also where it arrives in
    numba's compiler callbacks), so that the shard being written leaves no temporary file; SIGINT (Ctrl-C reaches the
    whole process group) is the parent's to handle. Once the worker's work is over, SIGTERM has nothing left to
    unwind: it ends the process quietly (raised in an exit hook, as numba's, it would print "Exception ignored in
    atexit callback" on the job's stderr)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with raising_signals((signal.SIGTERM,)):
            yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def worker_process(conn: Connection, parent_pid: int, cores: list[int] | None,
                   stopped_flush: float) -> Iterator[Channel]:
    """What every worker process does first and last: its signals (SIGTERM unwinds it), death with its parent, its
    cores, and the channel to the parent, closed at the end. Every message is written while the parent reads; a
    worker stopped by the parent (SystemExit) waits at most ``stopped_flush`` seconds for its last ones, and one
    whose parent is gone (end-of-file, a broken pipe) none."""
    with _worker_signals():
        _die_with_parent(parent_pid)
        if cores:
            os.sched_setaffinity(0, cores)
        chan = Channel(conn)
        flush: float | None = None
        try:
            yield chan
        except (EOFError, OSError):
            flush = 0
        except SystemExit:
            flush = stopped_flush
            raise
        finally:
            chan.close(flush)


def _worker_main(name: str, spec: JobSpec, device: str, cores: list[int] | None, conn: Connection,
                 parent_pid: int) -> None:
    """A worker process: load the items once, say it is ready, then score each shard the parent sends until a None
    arrives."""
    with worker_process(conn, parent_pid, cores, _STOPPED_FLUSH_S) as chan:
        try:
            scorer = ShardScorer(spec, device, worker=name)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
            chan.send(("error", name, None, *describe_error(exc)))
            if isinstance(exc, SystemExit):
                raise
            return
        chan.send(("ready", name, scorer.info))
        while (task := chan.recv()) is not None:
            try:
                result = scorer.score(task, progress=lambda n: chan.send(("users", name, n)))
            except InputError as exc:  # a bad shard: reported, and the worker takes the next one
                chan.send(("bad", name, task.name, task.path, str(exc)))
                continue
            except BaseException as exc:  # noqa: BLE001
                chan.send(("error", name, task.name, *describe_error(exc)))
                if isinstance(exc, SystemExit):
                    raise
                return
            chan.send(("done", name, result))


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
    """One spawned process per worker slot, each shard handed to the next worker that is free.

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
        procs: dict[str, Any] = {}
        chans: dict[str, Channel] = {}
        try:
            for slot in self.slots:
                procs[slot.name], chans[slot.name] = start_worker(ctx, slot, _worker_main, "recall-batch", spec)
            finished = _Dispatch(tasks, job, procs, chans).run()
            # Workers that had finished took their None and exit; one still loading the items when the last shard
            # finished has nothing left to do and is stopped below.
            for name in finished:
                procs[name].join(_JOIN_S)
        finally:
            stop_workers([(procs[name], chans[name]) for name in procs])


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread for the length of a ``Process.start()``: the child is born with it blocked, so a
    Ctrl-C (the terminal sends it to the whole process group) while the child still imports is not delivered there,
    where it would print a KeyboardInterrupt traceback beside the job's one line; :func:`_worker_signals` then
    ignores it. This process loses nothing: a SIGINT meanwhile goes to another of its threads or waits for the
    unblocking."""
    # Started by the first child otherwise, after which it unblocks SIGINT and SIGTERM in this thread.
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def start_worker(ctx: Any, slot: WorkerSlot, target: Callable[..., None], prefix: str,
                 spec: JobSpec) -> tuple[Any, Channel]:
    """Spawn ``target(slot.name, spec, slot.device, slot.cores, conn, parent pid)`` with the slot's environment from
    birth; (the process, the parent's channel to it)."""
    parent_end, child_end = ctx.Pipe(duplex=True)
    with _environ(slot.env), _sigint_blocked():
        proc = ctx.Process(target=target, name=f"{prefix}-{slot.name}", daemon=True,
                           args=(slot.name, spec, slot.device, slot.cores, child_end, os.getpid()))
        proc.start()
    child_end.close()  # the worker holds the only other end: its exit is this end's end-of-file
    return proc, Channel(parent_end)


def stop_workers(workers: list[tuple[Any, Channel]]) -> None:
    """Stop what is left of ``workers`` (process, channel): SIGTERM (each unwinds), then SIGKILL after ``_JOIN_S``;
    their channels closed."""
    for proc, _ in workers:
        if proc.is_alive():
            proc.terminate()
    for proc, chan in workers:
        proc.join(_JOIN_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
        chan.close(0)


class _Dispatch:
    """The parent's side of a multi-process job: each worker that is ready, or has just finished a shard, gets the
    next one (a slow shard holds no one else back), then a None once none are left."""

    def __init__(self, tasks: list[ShardTask], job: Any, procs: dict[str, Any], chans: dict[str, Channel]) -> None:
        self.todo = collections.deque(tasks)
        self.pending = len(tasks)
        self.job, self.procs, self.chans = job, procs, chans
        self.current: dict[str, str] = {}
        self.finished: set[str] = set()
        self._name = {chan.conn: name for name, chan in chans.items()}

    def run(self) -> set[str]:
        """Handle the workers' messages until every shard is done; returns the workers that were sent their None."""
        open_ = set(self._name)
        while self.pending:
            if not open_:
                raise BatchError(f"every worker exited with {self.pending} shard(s) left")
            for conn in wait(list(open_), timeout=_POLL_S):
                name = self._name[conn]
                try:
                    msg = self.chans[name].recv()
                except EOFError:
                    open_.discard(conn)
                    self._ended(name)
                    continue
                self._handle(name, msg)
        return self.finished

    def _handle(self, name: str, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            self.job.worker_ready(msg[2])
            self._next(name)
        elif kind == "users":
            self.job.users(msg[2])
        elif kind == "done":
            self.current.pop(name, None)
            self.job.shard_done(msg[2])
            self.pending -= 1
            self._next(name)
        elif kind == "bad":
            self.current.pop(name, None)
            self.job.shard_failed(*msg[2:])
            self.pending -= 1
            self._next(name)
        elif kind == "error":
            raise rebuild_error(name, *msg[2:])

    def _next(self, name: str) -> None:
        if self.todo:
            task = self.todo.popleft()
            self.current[name] = task.name
            self.chans[name].send(task)
        else:
            self.finished.add(name)
            self.chans[name].send(None)

    def _ended(self, name: str) -> None:
        """A worker's pipe closed: the worker exited. Fine once it was sent its None; otherwise the job fails,
        naming it and what it was doing."""
        proc = self.procs[name]
        proc.join(_JOIN_S)
        if name in self.finished and proc.exitcode == 0:
            return
        code = proc.exitcode
        how = f"was killed by signal {signal.Signals(-code).name}" if code is not None and code < 0 else \
            f"exited with code {code}"
        where = f"while scoring {self.current[name]}" if name in self.current else "before taking a shard"
        raise BatchError(f"worker {name} (pid {proc.pid}) {how} {where}; rerun the same command to resume")


def local_executor(*, device: str, gpus: int | str | None, workers: int | None,
                   say: Callable[[str], None]) -> Any:
    """The executor for ``--engine local`` (see :func:`recall.jobs.executors.make_executor`): the workers
    ``recall.backends.placement.plan_workers`` plans, in this process or one process each."""
    slots = plan_workers(device, gpus, workers, say)
    if len(slots) == 1:
        return InProcessExecutor(slots[0].device)
    return ProcessExecutor(slots)
