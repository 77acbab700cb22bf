"""The resident item matrix of a GPU engine, and what the backend derives from it once."""
from __future__ import annotations

from typing import Any

import numpy as np

from ...core.metrics import row_norms
from ..tiled import ranked_rows, sample_rows

#: Items whose norms spread less than this (their standard deviation over their mean) rank a threshold sample by norm
#: (the inner product) no better than evenly for most users' best items (``DeviceItems.loose_ranking``): i.i.d. normal
#: rows 0.06-0.12 (d = 128 to 32), log-normal norms (clustered, skewed) 0.53, popular 1.2-1.7.
CLOSE_NORMS_SPREAD = 0.25
#: Tile geometry of recall_fused_filter (fused.cu): 128 x 128 scores per tile, 32 dimensions per chunk.
FUSED_TILE = 128
FUSED_CHUNK = 32


class DeviceItems:
    """Items on the device: ``vecs`` (n_items, dim) (float32, or float16 for fast mode), and, built on first use
    and kept as long as the engine holds this object, their transposed copy for the fused kernel, their norms and
    their threshold samples. ``norms_rank``: an item's norm bounds its score (the inner product), so that samples
    take half their rows from the largest norms (``tiled.sample_rows``); ``ranks`` (n_items,) device values: half
    from the largest of those instead (``metrics.centroid_ranks``). ``constant_column`` (column, value): a column
    every item holds that value in, left out of the norms; ``bias_columns`` (first, end): columns whose products a
    threshold sample's margin bounds on their own (``Backend.load_items``)."""

    def __init__(self, vecs: Any, norms_rank: bool = False, constant_column: tuple[int, float] | None = None,
                 bias_columns: tuple[int, int] | None = None, ranks: Any = None) -> None:
        self.vecs = vecs
        self.norms_rank = norms_rank
        self.ranks = ranks
        self.constant_column = constant_column
        self.bias_columns = bias_columns
        self._transposed: Any = None
        self._norms: Any = None
        self._split: Any = None  # DeviceItems._split_norms, made once where there are bias columns
        self._samples: dict[tuple[int, int, bool], Any] = {}
        #: Per ranked sample made ((size, n_items)): how many of its rows it keeps evenly spaced (every n-th of
        #: them, ``tiled.probed_even_every``).
        self.even_every: dict[tuple[int, int], int] = {}
        self._loose: bool | None = None

    @property
    def ranked(self) -> bool:
        """Whether threshold samples take half their rows from the items ranked first (by ``ranks``, else by norm
        where ``norms_rank``) unless asked for evenly spaced rows."""
        return self.norms_rank or self.ranks is not None

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

    def loose_ranking(self, stream: Any) -> bool:
        """Whether samples ranked by norm (``norms_rank`` without ``ranks``) sort few of a user's best items first:
        the items' norms spread less than CLOSE_NORMS_SPREAD. Read once (a copy to the host, on ``stream``), then
        kept."""
        if self._loose is None:
            self._loose = False
            if self.norms_rank and self.ranks is None and self.vecs.shape[0] > 1:
                import cupy

                with stream:
                    norms = self._item_norms()
                    mean, std = cupy.stack((norms.mean(), norms.std())).get()  # one copy to the host
                self._loose = bool(mean > 0 and std < CLOSE_NORMS_SPREAD * mean)
        return self._loose

    @property
    def _constant(self) -> set:
        """The constant column, a set of it (left out of the norms), or an empty set."""
        return set() if self.constant_column is None else {self.constant_column[0]}

    def _item_norms(self) -> Any:
        """Each item's float64 norm without the constant column, made once (on the caller's stream)."""
        if self._norms is None:
            import cupy

            self._norms = norms_without(cupy, self.vecs, self._constant)
        return self._norms

    def sample(self, size: int, n_items: int, stream: Any, even: bool = False, users: Any = None,
               rank: int = 0) -> tuple[Any, Any, Any]:
        """The threshold sample of ``size`` of the first ``n_items`` items: (its sorted int64 device rows,
        ``tiled.sample_rows``, some of them those ranked first (``ranked``) unless ``even``: how many, found from a
        probe of the first search's prepared ``users`` (host or device rows of the items' width) started at their
        ``rank``-th best of it (``tiled.probed_even_every``, kept in ``even_every``); their float32
        norms, rounded up, for ``certificate.seed_margin``, the ``constant_column`` and the ``bias_columns`` left out;
        their sums of |v| over the ``bias_columns``, rounded up, or None without them), computed on ``stream`` the
        first time; the same arrays (so the same addresses, which a captured graph reads) for as long as this object
        lives."""
        ranked = self.ranked and not even
        key = (size, n_items, ranked)
        got = self._samples.get(key)
        if got is None:
            import cupy

            with stream:
                norms = self._item_norms()[:n_items]
                if ranked:
                    order = self.ranks[:n_items] if self.ranks is not None else norms
                    rows, self.even_every[(size, n_items)] = ranked_rows(cupy, users, self.vecs, n_items, size,
                                                                         order, rank)
                else:
                    rows = sample_rows(cupy, n_items, size)
                if self.bias_columns is None:
                    got = (rows, _up32(cupy, norms[rows]), None)
                else:
                    if self._split is None:  # each row's norm without those columns too, its sum of |v| over them
                        lo, hi = self.bias_columns
                        self._split = (norms_without(cupy, self.vecs, self._constant | set(range(lo, hi))),
                                       cupy.abs(self.vecs[:, lo:hi]).astype(cupy.float64).sum(axis=1))
                    rest, sums = self._split
                    got = (rows, _up32(cupy, rest[rows]), _up32(cupy, sums[rows]))
            self._samples[key] = got
        return got


def norms_without(xp: Any, vecs: Any, skip: set) -> Any:
    """Each row's Euclidean norm over the columns not in ``skip``, float64 (``metrics.row_norms`` of each run of
    kept columns, the runs' norms combined by ``hypot``; no column skipped: ``row_norms`` itself)."""
    out, start = None, 0
    for stop in sorted(set(skip) | {vecs.shape[1]}):
        if stop > start:
            run = row_norms(xp, vecs[:, start:stop])
            out = run if out is None else xp.hypot(out, run)
        start = stop + 1
    return xp.zeros(vecs.shape[0], xp.float64) if out is None else out


def _up32(xp: Any, exact: Any) -> Any:
    """float64 values as the float32 values at or above them."""
    rounded = exact.astype(xp.float32)
    return xp.where(rounded < exact, xp.nextafter(rounded, xp.float32(np.inf)), rounded)
