"""Slowing a job down from outside, so that a test's kill lands mid-shard: ``run_batch(after_batch=pace)`` (a
module-level function, so that spawned workers can import it), and ``python -m pacing batch ...``, the CLI with every
job paced (the subprocess tests put this folder on PYTHONPATH). ``python -m pacing score ...`` (or ``rescore``,
``demo``) paces the one-file commands: each table handed to the candidates writer waits first, so the temporary file
exists, half written, for a while."""
from __future__ import annotations

import functools
import sys
import time

PACE_S = 0.05


def pace() -> None:
    """Run in the worker after each batch it writes."""
    time.sleep(PACE_S)


def main(argv: list[str]) -> None:
    """``recall`` with ``recall batch`` paced, and every candidates file written slowly."""
    import recall.cli.batch as batch_cli
    from recall.cli.app import app
    from recall.io.writer import CandidateWriter

    batch_cli.run_batch = functools.partial(batch_cli.run_batch, after_batch=pace)
    if argv and argv[0] != "batch":
        write = CandidateWriter.write

        def slow_write(self: CandidateWriter, table: object) -> None:
            pace()
            write(self, table)

        CandidateWriter.write = slow_write
    sys.argv = ["recall", *argv]
    app()


if __name__ == "__main__":
    main(sys.argv[1:])
