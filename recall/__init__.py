"""recall: exact batch top-k recommendation candidates, every user against every item, on the GPU or the CPU.

The names below are imported on first use (PEP 562), so that ``import recall`` and the command line's entry point are
cheap: an interruption while the heavy modules load is then the command line's to report (``recall.cli.main``).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .core.version import __version__

if TYPE_CHECKING:
    from .core.errors import BackendUnavailable, InputError, RecallError, ResourceError
    from .core.options import EngineOptions
    from .core.results import SearchResult
    from .engine import Engine
    from .io import Embeddings, read_embeddings

#: Each public name and the module that defines it.
_HOMES = {
    "BackendUnavailable": ".core.errors",
    "InputError": ".core.errors",
    "RecallError": ".core.errors",
    "ResourceError": ".core.errors",
    "EngineOptions": ".core.options",
    "SearchResult": ".core.results",
    "Engine": ".engine",
    "Embeddings": ".io",
    "read_embeddings": ".io",
}

__all__ = [
    "BackendUnavailable",
    "Embeddings",
    "Engine",
    "EngineOptions",
    "InputError",
    "RecallError",
    "ResourceError",
    "SearchResult",
    "read_embeddings",
    "__version__",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
