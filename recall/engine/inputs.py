"""Validation of the engine's array inputs, once, at the boundary: shapes, dtypes, finiteness, ids, overflow."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..core.errors import InputError
from ..core.results import to_numpy

#: Largest score magnitude we let the float32 arithmetic reach: a margin under float32's 3.4e38 keeps every partial
#: sum of the GEMM (bounded by |u|·|v|, Cauchy-Schwarz) and the l2 expansion finite.
SCORE_LIMIT = 1e37


def check_kind(arr: Any, what: str) -> None:
    """InputError unless ``arr`` holds real numbers."""
    kind = getattr(getattr(arr, "dtype", None), "kind", "f")
    if kind not in "fiu":
        raise InputError(f"{what}: expected real numbers, got dtype {arr.dtype}")


#: Rows whose finiteness :func:`matrix` checks at once.
_FINITE_BLOCK_ROWS = 1 << 16


def matrix(backend: Any, xp: Any, arr: Any, what: str, dim: int | None = None, own: bool = False,
           first_row: int = 0, finite: bool = True) -> Any:
    """``arr`` as a C-contiguous float32 (n, dim) array of module ``xp`` (the backend's own, or NumPy), checked:
    2-d, real, the expected dimension, finite (the first bad row named, counted from ``first_row``: ``arr`` may be
    a slice of the caller's array; a float64 value beyond float32's range named as such). ``own``: never the
    caller's memory. ``finite=False``: the caller checks finiteness itself (:func:`check_overflow`, from the rows'
    norms), except for inputs wider than float32."""
    shape = getattr(arr, "shape", None)
    if shape is None:
        try:
            arr = np.asarray(arr)
        except (ValueError, TypeError) as exc:  # ragged nested lists, objects NumPy cannot make an array of
            raise InputError(f"{what}: not an (n, dim) array of numbers: {type(exc).__name__} from NumPy (rows of "
                             f"different lengths?)") from None
        shape = arr.shape
    if len(shape) != 2:
        raise InputError(f"{what}: expected a 2-d (n, dim) array, got shape {tuple(shape)}")
    check_kind(arr, what)
    if dim is not None and shape[1] != dim:
        raise InputError(f"{what}: dimension {shape[1]} does not match the items' dimension {dim}")
    if shape[1] < 1:
        raise InputError(f"{what}: vectors have dimension 0")
    given = arr
    if xp is np:
        given = host = to_numpy(arr)
        # A float64 value beyond float32's range becomes an infinity here and is named below: no RuntimeWarning.
        with np.errstate(over="ignore"):
            out = np.array(host, dtype=np.float32, order="C", copy=True) if own else \
                np.ascontiguousarray(host, dtype=np.float32)
    else:
        out = backend.ingest(arr, own=own)
    # Values wider than float32 are checked here even where the caller checks finiteness from the norms: there a
    # value beyond float32's range would be reported as an infinity the caller never gave.
    if finite or _wider_than_float32(given):
        # Block by block: a whole (n, dim) mask of a million items at dim 64 is 64 MiB more at the engine's peak.
        for start in range(0, int(out.shape[0]), _FINITE_BLOCK_ROWS):
            ok = xp.isfinite(out[start:start + _FINITE_BLOCK_ROWS]).all(axis=1)
            if not bool(ok.all()):
                row = start + int(xp.argmax(~ok))
                reason = "a value beyond the float32 range" if finite_as_given(given[row]) else \
                    "a NaN or infinite value"
                raise InputError(f"{what}: row {first_row + row} has {reason}")
    return out


def _wider_than_float32(arr: Any) -> bool:
    """Whether ``arr`` may hold finite values beyond float32's range: float64 and wider (a dtype without NumPy's
    ``kind``, such as torch's, counts as a float)."""
    dtype = getattr(arr, "dtype", None)
    return getattr(dtype, "kind", "f") == "f" and getattr(dtype, "itemsize", 8) > 4


def finite_as_given(values: Any) -> bool:
    """Whether every one of the caller's ``values`` (a vector, host or device) is finite as given; False where they
    cannot be read on the host."""
    try:
        host = np.asarray(to_numpy(values))
        # In the caller's own float type where NumPy has it: a longdouble beyond float64's range is finite too.
        return bool(np.isfinite(host if host.dtype.kind == "f" else host.astype(np.float64)).all())
    except (TypeError, ValueError, RuntimeError):
        return False


def item_ids(ids: Any, n_items: int) -> np.ndarray | None:
    """Item ids (n_items,) as a host array (object for strings), checked: integers or strings, one per row,
    unique."""
    if ids is None:
        return None
    given = ids
    ids = np.array(to_numpy(ids), copy=True)
    if ids.shape != (n_items,):
        raise InputError(f"ids: expected {n_items} ids (one per item row), got shape {ids.shape}")
    if isinstance(given, (list, tuple)):
        # NumPy turns integers mixed with strings into strings, and bools into integers: a list's values are checked
        # as the caller gave them, as those of an object array are.
        values = np.empty(n_items, dtype=object)
        values[:] = given
        _id_kind(values)
    if ids.dtype.kind in "US":
        ids = ids.astype(object)
    if ids.dtype.kind == "O":
        # Python objects (a pandas object column, pyarrow's strings): all strings, or all integers (made int64).
        if _id_kind(ids) == "integer":
            try:
                ids = ids.astype(np.int64)
            except OverflowError:
                raise InputError("ids: an integer id is beyond the int64 range") from None
    elif ids.dtype.kind not in "iu":
        raise InputError(f"ids: expected integers or strings, got dtype {ids.dtype}")
    order = np.argsort(ids, kind="stable")
    ranked = ids[order]
    repeat = np.flatnonzero(ranked[1:] == ranked[:-1]) + 1
    if repeat.size:
        # Name the first row (in file order) that repeats an earlier id, and that id's first row.
        second = int(order[repeat].min())
        first = int(np.flatnonzero(ids == ids[second])[0])
        dup = ids[second].item() if hasattr(ids[second], "item") else ids[second]
        raise InputError(f"ids: duplicate item id {dup!r} at rows {first} and {second}")
    return ids


def _id_kind(ids: np.ndarray) -> str:
    """``"integer"`` or ``"string"``: the kind of every id of an object array of ids; InputError naming the first
    row of another kind (bools are not integers)."""
    def kind(v: Any) -> str:
        if isinstance(v, str):
            return "string"
        return "integer" if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) else ""

    first = kind(ids[0]) if ids.size else "string"
    row = next((i for i, v in enumerate(ids) if kind(v) != first or not first), None)
    if row is not None:
        what = "integers or strings" if not first or row == 0 else f"{first}s like row 0"
        raise InputError(f"ids: row {row} holds {ids[row]!r} ({type(ids[row]).__name__}); ids must all be {what}")
    return first


def check_item_norm(item_norm: float, metric: str, row: Any = None, centre: Any = None) -> None:
    """Refuse items whose own squared norm overflows the float32 arithmetic under ``l2`` (the prepared items hold
    -|v|²/2: it would be -inf, and every later search refused for its users); ``row()`` names the item of the
    largest norm. ``centre``: the l2 centre the norm is measured from (said in the message), or None."""
    if metric == "l2" and _score_bound(0.0, item_norm, metric) > SCORE_LIMIT:
        at = f"row {row()} " if row is not None else "an item "
        raise InputError(f"item_vecs: {at}has norm {item_norm:.3g}{_from_centre(centre)}: metric 'l2' scores could "
                         f"overflow float32; rescale the vectors")


def _from_centre(centre: Any) -> str:
    """`` from the l2 centre (whose own norm is N)`` where a message's norms are measured from ``centre``, else
    ``""``."""
    if centre is None:
        return ""
    return f" from the l2 centre (whose own norm is {float(np.linalg.norm(np.asarray(centre, np.float64))):.3g})"


def _score_bound(norm: Any, item_norm: float, metric: str) -> Any:
    """The largest |score| a user of ``norm`` (a float, or an array of them) can reach against items of norms up to
    ``item_norm``; 0 under cosine, whose vectors are normalised."""
    if metric == "cosine":
        return 0.0
    return (norm + item_norm) ** 2 if metric == "l2" else norm * item_norm


def clearly_fine(top: float, item_norm: float, metric: str) -> bool:
    """Whether users whose largest norm is ``top`` (float64, NaN or inf where a row is not finite) pass
    :func:`check_overflow` whatever the order their norms were summed in: finite, and scores bounded below
    SCORE_LIMIT with room for a relative 2^-30. Where not, :func:`check_overflow` decides from the rows' norms."""
    return math.isfinite(top) and _score_bound(top * (1 + 2.0 ** -30), item_norm, metric) <= SCORE_LIMIT


def check_overflow(xp: Any, norms: Any, item_norm: float, metric: str, where: Any,
                   what: str | None = "user_vecs", centre: Any = None) -> None:
    """Refuse user vectors with a NaN or an infinity, and those whose scores could overflow float32 (they would come
    out as +-inf or NaN and be lost); the first such row is named.

    norms : (n,) float64 bound on each user's |u| (times its interest count for a sum): NaN or infinite exactly where
    a row holds a NaN or an infinity (float64 squares of float32 values do not overflow); ``where(row)`` names a
    row in the message, after ``what`` (the argument's name; None when ``where`` names the file, the row and the
    id, as the Parquet jobs do); ``centre``: the l2 centre the norms are measured from, or None. One transfer from
    the device where every row is good (the largest norm), two where one is not."""
    if norms.shape[0] == 0:
        return
    # The common case in one reduction and one transfer: the largest norm is finite (a NaN or an infinity anywhere
    # makes it NaN or inf) and bounds every row's scores (each bound rises with the norm).
    top = float(to_numpy(norms.max()))
    if math.isfinite(top) and _score_bound(top, item_norm, metric) <= SCORE_LIMIT:
        return
    bad = ~xp.isfinite(norms)
    per = xp.where(bad, 0.0, _score_bound(norms, item_norm, metric))
    first_bad, worst = xp.argmax(bad), xp.argmax(per)
    summary = xp.stack([bad[first_bad].astype(xp.float64), first_bad.astype(xp.float64),
                        worst.astype(xp.float64), per[worst], norms[worst]])
    any_bad, first_bad, worst, bound, norm = (float(v) for v in to_numpy(summary))
    prefix = f"{what}: " if what else ""
    if any_bad:
        raise InputError(f"{prefix}{where(int(first_bad))} has a NaN or infinite value")
    if bound > SCORE_LIMIT:
        raise InputError(f"{prefix}{where(int(worst))} has norm {norm:.3g} and the largest item norm is "
                         f"{item_norm:.3g}{_from_centre(centre)}: metric {metric!r} scores could overflow float32; "
                         f"rescale the vectors")
