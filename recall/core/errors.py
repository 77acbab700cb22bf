"""The error types of recall. Each inherits the matching built-in so callers can catch either."""


class RecallError(Exception):
    """Base class of every error recall raises on purpose."""


class InputError(RecallError, ValueError):
    """Bad data or arguments: the message names the file, row and id where there is one. CLI exit code 2."""


class ResourceError(RecallError, MemoryError):
    """The memory budget cannot be met even with the smallest tile; the message gives the numbers."""


class BackendUnavailable(RecallError, RuntimeError):
    """A GPU was asked for and none is usable; the message says why."""
