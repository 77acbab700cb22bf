"""Where the batch job's workers run: in this process, one process per GPU (or per share of the CPU cores) of this
host, or Ray actors on a cluster. Each worker holds one :class:`recall.jobs.batch.worker.ShardScorer` (items
resident, one ``Engine``) and takes shards until none is left; the parent (:func:`recall.jobs.batch.run_batch`) owns
the manifest. With item shards (``--item-shards N``) each worker holds one row range of the items instead
(:class:`recall.jobs.batch.item_shards.RangeScorer`: :mod:`.item_shards` for processes, :mod:`.ray` for actors), and
the parent scores every shard through all of them, merging and writing.

An executor has one method, ``run(spec, tasks, job)``, and one attribute, ``n_workers`` (the workers it started, set
by the end of ``run``; item-shard executors also set ``totals``, the job as one worker over the whole catalogue would
report it): ``run`` starts its workers, reports each one to
``job.worker_ready(WorkerInfo)``, feeds ``tasks`` to them dynamically, reports written users to ``job.users(n)`` and
finished shards to ``job.shard_done(ShardResult)`` (in the calling thread, or the in-process pipeline's writer
thread), bad shards (an ``InputError`` while scoring one) to ``job.shard_failed(name, path, message)`` and goes on
with the others, and re-raises the first other worker failure: ``InputError`` / ``ResourceError`` /
``BackendUnavailable`` as themselves, anything else as :class:`recall.jobs.batch.BatchError`. Workers never outlive
it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def make_executor(engine: str, *, device: str, gpus: int | str | None, workers: int | None,
                  ray_address: str | None, say: Callable[[str], None], item_shards: int = 1) -> Any:
    """The executor for ``--engine local|ray`` and the device / worker options (see
    :func:`recall.jobs.batch.run_batch`). ``item_shards`` >= 2: one worker per item range
    (:mod:`recall.jobs.executors.item_shards`, or Ray actors), whatever ``gpus`` and ``workers`` say (the job
    checked they agree).

    Raises
    ------
    InputError
        More GPUs or CPU workers asked for than there are; Ray not installed.
    BackendUnavailable
        ``device="gpu"`` and no GPU.
    """
    if engine == "ray":
        from .ray import RayExecutor, RayItemShardExecutor

        if item_shards > 1:
            return RayItemShardExecutor(device=device, n_shards=item_shards, address=ray_address, say=say)
        return RayExecutor(device=device, gpus=gpus, workers=workers, address=ray_address, say=say)
    if item_shards > 1:
        from .item_shards import local_item_shard_executor

        return local_item_shard_executor(device=device, n_shards=item_shards, say=say)
    from .local import local_executor

    return local_executor(device=device, gpus=gpus, workers=workers, say=say)


__all__ = ["make_executor"]
