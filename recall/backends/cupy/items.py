"""The resident item matrix of a GPU engine, and what the backend derives from it once."""
from __future__ import annotations

from typing import Any

import numpy as np

#: Tile geometry of recall_fused_filter (fused.cu): 128 x 128 scores per tile, 32 dimensions per chunk.
FUSED_TILE = 128
FUSED_CHUNK = 32


class DeviceItems:
    """Items on the device: ``vecs`` (n_items, dim) (float32, or float16 for fast mode), and, built on first use
    and kept as long as the engine holds this object, their transposed copy for the fused kernel."""

    def __init__(self, vecs: Any) -> None:
        self.vecs = vecs
        self._transposed: Any = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.vecs.shape)

    @property
    def dtype(self) -> Any:
        return self.vecs.dtype

    def transposed(self, stream: Any) -> Any:
        """The items transposed into (dim rounded up to 32, rows rounded up to 128), zero-padded: the fused
        kernel's operand, filled on ``stream`` the first time."""
        if self._transposed is None:
            import cupy

            n_items, dim = self.vecs.shape
            shape = (-(-dim // FUSED_CHUNK) * FUSED_CHUNK, -(-n_items // FUSED_TILE) * FUSED_TILE)
            with stream:
                items_t = cupy.zeros(shape, np.float32)
                items_t[:dim, :n_items] = self.vecs.T
            self._transposed = items_t
        return self._transposed
