"""``recall batch``: the nightly job from the shell (see :mod:`recall.jobs.batch`).

Exit codes: 0 done (or nothing left to do); 2 bad input or arguments, an output directory holding another job (one
``error:`` line naming the file or directory), or bad shards (every good shard is scored first; the line lists every
bad one); 1 a worker or the operating system failed; 143 / 130 on SIGTERM / SIGINT. The job resumes when the same
command is run again.
"""
from __future__ import annotations

import threading
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from ..core.checks import check_batch_size
from ..core.signals import when_done
from ..jobs import JobOptions
from ..jobs.batch import BatchError, BatchProgress, run_batch
from .common import (EXIT_OS_ERROR, AllowOption, BatchSizeOption, DenyOption, Device, ExcludeOption, IdColOption,
                     Interrupted, ItemMemoryOption, MemoryBudgetOption, Metric, MetricOption, QuietOption, VecColOption, errors_to_exit,
                     input_file, interruptible, log, logging_to_stderr, parse_bytes, say_first_run, show_progress)


def _resume_line(exc: Interrupted) -> str:
    """SIGTERM / SIGINT: the job recorded its failure, stopped its workers and removed its temporary files."""
    return f"error: {exc}; rerun the same command to resume"


def _complete_line(exc: Interrupted, summary: Any) -> str:
    """SIGTERM / SIGINT once the job is complete (its _SUCCESS written)."""
    return f"{exc}: the job is complete ({Path(summary.out_dir) / '_SUCCESS'})"


class EngineName(str, Enum):
    local = "local"
    ray = "ray"


class _RichProgress(BatchProgress):
    """Shards done / total, users written, users/s and ETA on stderr (rich; only when stderr is a terminal)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, \
            TimeElapsedColumn, TimeRemainingColumn

        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=24),
                            MofNCompleteColumn(), TextColumn("users, {task.fields[rate]}/s,"), TimeElapsedColumn(),
                            TextColumn("ETA"), TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        self.task: Any = None
        self.workers = 0
        self.lock = threading.Lock()
        self.done_users = 0
        self.shards = (0, 0)
        self.t0 = 0.0

    def begin(self, shards: int, users: int) -> None:
        self.bar.start()
        self.shards = (0, shards)
        self.t0 = time.perf_counter()
        self.task = self.bar.add_task(f"loading items, shards 0/{shards}", total=users, rate="-")

    def workers_ready(self, n: int) -> None:
        if n == 1:
            self.t0 = time.perf_counter()  # users/s from the first ready worker: loading items is not scoring
        self.workers = n
        self._describe()

    def _describe(self) -> None:
        n = self.workers
        self.bar.update(self.task, description=f"shards {self.shards[0]}/{self.shards[1]} "
                                               f"({n} worker{'s' if n != 1 else ''})")

    def users(self, n: int) -> None:
        with self.lock:
            self.done_users += n
            rate = self.done_users / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.update(self.task, advance=n, rate=f"{rate:,.0f}")

    def shard_done(self, done: int, total: int) -> None:
        self.shards = (done, total)
        self._describe()

    def end(self) -> None:
        self.bar.stop()


def batch(
    users: Annotated[str, typer.Option(
        "--users", help="Directory of user embedding Parquet shards (*.parquet), a glob ('data/users/part-*.parquet', "
                        "quoted), or one file.", show_default=False)],
    items: Annotated[Path, input_file("--items", "Item embeddings Parquet (id + vector columns).")],
    k: Annotated[int, typer.Option("--k", help="Items per user (>= 1).", show_default=False)],
    out: Annotated[str, typer.Option(  # as typed: click's Path would turn "" (an unset $OUT) into "."
        "--out", metavar="<path>", help="Output directory: one candidates Parquet per shard (same name), "
                                      "_manifest.json, _metrics.json, _SUCCESS. Created if missing.",
        show_default=False)],
    exclude: ExcludeOption = None,
    allow: AllowOption = None,
    deny: DenyOption = None,
    metric: MetricOption = Metric.ip,
    device: Annotated[Device, typer.Option("--device", help="auto: the GPU(s) when usable, else the CPU.")]
    = Device.auto,
    gpus: Annotated[str | None, typer.Option(
        "--gpus", metavar="N|all", help="GPU workers, one process (or Ray actor) per GPU, items resident on each "
                                        "(default 1). Ignored on the CPU.", show_default=False)] = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", metavar="N", help="CPU workers: processes pinned to disjoint cores (or Ray actors) "
                                       "(default 1). Ignored on GPUs.", show_default=False)] = None,
    item_shards: Annotated[int, typer.Option(
        "--item-shards", metavar="N", help="Split the items into N row ranges, one worker each (a process per GPU "
                                           "or share of the cores, or a Ray actor) holding only its range; every "
                                           "user batch is scored against all of them and the lists merged exactly. "
                                           "For a catalogue larger than one host or GPU. Same output as 1 "
                                           "(default: every worker holds every item).")] = 1,
    engine: Annotated[EngineName, typer.Option(
        "--engine", help="local: this host; ray: a Ray cluster (needs the ray extra).")] = EngineName.local,
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", metavar="ADDR", help="With --engine ray: the cluster, e.g. auto or ray://head:10001 "
                                              "(default: $RAY_ADDRESS, else a local Ray).", show_default=False)] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Discard what --out holds (another job's output) and score every shard again.")] = False,
    allow_empty: Annotated[bool, typer.Option(
        "--allow-empty", help="Accept a job whose shards hold no users at all (default: refuse, exit 2).")] = False,
    id_col: IdColOption = "id",
    vec_col: VecColOption = "embedding",
    batch_size: BatchSizeOption = None,
    memory_budget: MemoryBudgetOption = None,
    item_memory: ItemMemoryOption = None,
    quiet: QuietOption = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also print each worker's device and load time.")]
    = False,
) -> None:
    """Score a directory of user shards against the items: one output per shard, resumable, idempotent.

    Run the same command again after a crash or kill to resume: finished shards are kept (their output checked
    against the manifest's sha256, their input against its content hash), the others are scored again, and so is a
    shard regenerated since its output was written. A bad shard does not stop the others: the job exits 2 naming
    every bad shard, without _SUCCESS.
    """
    done: list = []  # the summary, once the job is complete

    def interrupted_line(exc: Interrupted) -> str:
        return _complete_line(exc, done[0]) if done else _resume_line(exc)

    with logging_to_stderr(quiet, verbose), errors_to_exit(), interruptible(interrupted_line):
        if batch_size is not None:
            check_batch_size(batch_size, "--batch-size")
        progress = _RichProgress() if show_progress(quiet) else None
        say_first_run(quiet, device.value)
        try:
            summary = run_batch(
                users, items, out, k, metric=metric.value, exclude=exclude, allow=allow, deny=deny, id_col=id_col,
                vec_col=vec_col, device=device.value, gpus=gpus, workers=workers, engine=engine.value,
                ray_address=ray_address, overwrite=overwrite, batch_size=batch_size,
                memory_budget=parse_bytes(memory_budget), progress=progress,
                notice=lambda msg: log.warning("notice: %s", msg), allow_empty=allow_empty, item_shards=item_shards,
                options=JobOptions(item_memory=parse_bytes(item_memory, "--item-memory")),
            )
        except BatchError as exc:
            first, _, rest = str(exc).partition("\n")
            if rest:
                typer.echo(rest, err=True)
            typer.echo(f"error: {first}", err=True)
            raise typer.Exit(EXIT_OS_ERROR) from None
        # The job is complete (_SUCCESS written): a signal from here on says so, not "rerun to resume", and after
        # the command too (the process shutting down).
        done.append(summary)
        when_done(lambda exc: _complete_line(exc, summary))
        for warning in summary.warnings():
            typer.echo(warning, err=True)
        typer.echo(summary.line())
        if verbose:
            for w in summary.worker_infos:
                rows = (f" (item rows {w.item_rows[0]:,}-{w.item_rows[1]:,}, {w.n_items:,} searched)" if w.item_rows
                        else "")
                typer.echo(f"worker {w.worker}: {w.device_detail} on {w.host} (pid {w.pid}), items{rows} loaded and "
                           f"prepared in {w.items_load_s:.2f} s")
            typer.echo(f"metrics: {Path(summary.out_dir) / '_metrics.json'}")

