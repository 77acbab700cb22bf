"""``recall batch``: the nightly job. A directory (or glob) of user Parquet shards in, one candidates file per shard out.

Sharded, resumable, idempotent:

- every output is written under a temporary name and renamed into place when complete (``CandidateWriter``);
- ``OUT_DIR/_manifest.json`` records the job (with a content hash of every input) and every finished shard
  (:mod:`.outdir`), rewritten atomically after every finished shard, by the parent process only;
- a rerun of the same command skips the shards whose output exists and matches the manifest's size and sha256 and
  whose input is unchanged, and redoes the others (a shard regenerated in place is scored again, its stale output
  removed first); a different job (other parameters, item file, exclusions, shards added or removed) into the same
  directory is refused unless ``overwrite``;
- a bad shard (bad rows, not Parquet, wrong columns) does not stop the job: every good shard is scored, then the job
  fails with an ``InputError`` listing every bad shard (also in ``_metrics.json``);
- ``_SUCCESS`` is written last, when every shard is good and done, and removed first whenever anything has to be
  (re)done;
- Parquet bytes are deterministic (fixed row groups, no timestamps): a run killed at any moment and run again gives
  the same bytes as an uninterrupted run, with the same code, device and tiling (see :func:`run_batch`).

Each worker (this process, a process per GPU, or a Ray actor; :mod:`recall.jobs.executors`) loads and prepares the
items once in a :class:`~.worker.ShardScorer` and streams shards through it; with ``item_shards`` each worker holds
one row range of the items, and the parent streams every shard through all of them, merging exactly
(:mod:`.item_shards`). The parent reads and maps the exclusion file once for the job and saves the index for the
workers (:mod:`.exclusions`), and owns the manifest, the metrics file (``_metrics.json``), the progress display and
``_SUCCESS``.
"""
from __future__ import annotations

import datetime as _dt
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ...core import metrics as _metrics
from ...core.checks import DEVICES, check_batch_size, check_budget, check_choice, check_int, check_k
from ...core.errors import InputError, one_line
from ...io import atomic, inspect_embeddings, inspect_item_set, inspect_pairs
from .. import executors
from ..options import DEFAULT_JOB_OPTIONS, JobOptions
from ..summary import unknown_id_warnings
from . import outdir
from .exclusions import ExclusionFiles, ExclusionRead
from .outdir import MANIFEST, METRICS, SUCCESS
from .shards import Shard, discover_shards, fingerprint, fingerprint_all, inspect_shards
from .worker import JobSpec, ShardResult, ShardTask, WorkerInfo

log = logging.getLogger("recall")

ENGINES = ("local", "ray")
#: Bad shards named in full in the error line (all of them are in ``_metrics.json``).
_SHOWN_BAD = 20


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class BatchProgress:
    """What :func:`run_batch` reports while it runs; the CLI draws it. Methods may be called from worker threads."""

    def begin(self, shards: int, users: int) -> None:
        """Work is about to start: ``shards`` shards holding ``users`` users to score."""

    def workers_ready(self, n: int) -> None:
        """``n`` workers have loaded the items."""

    def users(self, n: int) -> None:
        """``n`` more users were written."""

    def shard_done(self, done: int, total: int) -> None:
        """A shard finished: ``done`` of ``total`` in this run."""

    def end(self) -> None:
        """The run is over (success or failure)."""


@dataclass
class BatchSummary:
    """What :func:`run_batch` did.

    Attributes
    ----------
    shards_total : int
        Shards in the input.
    shards_skipped : int
        Already done (verified against the manifest), not recomputed.
    shards_scored : int
        Scored in this run.
    users_scored : int
        Users in the shards scored in this run.
    users_total : int
        Users in all shards.
    seconds : float
        Wall time of this run, from the call to the end.
    engine, device : str
        "local" or "ray"; "cpu" or "gpu" ("" when nothing had to be done).
    workers : int
    out_dir : str
    exclusion_pairs, unknown_exclusions : int
        Pairs in the exclusions file; of those, pairs naming an item id the items file does not have (ignored).
    filter_ids, unknown_filter_ids : int
        Ids in the ``--allow`` and ``--deny`` files; of those, ids the items file does not have (ignored).
    empty_exclusions : str
        The exclusions file, where it has no pairs (a warning); else "".
    item_shards : int
        Item ranges the catalogue was split into (1: every worker holds every item).
    """

    shards_total: int
    shards_skipped: int
    shards_scored: int
    users_scored: int
    users_total: int
    seconds: float
    engine: str
    device: str
    workers: int
    out_dir: str
    n_items: int = 0
    k: int = 0
    metric: str = ""
    exclusion_pairs: int = 0
    unknown_exclusions: int = 0
    filter_ids: int = 0
    unknown_filter_ids: int = 0
    empty_exclusions: str = ""
    notices: list[str] = field(default_factory=list)
    worker_infos: list[WorkerInfo] = field(default_factory=list)
    item_shards: int = 1

    @property
    def users_per_s(self) -> float:
        return self.users_scored / self.seconds if self.seconds > 0 else 0.0

    def warnings(self) -> list[str]:
        """The warnings for ids that are not in the items file (exclusion pairs, filter ids), one line each."""
        return unknown_id_warnings(self.exclusion_pairs, self.unknown_exclusions,
                                   "exclusion pairs name an item id that is not in the items file; they were ignored",
                                   self.filter_ids, self.unknown_filter_ids, self.empty_exclusions)

    def line(self) -> str:
        """The one-line summary the CLI prints."""
        if self.shards_scored == 0:
            return (f"batch: all {self.shards_total:,} shard{'s' if self.shards_total != 1 else ''} "
                    f"({self.users_total:,} users) already done and verified, nothing to do -> {self.out_dir}")
        skipped = f", {self.shards_skipped:,} already done" if self.shards_skipped else ""
        engine = f"{self.engine}, items in {self.item_shards} shards" if self.item_shards > 1 else self.engine
        return (f"batch: {self.shards_scored:,} of {self.shards_total:,} shards scored{skipped}; "
                f"{self.users_scored:,} users x {self.n_items:,} items, k {self.k}, metric {self.metric}, "
                f"{self.workers} {self.device} worker{'s' if self.workers != 1 else ''} ({engine}) in "
                f"{self.seconds:.2f} s ({self.users_per_s:,.0f} users/s) -> {self.out_dir}")


@dataclass(frozen=True)
class BatchRequest:
    """Everything :func:`run_batch` was asked, validated (see its parameters)."""

    users: str
    items_path: str
    exclude_path: str | None
    out: Path
    out_label: str
    k: int
    metric: str
    id_col: str
    vec_col: str
    device: str
    gpus: int | str | None
    workers: int | None
    engine: str
    ray_address: str | None
    overwrite: bool
    batch_size: int | None
    memory_budget: int | None
    options: JobOptions
    after_batch: Callable[[], None] | None = None
    allow_path: str | None = None
    deny_path: str | None = None
    item_shards: int = 1

    def job(self, shards: list[Shard]) -> dict:
        """The manifest's description of the job: what decides every output row, every input by size and content
        hash (each file read once, on a few threads). The filter files' keys are absent when there is no filter, so
        the manifests of unfiltered jobs are as they were."""
        named = [(key, path) for key, path in (("exclude", self.exclude_path), ("allow", self.allow_path),
                                               ("deny", self.deny_path)) if path is not None]
        heads = [self.items_path, *(path for _, path in named)]
        # A bad shard's file may not even be readable: it is reported with the others, not here.
        prints = fingerprint_all([*heads, *(s.path for s in shards)],
                                 [True] * len(heads) + [s.error is None for s in shards])
        items, side, rest = prints[0], dict(zip((key for key, _ in named), prints[1:len(heads)])), prints[len(heads):]
        job = {
            "k": self.k, "metric": self.metric, "id_col": self.id_col, "vec_col": self.vec_col,
            "items": items, "exclude": side.get("exclude"),
            # (A bad shard's rows are not known: it was not read.)
            "shards": {s.name: {"rows": s.rows if s.error is None else None, **fp} for s, fp in zip(shards, rest)},
        }
        job.update({key: side[key] for key in ("allow", "deny") if key in side})
        return job

    def spec(self, user_id_type: str, exclusions: ExclusionFiles | None = None) -> JobSpec:
        return JobSpec(items_path=self.items_path, exclusions=exclusions, k=self.k, metric=self.metric,
                       id_col=self.id_col, vec_col=self.vec_col, user_id_type=user_id_type,
                       batch_size=self.batch_size, memory_budget=self.memory_budget,
                       options=_shard_options(self.options), after_batch=self.after_batch,
                       allow_path=self.allow_path, deny_path=self.deny_path)


def _shard_options(options: JobOptions) -> JobOptions:
    """The options every shard and item range of a batch job runs with: its engines keep their tiles for a short
    last batch (``EngineOptions.few_user_tiles`` off), so that item shards, cut on the tile width, score every
    batch with the unsharded job's GEMMs and write its bytes."""
    return replace(options, engine=replace(options.engine, few_user_tiles=False))


class _Job:
    """The parent's bookkeeping while workers run: the manifest, ``_metrics.json`` and progress, all under one lock
    (the in-process executor reports from the runner's writer thread)."""

    def __init__(self, out_dir: Path, manifest: dict, metrics: dict, progress: BatchProgress, n_todo: int,
                 say: Callable[[str], None], t_start: float, first_write: Callable[[], None] | None = None) -> None:
        self.out_dir, self.manifest, self.metrics, self.progress = out_dir, manifest, metrics, progress
        self.first_write = first_write or (lambda: None)
        self.begun = False
        self.n_todo, self.say, self.t_start = n_todo, say, t_start
        # How the outputs kept from earlier runs were computed: a resume that computes differently is said once.
        self.earlier = {outdir.numerics(e) for e in manifest["outputs"].values()}
        self.warned_numerics = False
        self.done = 0
        self.users_done = 0
        self.bad: dict[str, dict] = {}  # shard name -> {"path", "row", "error"}
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.workers: list[WorkerInfo] = []

    def begin(self) -> None:
        """The job's first writes to the directory: what ``_resume`` deferred (``--overwrite``: the previous job's
        files removed), no ``_SUCCESS``, this job's manifest and metrics. Once a worker has read the job-wide inputs
        (the items, the filter, the exclusions): where one of them is bad, the job fails with the directory as it
        was."""
        with self.lock:
            if self.begun:
                return
            self.first_write()
            atomic.remove(self.out_dir / SUCCESS)
            atomic.write_json(self.out_dir / MANIFEST, self.manifest)
            atomic.write_json(self.out_dir / METRICS, self.metrics)
            self.begun = True

    def _write_metrics(self) -> None:
        if self.begun:
            atomic.write_json(self.out_dir / METRICS, self.metrics)

    def worker_ready(self, info: WorkerInfo) -> None:
        self.begin()
        with self.lock:
            self.workers.append(info)
            self.metrics["workers"] = [{key: round(v, 4) if isinstance(v, float) else v
                                        for key, v in asdict(w).items()} for w in self.workers]
            self._write_metrics()
            n = len(self.workers)
        self.progress.workers_ready(n)

    def users(self, n: int) -> None:
        self.progress.users(n)

    def shard_done(self, result: ShardResult) -> None:
        now = outdir.numerics(asdict(result))
        if self.earlier and not self.warned_numerics and self.earlier != {now}:
            self.warned_numerics = True
            self.say(f"shards kept from earlier runs were computed with {outdir.describe_numerics(self.earlier)}, "
                     f"this run uses {outdir.describe_numerics({now})}: every list is still the exact top-k, but "
                     f"scores may differ in the last bits from a single uninterrupted run")
        with self.lock:
            self.manifest["outputs"][result.name] = {
                "rows": result.rows, "bytes": result.bytes, "sha256": result.sha256, "device": result.device,
                "batch_size": result.batch_size, "memory_budget": result.memory_budget,
                "exclusions_applied": result.exclusions_applied,
            }
            if result.item_shards > 1:  # unsharded outputs' entries stay as they were
                self.manifest["outputs"][result.name]["item_shards"] = result.item_shards
            self.manifest["shards_done"] = len(self.manifest["outputs"])
            atomic.write_json(self.out_dir / MANIFEST, self.manifest)
            self.done += 1
            self.users_done += result.rows
            entry = {key: round(v, 4) if isinstance(v, float) else v for key, v in asdict(result).items()
                     if key != "name"}
            entry["users_per_s"] = round(result.users_per_s, 1)
            self.metrics["shards"][result.name] = entry
            self._update_totals()
            self._write_metrics()
            done = self.done
        self.progress.shard_done(done, self.n_todo)

    def shard_failed(self, name: str, path: str, message: str) -> None:
        """A bad shard (InputError): recorded in ``_metrics.json``; the job goes on with the others."""
        m = re.search(r": row (\d+)", message)
        entry = {"path": path, "row": int(m.group(1)) if m else None, "error": one_line(message)}
        with self.lock:
            self.bad[name] = entry
            self.metrics["shards"][name] = {"status": "bad", **entry}
            self.metrics["job"]["bad_shards"] = [{"shard": n, **e} for n, e in sorted(self.bad.items())]
            self._update_totals()
            self._write_metrics()
            done = self.done + len(self.bad)
        self.progress.shard_done(done, self.n_todo)

    def bad_shards_error(self, total: int) -> InputError:
        """The job's failure when shards were bad: each one's own message (file, row, id, reason), then what that
        means for the directory."""
        n, good = len(self.bad), total - len(self.bad)
        shown = [e["error"] for _, e in sorted(self.bad.items())][:_SHOWN_BAD]
        more = f"; and {n - _SHOWN_BAD} more" if n > _SHOWN_BAD else ""
        others = f"the {good} other{'s are' if good != 1 else ' is'} done and kept" if good else "no shard is good"
        return InputError(f"{'; '.join(shown)}{more} ({n} of {total} shard{'s' if total != 1 else ''} "
                          f"{'are' if n != 1 else 'is'} bad: {others}, and {self.out_dir.name}/ gets no {SUCCESS} "
                          f"until every shard is good; fix {'them' if n != 1 else 'it'} and rerun the same command; "
                          f"every bad shard is listed in {METRICS})")

    def _update_totals(self) -> None:
        seconds = time.perf_counter() - self.t0
        job = self.metrics["job"]
        job.update(seconds=round(seconds, 3), wall_s=round(time.perf_counter() - self.t_start, 3),
                   shards_scored=self.done, users_scored=self.users_done,
                   users_per_s=round(self.users_done / seconds, 1) if seconds > 0 else 0.0,
                   items_load_s_max=max((w.items_load_s for w in self.workers), default=0.0))

    def finish(self, status: str, notices: list[str], error: str | None = None) -> None:
        with self.lock:
            self._update_totals()
            self.metrics["job"].update(status=status, finished_at=_now(), notices=list(notices))
            if error is not None:
                self.metrics["job"]["error"] = error
            self._write_metrics()


def parse_gpus(value: Any) -> int | str | None:
    """``--gpus``: None, "all", or an integer >= 1 (also given as text).

    Raises
    ------
    InputError
        Anything else.
    """
    if value is None or value == "all":
        return value
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if isinstance(value, bool) or n < 1 or (isinstance(value, str) and not value.strip().isdigit()):
        raise InputError(f"--gpus must be 'all' or an integer >= 1, got {value!r}")
    return n


def run_batch(users: str | os.PathLike, items: str | os.PathLike, out_dir: str | os.PathLike, k: int, *,
              metric: str = "ip", exclude: str | os.PathLike | None = None,
              allow: str | os.PathLike | None = None, deny: str | os.PathLike | None = None, id_col: str = "id",
              vec_col: str = "embedding", device: str = "auto", gpus: int | str | None = None,
              workers: int | None = None, engine: str = "local", ray_address: str | None = None,
              overwrite: bool = False, batch_size: int | None = None, memory_budget: int | None = None,
              progress: BatchProgress | None = None, notice: Callable[[str], None] | None = None,
              options: JobOptions | None = None, after_batch: Callable[[], None] | None = None,
              allow_empty: bool = False, item_shards: int = 1) -> BatchSummary:
    """Score every user shard of ``users`` against ``items`` into ``out_dir``: one candidates file per shard,
    resumable, idempotent (see the module docstring).

    Parameters
    ----------
    users : str or PathLike
        A directory of user embedding Parquet files (``*.parquet``, not recursive), a glob pattern, or one file.
    items : str or PathLike
        The item embedding Parquet file.
    out_dir : str or PathLike
        Created if missing. Holds ``<shard name>`` per input shard, ``_manifest.json``, ``_metrics.json``,
        ``_SUCCESS``.
    k : int
    metric : {"ip", "cosine", "l2"}
    exclude : str or PathLike, optional
        Exclusion pairs (as for ``recall score``), applied to every shard.
    allow, deny : str or PathLike, optional
        Item filter files (an ``item_id`` column), applied to every shard.
    id_col, vec_col : str
    device : {"auto", "cpu", "gpu"}
    gpus : int, "all" or None
        GPU workers (one process, or Ray actor, per GPU). Ignored, with a notice, on the CPU.
    workers : int, optional
        CPU workers (processes pinned to disjoint cores, or Ray actors); default 1. Ignored on GPUs.
    engine : {"local", "ray"}
    ray_address : str, optional
        ``ray.init(address=...)``: "auto", "ray://head:10001", ...; default: a local Ray (or ``RAY_ADDRESS``).
    overwrite : bool
        Discard what ``out_dir`` holds (the outputs its manifest lists, and files named like this job's outputs)
        and compute every shard again. Without it, a directory holding another job's output, or files recall batch
        did not write, is refused.
    batch_size : int, optional
    memory_budget : int, optional
    progress : BatchProgress, optional
    notice : callable ``(message) -> None``, optional
        Receives notices (ignored options, redone shards); default: the ``recall`` logger at WARNING.
    options : JobOptions, optional
    after_batch : callable, optional
        Run in each worker after every batch it writes (a module-level function, so that it reaches worker
        processes and Ray actors; with item shards the parent writes, and runs it): to pace a job, or observe it.
    allow_empty : bool
        Accept shards that hold no users at all (by default a job of empty shards, an upstream failure, is refused:
        it would publish only empty candidate files). A few empty shards among others are always fine.
    item_shards : int
        Split the catalogue into this many row ranges, one worker each (a process per GPU or share of the CPU
        cores, or a Ray actor) holding only its range; every user batch is scored by every worker and the lists
        merged exactly before writing (:mod:`recall.jobs.batch.item_shards`). Outputs are those of the unsharded
        job. Default 1: every worker holds every item. ``gpus`` and ``workers``, if given, must agree (``gpus``
        may be "all").

    Returns
    -------
    BatchSummary

    Raises
    ------
    InputError
        Bad arguments or job-wide inputs (named), an ``out_dir`` that holds something else (use ``overwrite``), or
        bad shards: those are raised after every good shard is scored, one message naming each (file, row, reason),
        also listed in ``_metrics.json`` (``job.bad_shards``).
    ResourceError, BackendUnavailable
        As :class:`recall.Engine`.
    BatchError
        A worker failed for a reason that is not the input's; rerun to resume.

    Notes
    -----
    Byte-for-byte equal outputs between a resumed and an uninterrupted run need the same recall and pyarrow
    versions, the same device model, and the same tiling: the same ``batch_size`` and ``memory_budget`` (the default
    budget is a share of free memory, capped; it only varies when memory is short). The manifest records, per output,
    the device, batch size and budget it was computed with.
    """
    t_start = time.perf_counter()
    notices: list[str] = []

    def say(msg: str) -> None:
        notices.append(msg)
        (notice or log.warning)(msg)

    req = _request(users, items, out_dir, k, metric, exclude, id_col, vec_col, device, gpus, workers, engine,
                   ray_address, overwrite, batch_size, memory_budget, options, after_batch, allow, deny,
                   item_shards)
    try:
        files = discover_shards(users)
    except InputError:
        _withdraw_changed(req, None, say)
        raise
    # Cheap checks first (footers only), so that a typo costs no item read and touches no output.
    items_info = inspect_embeddings(req.items_path, id_col, vec_col)
    if items_info.n_rows == 0:
        raise InputError(f"{req.items_path}: the file has no rows, at least one is required")
    if req.item_shards > items_info.n_rows:
        raise InputError(f"--item-shards {req.item_shards}: {req.items_path} has {items_info.n_rows:,} item"
                         f"{'s' if items_info.n_rows != 1 else ''}, and an item shard holds at least one")
    if req.exclude_path is not None:
        inspect_pairs(req.exclude_path, "exclusion")
    for path, what in ((req.allow_path, "allow"), (req.deny_path, "deny")):
        if path is not None:
            inspect_item_set(path, what)
    try:
        shards = inspect_shards(files, id_col, vec_col, items_info.dim, req.items_path)
    except InputError:
        _withdraw_changed(req, files, say)
        raise
    if not allow_empty and all(s.error is None for s in shards) and sum(s.rows for s in shards) == 0:
        raise InputError(f"{req.users}: every shard is empty ({len(shards)} shard{'s' if len(shards) != 1 else ''}, "
                         f"0 users), so the job would publish only empty candidate files; pass --allow-empty "
                         f"(allow_empty=True) if that is what you want")
    created = not os.path.lexists(req.out)
    _prepare_out_dir(req, shards)
    with outdir.lock(req.out):
        try:
            return _run_locked(req, shards, progress or BatchProgress(), say, notices, t_start)
        except BaseException:
            if created:
                # A job-wide input refused (or a signal) before the job's first write: the directory it made goes
                # again, as the docs promise ("leaves the directory as it was").
                outdir.remove_if_unwritten(req.out)
            raise


def _request(users: Any, items: Any, out_dir: Any, k: Any, metric: str, exclude: Any, id_col: str, vec_col: str,
             device: str, gpus: Any, workers: Any, engine: str, ray_address: str | None, overwrite: bool,
             batch_size: Any, memory_budget: Any, options: JobOptions | None,
             after_batch: Callable[[], None] | None, allow: Any = None, deny: Any = None,
             item_shards: Any = 1) -> BatchRequest:
    """The arguments of :func:`run_batch`, validated."""
    if os.fspath(out_dir) in ("", "-"):
        # An unset variable in `--out "$OUT"` would otherwise be the current directory.
        raise InputError(f"--out {os.fspath(out_dir)!r}: expected the path of the output directory")
    k = check_k(k)
    _metrics.check_metric(metric)
    check_choice(device, DEVICES, "device")
    check_choice(engine, ENGINES, "engine")
    if workers is not None:
        check_int(workers, "--workers")
    if batch_size is not None:
        check_batch_size(batch_size, "--batch-size")
    if ray_address is not None and engine != "ray":
        raise InputError("--ray-address needs --engine ray")
    item_shards = check_int(item_shards, "--item-shards")
    gpus = parse_gpus(gpus)
    if item_shards > 1:
        # One worker per item range: the count of workers follows from it ("--gpus all", the nightly script's
        # default, means "the GPUs it needs").
        for option, value, fits in (("--workers", workers, (None, item_shards)),
                                    ("--gpus", gpus, (None, item_shards, "all"))):
            if value not in fits:
                raise InputError(f"{option} {value} does not go with --item-shards {item_shards}: an item-sharded "
                                 f"job runs one worker per item range ({item_shards}, one GPU each on GPUs); leave "
                                 f"{option} out")
    return BatchRequest(
        users=os.fspath(users), items_path=os.fspath(items),
        exclude_path=os.fspath(exclude) if exclude is not None else None, out=Path(out_dir).absolute(),
        out_label=os.fspath(out_dir), k=k, metric=metric, id_col=id_col, vec_col=vec_col, device=device,
        gpus=gpus, workers=workers, engine=engine, ray_address=ray_address, overwrite=overwrite,
        batch_size=batch_size, memory_budget=check_budget(memory_budget, "--memory-budget"),
        options=options or DEFAULT_JOB_OPTIONS, after_batch=after_batch,
        allow_path=os.fspath(allow) if allow is not None else None,
        deny_path=os.fspath(deny) if deny is not None else None, item_shards=item_shards)


def _withdraw_changed(req: BatchRequest, files: list[Path] | None, say: Callable[[str], None]) -> None:
    """The shards refused as a whole (shards of two id types, every shard of another dimension than the items, a
    shard that became a folder): where ``--out`` holds this job's output, the outputs of the shards that changed
    since they were computed go, and ``_SUCCESS`` first, as a resume would remove them (the directory must not serve
    candidates of vectors that are gone); the rest stays as it was. Nothing where another job holds the lock, or the
    manifest cannot be read. ``files``: today's shards (None: the shards' names under a ``--users`` folder)."""
    out = req.out
    if not (out / MANIFEST).is_file():
        return
    try:
        with outdir.lock(out):
            old = outdir.read_manifest(out / MANIFEST, overwrite=False)
            recorded = old["job"].get("shards") or {}
            if files is not None:
                paths = {f.name: str(f) for f in files}
            elif Path(req.users).is_dir():
                paths = {name: str(Path(req.users) / name) for name in recorded}
            else:
                return
            changed = {}
            for name, before in recorded.items():
                if name in paths and os.path.lexists(paths[name]):
                    now = fingerprint(paths[name], strict=False)
                    if any(now.get(key) != before.get(key) for key in ("size", atomic.CONTENT_HASH)):
                        changed[name] = outdir.describe_change(before, now)
            outdir.withdraw(out, changed, paths, say, lambda _: f", with {SUCCESS}, before the job stops")
    except (InputError, OSError):
        return  # another job holds the directory, or it cannot be read: it stays as it is


def _prepare_out_dir(req: BatchRequest, shards: list[Shard]) -> None:
    """Create ``--out`` (refusing one that holds an input or cannot be written)."""
    out = req.out
    if out.is_symlink() and not out.exists():
        raise InputError(f"{req.out_label}: is a symbolic link to {os.readlink(out)}, which does not exist")
    if out.exists() and not out.is_dir():
        raise InputError(f"{req.out_label}: exists and is not a directory")
    # Where the directories really are: an --out reached through ".." or a symbolic link may be an input's folder,
    # and an input may be a link to a file in --out.
    # (os.path.realpath: a link loop is a bad shard, named later, not an error here.)
    real = os.path.realpath(out)
    for p in [req.items_path, req.exclude_path, req.allow_path, req.deny_path, *(s.path for s in shards)]:
        if p is not None and real in (os.path.realpath(Path(p).absolute().parent),
                                      os.path.dirname(os.path.realpath(p))):
            raise InputError(f"{p}: is inside the output directory {req.out_label}; outputs are named after the "
                             f"user shards and would overwrite or mix with inputs; choose another --out")
    atomic.make_output_dir(out, req.out_label)


def _resume(req: BatchRequest, shards: list[Shard], job: dict,
            say: Callable[[str], None]) -> tuple[dict[str, dict], Callable[[], None] | None]:
    """What the directory already holds of this job (verified outputs, by shard name), and None where it holds
    this job's manifest; else what to do before the job's first write there (``_Job.begin``: with ``overwrite``,
    remove the previous job's files). Refuses another job's directory."""
    out, names = req.out, {s.name for s in shards}
    old = outdir.read_manifest(out / MANIFEST, req.overwrite)
    foreign = outdir.foreign_files(out, old, names)
    if req.overwrite:
        # Not before the job-wide inputs have been read (a worker is ready): a bad items file must leave the
        # previous output as it was.
        previous = old
        removed = outdir.remove_leftovers(out)
        if removed:
            say(atomic.describe_removed(removed, req.out_label))
        return {}, lambda: outdir.start_over(out, previous, names, foreign, req.out_label, say)
    if old is None:
        stray = [p.name for p in out.iterdir() if p.name not in outdir.OWN_NAMES and not atomic.TMP_NAME.match(p.name)]
        if stray:
            raise InputError(f"{req.out_label}: is not empty and has no {MANIFEST} (it holds "
                             f"{', '.join(sorted(stray)[:3])}{' ...' if len(stray) > 3 else ''}), so it is not the "
                             f"output of this job; choose an empty or new directory, or pass --overwrite")
    elif old.get("format") in outdir.OLD_FORMATS:
        if any(old["job"].get(key) != job[key] for key in outdir.PARAMETERS) or \
                set(old["job"].get("shards") or {}) != set(job["shards"]):
            raise _different_job(req, old["job"], job)
        say(f"{req.out_label}: {MANIFEST} was written by an earlier recall (format {old['format']!r}, whose "
            f"fingerprints of the shards miss some in-place rewrites), so its outputs cannot be checked against "
            f"today's inputs; every shard is scored again")
        outdir.start_over(out, old, names, [], req.out_label, say)
        old = None
    elif old["job"] != job and not outdir.same_job(old["job"], job):
        raise _different_job(req, old["job"], job)
    removed = outdir.remove_leftovers(out)
    if removed:
        say(atomic.describe_removed(removed, req.out_label))
    if old is not None and foreign:
        say(f"{req.out_label}: holds {len(foreign)} file(s) recall batch did not write ({', '.join(foreign[:5])}"
            f"{' ...' if len(foreign) > 5 else ''}); they are left as they are, and a reader of the directory as one "
            f"dataset reads them too: move them out")
    if old is None:
        # A new job: its manifest is written once its job-wide inputs have been read, so that a bad one leaves the
        # directory as it was (and the same command, fixed, is not refused as another job's).
        return {}, lambda: None
    changed = outdir.changed_shards(old["job"], job)
    paths = {s.name: s.path for s in shards}
    bad = {s.name for s in shards if s.error is not None}  # reported with the job's other bad shards, not scored
    gone = outdir.withdraw(out, changed, paths, say, lambda name: " and it cannot be scored (below)" if name in bad
                           else " and the shard is scored again")
    for name, what in changed.items():
        if name not in gone and name not in bad:
            say(f"{paths[name]}: the shard changed since the last run ({what}); scoring it")
    outputs = outdir.kept_outputs(out, old, names - set(changed), say)
    prev, now = old.get("versions", {}), outdir.versions()
    if outputs and prev and prev != now:
        say(f"{req.out_label}: earlier outputs were written with {prev}, this run uses {now}; outputs stay exact, "
            f"but may differ in bytes from a run with one version")
    return outputs, None


def _different_job(req: BatchRequest, old: dict, new: dict) -> InputError:
    return InputError(f"{req.out_label}: holds the output of a different job ({outdir.describe_difference(old, new)}); "
                      f"rerun with the same parameters and inputs to resume it, pass --overwrite to replace it, or "
                      f"choose another --out")


def _run_locked(req: BatchRequest, shards: list[Shard], progress: BatchProgress, say: Callable[[str], None],
                notices: list[str], t_start: float) -> BatchSummary:
    # The exclusions are read and mapped once the job knows it has shards to score (``_run_job``).
    good = [s for s in shards if s.error is None]
    reading = None
    if req.exclude_path is not None and good:
        reading = ExclusionRead(req.exclude_path, good[0].id_type == "string", req.items_path, req.id_col,
                                req.vec_col)
    try:
        return _run_job(req, shards, progress, say, notices, t_start, reading)
    finally:
        if reading is not None:
            reading.close()


def _run_job(req: BatchRequest, shards: list[Shard], progress: BatchProgress, say: Callable[[str], None],
             notices: list[str], t_start: float, reading: ExclusionRead | None) -> BatchSummary:
    t0 = time.perf_counter()
    job = req.job(shards)
    fingerprint_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outputs, first_write = _resume(req, shards, job, say)
    verify_s = time.perf_counter() - t0

    todo = [s for s in shards if s.name not in outputs]
    manifest = {
        "format": outdir.FORMAT, "job": job, "versions": outdir.versions(),
        "inputs": {"users": req.users, "items": os.path.abspath(req.items_path),
                   **{key: os.path.abspath(path) if path else None
                      for key, path in (("exclude", req.exclude_path), ("allow", req.allow_path),
                                        ("deny", req.deny_path))}},
        "shards_total": len(shards), "shards_done": len(outputs), "outputs": outputs,
    }
    users_total = sum(s.rows for s in shards)
    base = dict(shards_total=len(shards), shards_skipped=len(outputs), users_total=users_total,
                out_dir=req.out_label, k=req.k, metric=req.metric, notices=notices, engine=req.engine)
    out = req.out
    if not todo:
        # Idempotent: nothing is rewritten, unless a kill landed between the last manifest update and _SUCCESS.
        if first_write is not None:
            first_write()
        if first_write is None and outputs:  # a metrics file lost or damaged since: what the manifest says
            outdir.complete_metrics(out / METRICS, outputs, {"shards_total": len(shards), "k": req.k,
                                                              "metric": req.metric, "users_total": users_total},
                                    _now())
        if not (out / SUCCESS).exists():
            atomic.write_json(out / MANIFEST, manifest)
            outdir.mark_succeeded(out / METRICS, _now())
            atomic.write_bytes(out / SUCCESS, b"")
        return BatchSummary(shards_scored=0, users_scored=0, seconds=time.perf_counter() - t_start, device="",
                            workers=0, **base)

    good = [s for s in todo if s.error is None]
    # Placement errors (more GPUs than there are, Ray missing) before anything in OUT_DIR changes.
    executor = executors.make_executor(req.engine, device=req.device, gpus=req.gpus, workers=req.workers,
                                       ray_address=req.ray_address, say=say,
                                       item_shards=req.item_shards) if good else None
    if executor is not None and reading is not None:
        reading.start()
    metrics = {
        "job": {"status": "running", "started_at": _now(), "engine": req.engine, "device_requested": req.device,
                "shards_total": len(shards), "shards_skipped": len(outputs), "shards_todo": len(todo),
                "users_total": users_total, "users_todo": sum(s.rows for s in todo), "k": req.k,
                "metric": req.metric, "fingerprint_s": round(fingerprint_s, 3), "verify_s": round(verify_s, 3),
                "fingerprint_bytes": sum(int(e.get("size") or 0) for e in
                                         [job["items"], *(job.get(key) or {} for key in ("exclude", "allow", "deny")),
                                          *job["shards"].values()]),
                "host": socket.gethostname(), "bad_shards": [], "item_shards": req.item_shards},
        "workers": [], "shards": outdir.earlier_shard_metrics(out / METRICS, outputs),
    }
    state = _Job(out, manifest, metrics, progress, len(todo), say, t_start, first_write)
    if first_write is None or executor is None:
        state.begin()  # a resumed job (its manifest is there already), or nothing to read: no worker to wait for
    # Largest shards first: with several workers the last one to finish is then a small one.
    tasks = [ShardTask(s.name, s.path, str(out / s.name), s.rows)
             for s in sorted(good, key=lambda s: (-s.rows, s.name))]

    progress.begin(len(todo), sum(t.rows for t in tasks))
    excl_files = None
    try:
        for s in todo:
            if s.error is not None:
                state.shard_failed(s.name, s.path, s.error)
        if executor is not None:
            # Read and mapped once for the job; every worker maps the saved index (.exclusions).
            excl_files = reading.save(out) if reading is not None else None
            executor.run(req.spec(good[0].id_type, excl_files), tasks, state)
    except BaseException as exc:
        state.finish("failed", notices, f"{type(exc).__name__}: {one_line(exc)}")
        raise
    finally:
        progress.end()
    if state.bad:
        error = state.bad_shards_error(len(shards))
        state.finish("failed", notices, f"InputError: {error}")
        raise error
    state.finish("succeeded", notices)
    atomic.write_bytes(out / SUCCESS, b"")
    # Item shards: the whole catalogue's figures (each worker saw its range).
    info = getattr(executor, "totals", None) or (state.workers[0] if state.workers else None)
    return BatchSummary(
        shards_scored=state.done, users_scored=state.users_done, seconds=time.perf_counter() - t_start,
        device=info.device if info else "", workers=executor.n_workers if executor else 0,
        n_items=info.n_items if info else 0,
        exclusion_pairs=info.exclusion_pairs if info else 0, unknown_exclusions=info.unknown_exclusions if info else 0,
        filter_ids=info.filter_ids if info else 0, unknown_filter_ids=info.unknown_filter_ids if info else 0,
        worker_infos=list(state.workers), item_shards=req.item_shards,
        empty_exclusions=req.exclude_path if excl_files is not None and excl_files.n_pairs == 0 else "", **base,
    )
