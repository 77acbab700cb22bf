"""The ``recall`` command line (``recall.cli.app``): one module per command group."""
from __future__ import annotations

import sys

from ..core.signals import (Interrupted, after_command, command_line_starts, exit_on_signal, raising_signals,
                            restore_signals)


def main() -> None:
    """Entry point of the ``recall`` console script and of ``python -m recall``. Loading the command line
    (``recall.cli.app``: typer, NumPy, pyarrow, the engine) takes most of a second, and parsing the arguments some
    more; a SIGTERM or a Ctrl-C meanwhile stops it with one line and the signal's exit status (143 or 130), as it
    stops a command (docs/errors.md), where it printed a traceback (or, for SIGTERM, nothing). So does one while the
    process shuts down after its command (``exit_on_signal``): its handlers stay once the command line returns."""
    command_line_starts()
    # The handlers the command line's own give way to when it is done (the process then shuts down), installed first
    # so that no signal finds the defaults in between.
    before = exit_on_signal()
    try:
        with raising_signals():
            from .app import main as run

            run()
    except Interrupted as exc:
        # A command handles its own signals (``recall.cli.common.interruptible``): this one came before it began, or
        # after it ended.
        restore_signals(before)
        print(after_command(exc), file=sys.stderr)
        raise SystemExit(exc.code) from None
