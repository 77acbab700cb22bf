"""The ``recall`` command line (``recall.cli.app``): one module per command group."""
from __future__ import annotations

import sys

from ..core.signals import Interrupted, raising_signals


def main() -> None:
    """Entry point of the ``recall`` console script and of ``python -m recall``. Loading the command line
    (``recall.cli.app``: typer, NumPy, pyarrow, the engine) takes most of a second; a SIGTERM or a Ctrl-C meanwhile
    stops it with one line and the signal's exit status (143 or 130), as it stops a command (docs/errors.md), where
    it printed a traceback (or, for SIGTERM, nothing)."""
    try:
        with raising_signals():
            from .app import main as run
    except Interrupted as exc:
        print(f"{exc}: nothing done", file=sys.stderr)
        raise SystemExit(exc.code) from None
    run()
