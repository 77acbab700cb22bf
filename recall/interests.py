"""Multi-interest users: several vectors per user, an item's score is the max (or the sum) over them.

Multi-interest (multi-head) two-tower models give each user a few vectors. ``Engine.search`` takes them as an
``(n_users, n_interests, dim)`` array, or as a list of ``(n_i, dim)`` arrays (ragged), with ``aggregate="max"`` (the
default) or ``"sum"``; it returns the same ``SearchResult`` as for one vector per user, with the same exclusions, tie
rule and padding.

How: the user block of a tile plan holds every interest row of its users (``n_users_block * rows`` GEMM rows), one
strided-batched GEMM scores them against a segment of items, and a reduce step folds each user's interest rows into
one row (``xp.maximum`` / ``xp.add`` into a preallocated part of the score buffer, on either backend) before the
running top-k update. It is the same tiled search (``scoring.search_block``), hooked through
``TilePlan.interests``; on the GPU the reduce launches are captured in the same CUDA graph.

Ragged users are padded to the largest interest count: for ``max`` with a copy of the user's first interest (it
changes no maximum), for ``sum`` with zero rows (they add exactly 0).

Metric ``l2`` ranks by -||u - v||²; with the augmented vectors of ``recall.metrics`` each interest row scores
``s_i = u_i·v - ||v||²/2``. For ``sum`` the reported score is ``2·Σ s_i - Σ ||u_i||²`` (the bias is the same for every
item). For ``max`` each interest's own bias ``||u_i||²/2`` must be taken off before the maximum: it rides in one
extra "bias row" per user (its values are ignored by the GEMM's consumer, only read by the reduce step), the reduce
subtracts it in place, and the reported score is ``2·max_i (s_i - ||u_i||²/2)``.

``read_interest_users`` reads such users from Parquet (repeated ``user_id`` rows, or a ``list<fixed_size_list>``
column) and ``score_files`` is the Parquet-to-Parquet job behind ``recall score --interests max|sum``.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import metrics, scoring
from .errors import InputError, ResourceError
from .exclusions import normalise
from .io import DEFAULT_COMPRESSION
from .pipeline import ScoreSummary
from .result import SearchResult

AGGREGATES = ("max", "sum")


def check_aggregate(aggregate: Any) -> str:
    """``aggregate`` if it is "max" or "sum", else InputError."""
    if aggregate not in AGGREGATES:
        raise InputError(f"unknown aggregate {aggregate!r}: expected one of {', '.join(AGGREGATES)}")
    return aggregate


def is_multi(user_vecs: Any) -> bool:
    """True for a 3-d array, or a list/tuple of 2-d arrays (ragged interests): what ``Engine.search`` sends here."""
    shape = getattr(user_vecs, "shape", None)
    if shape is not None:
        return len(shape) == 3
    if isinstance(user_vecs, (list, tuple)) and len(user_vecs) > 0:
        first = user_vecs[0]
        ndim = getattr(first, "ndim", None)
        if ndim is None:
            ndim = np.ndim(first)
        return ndim == 2
    return False


# --------------------------------------------------------------------------------------------------------------------
# The reduce step, inside the tiled search


@dataclass(frozen=True)
class InterestPlan:
    """How a block's user rows fold into users (``TilePlan.interests``).

    Attributes
    ----------
    m : int
        Interest rows per user (ragged users padded to it).
    rows : int
        User rows per user in the block: ``m``, plus the bias rows of l2 + max.
    aggregate : {"max", "sum"}
    bias : bool
        Whether row ``m`` holds each interest's ``||u_i||²/2``, subtracted before the maximum (l2 + max).
    width : int
        Items per score tile. The plan's score buffer holds ``item_tile`` floats per user and tile; ``rows`` of
        them hold the GEMM output and one the reduced scores, so ``width = item_tile // (rows + 1)``.
    """

    m: int
    rows: int
    aggregate: str
    bias: bool
    width: int

    def search_block(self, backend: Any, plan: scoring.TilePlan, users: Any, items: Any, n_items: int, state: Any,
                     scores_buf: Any, excl_indptr: Any, excl_items: Any) -> None:
        """``scoring.search_block`` for a block of ``n`` users given as ``(n, rows * dim)``."""
        xp = backend.xp
        n = int(users.shape[0])
        dim = int(items.shape[1])
        m, rows = self.m, self.rows
        users_batch = users.reshape(1, n * rows, dim)
        bias = users.reshape(n, rows * dim)[:, m * dim:m * dim + m] if self.bias else None  # (n, m) view
        op = xp.maximum if self.aggregate == "max" else xp.add
        for start, width, tiles in scoring.item_segments(n_items, replace(plan, item_tile=self.width, interests=None)):
            segment = items[start:start + width * tiles].reshape(tiles, width, dim)
            n_raw = tiles * n * rows * width
            raw = scores_buf[:n_raw].reshape(tiles, n * rows, width)
            backend.gemm_strided_batched(users_batch, segment, raw)
            per_user = raw.reshape(tiles, n, rows, width)
            if bias is not None:
                # One view object for input and output: an in-place ufunc then neither copies nor allocates (CuPy
                # copies an input that overlaps the output unless it is the output), which CUDA graph capture needs.
                real = per_user[:, :, :m]
                xp.subtract(real, bias[None, :, :, None], out=real)
            out = scores_buf[n_raw:n_raw + tiles * n * width].reshape(tiles, n, width)
            # Interest by interest, in a fixed order: float32 sums come out the same on every backend.
            op(per_user[:, :, 0], per_user[:, :, 1], out=out)
            for j in range(2, m):
                op(out, per_user[:, :, j], out=out)
            backend.topk_update(state, out, start, n_items, excl_indptr, excl_items)


# --------------------------------------------------------------------------------------------------------------------
# Engine.search with several vectors per user


def _flatten(engine: Any, user_vecs: Any) -> tuple[Any, Any, np.ndarray]:
    """(xp, interest rows (N, dim) float32 of module xp, indptr (n_users + 1,) host int64) of a 3-d array or a list
    of 2-d arrays, validated: real numbers, the engine's dimension, finite, at least one interest per user."""
    dim = engine.dim
    if getattr(user_vecs, "shape", None) is not None:
        xp = engine._xp_for(user_vecs)
        arr = user_vecs
        if xp is np:
            arr = np.asarray(arr.get() if hasattr(arr, "get") and not isinstance(arr, np.ndarray) else arr)
        elif not hasattr(arr, "__cuda_array_interface__") and hasattr(arr, "__dlpack__"):
            arr = xp.from_dlpack(arr)
        n, m, d = (int(x) for x in arr.shape)
        _check_kind(arr, "user_vecs")
        if d != dim:
            raise InputError(f"user_vecs: dimension {d} does not match the items' dimension {dim}")
        if m < 1 and n > 0:
            raise InputError("user_vecs: every user needs at least one interest vector, got shape "
                             f"{tuple(arr.shape)}")
        flat = xp.ascontiguousarray(xp.asarray(arr).reshape(n * m, d), dtype=xp.float32)
        indptr = np.arange(n + 1, dtype=np.int64) * m
    else:
        parts = list(user_vecs)
        xp = engine._xp_for(parts[0]) if parts and all(engine._xp_for(p) is not np for p in parts) else np
        arrays = []
        for u, p in enumerate(parts):
            if xp is np:
                p = np.asarray(p.get() if hasattr(p, "get") and not isinstance(p, np.ndarray) else p)
            if getattr(p, "ndim", 2) != 2:
                raise InputError(f"user_vecs: user {u} must be an (n_interests, dim) array, got shape "
                                 f"{tuple(p.shape)}")
            _check_kind(p, f"user_vecs: user {u}")
            if p.shape[0] < 1:
                raise InputError(f"user_vecs: user {u} has no interest vectors; every user needs at least one")
            if p.shape[1] != dim:
                raise InputError(f"user_vecs: user {u} has dimension {p.shape[1]}, the items have {dim}")
            arrays.append(xp.asarray(p, dtype=xp.float32))
        indptr = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum([a.shape[0] for a in arrays], out=indptr[1:])
        flat = xp.ascontiguousarray(xp.concatenate(arrays)) if arrays else xp.zeros((0, dim), xp.float32)
    finite = xp.isfinite(flat).all(axis=1)
    if not bool(finite.all()):
        user, interest = _where(indptr, int(xp.argmax(~finite)))
        raise InputError(f"user_vecs: user {user}, interest {interest} has a NaN or infinite value")
    return xp, flat, indptr


def _check_kind(arr: Any, what: str) -> None:
    kind = getattr(getattr(arr, "dtype", None), "kind", "f")
    if kind not in "fiu":
        raise InputError(f"{what}: expected real numbers, got dtype {arr.dtype}")


def _where(indptr: np.ndarray, row: int) -> tuple[int, int]:
    """(user, interest) of flat interest row ``row``."""
    user = int(np.searchsorted(indptr, row, side="right") - 1)
    return user, row - int(indptr[user])


def _check_values(engine: Any, xp: Any, flat: Any, indptr: np.ndarray, aggregate: str) -> Any:
    """Refuse zero vectors under cosine and scores that could overflow float32; returns the rows' squared norms."""
    sq = metrics.row_norms(xp, flat) ** 2 if flat.shape[0] else xp.zeros(0, xp.float64)
    if engine.metric == "cosine":
        zero = sq == 0
        if bool(zero.any()):
            user, interest = _where(indptr, int(xp.argmax(zero)))
            raise InputError(f"user_vecs: user {user}, interest {interest} is a zero vector, which has no direction "
                             f"for metric 'cosine'")
        return sq
    if not flat.shape[0]:
        return sq
    from .engine import _SCORE_LIMIT

    norms = xp.sqrt(sq)
    per = (norms + engine._item_norm) ** 2 if engine.metric == "l2" else norms * engine._item_norm
    if aggregate == "sum":
        # A sum of m scores is bounded by m times the largest: scale by the user's interest count.
        per = per * xp.asarray(np.repeat(np.diff(indptr), np.diff(indptr)).astype(np.float64))
    row = int(xp.argmax(per))
    if float(per[row]) > _SCORE_LIMIT:
        user, interest = _where(indptr, row)
        raise InputError(f"user_vecs: user {user}, interest {interest} has norm {float(norms[row]):.3g} and the "
                         f"largest item norm is {engine._item_norm:.3g}: metric {engine.metric!r} scores could "
                         f"overflow float32; rescale the vectors")
    return sq


def _layout(xp: Any, prepared: Any, sq: Any, indptr: np.ndarray, m: int, aggregate: str, bias: bool) -> Any:
    """The users as (n_users, rows * width) float32: each user's m interest rows (ragged ones padded), then, for
    l2 + max, the bias rows holding ``||u_i||²/2`` of each interest in their first m values."""
    n = indptr.size - 1
    width = int(prepared.shape[1])
    counts = np.diff(indptr)
    extra = -(-m // width) if bias else 0
    rows = m + extra
    out = xp.zeros((n, rows, width), dtype=xp.float32)
    halves = xp.zeros((n, m), dtype=xp.float32)
    half = (0.5 * sq).astype(xp.float32)
    if bool((counts == m).all()):
        out[:, :m, :] = prepared.reshape(n, m, width)
        halves[:] = half.reshape(n, m)
    else:
        user_of = np.repeat(np.arange(n, dtype=np.int64), counts)
        slot = np.arange(indptr[-1], dtype=np.int64) - indptr[user_of]
        ui, si = (user_of, slot) if xp is np else (xp.asarray(user_of), xp.asarray(slot))
        out[ui, si] = prepared
        halves[ui, si] = half
        if aggregate == "max":
            # Pad with a copy of the user's first interest: it changes no maximum. For sum the padding stays zero
            # and adds exactly 0 (under l2 too: the row is zero in the augmented space, not [0, 1]).
            pu, ps = np.nonzero(np.arange(m)[None, :] >= counts[:, None])
            pu_x, ps_x = (pu, ps) if xp is np else (xp.asarray(pu), xp.asarray(ps))
            out[pu_x, ps_x] = out[pu_x, 0]
            halves[pu_x, ps_x] = halves[pu_x, 0]
    flat = out.reshape(n, rows * width)
    if bias:
        flat[:, m * width:m * width + m] = halves
    return flat


def search(engine: Any, user_vecs: Any, k: int, exclude: Any = None, aggregate: str = "max") -> SearchResult:
    """The exact top-k items of users with several vectors each; see :meth:`recall.Engine.search`.

    Parameters
    ----------
    engine : recall.Engine
    user_vecs : array (n_users, n_interests, dim), or a list of n_users arrays (n_i, dim), n_i >= 1
        NumPy, or device arrays (used in place) on a GPU engine.
    k : int
    exclude : as for ``Engine.search``
    aggregate : {"max", "sum"}
        An item's score for a user: the max or the sum of its scores against the user's interests.

    Raises
    ------
    InputError
        Bad k or aggregate, wrong dimension, NaN/Inf, a user without interests, a zero vector under cosine,
        possible float32 overflow, exclusions out of range.
    ResourceError
        The memory budget cannot hold the smallest tile.
    """
    aggregate = check_aggregate(aggregate)
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or k < 1:
        raise InputError(f"k must be an integer >= 1, got {k!r}")
    k = int(k)
    xp, flat, indptr = _flatten(engine, user_vecs)
    n_users = indptr.size - 1
    counts = np.diff(indptr)
    sq = _check_values(engine, xp, flat, indptr, aggregate)
    excl = normalise(exclude, n_users, engine.n_items)
    if n_users == 0 or int(counts.max()) == 1:
        return engine.search(flat, k, exclude=exclude)  # one vector per user: the plain search
    m = int(counts.max())
    bias = engine.metric == "l2" and aggregate == "max"
    prepared = metrics.prepare_users(engine.metric, xp, flat)
    users = _layout(xp, prepared, sq, indptr, m, aggregate, bias)
    vals, rows = _run(engine, users, m, users.shape[1] // prepared.shape[1], aggregate, bias, k, excl)
    if xp is np:
        vals, rows = engine.backend.to_host(vals), engine.backend.to_host(rows)
    if engine.metric == "l2":
        # -inf padding stays -inf.
        if aggregate == "max":
            vals = (2.0 * vals).astype(xp.float32)
        else:
            sq_sum = np.add.reduceat(sq if xp is np else sq.get(), indptr[:-1]).astype(np.float32)
            vals = (2.0 * vals - (sq_sum if xp is np else xp.asarray(sq_sum))[:, None]).astype(xp.float32)
    return SearchResult(indices=rows, scores=vals, ids=engine._map_ids(rows))


def _run(engine: Any, users: Any, m: int, rows: int, aggregate: str, bias: bool, k: int,
         excl: Any) -> tuple[Any, Any]:
    """(scores, item rows), each (n_users, k), padded; the tiled search with the interest reduce hooked in."""
    backend, xp = engine.backend, engine.backend.xp
    n_users = int(users.shape[0])
    n_items = engine.n_items
    k_sel = min(k, n_items)
    vals = xp.full((n_users, k), -xp.inf, dtype=xp.float32)
    out_rows = xp.full((n_users, k), -1, dtype=xp.int64)
    width = int(engine._items.shape[1])
    parts = rows + 1  # per user and tile: `rows` rows of GEMM output, one row of reduced scores
    # Planned as a search whose user rows are `rows` vectors wide and whose items are `parts` times as many: the
    # score buffer the plan sizes (user_block x item_tile x tiles_per_call floats) is exactly what the block uses.
    plan = scoring.plan_tiles(n_users, n_items * parts, rows * width, k_sel, engine.memory_budget,
                              backend.preferred_tiles(width, k_sel), backend.state_bytes(k_sel), backend.workers)
    tile = plan.item_tile // parts
    if tile >= 8:
        tile -= tile % 4  # keep tiles a multiple of 4 wide: the GPU filter reads them as float4
    if tile < 1:
        raise ResourceError(f"memory budget of {engine.memory_budget:,} bytes is too small for users with {m} "
                            f"interests: a tile of one item needs {parts} score rows per user")
    plan = replace(plan, interests=InterestPlan(m, rows, aggregate, bias, tile))
    backend.run_blocks(plan, users, engine._items, n_items, k_sel, excl, vals, out_rows)
    engine.stats = {**dict(getattr(backend, "stats", {})), "interests": m, "aggregate": aggregate,
                    "item_tile": tile}
    return vals, out_rows


# --------------------------------------------------------------------------------------------------------------------
# Parquet: users with several vectors, and the job behind `recall score --interests`


class Aggregate(str, Enum):
    """``--interests``: how a user's interest scores combine."""

    max = "max"
    sum = "sum"


@dataclass(frozen=True)
class InterestUsers:
    """Users with one or more vectors each, read from Parquet.

    Attributes
    ----------
    ids : np.ndarray, shape (n_users,)
        int64, or object (str); unique, in order of first appearance in the file.
    vectors : np.ndarray of float32, shape (n_vectors, dim)
        Every user's interest vectors, contiguous per user, in file order within a user.
    indptr : np.ndarray of int64, shape (n_users + 1,)
        User ``i`` has ``vectors[indptr[i]:indptr[i + 1]]`` (at least one).
    file_rows : np.ndarray of int64, shape (n_vectors,)
        The file row each vector came from (for messages).
    """

    ids: np.ndarray
    vectors: np.ndarray
    indptr: np.ndarray
    file_rows: np.ndarray

    def __len__(self) -> int:
        return int(self.ids.size)

    @property
    def max_interests(self) -> int:
        return int(np.diff(self.indptr).max()) if len(self) else 0

    def batch(self, start: int, stop: int) -> Any:
        """Users ``start:stop`` as ``Engine.search`` takes them: a 3-d array when they all have the same number of
        vectors, else a list of (n_i, dim) views."""
        counts = np.diff(self.indptr[start:stop + 1])
        lo, hi = int(self.indptr[start]), int(self.indptr[stop])
        if counts.size and bool((counts == counts[0]).all()):
            return self.vectors[lo:hi].reshape(counts.size, int(counts[0]), self.vectors.shape[1])
        return [self.vectors[self.indptr[i]:self.indptr[i + 1]] for i in range(start, stop)]


def _list_like(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def inspect_interest_users(path: str | os.PathLike, id_col: str = "id", vec_col: str = "embedding") -> bool:
    """Check a multi-interest users file's columns without reading rows; True for the nested layout (a list of
    vectors per row), False for one vector per row (ids repeated).

    Raises
    ------
    InputError
        Unreadable or not Parquet; a missing column (listing those there are) or a column of the wrong type.
    """
    from .io.parquet import _column_names, _id_type, open_parquet

    path = os.fspath(path)
    schema = open_parquet(path, "embeddings").schema_arrow
    for col, role, option in ((id_col, "id", "--id-col"), (vec_col, "vector", "--vec-col")):
        if schema.get_field_index(col) < 0:
            raise InputError(f"{path}: no {role} column {col!r}; the columns are {_column_names(schema)} "
                             f"(choose another with {option})")
    _id_type(path, id_col, schema.field(id_col).type)
    vt = schema.field(vec_col).type
    nested = _list_like(vt) and _list_like(vt.value_type)
    inner = vt.value_type.value_type if nested else (vt.value_type if _list_like(vt) else None)
    if inner is None or not pa.types.is_floating(inner):
        raise InputError(f"{path}: vector column {vec_col!r} has type {vt}, expected fixed_size_list<float32>[dim] "
                         f"(one interest per row, user ids repeated) or list<fixed_size_list<float32>[dim]> (a list "
                         f"of interests per row)")
    return nested


def read_interest_users(path: str | os.PathLike, id_col: str = "id", vec_col: str = "embedding", *,
                        dim: int | None = None, dim_source: str | None = None) -> InterestUsers:
    """Read users with several vectors each from Parquet.

    Two layouts: one vector per row with the user id repeated on each of its rows (the rows of a user need not be
    adjacent), or one row per user whose vector column is a list of vectors (``list<fixed_size_list<float32>[d]>``
    or ``list<list<float>>``). The whole file is read.

    Parameters
    ----------
    path : str or PathLike
    id_col, vec_col : str
    dim : int, optional
        The dimension every vector must have (the items'); default: the first vector's.
    dim_source : str, optional
        Where ``dim`` comes from, for messages.

    Raises
    ------
    InputError
        Naming the file, the row and the id: bad file or columns, null ids, lists or vectors, a user without vectors,
        a wrong or ragged dimension, NaN/Inf or float32 overflow, and (nested layout) a user id on two rows.
    """
    from .io.parquet import (READ_BATCH_ROWS, _at, _duplicate, _first, _ids_from_arrow, _iter_batches, _to_float32,
                             _vectors_from_arrow, open_parquet)

    path = os.fspath(path)
    nested = inspect_interest_users(path, id_col, vec_col)
    pf = open_parquet(path, "embeddings")
    id_parts, vec_parts, row_parts = [], [], []
    row = 0
    for batch in _iter_batches(pf, path, [id_col, vec_col], READ_BATCH_ROWS):
        ids = _ids_from_arrow(path, batch.column(0), row)
        col = batch.column(1)
        if not nested:
            vecs = _vectors_from_arrow(path, col, ids, row, dim, dim_source)
            vec_parts.append(_to_float32(path, vecs, ids, row))
            id_parts.append(ids)
            row_parts.append(np.arange(row, row + len(ids), dtype=np.int64))
        else:
            if col.null_count:
                pos = _first(col.is_null().to_numpy(zero_copy_only=False))
                raise InputError(f"{_at(path, row + pos, ids, pos)} has a null list of vectors")
            lengths = (np.full(len(col), col.type.list_size, np.int64) if pa.types.is_fixed_size_list(col.type)
                       else np.diff(col.offsets.to_numpy()).astype(np.int64))
            if (lengths == 0).any():
                pos = _first(lengths == 0)
                raise InputError(f"{_at(path, row + pos, ids, pos)} has no interest vectors; every user needs one")
            outer = np.repeat(np.arange(len(col), dtype=np.int64), lengths)
            inner_ids = np.repeat(ids, lengths)
            try:
                vecs = _vectors_from_arrow(path, col.flatten(), inner_ids, 0, dim, dim_source)
                vecs = _to_float32(path, vecs, inner_ids, 0)
            except InputError as exc:
                # The vector reader counts vectors, not rows: name the row that holds the bad vector instead.
                m = re.match(re.escape(path) + r": row (\d+)", str(exc))
                if m is None:
                    raise
                i = int(m.group(1))
                detail = str(exc)[len(_at(path, i, inner_ids, i)):].strip()
                pos = int(outer[i])
                raise InputError(f"{_at(path, row + pos, ids, pos)}: vector {i - int(np.searchsorted(outer, pos))} "
                                 f"of its list {detail}") from None
            vec_parts.append(vecs)
            id_parts.append(ids)
            row_parts.append(row + outer)
        if dim is None and vec_parts and vec_parts[-1].shape[0]:
            dim, dim_source = vec_parts[-1].shape[1], f"the dimension of the first vector of {path}"
        row += batch.num_rows
    ids = np.concatenate(id_parts) if id_parts else np.zeros(0, np.int64)
    vectors = np.concatenate(vec_parts) if vec_parts else np.zeros((0, dim or 0), np.float32)
    file_rows = np.concatenate(row_parts) if row_parts else np.zeros(0, np.int64)
    if nested:
        _duplicate(path, ids, "user id")
        counts = np.diff(np.append(np.flatnonzero(np.r_[True, file_rows[1:] != file_rows[:-1]]), file_rows.size))
        indptr = np.zeros(ids.size + 1, np.int64)
        np.cumsum(counts, out=indptr[1:])
        return InterestUsers(ids, np.ascontiguousarray(vectors), indptr, file_rows)
    # One vector per row: group the rows of each id, users in order of first appearance (Arrow's dictionary
    # encoding numbers distinct values in that order), rows in file order within a user.
    arr = pa.array(ids, type=pa.string() if ids.dtype == object else pa.int64())
    enc = pc.dictionary_encode(arr)
    codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    uniq = enc.dictionary.to_numpy(zero_copy_only=False)
    uniq = uniq.astype(object) if ids.dtype == object else uniq.astype(np.int64)
    order = np.argsort(codes, kind="stable")
    indptr = np.zeros(uniq.size + 1, np.int64)
    np.cumsum(np.bincount(codes, minlength=uniq.size), out=indptr[1:])
    return InterestUsers(uniq, np.ascontiguousarray(vectors[order]), indptr, file_rows[order])


@dataclass(frozen=True)
class InterestScoreSummary(ScoreSummary):
    """:class:`recall.pipeline.ScoreSummary` of a multi-interest job, with the vector count and the aggregate."""

    vectors: int = 0
    aggregate: str = "max"

    def line(self) -> str:
        return (
            f"scored {self.users:,} users ({self.vectors:,} interest vectors, {self.aggregate}) x {self.items:,} "
            f"items, dim {self.dim}, k {self.k}, metric {self.metric}, on {self.device} in {self.seconds:.2f} s "
            f"({self.users_per_s:,.0f} users/s) -> {self.out_path}"
        )


def score_files(users_path: str | os.PathLike, items_path: str | os.PathLike, out_path: str | os.PathLike, k: int,
                aggregate: str = "max", metric: str = "ip", exclude_path: str | os.PathLike | None = None,
                id_col: str = "id", vec_col: str = "embedding", device: str = "auto", batch_size: int | None = None,
                memory_budget: int | None = None, progress: Any = None,
                compression: str = DEFAULT_COMPRESSION) -> InterestScoreSummary:
    """:func:`recall.pipeline.score_files` for users with several vectors each (see :func:`read_interest_users`).

    Same parameters, output and errors, plus ``aggregate`` ("max" or "sum"). One output row per user, in order of
    first appearance in the users file; exclusions name user ids. The users file is read whole, then searched in
    batches of ``batch_size`` users.
    """
    from .io import (
        CandidateWriter,
        check_compression,
        check_output_path,
        inspect_embeddings,
        inspect_exclusions,
        load_exclusions,
    )
    from .io.parquet import _fmt_id
    from .pipeline import auto_batch_size, check_job_args, load_engine
    from .result import id_lookup

    t_start = time.perf_counter()
    k = check_job_args(k, metric, device, batch_size)
    aggregate = check_aggregate(aggregate)
    check_compression(compression)
    users_path, items_path = os.fspath(users_path), os.fspath(items_path)
    exclude_path = os.fspath(exclude_path) if exclude_path is not None else None
    out = check_output_path(out_path, (users_path, items_path, exclude_path))
    inspect_interest_users(users_path, id_col, vec_col)
    inspect_embeddings(items_path, id_col, vec_col)
    if exclude_path is not None:
        inspect_exclusions(exclude_path)

    t0 = time.perf_counter()
    items, engine, _ = load_engine(items_path, id_col, vec_col, metric, device, memory_budget)
    users = read_interest_users(users_path, id_col, vec_col, dim=engine.dim,
                                dim_source=f"the items' dimension, {items_path}")
    if metric == "cosine" and users.vectors.shape[0]:
        zero = ~users.vectors.any(axis=1)
        if zero.any():
            pos = int(np.argmax(zero))
            user = int(np.searchsorted(users.indptr, pos, side="right") - 1)
            raise InputError(f"{users_path}: row {int(users.file_rows[pos])} (id {_fmt_id(users.ids[user])}) has a "
                             f"zero vector, which has no direction for metric 'cosine'")
    excl = load_exclusions(exclude_path, users.ids, items.ids) if exclude_path is not None else None
    read_s = time.perf_counter() - t0
    n = len(users)
    batch = int(batch_size) if batch_size is not None else auto_batch_size(k, engine.dim * max(1, users.max_interests))
    search_s = write_s = busy = 0.0
    id_type = {True: pa.string(), False: pa.int64()}
    item_ids = id_lookup(items.ids)
    with CandidateWriter(out, id_type[users.ids.dtype == object], id_type[items.ids.dtype == object],
                         compression) as writer:
        if progress is not None:
            progress(0, n)
        for start in range(0, n, batch):
            stop = min(start + batch, n)
            t0 = time.perf_counter()
            res = engine.search(users.batch(start, stop), k, aggregate=aggregate,
                                exclude=excl.block(start, stop) if excl is not None else None)
            busy += engine.stats.get("gpu_busy_s", 0.0)
            t1 = time.perf_counter()
            writer.write(res.to_arrow(users.ids[start:stop], item_ids))
            search_s, write_s = search_s + t1 - t0, write_s + time.perf_counter() - t1
            if progress is not None:
                progress(stop, n)
    return InterestScoreSummary(
        users=n, items=engine.n_items, dim=engine.dim, k=k, metric=metric, device=engine.device,
        device_detail=engine.backend.describe(), seconds=time.perf_counter() - t_start, read_s=read_s,
        search_s=search_s, write_s=write_s, batch_size=batch, exclusion_pairs=excl.n_pairs if excl is not None else 0,
        unknown_exclusions=excl.n_unknown if excl is not None else 0, out_path=str(out_path), device_busy_s=busy,
        vectors=int(users.vectors.shape[0]), aggregate=aggregate)
