"""The resident item matrix of a GPU engine, and what the backend derives from it once."""
from __future__ import annotations

from typing import Any

import numpy as np

from ...core.metrics import row_norms
from ..tiled import sample_rows

#: Tile geometry of recall_fused_filter (fused.cu): 128 x 128 scores per tile, 32 dimensions per chunk.
FUSED_TILE = 128
FUSED_CHUNK = 32
#: Auxiliary columns a threshold sample's margin takes one by one at most (topk.cu's RECALL_SEED_AUX).
SEED_AUX_MAX = 8


class DeviceItems:
    """Items on the device: ``vecs`` (n_items, dim) (float32, or float16 for fast mode), and, built on first use
    and kept as long as the engine holds this object, their transposed copy for the fused kernel, their norms and
    their threshold samples. ``norms_rank``: an item's norm bounds its score (the inner product), so that samples
    take half their rows from the largest norms (``tiled.sample_rows``). ``seed_columns`` (D, M): the first D
    columns are the dot part and the next M auxiliary ones, taken one by one by a sample's margins
    (``Backend.load_items``); None: every column is the dot part."""

    def __init__(self, vecs: Any, norms_rank: bool = False, seed_columns: tuple[int, int] | None = None) -> None:
        self.vecs = vecs
        self.norms_rank = norms_rank
        width = int(vecs.shape[1])
        dot, aux = seed_columns if seed_columns is not None else (width, 0)
        if not (0 <= dot and 0 <= aux <= SEED_AUX_MAX and dot + aux <= width):
            dot, aux = width, 0  # columns the kernel cannot take one by one: the whole norm, as always valid
        self.seed_columns = (dot, aux)
        self._transposed: Any = None
        self._norms: Any = None
        self._samples: dict[tuple[int, int, bool], Any] = {}

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

    def sample(self, size: int, n_items: int, stream: Any, even: bool = False) -> tuple[Any, Any, Any]:
        """The threshold sample of ``size`` of the first ``n_items`` items: (its sorted int64 device rows,
        ``tiled.sample_rows``, half of them the largest norms of the dot part where ``norms_rank`` unless ``even``;
        their dot part's float32 norms, rounded up, and their M auxiliary columns' magnitudes, (M, size) float32 (M =
        ``seed_columns[1]``, possibly 0), for ``certificate.seed_margin``), computed on ``stream`` the first time;
        the same arrays (so the same addresses, which a captured graph reads) for as long as this object lives."""
        ranked = self.norms_rank and not even
        key = (size, n_items, ranked)
        got = self._samples.get(key)
        if got is None:
            import cupy

            dot, aux = self.seed_columns
            with stream:
                if self._norms is None:
                    self._norms = row_norms(cupy, self.vecs[:, :dot])
                norms = self._norms[:n_items]
                rows = sample_rows(cupy, n_items, size, norms if ranked else None)
                exact = norms[rows]
                rounded = exact.astype(cupy.float32)
                # float16 and float32 values are exact in float32: their magnitudes need no rounding.
                mags = cupy.ascontiguousarray(cupy.abs(self.vecs[rows, dot:dot + aux].T).astype(cupy.float32))
                got = (rows, cupy.where(rounded < exact, cupy.nextafter(rounded, cupy.float32(np.inf)), rounded),
                       mags)
            self._samples[key] = got
        return got
