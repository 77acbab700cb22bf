"""The GPU backend (CuPy: cuBLAS, recall's own CUDA kernels, streams, CUDA graphs, pinned staging): the only part of
recall that imports CuPy. Importing this package does not import CuPy; creating a :class:`CupyBackend` does."""
from .backend import CupyBackend, is_device_array
from .probe import cuda_status

__all__ = ["CupyBackend", "cuda_status", "is_device_array"]
