"""SIGTERM and SIGINT as an exception: the one signal policy of every command (``recall.cli.common.interruptible``
and ``recall bench``)."""
from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Interrupted(SystemExit):
    """SIGTERM (a scheduler's timeout, ``kill``, ``timeout``) or SIGINT (Ctrl-C) turned into an exception, raised in
    the main thread, so that the command unwinds: writers remove their temporary files, the batch job records its
    failure in ``_metrics.json`` and stops its workers. The exit status is 128 + the signal: 143 or 130. A
    ``SystemExit``, so that no ``except Exception`` (a contender's failure, a worker's) takes it for an error."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return "terminated by SIGTERM" if self.signum == signal.SIGTERM else "interrupted by SIGINT (Ctrl-C)"


@contextmanager
def raising_signals() -> Iterator[None]:
    """For the length of the block, SIGTERM and SIGINT raise :class:`Interrupted` in the main thread (a Ctrl-C that
    reached Python first, as ``KeyboardInterrupt``, comes out as one too); the previous handlers are back after.

    A second signal while the first unwinds exits at once (a temporary file may then stay: the next run into the
    directory removes it). Outside the main thread (an embedding that runs commands on a thread) signals are left
    alone.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if pending:
            os._exit(128 + signum)
        pending.append(signum)
        raise Interrupted(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    except KeyboardInterrupt:
        raise Interrupted(signal.SIGINT) from None
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)
