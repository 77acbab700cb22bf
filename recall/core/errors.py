"""The error types of recall (each inherits the matching built-in so callers can catch either), and how an error
reads on one line."""
from __future__ import annotations

import contextlib
import os
import sys


class RecallError(Exception):
    """Base class of every error recall raises on purpose."""


class InputError(RecallError, ValueError):
    """Bad data or arguments: the message names the file, row and id where there is one. CLI exit code 2."""


class ResourceError(RecallError, MemoryError):
    """The memory budget cannot be met even with the smallest tile; the message gives the numbers."""


class BackendUnavailable(RecallError, RuntimeError):
    """A GPU was asked for and none is usable; the message says why."""


def one_line(exc: BaseException | str) -> str:
    """An error's text (or any text) on one line; an exception without text reads as its type's name."""
    text = " ".join(str(exc).split())
    return text or (type(exc).__name__ if isinstance(exc, BaseException) else "")


def os_error_line(exc: OSError) -> str:
    """An OSError as ``{path}: {reason}`` (every OSError recall raises names its path; others are shown whole)."""
    if exc.filename is not None and exc.strerror:
        return one_line(f"{os.fsdecode(exc.filename)}: {exc.strerror}")
    return one_line(exc)


#: The exit status of a command whose stdout's reader has gone (``recall demo | head -1``): 128 + SIGPIPE, as a shell
#: reports a process killed by it.
EXIT_STDOUT_CLOSED = 141


def stdout_closed(exc: OSError) -> bool:
    """Whether ``exc`` is stdout's reader gone (a broken pipe without a path: the command's files are written by
    path). If so, stdout is pointed at the null device, so that nothing more is said to it, not even at exit."""
    if not isinstance(exc, BrokenPipeError) or exc.filename is not None:
        return False
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return True
