"""recall: exact batch top-k recommendation candidates, every user against every item, on the GPU or the CPU."""
from .core.errors import BackendUnavailable, InputError, RecallError, ResourceError
from .core.options import EngineOptions
from .core.results import SearchResult
from .core.version import __version__
from .engine import Engine
from .io import Embeddings, read_embeddings

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
