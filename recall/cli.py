"""The ``recall`` command line: ``recall score``, ``recall demo`` (and ``recall bench``, registered by recall.bench).

Errors the user can fix (bad files, rows, arguments; an unmet memory budget; no GPU) print one line,
``error: ...``, on stderr and exit with code 2, without a traceback. Progress goes to stderr, and only when stderr is a
terminal; the final summary goes to stdout.
"""
from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from . import __version__
from .errors import BackendUnavailable, InputError, ResourceError

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    help="Exact top-k recommendation candidates: every user against every item, on the GPU or the CPU.",
)

#: Exit code for bad input (data, arguments), an unmet memory budget or a missing GPU: the user can fix these.
EXIT_BAD_INPUT = 2
#: Exit code for operating-system failures that are not the input's fault (disk full, I/O error).
EXIT_OS_ERROR = 1

log = logging.getLogger("recall")


class Metric(str, Enum):
    ip = "ip"
    cosine = "cosine"
    l2 = "l2"


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    gpu = "gpu"


class Precision(str, Enum):
    exact = "exact"
    fast = "fast"


class Interests(str, Enum):
    max = "max"
    sum = "sum"


class Compression(str, Enum):
    """The output codecs, as ``recall.io.COMPRESSIONS`` lists them."""

    none = "none"
    snappy = "snappy"
    lz4 = "lz4"
    zstd = "zstd"


class _StderrHandler(logging.Handler):
    """Log records to whatever ``sys.stderr`` is at the time (test runners swap it per invocation)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # logging must never take the command down
            self.handleError(record)


@contextmanager
def _logging(quiet: bool, verbose: bool) -> Iterator[None]:
    """Show recall's notices on stderr for the length of a command, then put the logger back as it was.

    Scoped rather than global so that embedding the CLI (or running it under a test runner) leaves the
    ``recall`` logger's configuration to its owner.
    """
    handler = _StderrHandler()
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.ERROR if quiet else logging.INFO if verbose else logging.WARNING)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


@contextmanager
def _errors_to_exit() -> Iterator[None]:
    """Turn the errors a user can act on into ``error: ...`` on stderr and an exit code, never a traceback."""
    try:
        yield
    except (InputError, ResourceError, BackendUnavailable) as exc:
        typer.echo(f"error: {_one_line(exc)}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except OSError as exc:
        typer.echo(f"error: {_one_line(exc)}", err=True)
        raise typer.Exit(EXIT_OS_ERROR) from None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


# Options every Parquet command shares (score, rescore, batch), defined once.
MetricOption = Annotated[Metric, typer.Option("--metric", help="ip: inner product; cosine; l2: -||u - v||^2.")]
DeviceOption = Annotated[Device, typer.Option("--device", help="auto: the GPU when usable, else the CPU.")]
IdColOption = Annotated[str, typer.Option("--id-col", help="Id column of the embedding files.")]
VecColOption = Annotated[str, typer.Option("--vec-col", help="Vector column of the embedding files.")]
BatchSizeOption = Annotated[int | None, typer.Option(
    "--batch-size", help="Users per batch (default: sized from k and dim).", show_default=False)]
MemoryBudgetOption = Annotated[str | None, typer.Option(
    "--memory-budget", metavar="BYTES",
    help="Working memory of a search, e.g. 1073741824, 512MiB, 2G (default: a share of free memory).",
    show_default=False)]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar, no notices.")]


def parse_bytes(text: str | None) -> int | None:
    """``"1073741824"``, ``"512MiB"``, ``"2G"``, ``"1.5GB"`` -> bytes (binary multiples: K = 1024). None stays None.

    Raises
    ------
    InputError
        If the text is not a positive size.
    """
    if text is None:
        return None
    m = _SIZE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise InputError(f"--memory-budget must be a positive number of bytes (e.g. 1073741824, 512MiB, 2G), "
                         f"got {text!r}")
    scale = 1024 ** " kmgt".index((m.group(2) or " ").lower())
    return int(float(m.group(1)) * scale)


@contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar on stderr, fed by ``score_files``'s callback; None when disabled."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("users"), TimeElapsedColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("reading items", total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, description="scoring", completed=done, total=total)

        yield update


def _show_progress(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"recall {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.", is_eager=True,
                                          callback=_print_version)] = False,
) -> None:
    """Exact top-k recommendation candidates: every user against every item, on the GPU or the CPU."""


def _run_score(users: Path, items: Path, out: Path, k: int, metric: Metric, exclude: Path | None, id_col: str,
               vec_col: str, device: Device, batch_size: int | None, memory_budget: int | None, quiet: bool,
               verbose: bool, interests: Interests | None = None, precision: Precision = Precision.exact,
               compression: Compression = Compression.snappy) -> Any:
    from functools import partial

    if interests is not None:  # several vectors per user: recall/interests.py
        if precision is not Precision.exact:
            raise InputError("--precision fast applies to single-vector users; with --interests use --precision exact")
        from .interests import score_files as interest_files

        score_files = partial(interest_files, aggregate=interests.value)
    else:
        from .pipeline import score_files as single_files

        score_files = partial(single_files, precision=precision.value)

    with _progress(_show_progress(quiet)) as progress:
        summary = score_files(users, items, out, k, metric=metric.value, exclude_path=exclude, id_col=id_col,
                              vec_col=vec_col, device=device.value, batch_size=batch_size,
                              memory_budget=memory_budget, progress=progress, compression=compression.value)
    if summary.unknown_exclusions:
        typer.echo(f"warning: {summary.unknown_exclusions:,} of {summary.exclusion_pairs:,} exclusion pairs name a "
                   f"user or item id that is not in the input files; they were ignored", err=True)
    typer.echo(summary.line())
    if verbose:
        typer.echo(summary.stages_line())
    return summary


@app.command()
def score(
    users: Annotated[Path, typer.Option("--users", help="User embeddings Parquet (id + vector columns).",
                                        show_default=False)],
    items: Annotated[Path, typer.Option("--items", help="Item embeddings Parquet (id + vector columns).",
                                        show_default=False)],
    k: Annotated[int, typer.Option("--k", help="Items per user (>= 1).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Candidates Parquet to write (atomically).",
                                      show_default=False)],
    metric: MetricOption = Metric.ip,
    exclude: Annotated[Path | None, typer.Option(
        "--exclude", help="Parquet of user_id, item_id pairs (or user_id, item_ids lists) never to return.")] = None,
    id_col: IdColOption = "id",
    vec_col: VecColOption = "embedding",
    device: DeviceOption = Device.auto,
    batch_size: BatchSizeOption = None,
    memory_budget: MemoryBudgetOption = None,
    quiet: QuietOption = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also print per-stage times.")] = False,
    precision: Annotated[Precision, typer.Option(
        "--precision", help="exact: float32 scores; fast: float16 tensor-core scores with a certified exact "
        "re-rank (same answer; faster on GPUs).")] = Precision.exact,
    interests: Annotated[Interests | None, typer.Option(
        "--interests", help="Users have several vectors (ids repeated, or a list of vectors per row): an item's "
        "score is the max or the sum over them.", show_default=False)] = None,
    compression: Annotated[Compression, typer.Option(
        "--compression", help="Parquet codec of the output: snappy; lz4 (about as fast and small); zstd (level 1: "
        "~20% smaller than snappy, ~1.6x its encoding CPU); none (~35% larger, half the encoding CPU)."
    )] = Compression.snappy,
) -> None:
    """Score every user against every item and write each user's top-k items to Parquet."""
    with _logging(quiet, verbose), _errors_to_exit():
        if batch_size is not None and batch_size < 1:
            raise InputError(f"--batch-size must be >= 1, got {batch_size}")
        _run_score(users, items, out, k, metric, exclude, id_col, vec_col, device, batch_size,
                   parse_bytes(memory_budget), quiet, verbose, interests, precision, compression)


def sample_dir() -> Path:
    """The bundled sample: ``data/`` next to the ``recall`` package in a source checkout."""
    return Path(__file__).resolve().parent.parent / "data"


def _format_top(item_ids: list[Any], scores: list[float], n: int) -> str:
    return ", ".join(f"{i} ({s:.2f})" for i, s in zip(item_ids[:n], scores[:n]))


@app.command()
def demo(
    out: Annotated[Path, typer.Option("--out", help="Where to write the candidates Parquet.")]
    = Path("demo-candidates.parquet"),
    k: Annotated[int, typer.Option("--k", help="Items per user.")] = 10,
    device: Annotated[Device, typer.Option("--device", help="auto: the GPU when usable, else the CPU.")]
    = Device.auto,
    data: Annotated[Path | None, typer.Option(
        "--data", help="Directory with users/items/exclusions.parquet (default: the bundled sample).",
        show_default=False)] = None,
    n_users: Annotated[int, typer.Option("--show", help="How many users' top-5 to print (at least 1).")] = 3,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar, no notices.")] = False,
) -> None:
    """Score the bundled sample (3,000 users x 5,000 items, with exclusions) and show a few users' top items."""
    import pyarrow.parquet as pq

    with _logging(quiet, False), _errors_to_exit():
        data_dir = data if data is not None else sample_dir()
        names = ("users.parquet", "items.parquet", "exclusions.parquet")
        missing = [n for n in names if not (data_dir / n).is_file()]
        if missing:
            raise InputError(f"{data_dir}: the sample files {', '.join(missing)} are missing; run "
                             f"'python scripts/make_sample_data.py --out {data_dir}' from a source checkout, "
                             f"or pass --data DIR")
        summary = _run_score(data_dir / names[0], data_dir / names[1], out, k, Metric.ip, data_dir / names[2],
                             "id", "embedding", device, None, None, quiet, False)
        excluded_users = pq.read_table(data_dir / names[2], columns=["user_id"]).column("user_id").to_numpy()
        table = pq.read_table(out)
        rows = list(range(min(max(n_users, 1), table.num_rows)))
        # Show one user whose already-seen items were excluded, so the demo shows exclusions at work.
        with_excl = np.flatnonzero(np.isin(table.column("user_id").to_numpy(), excluded_users))
        if with_excl.size and not set(rows) & set(with_excl.tolist()) and rows:
            rows[-1] = int(with_excl[0])
        typer.echo(f"top-5 items (score) of {len(rows)} users; {k} per user written to {out}:")
        for row in table.take(rows).to_pylist():
            n_excl = int(np.count_nonzero(excluded_users == row["user_id"]))
            note = f"  [{n_excl} already-seen items excluded]" if n_excl else ""
            typer.echo(f"  user {row['user_id']}: {_format_top(row['item_ids'], row['scores'], 5)}{note}")
        if summary.exclusion_pairs:
            typer.echo(f"{summary.exclusion_pairs:,} (user, item) exclusion pairs applied from "
                       f"{data_dir / names[2]}")


def main() -> None:
    """Entry point of the ``recall`` console script and of ``python -m recall``."""
    app()


from recall.bench.cli import register as _register_bench  # noqa: E402 - bench adds its commands to this app

_register_bench(app)

from recall.ops_cli import register as _register_ops  # noqa: E402 - doctor and tune add their commands to this app

_register_ops(app)
from recall.batch_cli import register as _register_batch  # noqa: E402 - `recall batch` (recall/batch_cli.py)

_register_batch(app)
from recall.rescore_cli import register as _register_rescore  # noqa: E402 - `recall rescore` (recall/rescore_cli.py)

_register_rescore(app)
