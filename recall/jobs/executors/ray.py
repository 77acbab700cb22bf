"""The batch job on Ray: one actor per worker, each holding one ``recall.Engine``; shards dispatched to free actors.

Why actors over shards, not Ray Data (``read_parquet`` -> ``map_batches`` -> ``write_parquet``): the job's contract is
one output file per input shard, same name, written atomically and checksummed, so that a rerun can tell finished
shards from unfinished ones. Ray Data re-partitions files into blocks (a batch may span shards, a shard may be split
across actors), names its output files itself and writes them in place, so a per-shard rename, checksum and manifest
would need a shuffle back into shards. Dispatching whole shards to actors keeps every guarantee of the local engine
(it is the same :class:`recall.jobs.batch.worker.ShardScorer` code, so the bytes are the same) while Ray does the scheduling,
placement (``num_gpus=1`` per actor, actors spread over nodes) and failure detection.

On a cluster, every node needs recall installed (``pip install 'recall[ray]'``, with the ``gpu`` extra on GPU nodes)
and must see the input files and the output directory at the same paths as the driver (a shared file system): actors
read their shard and write its output themselves, and the driver verifies outputs and writes the manifest.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ...backends.placement import plan_actors
from ...core.errors import InputError, one_line
from ...io import atomic
from ..batch.item_shards import RangeScorer
from ..batch.worker import BatchError, JobSpec, ShardResult, ShardScorer, ShardTask
from .item_shards import ItemShardExecutor
from .local import describe_error, rebuild_error


class ShardActor:
    """The actor: items loaded and prepared once, in ``__init__``; :meth:`score` streams one shard.

    Failures are returned, not raised, as ``("error", class name, message, traceback)``: the driver rebuilds the
    user-facing error types (exit code 2) without depending on Ray's exception wrapping.
    """

    def __init__(self, spec: JobSpec, device: str, name: str) -> None:
        self.name = name
        try:
            self.scorer: ShardScorer | None = ShardScorer(spec, device, worker=name)
            self.error = None
        except Exception as exc:  # noqa: BLE001 - reported by info()
            self.scorer = None
            self.error = describe_error(exc)

    def info(self) -> tuple:
        if self.scorer is None:
            return ("error", *self.error)
        return ("ok", self.scorer.info)

    def score(self, task: ShardTask) -> tuple:
        try:
            return ("ok", self.scorer.score(task))
        except InputError as exc:  # a bad shard: the driver records it and the job goes on
            return ("bad", str(exc))
        except Exception as exc:  # noqa: BLE001
            return ("error", *describe_error(exc))


class RayExecutor:
    """Run the job on Ray: ``ray.init(address)`` (a local instance when ``address`` is None and ``RAY_ADDRESS`` is
    unset), one :class:`ShardActor` per worker, dynamic dispatch, actors and (if started here) Ray shut down at the
    end.

    Parameters
    ----------
    device : {"auto", "cpu", "gpu"}
        "auto": GPU actors when the cluster has GPUs, else CPU actors.
    gpus : int, "all" or None
        GPU actors (``num_gpus=1`` each); "all": one per GPU of the cluster; default 1.
    workers : int, optional
        CPU actors (default 1), spread over the nodes; each uses every core its node gives it.
    address : str, optional
    say : callable
        Notices.
    """

    def __init__(self, *, device: str, gpus: int | str | None, workers: int | None, address: str | None,
                 say: Callable[[str], None]) -> None:
        try:
            import ray  # noqa: F401
        except ImportError as exc:
            raise InputError(f"--engine ray needs Ray: pip install 'recall[ray]' ({exc})") from None
        self.device, self.gpus, self.workers, self.address, self.say = device, gpus, workers, address, say
        self.n_workers = 0

    def run(self, spec: JobSpec, tasks: list[ShardTask], job: Any) -> None:
        import ray

        actors: list[Any] = []
        with ray_session(self.address) as poll:
            try:
                kind, n = plan_actors(self.device, self.gpus, self.workers,
                                      int(ray.cluster_resources().get("GPU", 0)), self.say)
                cpus = int(ray.cluster_resources().get("CPU", 0))
                if kind == "cpu" and n > cpus:
                    # (each CPU actor takes one: the others would wait for a CPU for ever)
                    raise InputError(f"--workers {n}: the Ray cluster has {cpus} CPU(s), one for each CPU actor")
                self.n_workers = n
                actor_cls = ray.remote(ShardActor).options(**actor_options(kind))
                names = [f"ray-{kind}{i}" for i in range(n)]
                actors = [actor_cls.remote(spec, kind, name) for name in names]
                refs = [a.info.remote() for a in actors]
                for name, ref in zip(names, refs):
                    info = wait_for(ray, ref, poll, name)
                    if info[0] == "error":
                        raise rebuild_error(name, None, *info[1:])
                    job.worker_ready(info[1])
                self._dispatch(ray, actors, names, tasks, job, poll)
            except ray.exceptions.RayError as exc:  # a node was lost, the object store ran out...
                raise ray_failed(exc) from None
            except BaseException:
                kill_actors(ray, actors, KILL_WAIT_S)  # gone before their files are: they may still open one
                actors = []
                remove_partials(tasks)  # what the killed actors were writing (they do not unwind)
                raise
            finally:
                kill_actors(ray, actors)

    @staticmethod
    def _dispatch(ray: Any, actors: list[Any], names: list[str], tasks: list[ShardTask], job: Any,
                  poll: Callable[[], None]) -> None:
        todo = list(reversed(tasks))  # pop() from the end keeps the largest-first order
        running: dict[Any, tuple[int, ShardTask]] = {}

        def submit(i: int) -> None:
            if todo:
                task = todo.pop()
                running[actors[i].score.remote(task)] = (i, task)

        for i in range(len(actors)):
            submit(i)
        while running:
            poll()
            ready, _ = ray.wait(list(running), num_returns=1, timeout=_POLL_S)
            if not ready:
                poll()
                continue
            ref = ready[0]
            i, task = running.pop(ref)
            status, *payload = wait_for(ray, ref, poll, names[i], task.name)
            if status == "error":
                raise rebuild_error(names[i], task.name, *payload)
            if status == "bad":
                job.shard_failed(task.name, task.path, payload[0])
                submit(i)
                continue
            result: ShardResult = payload[0]
            job.users(result.rows)
            job.shard_done(result)
            submit(i)


def actor_options(kind: str) -> dict[str, Any]:
    """Ray options of a batch actor: one GPU for a GPU actor, spread over the nodes, never restarted (a lost actor
    fails the job, which resumes)."""
    return {"num_gpus": 1 if kind == "gpu" else 0, "num_cpus": 1, "scheduling_strategy": "SPREAD",
            "max_restarts": 0}


#: Seconds the driver waits on Ray at a time before it looks for a signal (``ray_session``'s ``poll``).
_POLL_S = 0.2
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def ray_session(address: str | None, min_cpus: int = 0) -> Iterator[Callable[[], None]]:
    """Ray for the length of a job: the running one when this process is connected already, else ``ray.init``
    of ``address`` (a new local instance when it is None and ``RAY_ADDRESS`` is unset, even where a cluster runs on
    this host: with at least ``min_cpus`` logical CPUs, so that that many one-CPU actors can run at once), shut down
    at the end if started here.

    Yields ``poll()``, which the driver calls between its waits on Ray (never more than ``_POLL_S`` apart). A
    SIGTERM or SIGINT from the start of ``ray.init`` on is only recorded, then handed by ``poll`` to the handler the
    process had before (the CLI's, which stops the job with its exit code and line): a handler that raised inside a
    Ray wait would come out of it as Ray's own ``SystemExit(1)``, one that raised inside ``ray.init`` would leave
    Ray's agents running, and ``ray.init`` puts Ray's handlers in place of the caller's."""
    import ray

    # The handlers from before ray.init, which replaces them. They belong to the main thread; elsewhere (an
    # embedding's thread) they are left alone.
    previous = {sig: signal.getsignal(sig) for sig in _SIGNALS} \
        if threading.current_thread() is threading.main_thread() else {}
    pending: list[int] = []

    def hold() -> None:
        for sig in previous:
            signal.signal(sig, lambda signum, frame: pending.append(signum))

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def poll() -> None:
        if pending:
            signum = pending.pop(0)
            restore()
            if callable(previous[signum]):
                previous[signum](signum, None)
            signal.raise_signal(signum)  # the default action (or ignored: then the job goes on)

    started = not ray.is_initialized()
    # Held from before ray.init: a signal that stopped it half-way would leave its agents running.
    hold()
    try:
        if started:
            kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
            if address is None and not os.environ.get("RAY_ADDRESS"):
                address = "local"
                kwargs["include_dashboard"] = False
                if min_cpus > (os.cpu_count() or 1):
                    kwargs["num_cpus"] = min_cpus
            try:
                with _own_sigterm(ray):
                    ray.init(address=address, **kwargs)
            except Exception as exc:  # noqa: BLE001 - connection refused, version mismatch, bad address...
                poll()  # a signal meanwhile comes first
                where = "a local Ray instance" if address == "local" else (address or os.environ.get("RAY_ADDRESS"))
                raise BatchError(f"cannot start or reach Ray ({where}): {type(exc).__name__}: "
                                 f"{one_line(exc)}") from None
            hold()  # ray.init put Ray's handlers in place
        yield poll
    finally:
        if started and ray.is_initialized():
            ray.shutdown()
        poll()  # a signal since the driver's last look: the job stops as if it had come a moment earlier
        restore()


@contextlib.contextmanager
def _own_sigterm(ray: Any) -> Iterator[None]:
    """While ``ray.init`` runs, Ray's own SIGTERM handlers (``sys.exit`` at once, or the node's processes killed and
    ``sys.exit(1)``: either leaves the job without its line, and its dashboard and runtime-env agents running) are
    not put in place of the job's. Ray installs them through one function of its private utilities: left alone
    where a Ray version has none."""
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    if utils is None or not hasattr(utils, "set_sigterm_handler"):
        yield
        return
    original = utils.set_sigterm_handler
    utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = original


def wait_for(ray: Any, ref: Any, poll: Callable[[], None], worker: str, shard: str | None = None) -> Any:
    """``ray.get(ref)`` of a call to actor ``worker`` (scoring ``shard``), looking for signals meanwhile
    (``ray_session``); a dead actor fails the job naming it and the shard."""
    poll()
    while not ray.wait([ref], timeout=_POLL_S)[0]:
        poll()
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as exc:
        raise ray_failed(exc, worker, shard) from None


def ray_failed(exc: BaseException, worker: str | None = None, shard: str | None = None) -> BatchError:
    """The job's failure when Ray fails (an actor died, a node was lost...), naming the worker and its shard where
    known. Ray's message is cut to its first 300 characters, at a word."""
    text = one_line(exc)
    if len(text) > 300:
        text = text[:300].rsplit(" ", 1)[0] + " ..."
    who = f"worker {worker}" + (f" failed while scoring {shard}" if shard else " failed") + ": " if worker else ""
    return BatchError(f"Ray failed: {who}{type(exc).__name__}: {text}; rerun the same command to resume")


def remove_partials(tasks: list[ShardTask]) -> None:
    """The temporary files of ``tasks``' outputs (``atomic.TMP_NAME``), whatever their pid: those of actors that
    were killed, which do not remove their own (and may live on for a moment, or on another node, so that
    ``atomic.stale_temporaries`` would keep them); the job holds the directory's lock, so nothing else writes them."""
    names = {Path(task.out_path).name for task in tasks}
    for directory in {Path(task.out_path).parent for task in tasks}:
        for path in directory.iterdir():
            m = atomic.TMP_NAME.match(path.name)
            if m is not None and m["name"] in names:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


#: Seconds ``kill_actors`` waits at most for killed actors to be reported dead before their partial files are removed.
KILL_WAIT_S = 10.0


def kill_actors(ray: Any, actors: list[Any], wait_s: float = 0.0) -> None:
    """Kill ``actors``; with ``wait_s``, then wait up to that long until Ray reports each one dead (a call on it
    fails), so that none still creates or writes a file once this returns. ``ray.kill`` only asks: an actor killed
    while it opened its next shard's temporary file created it after the driver had removed the partial files (one
    of four CI runs of tests/jobs/test_executors.py's SIGTERM test, 2026-12-06, found it left)."""
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # already dead
            pass
    deadline = time.monotonic() + wait_s
    for actor in actors if wait_s > 0 else ():
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=left)
            except Exception:  # dead (or the wait ran out)
                break
            time.sleep(0.01)  # it still answers: the kill has not reached it yet


# -- item shards (``--item-shards N``) -------------------------------------------------------------------------------

class RangeActor:
    """An item-shard actor: one :class:`recall.jobs.batch.item_shards.RangeScorer`; :meth:`call` runs one of its
    methods and returns ``("ok", value)`` or ``("error", class name, message, traceback)``."""

    def __init__(self, spec: JobSpec, device: str, name: str) -> None:
        try:
            self.scorer: RangeScorer | None = RangeScorer(spec, device, worker=name)
            self.error = None
        except Exception as exc:  # noqa: BLE001 - reported by the first call
            self.scorer = None
            self.error = describe_error(exc)

    def call(self, method: str, *args: Any) -> tuple:
        if self.scorer is None:
            return ("error", *self.error)
        try:
            return ("ok", getattr(self.scorer, method)(*args))
        except Exception as exc:  # noqa: BLE001
            return ("error", *describe_error(exc))


class _ActorReply:
    def __init__(self, handle: "ActorHandle", ref: Any) -> None:
        self.handle, self.ref = handle, ref

    def result(self) -> Any:
        h = self.handle
        status, *payload = wait_for(h.ray, self.ref, h.poll, h.name, h.shard)
        if status == "error":
            raise rebuild_error(h.name, h.shard, *payload)
        return payload[0]


class ActorHandle:
    """The driver's end of one :class:`RangeActor` (the actor runs its calls in the order they are sent)."""

    def __init__(self, ray: Any, actor: Any, name: str, poll: Callable[[], None] = lambda: None) -> None:
        self.ray, self.actor, self.name, self.poll = ray, actor, name, poll
        self.shard: str | None = None

    def submit(self, method: str, *args: Any) -> _ActorReply:
        return _ActorReply(self, self.actor.call.remote(method, *args))

    def share(self, value: Any) -> Any:
        return self.ray.put(value)  # one copy in the object store for every actor of the batch

    def drain(self) -> None:
        pass  # unclaimed answers are dropped with their references; the actor's later calls run after them


class RayItemShardExecutor:
    """``--engine ray --item-shards N``: one :class:`RangeActor` per item range (one GPU each, or one CPU, spread
    over the nodes), driven by the driver, which merges their lists and writes every output.

    Parameters
    ----------
    device : {"auto", "cpu", "gpu"}
    n_shards : int
    address : str, optional
    say : callable
        Notices.
    """

    def __init__(self, *, device: str, n_shards: int, address: str | None,
                 say: Callable[[str], None] = lambda msg: None) -> None:
        try:
            import ray  # noqa: F401
        except ImportError as exc:
            raise InputError(f"--engine ray needs Ray: pip install 'recall[ray]' ({exc})") from None
        self.device, self.n_workers, self.address, self.say = device, n_shards, address, say
        self.totals = None

    def run(self, spec: JobSpec, tasks: list[ShardTask], job: Any) -> None:
        import ray

        n = self.n_workers
        polls: list[Callable[[], None]] = []  # the session's, once it is started below

        @contextlib.contextmanager
        def actors(spec: JobSpec) -> Iterator[list[ActorHandle]]:
            started: list[Any] = []
            try:
                try:
                    # Its notices are about --gpus and --workers, which item shards set themselves.
                    kind, _ = plan_actors(self.device, n, n, int(ray.cluster_resources().get("GPU", 0)),
                                          lambda msg: None)
                except InputError as exc:
                    raise InputError(f"--item-shards {n} needs one GPU per item range: {exc}") from None
                cpus = int(ray.cluster_resources().get("CPU", 0))
                if kind == "cpu" and cpus < n:
                    raise InputError(f"--item-shards {n} needs {n} CPU actors at once (one CPU each), and the Ray "
                                     f"cluster has {cpus} CPU(s)")
                actor_cls = ray.remote(RangeActor).options(**actor_options(kind))
                names = [f"ray-{kind}{i}" for i in range(n)]
                started = [actor_cls.remote(spec, kind, name) for name in names]
                yield [ActorHandle(ray, a, name, polls[0]) for a, name in zip(started, names)]
            except ray.exceptions.RayError as exc:
                raise ray_failed(exc) from None
            finally:
                kill_actors(ray, started)

        inner = ItemShardExecutor(n, actors, self.say)
        with ray_session(self.address, min_cpus=n) as poll:
            polls.append(poll)
            try:
                inner.run(spec, tasks, job)
            finally:
                self.totals = inner.totals


__all__ = ["ActorHandle", "RangeActor", "RayExecutor", "RayItemShardExecutor", "ShardActor", "ray_session"]
