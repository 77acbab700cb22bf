"""SIGTERM and SIGINT as an exception: the one signal policy of every command (``recall.cli.common.interruptible``
and ``recall bench``)."""
from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


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
def raising_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[None]:
    """For the length of the block, ``signals`` (SIGTERM and SIGINT) raise :class:`Interrupted` in the main thread (a
    Ctrl-C that reached Python first, as ``KeyboardInterrupt``, comes out as one too); the previous handlers are back
    after.

    A second signal while the first unwinds exits at once (a temporary file may then stay: the next run into the
    directory removes it). A signal that arrives while a C library runs a Python callback (numba compiling, through
    llvmlite's ctypes callbacks) raises there, where Python only reports the exception ("Exception ignored on calling
    ctypes callback function") and goes on: it is sent again a moment later, from another thread, so that it
    unwinds the command at its next line outside the callback, and nothing is printed for it. Outside the main
    thread (an embedding that runs commands on a thread) signals are left alone.
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

    def unraisable(info: Any) -> None:
        exc = info.exc_value
        if isinstance(exc, Interrupted) and pending:
            pending.clear()  # not a second signal: the first, again
            threading.Timer(_RESEND_S, os.kill, (os.getpid(), exc.signum)).start()
            return
        previous_hook(info)

    previous_hook = sys.unraisablehook
    sys.unraisablehook = unraisable
    old = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    except KeyboardInterrupt:
        raise Interrupted(signal.SIGINT) from None
    finally:
        restore_signals(old)
        sys.unraisablehook = previous_hook


#: Seconds after which a signal swallowed by a C callback is sent again (:func:`raising_signals`).
_RESEND_S = 0.001


#: What a signal after a command's work says (:func:`after_command`): set by :func:`when_done`, and by
#: :func:`command_began` to a neutral line.
_done_line: list = []


def command_line_starts() -> None:
    """``recall.cli.main`` starts: no command has begun yet (a process that ran commands before, in tests)."""
    _done_line.clear()


def command_began() -> None:
    """A command has begun (``recall.cli.common.interruptible``): a signal after it is no longer "nothing done"."""
    if not _done_line:
        _done_line.append(lambda exc: f"{exc}, after the command had ended")


def when_done(message: Callable[[Interrupted], str]) -> None:
    """The line a signal prints once the running command has finished its work (:func:`after_command`): the batch
    job's "the job is complete (…/_SUCCESS)"."""
    _done_line[:] = [message]


def after_command(exc: Interrupted) -> str:
    """The line of a signal that arrived outside a command's own handling: before it began ("nothing done"), or
    after it ended (:func:`when_done`'s)."""
    return _done_line[0](exc) if _done_line else f"{exc}: nothing done"


def exit_on_signal() -> dict:
    """From now until the process exits, SIGTERM and SIGINT print :func:`after_command`'s line on stderr and exit at
    once with 128 + the signal: for a process whose command has returned and which is only shutting down (joining
    its threads, flushing), where the signals' defaults would kill it without a word (SIGTERM) or print a traceback
    (SIGINT). Returns the handlers it replaced (:func:`restore_signals`). Outside the main thread, nothing."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum: int, frame: object) -> None:
        try:
            sys.stderr.write(after_command(Interrupted(signum)) + "\n")
            sys.stderr.flush()
        finally:
            os._exit(128 + signum)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def restore_signals(handlers: dict) -> None:
    """Put back the handlers :func:`exit_on_signal` (or :func:`raising_signals`) replaced."""
    for sig, previous in handlers.items():
        signal.signal(sig, previous)

