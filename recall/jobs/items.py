"""The start of every Parquet job: the item file read (on a GPU straight to the device) and its resident engine."""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core import metrics
from ..core.errors import InputError
from ..engine import Engine, streamed
from ..engine.inputs import check_item_norm
from ..io import inspect_embeddings, read_embeddings
from ..io.parquet import fmt_id


def check_nonzero(vectors: Any, ids: np.ndarray, path: str, row_start: int = 0,
                  file_rows: np.ndarray | None = None) -> None:
    """Cosine has no direction for a zero vector: name the file, row and id here, where they are known (the row:
    ``file_rows[i]`` of vector i where given, else ``row_start + i``)."""
    zero = ~vectors.any(axis=1)
    if bool(zero.any()):
        pos = int(zero.argmax())  # host or device vectors
        row = int(file_rows[pos]) if file_rows is not None else row_start + pos
        raise InputError(f"{path}: row {row} (id {fmt_id(ids[pos])}) {metrics.ZERO_VECTOR}")


def check_item_norm_row(norm: float, metric: str, path: str, row: int, item_id: Any) -> None:
    """The engine's refusal of an item whose norm overflows float32 under l2 (``check_item_norm``), for one row of
    an item file read apart from the engine (an item shard's rows, every one of which is checked)."""
    try:
        check_item_norm(norm, metric, lambda: 0)
    except InputError as exc:
        raise _named(exc, path, [item_id], [row]) from None


def item_engine(vectors: Any, ids: np.ndarray, path: str, file_rows: np.ndarray | None = None,
                **engine_args: Any) -> Engine:
    """``Engine(vectors, copy=False, **engine_args)`` over rows of an item file (vector i is file row
    ``file_rows[i]``, default i; ``vectors`` the job's own, which it does not change afterwards), whose refusal of
    an item row (an l2 norm that would overflow float32) names the file, the row and the id, as the reader's
    messages do."""
    try:
        return Engine(vectors, copy=False, **engine_args)
    except InputError as exc:
        raise _named(exc, path, ids, file_rows) from None


def _named(exc: InputError, path: str, ids: Any, file_rows: Any = None) -> InputError:
    """An engine's ``item_vecs: row i ...`` as ``{path}: row {file_rows[i]} (id {ids[i]}) ...`` (``exc`` itself when it
    names no item row)."""
    m = re.match(r"item_vecs: row (\d+) (.*)", str(exc), re.S)
    if m is None:
        return exc
    pos = int(m.group(1))
    row = int(file_rows[pos]) if file_rows is not None else pos
    return InputError(f"{path}: row {row} (id {fmt_id(ids[pos])}) {m.group(2)}")


def streams(backend: Any, n_items: int, dim: int, metric: str, memory_budget: int | None,
            item_memory: int | None) -> bool:
    """Whether an engine of these items would keep them in host memory (``recall.engine.streamed``): then the job
    reads the file into host memory rather than onto the device, and searches no batch while it loads."""
    budget = memory_budget if memory_budget is not None else backend.default_budget()
    return streamed.needs_streaming(backend, n_items, metrics.scored_width(metric, dim), item_memory,
                                    budget) is not None


def load_engine(items_path: str, id_col: str, vec_col: str, metric: str, backend: Any, memory_budget: int | None,
                precision: str = "exact", options: Any = None,
                on_rows: Callable[[Any, int], None] | None = None,
                item_memory: int | None = None, info: Any = None,
                keep_vectors: bool = False) -> tuple[np.ndarray, Any, Engine, float]:
    """Read and validate an item file into ``backend``'s memory and build the resident engine on it.

    The engine gets no ids: its results hold item rows, which the job maps to ids as it writes them
    (``result.to_arrow(user_ids, id_lookup(items.ids))``). So the gather of 10^8 ids runs on the writer thread
    rather than between two searches, and the ids, already checked by the reader (naming the file and rows), are not
    sorted a second time by the engine. ``on_rows(vectors, rows)`` is called as the rows arrive (see
    ``read_embeddings``). Items beyond ``item_memory`` (see :func:`streams`) are read into host memory and streamed.
    ``info``: the item file's ``inspect_embeddings``, where the caller has it already.

    Returns (item ids, the file's vectors where ``keep_vectors`` else None, engine, seconds spent reading): the
    engine holds the vectors (under ``ip`` the file's own array, on the host or the device: ``Engine(copy=False)``;
    else vectors it derived), so a caller that does not need the file's lets them go at once (a second catalogue in
    host memory for the whole job otherwise). The early start reads the ones it keeps and never changes them.
    Raises InputError naming the file, row and id of a bad item.
    """
    t0 = time.perf_counter()
    info = info or inspect_embeddings(items_path, id_col, vec_col)
    # A list<float> column declares no dimension: its items go to the host when the caller set item_memory.
    host = streams(backend, info.n_rows, info.dim, metric, memory_budget, item_memory) if info.dim is not None \
        else item_memory is not None
    items = read_embeddings(items_path, id_col, vec_col, allow_empty=False, target=None if host else backend,
                            on_rows=None if host else on_rows)
    if metric == "cosine":
        check_nonzero(items.vectors, items.ids, items_path)
    read_s = time.perf_counter() - t0
    engine = item_engine(items.vectors, items.ids, items_path, metric=metric, device=backend,
                         memory_budget=memory_budget, precision=precision, options=options, item_memory=item_memory)
    return items.ids, items.vectors if keep_vectors else None, engine, read_s
