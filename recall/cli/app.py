"""The ``recall`` command line: one app, each command group in a module of its own (none imports this one)."""
from __future__ import annotations

import sys
from typing import Annotated

import typer

from ..bench.cli import bench
from . import batch, ops, rescore, score
from .common import EXIT_STDOUT_CLOSED, print_version, stdout_closed

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    # Plain click help: typer's rich panels print "<bool>" after every flag, as if it took a value.
    rich_markup_mode=None,
    help="Exact top-k recommendation candidates: every user against every item, on the GPU or the CPU.",
)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.", is_eager=True,
                                          callback=print_version)] = False,
) -> None:
    """Exact top-k recommendation candidates: every user against every item, on the GPU or the CPU."""


app.command("score")(score.score)
app.command("demo")(score.demo)
app.command("rescore")(rescore.rescore)
app.command("batch")(batch.batch)
app.command("doctor")(ops.doctor)
app.command("tune")(ops.tune)
app.command("bench")(bench)


def main() -> None:
    """Entry point of the ``recall`` console script and of ``python -m recall``."""
    try:
        try:
            app()
        finally:
            sys.stdout.flush()  # here rather than at exit, so that a closed stdout is met below
    except BrokenPipeError as exc:
        if not stdout_closed(exc):
            raise
        raise SystemExit(EXIT_STDOUT_CLOSED) from None
