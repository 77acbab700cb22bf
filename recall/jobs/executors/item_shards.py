"""Item-sharded jobs on this host (``recall batch --item-shards N``): one spawned process per item range, one GPU
each (or a share of the CPU cores), driven by :class:`recall.jobs.batch.item_shards.ItemShardScorer` in the parent,
which merges their lists and writes every output.

Each worker is reached through a :class:`ProcessHandle`: a pipe of its own (:mod:`.channel`), so replies come back in
request order, and the parent's searching thread can send the next batches while its writer thread waits for
the lists of the previous one. The workers are born and die as those of :mod:`.local` (``spawn``, the slot's
environment from birth, killed with the parent), and a worker that dies fails the job with its name and the shard it
was scoring.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from ...backends.placement import WorkerSlot, plan_workers
from ...core.errors import InputError
from ..batch.item_shards import InlineHandle, ItemShardScorer, RangeScorer
from ..batch.worker import BatchError, JobSpec, ShardTask
from .channel import Channel
from .local import describe_error, rebuild_error, score_in_turn, start_worker, stop_workers, worker_process

_POLL_S = 0.2
_JOIN_S = 10.0

#: ``start(spec)``: a context that starts the job's workers and yields their handles, in range order.
StartWorkers = Callable[[JobSpec], contextlib.AbstractContextManager]


class ItemShardExecutor:
    """Run a job over item shards: the workers started (``start``), the catalogue split among them and loaded, then
    every user shard scored against all of them, merged and written by the parent (one shard at a time: each one
    already keeps every worker busy).

    Attributes
    ----------
    n_workers : int
        The item shards (one worker each).
    totals : WorkerInfo or None
        After ``run``: the job as one worker over the whole catalogue would report it (items, exclusion pairs and
        filter ids, with their unknown ids), for the summary.
    """

    def __init__(self, n_shards: int, start: StartWorkers, say: Callable[[str], None] = lambda msg: None) -> None:
        self.n_workers = n_shards
        self._start, self._say = start, say
        self.totals = None

    def run(self, spec: JobSpec, tasks: list[ShardTask], job: Any) -> None:
        with self._start(spec) as handles:
            scorer = ItemShardScorer(spec, handles)
            for info in scorer.infos:
                job.worker_ready(info)
            self.totals = scorer.totals
            notice = scorer.empty_notice()
            if notice:
                self._say(notice)
            score_in_turn(scorer, tasks, job)


def _range_worker_main(name: str, spec: JobSpec, device: str, cores: list[int] | None, conn: Connection,
                       parent_pid: int) -> None:
    """A worker process: a :class:`RangeScorer`, then each request ``(method, args)`` answered in order until a
    None arrives. A failure is answered as ``("error", class, message, traceback)`` and ends the worker. Stopped by
    the parent (SIGTERM), it exits at once: lists the parent will never read must not hold it up."""
    with worker_process(conn, parent_pid, cores, stopped_flush=0) as chan:
        try:
            scorer = RangeScorer(spec, device, worker=name)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
            chan.send(("error", *describe_error(exc)))
            if isinstance(exc, SystemExit):
                raise
            return
        while (msg := chan.recv()) is not None:
            method, args = msg
            try:
                value = getattr(scorer, method)(*args)
            except SystemExit:
                raise
            except BaseException as exc:  # noqa: BLE001
                chan.send(("error", *describe_error(exc)))
                return
            chan.send(("ok", value))


class _Reply:
    def __init__(self, handle: "ProcessHandle", seq: int) -> None:
        self.handle, self.seq = handle, seq

    def result(self) -> Any:
        return self.handle.take(self.seq)


class ProcessHandle:
    """The parent's end of one worker process: ``submit`` sends a call, its reply's ``result()`` waits for the
    answer (replies arrive in request order; any thread may wait), ``drain`` discards the answers nobody took.

    Raises (from ``result()``)
    --------------------------
    InputError, ResourceError, BackendUnavailable
        As the worker raised them.
    BatchError
        The worker failed otherwise, or died (naming it, its pid and the shard).
    """

    def __init__(self, name: str, proc: Any, chan: Channel) -> None:
        self.name, self.proc, self.chan = name, proc, chan
        self.shard: str | None = None
        self._send = threading.Lock()
        self._read = threading.Lock()  # one reader of the replies at a time; answers kept by sequence number
        self._sent = 0
        self._received = 0
        self._answers: dict[int, tuple] = {}
        self._failure: BaseException | None = None

    def submit(self, method: str, *args: Any) -> _Reply:
        with self._send:
            self.chan.send((method, args))
            seq = self._sent  # counted once sent: a drain waits only for answers that can come
            self._sent += 1
        return _Reply(self, seq)

    def share(self, value: Any) -> Any:
        return value  # each request carries its own copy through the pipe

    def take(self, seq: int) -> Any:
        with self._read:
            self._receive_until(seq)
            status, *payload = self._answers.pop(seq)
        if status == "error":
            raise rebuild_error(self.name, self.shard, *payload)
        return payload[0]

    def drain(self) -> None:
        with self._read:
            with self._send:
                last = self._sent - 1
            try:
                self._receive_until(last)
            finally:
                self._answers.clear()

    def _receive_until(self, seq: int) -> None:
        while self._received <= seq:
            if self._failure is not None:
                raise self._failure
            try:
                msg = self.chan.recv(_POLL_S)
            except queue.Empty:
                continue
            except EOFError:  # the worker exited before answering
                self.proc.join(_JOIN_S)
                self._failure = self._died()
                raise self._failure
            self._answers[self._received] = msg
            self._received += 1
            if msg[0] == "error":  # the worker exits after it: later requests get no answer
                self._failure = rebuild_error(self.name, self.shard, *msg[1:])
                for later in range(self._received, self._sent):
                    self._answers[later] = msg
                self._received = max(self._received, self._sent)

    def _died(self) -> BatchError:
        code = self.proc.exitcode
        how = f"was killed by signal {signal.Signals(-code).name}" if code is not None and code < 0 else \
            f"exited with code {code}"
        where = f"while scoring {self.shard}" if self.shard else "while loading its item range"
        return BatchError(f"worker {self.name} (pid {self.proc.pid}) {how} {where}; rerun the same command to "
                          f"resume")


def item_shard_slots(device: str, n_shards: int) -> list[WorkerSlot]:
    """One worker slot per item range (``recall.backends.placement`` plans them): a GPU each, or disjoint shares
    of the CPU cores; with more ranges than cores, ranges share cores (each worker still holds only its range).

    Raises
    ------
    InputError
        Fewer GPUs visible than item shards.
    BackendUnavailable
        ``device="gpu"`` and no GPU.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        # The notices plan_workers gives are about --gpus and --workers, which item shards set themselves.
        slots = plan_workers(device, n_shards, min(n_shards, cores), lambda msg: None)
    except InputError as exc:
        raise InputError(f"--item-shards {n_shards} needs one GPU per item range: {exc}") from None
    if len(slots) == n_shards and all(s.env for s in slots):
        return slots
    # The CPU with fewer cores than ranges: the cores' shares, dealt out in turn.
    return [replace(slots[i % len(slots)], name=f"cpu{i}", device="cpu") for i in range(n_shards)]


@contextlib.contextmanager
def _processes(slots: list[WorkerSlot], spec: JobSpec) -> Iterator[list[ProcessHandle]]:
    """Start one worker process per slot; stop them all at the end (a None each, then terminate what is left)."""
    ctx = mp.get_context("spawn")
    handles: list[ProcessHandle] = []
    try:
        for slot in slots:
            handles.append(ProcessHandle(slot.name, *start_worker(ctx, slot, _range_worker_main, "recall-items",
                                                                  spec)))
        yield handles
        for h in handles:
            h.chan.send(None)
        for h in handles:
            h.proc.join(_JOIN_S)
    finally:
        stop_workers([(h.proc, h.chan) for h in handles])


def local_item_shard_executor(*, device: str, n_shards: int, say: Callable[[str], None]) -> ItemShardExecutor:
    """The executor for ``--engine local --item-shards N`` (N >= 2): one process per item range."""
    slots = item_shard_slots(device, n_shards)
    return ItemShardExecutor(n_shards, lambda spec: _processes(slots, spec), say)


@contextlib.contextmanager
def _inline(n_shards: int, device: str, spec: JobSpec) -> Iterator[list[InlineHandle]]:
    yield [InlineHandle(RangeScorer(spec, device, worker=f"items{i}")) for i in range(n_shards)]


def inline_item_shard_executor(*, device: str, n_shards: int,
                               say: Callable[[str], None] = lambda msg: None) -> ItemShardExecutor:
    """Every item range in this process, searched one after the other: the same ranges, merge and bytes as
    :func:`local_item_shard_executor` without its processes (tests; no faster than one worker)."""
    return ItemShardExecutor(n_shards, lambda spec: _inline(n_shards, device, spec), say)


__all__ = ["ItemShardExecutor", "ProcessHandle", "inline_item_shard_executor", "item_shard_slots",
           "local_item_shard_executor"]
