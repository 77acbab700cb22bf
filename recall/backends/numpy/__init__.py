"""The CPU backend (NumPy BLAS + numba heap kernels)."""
from .backend import NumpyBackend, blas_name, blas_summation, cpu_model

__all__ = ["NumpyBackend", "blas_name", "blas_summation", "cpu_model"]
