"""``recall doctor`` (is this machine's stack sound?) and ``recall tune`` (the best tiling for a shape, cached).

Exit codes. doctor: 0 when every check passes (no GPU in ``--device auto`` is not a failure), 1 when one fails.
tune: 0 on success; 2 for bad arguments or data, data of a shape that does not fit in memory, an unmet budget,
``--device gpu`` without a GPU, or (``--save``) no directory for the tune cache (no absolute ``XDG_CACHE_HOME`` and no
home directory); 1 when the cache cannot be written (its directory is checked before the trials).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..bench.workloads import Kind
from .common import Device, Metric, Precision, errors_to_exit, interruptible, logging_to_stderr, parse_bytes


def doctor(
    device: Annotated[Device, typer.Option(
        help="auto: GPU checks when a GPU is usable, else the CPU's (not a failure); gpu: no GPU fails.")]
    = Device.auto,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON (for machines).")] = False,
) -> None:
    """Check the environment: versions, CUDA, GPUs, GEMM accuracy, exact top-k, bandwidth, FAISS. Exit 1 on a FAIL."""
    from ..tools import doctor as doc

    with logging_to_stderr(quiet=as_json, verbose=False), interruptible(lambda exc: f"{exc}: no report"):
        report = doc.run(device.value)
    if as_json:
        typer.echo(json.dumps(report, indent=1, default=str))
    else:
        for line in doc.render(report):
            typer.echo(line)
    if not report["ok"]:
        raise typer.Exit(1)


def tune(
    k: Annotated[int, typer.Option("--k", help="Items per user (>= 1).", show_default=False)],
    users: Annotated[Optional[int], typer.Option("--users", help="Number of users to generate.",
                                                 show_default=False)] = None,
    items: Annotated[Optional[int], typer.Option("--items", help="Number of items to generate.",
                                                 show_default=False)] = None,
    dim: Annotated[Optional[int], typer.Option("--dim", help="Dimension of generated vectors.",
                                               show_default=False)] = None,
    users_file: Annotated[Optional[Path], typer.Option(
        "--users-file", dir_okay=False, help="Users Parquet (id, embedding) instead of --users.")] = None,
    items_file: Annotated[Optional[Path], typer.Option(
        "--items-file", dir_okay=False, help="Items Parquet (id, embedding) instead of --items.")] = None,
    id_col: Annotated[str, typer.Option("--id-col", help="Id column of the Parquet files.")] = "id",
    vec_col: Annotated[str, typer.Option("--vec-col", help="Vector column of the Parquet files.")] = "embedding",
    device: Annotated[Device, typer.Option("--device", help="auto: the GPU when usable, else the CPU.")]
    = Device.auto,
    metric: Annotated[Metric, typer.Option("--metric", help="ip: inner product; cosine; l2.")] = Metric.ip,
    precision: Annotated[Precision, typer.Option("--precision", help="The engine's precision mode.")]
    = Precision.exact,
    kind: Annotated[Kind, typer.Option("--kind", help="Kind of generated data (as recall bench).")]
    = Kind.clustered,
    budget: Annotated[Optional[str], typer.Option(
        "--budget", "--memory-budget", metavar="BYTES",
        help="The engine's working memory, e.g. 2G (default: the engine's).", show_default=False)] = None,
    repeat: Annotated[int, typer.Option("--repeat", help="Timed searches per candidate, after a warm-up; the median "
                                        "counts.")] = 3,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the generated data.")] = 0,
    save: Annotated[bool, typer.Option("--save/--no-save", help="Store the best tiling in the tune cache.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress lines on stderr.")] = False,
) -> None:
    """Time a small grid of tilings for one search shape and cache the fastest for the engine (tune="auto")."""
    from ..tools import tune as tool

    def progress(trial: Any, i: int, n: int) -> None:
        if not quiet:
            typer.echo(f"[{i + 1}/{n}] {tool.fmt_tiles(trial.tiles)}: {trial.seconds:.4f} s "
                       f"(warm-up {trial.warmup_seconds:.3f} s)", err=True)

    with logging_to_stderr(quiet, False), errors_to_exit(), interruptible(_tune_stopped(save)):
        memory_budget = parse_bytes(budget, "--budget")
        out = tool.run(k, users, items, dim, users_file, items_file, id_col, vec_col, device.value, metric.value,
                       precision.value, kind, memory_budget, repeat, seed, save, progress)
    if as_json:
        typer.echo(json.dumps(out, indent=1, default=str))
    else:
        for line in tool.report_lines(out):
            typer.echo(line)



def _tune_stopped(save: bool) -> Any:
    """The interruption line of ``recall tune`` (the cache is written whole or not at all)."""
    return lambda exc: f"{exc}: " + ("the tune cache is written whole or not at all" if save else "no result")
