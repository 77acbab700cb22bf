"""Argument checks shared by every boundary (engine, jobs, CLI): one rule for each kind of argument."""
from __future__ import annotations

from typing import Any

import numpy as np

from .errors import InputError

#: Where an engine runs: "auto" takes the GPU when one is usable and otherwise the CPU (saying so once).
DEVICES = ("auto", "cpu", "gpu")
PRECISIONS = ("exact", "fast")


def is_int(value: Any) -> bool:
    """True for Python and NumPy integers, False for bools (``True`` is no count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(value: Any, what: str, minimum: int = 1) -> int:
    """``value`` as an int, or InputError unless it is an integer >= ``minimum``."""
    if not is_int(value) or value < minimum:
        raise InputError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_batch_size(value: Any, what: str = "batch_size") -> int:
    """``value`` as an int, or InputError unless it is an integer from 1 to 2^31 - 1 (more users than any batch holds
    at once: a reader's batch of rows)."""
    value = check_int(value, what)
    if value >= 2 ** 31:
        raise InputError(f"{what} must be below 2^31, got {value:,}")
    return value


def check_k(k: Any) -> int:
    """``k`` as an int, or InputError unless it is an integer >= 1 that a result can hold (an (n, k) array)."""
    k = check_int(k, "k")
    if k >= 2 ** 31:
        raise InputError(f"k must be below 2^31 (the largest catalogue row), got {k:,}")
    return k


def check_choice(value: Any, choices: tuple[str, ...], what: str) -> str:
    """``value`` if it is one of ``choices``, else InputError naming them."""
    if not isinstance(value, str) or value not in choices:
        raise InputError(f"unknown {what} {value!r}: expected one of {', '.join(choices)}")
    return value


def check_budget(value: Any, what: str = "memory_budget") -> int | None:
    """A memory budget in bytes (a positive integer), or None for the default."""
    if value is None:
        return None
    return check_int(value, what)
