"""What every ``recall`` command shares: the choices, the options defined once, the error and logging policy.

Errors the user can fix (bad files, rows, arguments; an unmet memory budget; no GPU) print one line,
``error: ...``, on stderr and exit with code 2, without a traceback; operating-system failures print one line naming
the path and exit with 1. SIGTERM and SIGINT (Ctrl-C) stop a command the same way everywhere (:func:`interruptible`):
its temporary files are removed, one line says what was left, and the exit code is 143 or 130. Progress goes to
stderr, and only when stderr is a terminal; the final summary goes to stdout.
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

import typer

from ..core.errors import (EXIT_STDOUT_CLOSED, BackendUnavailable, InputError, ResourceError, one_line,
                           os_error_line, stdout_closed)
from ..core.signals import Interrupted, command_began, raising_signals
from ..core.version import __version__

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


class Aggregate(str, Enum):
    """``--interests``: how a user's interest scores combine."""

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
def logging_to_stderr(quiet: bool, verbose: bool) -> Iterator[None]:
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


@contextmanager
def errors_to_exit() -> Iterator[None]:
    """Turn the errors a user can act on into ``error: ...`` on stderr and an exit code, never a traceback."""
    try:
        yield
    except (InputError, ResourceError, BackendUnavailable) as exc:
        typer.echo(f"error: {one_line(exc)}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except OSError as exc:
        if stdout_closed(exc):
            raise typer.Exit(EXIT_STDOUT_CLOSED) from None
        typer.echo(f"error: {os_error_line(exc)}", err=True)
        raise typer.Exit(EXIT_OS_ERROR) from None
    except MemoryError as exc:
        typer.echo(f"error: out of host memory ({one_line(exc)}); pass a smaller --batch-size or --memory-budget",
                   err=True)
        raise typer.Exit(EXIT_OS_ERROR) from None


@contextmanager
def interruptible(message: Callable[[Interrupted], str]) -> Iterator[None]:
    """Every command's signal policy (``recall.core.signals.raising_signals``): SIGTERM and SIGINT raise
    :class:`Interrupted` in the main thread; once the command has unwound, ``message(exc)`` is printed as one line on
    stderr and the command exits with 143 / 130."""
    command_began()
    try:
        with raising_signals():
            yield
    except Interrupted as exc:
        typer.echo(message(exc), err=True)
        raise typer.Exit(exc.code) from None


def nothing_written(out: object) -> Callable[[Interrupted], str]:
    """The interruption line of a command that writes one file atomically."""
    return lambda exc: f"interrupted: nothing written to {out}; rerun to start again"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def input_file(flag: str, help: str) -> Any:
    """The option of an input file. recall's reader checks the path itself (missing, a directory, unreadable, a loop
    of links) and says so on one ``error:`` line; click's own readability check would print a usage error."""
    return typer.Option(flag, help=help, show_default=False, readable=False)


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
ItemMemoryOption = Annotated[str | None, typer.Option(
    "--item-memory", metavar="BYTES",
    help="Device memory the items may take, e.g. 20G; a larger catalogue stays in host memory and is streamed to "
         "the device in segments at every batch (same output). Default: what the device holds.",
    show_default=False)]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar, no notices.")]
ExcludeOption = Annotated[Path | None, input_file(
    "--exclude", "Parquet of user_id, item_id pairs (or user_id, item_ids lists) never to return.")]
AllowOption = Annotated[Path | None, input_file(
    "--allow", "Parquet with an item_id column: only these items may be returned (to every user).")]
DenyOption = Annotated[Path | None, input_file(
    "--deny", "Parquet with an item_id column: these items are never returned (to any user).")]
AllowEmptyOption = Annotated[bool, typer.Option(
    "--allow-empty", help="Write an empty output when the users file has no rows (default: refuse, exit 2, and "
                          "leave the previous output as it was).")]


def parse_bytes(text: str | None, option: str = "--memory-budget") -> int | None:
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
        raise InputError(f"{option} must be a positive number of bytes (e.g. 1073741824, 512MiB, 2G), got {text!r}")
    scale = 1024 ** " kmgt".index((m.group(2) or " ").lower())
    value = int(float(m.group(1)) * scale)
    if value < 1:
        raise InputError(f"{option} must be at least 1 byte (e.g. 1073741824, 512MiB, 2G), got {text!r}")
    return value


@contextmanager
def progress_bar(enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar on stderr, fed by a job's ``progress`` callback; None when disabled."""
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


def show_progress(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


def say_first_run(quiet: bool, device: str) -> None:
    """On a terminal, say why the first run after an install pauses for seconds before anything moves (the CPU
    kernels compile); nothing in scripts and pipes, whose output stays as documented."""
    if show_progress(quiet):
        from .. import backends

        line = backends.first_run_notice(device)
        if line:
            typer.echo(line, err=True)


def print_version(value: bool) -> None:
    if value:
        typer.echo(f"recall {__version__}")
        raise typer.Exit(0)
