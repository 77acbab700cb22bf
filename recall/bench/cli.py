"""`recall bench`: run named workloads (or your own Parquet files) against this engine, FAISS and torch.

Exit codes: 0 when every contender ran and every exact contender was exact; 1 when a contender failed, an exact
contender missed items, or the GPU asked for is not usable; 2 for bad arguments.
"""
from __future__ import annotations

import dataclasses
import enum
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..core.errors import BackendUnavailable, InputError
from . import workloads as wl

WorkloadName = enum.Enum("WorkloadName", {name: name for name in wl.WORKLOADS}, type=str)
WorkloadName.__doc__ = "Named workloads (see `recall bench --list`)."


class Device(str, enum.Enum):
    cpu = "cpu"
    gpu = "gpu"


class Metric(str, enum.Enum):
    ip = "ip"
    cosine = "cosine"
    l2 = "l2"


def _print_list() -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="recall bench workloads")
    for col in ("name", "users x items x dim", "k", "kind", "where", "fp32 TFLOP", "why / status"):
        table.add_column(col)
    for w in wl.WORKLOADS.values():
        shape = f"{w.n_users:,} x {w.n_items:,} x {w.dim}"
        if w.candidates:
            shape = f"{w.n_users:,} x own {w.candidates:,} of {w.n_items:,} x {w.dim}"
        table.add_row(w.name, shape, f"{w.k:,}", w.kind_label, w.device, f"{w.flops / 1e12:.3g}",
                      w.why + (f" [{w.unsupported}]" if w.unsupported else ""))
    console = Console()
    console.print(table)
    console.print("data kinds: " + ", ".join(k.value for k in wl.Kind) + " (--kind overrides a workload's default); "
                  "end to end from Parquet: --e2e")


def _command_line() -> list[str] | None:
    """``recall bench ...`` as typed, for the record; None when not run from a command line (tests)."""
    if "bench" not in sys.argv[1:]:
        return None
    return ["recall", *sys.argv[sys.argv.index("bench"):]]


def _fail(message: str, code: int) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def bench(
    workload: Annotated[Optional[list[WorkloadName]], typer.Option(
        "--workload", "-w", case_sensitive=False, help="Named workload; repeat for several (see --list).")] = None,
    kind: Annotated[Optional[wl.Kind], typer.Option(
        help="Data kind, overriding each workload's default.")] = None,
    device: Annotated[Optional[Device], typer.Option(
        help="Where to run; default: the GPU when one is usable, else the CPU.")] = None,
    contenders: Annotated[str, typer.Option(
        help="Comma-separated contender families: recall, faiss, torch.")] = "recall,faiss,torch",
    repeat: Annotated[int, typer.Option(min=1, help="Timed runs per contender (median reported), after a warm-up.")] = 3,
    out: Annotated[Path, typer.Option(file_okay=False, help="Folder for results.json, results.md, throughput.png.")]
    = Path("bench-out"),
    sample_users: Annotated[int, typer.Option(
        min=1, help="Users checked against the float64 oracle (>= 1,000 recommended).")] = 1000,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the generated data and of the user sample.")] = 0,
    metric: Annotated[Metric, typer.Option(help="Score metric for every contender.")] = Metric.ip,
    ceilings: Annotated[bool, typer.Option(
        "--ceilings", help="Measure the GPU's FP32/TF32/BF16 matmul rates and copy bandwidth first.")] = False,
    e2e: Annotated[bool, typer.Option(
        "--e2e", help="Also time recall.pipeline.score_files from Parquet to Parquet.")] = False,
    users: Annotated[Optional[Path], typer.Option(
        dir_okay=False, help="Your own users Parquet (id, embedding); needs --items and --k.")] = None,
    items: Annotated[Optional[Path], typer.Option(dir_okay=False, help="Your own items Parquet.")] = None,
    k: Annotated[Optional[int], typer.Option(help="k for --users/--items, or to override the workloads' k.")] = None,
    list_: Annotated[bool, typer.Option("--list", help="Print the workload table and exit.")] = False,
) -> None:
    """Benchmark exact top-k: this engine against FAISS and torch, with recall@k checked against float64."""
    from . import report, runner

    if list_:
        _print_list()
        return
    console = report.make_console()
    try:
        if (users is None) != (items is None):
            raise InputError("--users and --items go together")
        if users is not None and (workload or kind is not None):
            raise InputError("--users/--items bring their own data: --workload and --kind do not apply")
        if k is not None and k < 1:
            raise InputError(f"--k must be >= 1, got {k}")
        if device is None:
            from ..backends import cuda_status

            dev = "gpu" if cuda_status()[0] else "cpu"
        else:
            dev = device.value
        from .contenders import parse_families

        families = parse_families(contenders)
        data = {}
        if users is not None:
            if k is None:
                raise InputError("--users/--items need --k")
            w, arrays = runner.load_parquet_workload(users, items, k, dev)
            chosen = [w]
            data[w.name] = arrays
        else:
            if not workload and not ceilings:
                raise InputError("nothing to run: give --workload NAME (see --list), --users/--items, or --ceilings")
            chosen = []
            for name in workload or []:
                w = wl.get(name.value).with_kind(kind)
                if k is not None:
                    w = dataclasses.replace(w, k=k)
                chosen.append(w)
        settings = runner.Settings(workloads=chosen, device=dev, families=families, repeat=repeat, seed=seed,
                                   sample_users=sample_users, metric=metric.value, measure_ceilings=ceilings,
                                   e2e=e2e, data=data)
        doc = runner.run(settings, log=lambda msg: console.print(msg, style="dim", highlight=False),
                         argv=_command_line())
    except InputError as exc:
        _fail(str(exc), 2)
    except BackendUnavailable as exc:
        _fail(str(exc), 1)
    report.print_table(doc, console)
    for name, what in report.write(doc, out).items():
        console.print(f"{name}: {what}", style="dim", highlight=False)
    bad = runner.problems(doc)
    for line in bad:
        typer.echo(f"problem: {line}", err=True)
    if bad:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add the ``bench`` command to the main ``recall`` CLI app."""
    app.command("bench")(bench)
