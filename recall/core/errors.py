"""The error types of recall (each inherits the matching built-in so callers can catch either), and how an error
reads on one line."""
from __future__ import annotations

import os


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
