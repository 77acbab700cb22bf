"""`recall bench`: run named workloads, a matrix of cells, or your own Parquet files against this engine, FAISS, cuVS
and torch.

Exit codes: 0 when every contender ran and every exact contender was exact; 1 when a contender failed, an exact
contender missed items, or the GPU asked for is not usable; 2 for bad arguments.
"""
from __future__ import annotations

import dataclasses
import enum
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from recall import BackendUnavailable, InputError
from recall.core.errors import EXIT_STDOUT_CLOSED, one_line, os_error_line, stdout_closed
from recall.core.signals import Interrupted, raising_signals
from recall.io.atomic import make_output_dir

from . import layouts as lay
from . import matrix as mx
from . import workloads as wl

WorkloadName = enum.Enum("WorkloadName", {name: name for name in wl.WORKLOADS}, type=str)
WorkloadName.__doc__ = "Named workloads (see `recall bench --list`)."
GridName = enum.Enum("GridName", {name: name for name in mx.GRIDS}, type=str)
GridName.__doc__ = "Named matrix grids (see `recall bench --list --matrix NAME`)."
LayoutName = enum.Enum("LayoutName", {name: name for name in lay.LAYOUTS}, type=str)
LayoutName.__doc__ = "File layouts of the end-to-end rows."


class Device(str, enum.Enum):
    cpu = "cpu"
    gpu = "gpu"


class Metric(str, enum.Enum):
    ip = "ip"
    cosine = "cosine"
    l2 = "l2"


def _list_console() -> "object":
    from rich.console import Console

    console = Console()
    if not console.is_terminal and console.width < 160:
        console = Console(width=160)  # pipes and tests: wide enough that names are not folded
    return console


def _print_list(grid: str | None = None) -> None:
    from rich.table import Table

    console = _list_console()
    if grid is not None:
        g = mx.get(grid)
        names = mx.contender_names(["recall", "faiss", "cuvs", "torch"], g.device)
        total, per = mx.estimate(g, list(range(len(g.cells))), names)
        table = Table(title=f"recall bench --matrix {g.name}: {g.why} ({g.device}, repeat {g.repeat})")
        for col in ("#", "cell", "est. s"):
            table.add_column(col)
        for i, (c, t) in enumerate(zip(g.cells, per)):
            table.add_row(str(i), c.text, f"{t:.0f}")
        console.print(table)
        console.print(f"estimated {total / 60:.1f} min with {', '.join(names)}"
                      + (" on an H200" if g.device == "gpu" else " (rough)"))
        runs = mx.split(g, names)
        if len(runs) > 1:
            console.print("runs of about 8 minutes each: " + " ".join(f"--cells {r}" for r in runs))
        return
    table = Table(title="recall bench workloads")
    for col in ("name", "users x items x dim", "k", "kind", "where", "fp32 TFLOP", "why / status"):
        table.add_column(col)
    for w in wl.WORKLOADS.values():
        shape = f"{w.n_users:,} x {w.n_items:,} x {w.dim}"
        if w.candidates:
            shape = f"{w.n_users:,} x own {w.candidates:,} of {w.n_items:,} x {w.dim}"
        table.add_row(w.name, shape, f"{w.k:,}", w.kind_label, w.device, f"{w.flops / 1e12:.3g}",
                      w.why + (f" [{w.unsupported}]" if w.unsupported else ""))
    console.print(table)
    console.print("data kinds: " + ", ".join(k.value for k in wl.Kind) + " (--kind overrides a workload's default; "
                  "parameters as --kind 'skewed:user_sigma=0.8,centres=1024'); end to end from Parquet: --e2e with "
                  "--layout " + "/".join(lay.LAYOUTS))
    console.print("matrix grids (--matrix NAME, --list --matrix NAME for the cells): "
                  + "; ".join(f"{g.name} ({len(g.cells)} cells, {g.device}: {g.why})" for g in mx.GRIDS.values()))


def _command_line() -> list[str] | None:
    """``recall bench ...`` as typed, for the record; None when not run from a command line (tests)."""
    if "bench" not in sys.argv[1:]:
        return None
    return ["recall", *sys.argv[sys.argv.index("bench"):]]


def _fail(message: str, code: int) -> None:
    typer.echo(f"error: {one_line(message)}", err=True)
    raise typer.Exit(code)


def _make_out(out: Path) -> Path | None:
    """Create the ``--out`` folder before anything runs, so that a path that cannot be one fails at once, not after
    the run; return the topmost folder created here (None: it was there).

    Raises
    ------
    InputError
        When the folder cannot be created or written to.
    """
    top = None
    for p in (out, *out.parents):
        if p.exists():
            break
        top = p
    make_output_dir(out, f"--out {out}")
    return top


def _remove_if_empty(out: Path, top: Path | None) -> None:
    """Remove the folders :func:`_make_out` created, from ``out`` up to ``top``, where nothing was written in them."""
    if top is None:
        return
    for p in (out, *out.parents):
        try:
            p.rmdir()
        except OSError:
            return
        if p == top:
            return


def bench(
    workload: Annotated[Optional[list[WorkloadName]], typer.Option(
        "--workload", "-w", case_sensitive=False, help="Named workload; repeat for several (see --list).")] = None,
    kind: Annotated[Optional[str], typer.Option(
        help="Data kind, overriding each workload's default: " + ", ".join(k.value for k in wl.Kind)
        + "; with parameters as 'skewed:user_sigma=0.8,centres=1024'.")] = None,
    device: Annotated[Optional[Device], typer.Option(
        help="Where to run; default: the GPU when one is usable, else the CPU (a matrix: its grid's device).")] = None,
    contenders: Annotated[str, typer.Option(
        help="Comma-separated contender families: recall, faiss, cuvs, torch.")] = "recall,faiss,cuvs,torch",
    repeat: Annotated[Optional[int], typer.Option(
        min=1, help="Timed runs per contender (median reported), after a warm-up; default 3 (a matrix: its "
        "grid's; --cell: 2); up to 2 more where the slowest took over 1.1x the fastest.")] = None,
    out: Annotated[str, typer.Option(metavar="<path>", help="Folder for results.json, results.md and the PNGs.")]
    = "bench-out",
    sample_users: Annotated[Optional[int], typer.Option(
        min=1, help="Users checked against the float64 oracle (default 1,000; >= 1,000 recommended).")] = None,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the generated data and of the user sample.")] = 0,
    metric: Annotated[Metric, typer.Option(help="Score metric for every contender (a matrix cell has its own).")]
    = Metric.ip,
    ceilings: Annotated[bool, typer.Option(
        "--ceilings", help="Measure the GPU's FP32/TF32/BF16 matmul rates and copy bandwidth first.")] = False,
    e2e: Annotated[bool, typer.Option(
        "--e2e", help="Also time the end-to-end job (recall.jobs.score_files) from Parquet to Parquet.")] = False,
    layout: Annotated[Optional[list[LayoutName]], typer.Option(
        "--layout", case_sensitive=False, help="File layout of the --e2e rows, repeat for several: "
        + ", ".join(f"{x.name} ({x.why})" for x in lay.LAYOUTS.values()) + ".")] = None,
    matrix: Annotated[Optional[GridName], typer.Option(
        "--matrix", case_sensitive=False, help="Run a named grid of cells: " + ", ".join(mx.GRIDS)
        + " (see --list --matrix NAME).")] = None,
    cells: Annotated[Optional[str], typer.Option(
        help="With --matrix: which cells, e.g. '0:20', '20:', '3,5,7:9'.")] = None,
    cell: Annotated[Optional[list[str]], typer.Option(
        "--cell", help="Run your own cell, written as a matrix cell is: '<shape>[:<users>] d<dim> k<k> <metric> "
        "<kind>[:<param>=<value>,...] [x<exclusions per user>]', e.g. 'S1:20k d768 k100 cosine skewed'; repeat "
        "for several (they run as the grid 'custom').")] = None,
    max_minutes: Annotated[Optional[float], typer.Option(
        help="Start no further workload or cell once the run has taken this long (the rest: skipped).")] = None,
    users: Annotated[Optional[Path], typer.Option(
        help="Your own users Parquet (id, embedding); needs --items and --k.")] = None,
    items: Annotated[Optional[Path], typer.Option(help="Your own items Parquet.")] = None,
    k: Annotated[Optional[int], typer.Option(help="k for --users/--items, or to override the workloads' k.")] = None,
    list_: Annotated[bool, typer.Option(
        "--list", help="Print the workload table (with --matrix: that grid's cells) and exit.")] = False,
) -> None:
    """Benchmark exact top-k: this engine against FAISS, cuVS and torch, with recall@k checked against float64."""
    from . import report, runner

    console = report.make_console()
    if out in ("", "-"):
        # An unset variable in `--out "$OUT"` would otherwise be the current directory, whose pictures a run removes.
        _fail(f"--out {out!r}: expected the path of a folder", 2)
    out = Path(out)
    if out.is_file():
        _fail(f"--out {out}: is a file, expected a folder", 2)
    partial = out / report.PARTIAL_NAME
    created: Path | None = None
    checkpoints = 0

    def left() -> str:
        """What a run that stops early leaves behind, for its last line (an --out folder it created and left empty
        is removed)."""
        if checkpoints:
            earlier = [n for n in (report.JSON_NAME, report.MD_NAME) if (out / n).exists()]
            return (f"the finished workloads are in {partial}; {report.JSON_NAME} not written"
                    + (f" (the {' and '.join(earlier)} there {'are' if len(earlier) > 1 else 'is'} an earlier run's)"
                       if earlier else ""))
        _remove_if_empty(out, created)
        return f"nothing written to {out}"

    def bad_input(message: str) -> str:
        """An error's line: what was left only where the run had finished a workload (else nothing ran)."""
        if checkpoints:
            return f"{message}; {left()}"
        _remove_if_empty(out, created)
        return message

    try:
        with raising_signals():
            if list_:
                _print_list(matrix.value if matrix is not None else None)
                return
            grid, indices, settings = _plan(workload, kind, device, contenders, repeat, sample_users, seed, metric,
                                            ceilings, e2e, layout, matrix, cells, cell, max_minutes, users, items, k)
            created = _make_out(out)

            def log(msg: str) -> None:
                console.print(msg, style="dim", highlight=False)

            def checkpoint(doc: dict) -> None:
                nonlocal checkpoints
                report.write_partial(doc, partial)
                checkpoints += 1

            if grid is not None:
                doc = mx.run(grid, indices, settings, log=log, argv=_command_line(), checkpoint=checkpoint)
            else:
                doc = runner.run(settings, log=log, argv=_command_line(), checkpoint=checkpoint)
            report.print_table(doc, console)
            for name, what in report.write(doc, out).items():
                console.print(f"{name}: {what}", style="dim", highlight=False)
            partial.unlink(missing_ok=True)  # only now: results.json holds everything it did
    except InputError as exc:
        _fail(bad_input(str(exc)), 2)
    except BackendUnavailable as exc:
        _fail(bad_input(str(exc)), 1)
    except MemoryError as exc:
        _fail(f"out of host memory ({one_line(exc)}); {left()}", 1)
    except OSError as exc:
        if stdout_closed(exc):  # the reader of stdout has gone (`| head`): as every command, 141 and no line
            left()
            raise typer.Exit(EXIT_STDOUT_CLOSED) from None
        _fail(f"{os_error_line(exc)}; {left()}", 1)
    except Interrupted as exc:
        typer.echo(f"{exc}: {left()}", err=True)
        raise typer.Exit(exc.code) from None
    bad = runner.problems(doc)
    for line in bad:
        typer.echo(f"problem: {line}", err=True)
    if bad:
        raise typer.Exit(1)


def _plan(workload: list[Any] | None, kind: str | None, device: Device | None, contenders: str, repeat: int | None,
          sample_users: int | None, seed: int, metric: Metric, ceilings: bool, e2e: bool, layout: list[Any] | None,
          matrix: Any, cells: str | None, cell: list[str] | None, max_minutes: float | None, users: Path | None,
          items: Path | None, k: int | None) -> tuple[mx.Grid | None, list[int], Any]:
    """The grid (None: workloads), its chosen cells and the run's settings, from the options; nothing runs yet.

    Raises
    ------
    InputError
        Options that do not go together or values no run can use.
    BackendUnavailable
        ``--device gpu`` with ``--users/--items`` and no usable GPU.
    """
    from . import runner

    if (users is None) != (items is None):
        raise InputError("--users and --items go together")
    if users is not None and (workload or kind is not None):
        raise InputError("--users/--items bring their own data: --workload and --kind do not apply")
    if matrix is not None and (workload or users is not None or kind is not None or k is not None):
        raise InputError("--matrix runs its own cells: --workload, --users/--items, --kind and --k do not apply")
    if cell and (matrix is not None or workload or users is not None or kind is not None or k is not None):
        raise InputError("--cell runs its own cells: --matrix, --workload, --users/--items, --kind and --k do "
                         "not apply")
    if cells is not None and matrix is None:
        raise InputError("--cells selects cells of a --matrix")
    if layout and not e2e:
        raise InputError("--layout is the file layout of the --e2e rows: give --e2e too")
    if k is not None and k < 1:
        raise InputError(f"--k must be >= 1, got {k}")
    if max_minutes is not None and not max_minutes > 0:
        raise InputError(f"--max-minutes must be > 0, got {max_minutes}")
    grid = mx.get(matrix.value) if matrix is not None else None
    if cell:
        grid = mx.custom(cell, device.value if device is not None else None)
    if device is not None:
        dev = device.value
    elif grid is not None:
        dev = grid.device
    else:
        from recall.backends import cuda_status

        dev = "gpu" if cuda_status()[0] else "cpu"
    from .contenders import parse_families

    families = parse_families(contenders)
    data = {}
    chosen = []
    if users is not None:
        if k is None:
            raise InputError("--users/--items need --k")
        w, arrays = runner.load_parquet_workload(users, items, k, dev)
        chosen = [w]
        data[w.name] = arrays
    elif grid is None:
        if not workload and not ceilings:
            raise InputError("nothing to run: give --workload NAME (see --list), --matrix NAME, --users/--items, "
                             "or --ceilings")
        for name in workload or []:
            w = wl.get(name.value).with_kind(kind)
            if k is not None:
                w = dataclasses.replace(w, k=k)
            chosen.append(w)
    default_repeat = grid.repeat if grid is not None else 3
    default_sample = grid.sample_users if grid is not None else 1000
    settings = runner.Settings(workloads=chosen, device=dev, families=families,
                               repeat=repeat or default_repeat, seed=seed,
                               sample_users=sample_users or default_sample, metric=metric.value,
                               measure_ceilings=ceilings, e2e=e2e, data=data,
                               layouts=[x.value for x in layout] if layout else [lay.DEFAULT],
                               max_seconds=None if max_minutes is None else 60.0 * max_minutes)
    settings.validate()
    indices = mx.parse_cells(cells, len(grid.cells)) if grid is not None else []
    return grid, indices, settings
