"""Multi-interest users: several vectors per user, an item's score is the max (or the sum) over them.

Multi-interest (multi-head) two-tower models give each user a few vectors. ``Engine.search`` takes them as an
``(n_users, n_interests, dim)`` array, or as a list of ``(n_i, dim)`` arrays (ragged), with ``aggregate="max"`` (the
default) or ``"sum"``; it returns the same ``SearchResult`` as for one vector per user, with the same exclusions, tie
rule and padding.

How: the user block of a tile plan holds every interest row of its users (``n_users_block * rows`` GEMM rows), one
strided-batched GEMM scores them against a segment of items, and a reduce step folds each user's interest rows into
one row (``xp.maximum`` / ``xp.add`` into a preallocated part of the score buffer, on either backend) before the
running top-k update. It is the same tiled search (``recall.backends.tiled``), planned with
``TilePlan.interests``; on the GPU the reduce launches are captured in the same CUDA graph.

Ragged users are padded to the largest interest count: for ``max`` with a copy of the user's first interest (it
changes no maximum), for ``sum`` with zero rows (they add exactly 0).

Metric ``l2`` ranks by -||u - v||²; with the augmented vectors of ``recall.metrics`` each interest row scores
``s_i = u_i·v - ||v||²/2``. For ``sum`` the reported score is ``2·Σ s_i - Σ ||u_i||²`` (the bias is the same for every
item). For ``max`` each interest's own bias ``||u_i||²/2`` must be taken off before the maximum: it rides in one
extra "bias row" per user (its values are ignored by the GEMM's consumer, only read by the reduce step), the reduce
subtracts it in place, and the reported score is ``2·max_i (s_i - ||u_i||²/2)``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ..core import metrics
from ..core.errors import InputError, ResourceError
from ..core.exclusions import normalise
from ..core.results import SearchResult, to_numpy
from ..core.tiling import InterestPlan, plan_tiles
from .inputs import check_kind, check_overflow, finite_as_given

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


def count_users(user_vecs: Any) -> int:
    """Users in a 3-d array or a list of 2-d arrays (what :func:`is_multi` accepts)."""
    shape = getattr(user_vecs, "shape", None)
    return int(shape[0]) if shape is not None else len(user_vecs)


# --------------------------------------------------------------------------------------------------------------------
# Engine.search with several vectors per user


def _flatten(engine: Any, user_vecs: Any) -> tuple[Any, Any, np.ndarray]:
    """(xp, interest rows (N, dim) float32 of module xp, indptr (n_users + 1,) host int64) of a 3-d array or a list
    of 2-d arrays, validated: real numbers, the engine's dimension, finite, at least one interest per user."""
    dim = engine.dim
    if getattr(user_vecs, "shape", None) is not None:
        xp = engine.backend.module_of(user_vecs)
        arr = user_vecs
        if xp is np:
            arr = to_numpy(arr)
        n, m, d = (int(x) for x in arr.shape)
        check_kind(arr, "user_vecs")
        if d != dim:
            raise InputError(f"user_vecs: dimension {d} does not match the items' dimension {dim}")
        if m < 1 and n > 0:
            raise InputError("user_vecs: every user needs at least one interest vector, got shape "
                             f"{tuple(arr.shape)}")
        with np.errstate(over="ignore"):  # a float64 value beyond float32's range: named below, no warning
            flat = engine.backend.ingest(arr).reshape(n * m, d) if xp is not np else \
                np.ascontiguousarray(arr.reshape(n * m, d), dtype=np.float32)
        indptr = np.arange(n + 1, dtype=np.int64) * m
    else:
        parts = list(user_vecs)
        module_of = engine.backend.module_of
        xp = module_of(parts[0]) if parts and all(module_of(p) is not np for p in parts) else np
        arrays = []
        for u, p in enumerate(parts):
            if xp is np:
                p = to_numpy(p)
            if getattr(p, "ndim", 2) != 2:
                raise InputError(f"user_vecs: user {u} must be an (n_interests, dim) array, got shape "
                                 f"{tuple(p.shape)}")
            check_kind(p, f"user_vecs: user {u}")
            if p.shape[0] < 1:
                raise InputError(f"user_vecs: user {u} has no interest vectors; every user needs at least one")
            if p.shape[1] != dim:
                raise InputError(f"user_vecs: user {u} has dimension {p.shape[1]}, the items have {dim}")
            with np.errstate(over="ignore"):
                arrays.append(np.asarray(p, dtype=np.float32) if xp is np else engine.backend.ingest(p))
        indptr = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum([a.shape[0] for a in arrays], out=indptr[1:])
        flat = xp.ascontiguousarray(xp.concatenate(arrays)) if arrays else xp.zeros((0, dim), xp.float32)
    finite = xp.isfinite(flat).all(axis=1)
    if not bool(finite.all()):
        user, interest = _where(indptr, int(xp.argmax(~finite)))
        given = user_vecs[user][interest]  # as the caller gave it: finite there, it was beyond float32's range
        reason = "a value beyond the float32 range" if finite_as_given(given) else "a NaN or infinite value"
        raise InputError(f"user_vecs: user {user}, interest {interest} has {reason}")
    return xp, flat, indptr


def check(engine: Any, user_vecs: Any, aggregate: str) -> None:
    """Raise what :func:`search` would raise for these users (the checks of a search that has no item to score)."""
    xp, flat, indptr = _flatten(engine, user_vecs)
    _check_values(engine, xp, engine.centred(xp, flat), indptr, aggregate)


def _where(indptr: np.ndarray, row: int) -> tuple[int, int]:
    """(user, interest) of flat interest row ``row``."""
    user = int(np.searchsorted(indptr, row, side="right") - 1)
    return user, row - int(indptr[user])


def _check_values(engine: Any, xp: Any, flat: Any, indptr: np.ndarray, aggregate: str) -> Any:
    """Refuse zero vectors under cosine and scores that could overflow float32; returns the rows' squared norms."""
    sq = engine.backend.row_norms(flat) ** 2 if flat.shape[0] else xp.zeros(0, xp.float64)
    if engine.metric == "cosine":
        zero = sq == 0
        if bool(zero.any()):
            user, interest = _where(indptr, int(xp.argmax(zero)))
            raise InputError(f"user_vecs: user {user}, interest {interest} {metrics.ZERO_VECTOR}")
        return sq
    if not flat.shape[0]:
        return sq
    norms = xp.sqrt(sq)
    if aggregate == "sum":
        # A sum of m scores is bounded by m times the largest: scale by the user's interest count.
        norms = norms * xp.asarray(np.repeat(np.diff(indptr), np.diff(indptr)).astype(np.float64))

    def where(row: int) -> str:
        user, interest = _where(indptr, row)
        return f"user {user}, interest {interest}"

    check_overflow(xp, norms, engine.item_norm, engine.metric, where)
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
    with np.errstate(over="ignore"):  # used under l2 alone, whose overflow check refuses such norms
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
    xp, flat, indptr = _flatten(engine, user_vecs)
    n_users = indptr.size - 1
    counts = np.diff(indptr)
    centred = engine.centred(xp, flat)  # as the engine scores them (l2: less its centre)
    sq = _check_values(engine, xp, centred, indptr, aggregate)
    excl = normalise(exclude, n_users, engine.n_items)
    if n_users == 0 or int(counts.max()) == 1:
        return engine.search(flat, k, exclude=exclude)  # one vector per user: the plain search
    m = int(counts.max())
    bias = engine.metric == "l2" and aggregate == "max"
    prepared = engine._prepared(xp, centred)
    users = _layout(xp, prepared, sq, indptr, m, aggregate, bias)
    vals, rows = _run(engine, users, m, users.shape[1] // prepared.shape[1], aggregate, bias, k, excl)
    if xp is np:
        vals, rows = engine.backend.to_host(vals), engine.backend.to_host(rows)
    if engine.metric == "l2":
        # -inf padding stays -inf.
        if aggregate == "max":
            vals = (2.0 * vals).astype(xp.float32)
        else:
            sq_sum = np.add.reduceat(engine.backend.to_host(sq), indptr[:-1]).astype(np.float32)
            vals = (2.0 * vals - xp.asarray(sq_sum)[:, None]).astype(xp.float32)
    return SearchResult(indices=rows, scores=vals, ids=engine.map_ids(rows))


def _run(engine: Any, users: Any, m: int, rows: int, aggregate: str, bias: bool, k: int,
         excl: Any) -> tuple[Any, Any]:
    """(scores, item rows), each (n_users, min(k, n_items)), padded; the tiled search with the interest reduce
    hooked in."""
    backend, xp = engine.backend, engine.backend.xp
    n_users = int(users.shape[0])
    n_items = engine.n_items
    k_sel = min(k, n_items)
    vals = xp.full((n_users, k_sel), -xp.inf, dtype=xp.float32)
    out_rows = xp.full((n_users, k_sel), -1, dtype=xp.int64)
    width = int(engine.prepared_items.shape[1])
    parts = rows + 1  # per user and tile: `rows` rows of GEMM output, one row of reduced scores
    # Planned as a search whose user rows are `rows` vectors wide and whose items are `parts` times as many: the
    # score buffer the plan sizes (user_block x item_tile x tiles_per_call floats) is exactly what the block uses.
    # The tiling of an unfused pass: interest rows are multiplied by GEMM calls, never by a fused kernel.
    unfused = replace(engine.options, fused="off")
    if engine.options.tiles is not None:
        # Tiles asked for count items (EngineOptions.tiles); the plan counts score rows, `parts` of them an item.
        block, items_per_tile, per_call = engine.options.tiles
        preferred = (block, items_per_tile * parts, per_call)
    else:
        preferred = backend.preferred_tiles(width, k_sel, users.dtype, n_users, n_items, unfused)
    plan = plan_tiles(n_users, n_items * parts, rows * width, k_sel, engine.memory_budget, preferred,
                      backend.state_bytes(k_sel, n_items), backend.workers)
    tile = plan.item_tile // parts
    if tile >= 8:
        tile -= tile % 4  # keep tiles a multiple of 4 wide: the GPU filter reads them as float4
    if tile < 1:
        raise ResourceError(f"memory budget of {engine.memory_budget:,} bytes is too small for users with {m} "
                            f"interests: a tile of one item needs {parts} score rows per user")
    plan = replace(plan, interests=InterestPlan(m, rows, aggregate, bias, tile))
    stats = engine.run(users, k_sel, excl, vals, out_rows, plan=plan)()
    engine.stats = {**stats, "interests": m, "aggregate": aggregate, "item_tile": tile}
    return vals, out_rows


