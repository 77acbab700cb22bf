"""recall: exact batch top-k recommendation candidates, every user against every item, on the GPU or the CPU."""
from .errors import BackendUnavailable, InputError, RecallError, ResourceError
from .result import SearchResult
from .engine import Engine
from .io import Embeddings, read_embeddings

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "Embeddings",
    "Engine",
    "InputError",
    "RecallError",
    "ResourceError",
    "SearchResult",
    "read_embeddings",
    "__version__",
]
