"""cuBLAS strided-batched GEMMs through CuPy's bindings, and through ctypes while a stream is being captured into a
CUDA graph (CuPy's bindings refuse cuBLAS calls during capture; cuBLAS itself allows them)."""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

_OP_N, _OP_T = 0, 1
_CUDA_R_32F, _CUDA_R_16F = 0, 2
_CUBLAS_COMPUTE_32F = 68  # float32 accumulation (not the _FAST_16F variant, which would accumulate in float16)
_CUBLAS_GEMM_DEFAULT = -1
_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)

_P, _I, _LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
_ARGTYPES = {
    "cublasSgemmStridedBatched": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _LL, _P, _I, _LL, _P, _P, _I, _LL, _I],
    "cublasGemmStridedBatchedEx": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _LL, _P, _I, _I, _LL, _P, _P, _I, _I, _LL,
                                   _I, _I, _I],
}
_lib: Any = None


def _captured(stream_ptr: int, name: str, args: tuple) -> None:
    """Call cuBLAS function ``name`` through ctypes, on the libcublas CuPy has loaded (found in /proc/self/maps),
    on the stream being captured."""
    global _lib
    if _lib is None:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libcublas.so" in line})
        if not paths:
            raise RuntimeError("libcublas is not loaded in this process")
        lib = ctypes.CDLL(paths[0])
        lib.cublasSetStream_v2.argtypes = [_P, _P]
        lib.cublasSetPointerMode_v2.argtypes = [_P, _I]
        for fn, types in _ARGTYPES.items():
            getattr(lib, fn).argtypes = types
        _lib = lib
    handle = args[0]
    for status in (_lib.cublasSetStream_v2(handle, stream_ptr), _lib.cublasSetPointerMode_v2(handle, 0),
                   getattr(_lib, name)(*args)):
        if status != 0:
            raise RuntimeError(f"cuBLAS call failed during graph capture: status {status}")


def gemm_strided_batched(handle: int, users: Any, items: Any, out: Any, half_alpha: np.ndarray,
                         capture_stream: int | None) -> None:
    """``out[b] = users[b or 0] @ items[b].T`` for every batch ``b``, in one strided-batched GEMM on the current
    stream (``capture_stream``: the stream being captured, whose calls must go through ctypes).

    users : (1 or n_tiles, n_users_block, dim) float32, or float16 (then items are float16 too: tensor cores, float32
    accumulation, and ``out`` float32, or float16 scaled by ``half_alpha``, a host scalar kept alive by the caller:
    a captured graph holds a pointer to it); items : (n_tiles, tile_width, dim); out : (n_tiles, n_users_block,
    tile_width). All CuPy arrays.

    cuBLAS is column-major: a row-major (n, T) tile is a column-major (T, n) matrix, so each batch computes
    ``out[b]ᵀ = items[b] · usersᵀ``: A = items[b] (column-major d x T, transposed), B = users (d x n).
    """
    from cupy_backends.cuda.libs import cublas

    tiles, width, dim = items.shape
    n = users.shape[1]
    stride_users = 0 if users.shape[0] == 1 else n * dim
    if n == 1 and stride_users == 0 and items.flags.c_contiguous and out.flags.c_contiguous:
        # One user against consecutive tiles: their scores are one contiguous row, so one GEMM of all the rows
        # (a matrix-vector product, which cuBLAS runs at memory speed) instead of a batch of thin ones.
        tiles, width = 1, tiles * width
    if users.dtype == np.float16:
        half_out = out.dtype == np.float16
        alpha = half_alpha if half_out else _ONE
        name = "cublasGemmStridedBatchedEx"
        args = (handle, _OP_T, _OP_N, width, n, dim,
                alpha.ctypes.data, items.data.ptr, _CUDA_R_16F, dim, width * dim,
                users.data.ptr, _CUDA_R_16F, dim, stride_users,
                _ZERO.ctypes.data, out.data.ptr, _CUDA_R_16F if half_out else _CUDA_R_32F, width, n * width,
                tiles, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
        call = cublas.gemmStridedBatchedEx
    else:
        name = "cublasSgemmStridedBatched"
        args = (handle, _OP_T, _OP_N, width, n, dim,
                _ONE.ctypes.data, items.data.ptr, dim, width * dim,
                users.data.ptr, dim, stride_users,
                _ZERO.ctypes.data, out.data.ptr, width, n * width,
                tiles)
        call = cublas.sgemmStridedBatched
    if capture_stream is not None:
        _captured(capture_stream, name, args)
        return
    cublas.setPointerMode(handle, 0)  # alpha and beta are host scalars (CuPy may leave device mode set)
    call(*args)
