"""Item-sharded batch jobs (``recall batch --item-shards N``): the catalogue cut into N row ranges, one worker per
range, every user batch scored by every worker against its range, and the per-user lists merged exactly before the
output is written.

The parts, and where they run:

- :func:`split_catalogue` (the parent) cuts the items into N contiguous row ranges. The ranges balance the items a
  search visits (those the item filter passes, or every item) and fall on the item tile grid of a search of the
  whole catalogue, so that every score a worker computes comes out of the same GEMM call, with the same operands,
  as in the unsharded job: the scores, and so the output bytes, are the unsharded job's.
- :class:`RangeScorer` (each worker: a process per GPU, or a share of the CPU cores, or a Ray actor) reads only its
  rows of the item file (:func:`recall.io.read_embedding_rows`; every row is still validated), keeps the ones the
  filter passes in an :class:`recall.Engine`, takes the job's exclusions that fall in its range (mapped once, by the
  parent: :mod:`.exclusions`), and returns, for each user
  batch, the range's top-k in the space the selection ranks in (inner products of the metric's prepared vectors),
  with global item rows.
- :class:`ItemShardScorer` (the parent) reads the item ids once (duplicates are checked over the whole file; the
  output maps rows to them) and the filter files, sends each batch to every worker, merges the lists
  (:func:`recall.core.results.merge_topk`: best k, equal scores to the lower global row, padding last), finishes
  the scores for the metric (``metrics.finish_scores``: l2's ``2·s - |u|²`` rounds, so lists are merged before it)
  and writes the output through the same code as an unsharded worker (:func:`.worker.stream_shard`).

Workers are reached through handles (:class:`InlineHandle` here; processes and Ray actors in
:mod:`recall.jobs.executors`) with one operation, ``submit(method, *args)``: the call of a :class:`RangeScorer`
method in the worker, answered in submission order by a reply whose ``result()`` waits for it.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa

from ... import backends
from ...core import metrics
from ...core.checks import check_budget
from ...core.errors import InputError
from ...core.exclusions import normalise
from ...core.filters import ItemFilter
from ...core.options import EngineOptions
from ...core.results import SearchResult, id_lookup, merge_topk
from ...core.tiling import TilePlan, plan_tiles
from ...engine import Engine
from ...engine import tuning
from ...io import embedding_dim, read_embedding_rows, read_ids, read_item_filter
from ..files import auto_batch_size, check_scores_fit
from ..items import check_item_norm_row, check_nonzero, item_engine
from .exclusions import ExclusionIndex
from .worker import JobSpec, OutputLayout, ShardResult, ShardTask, WorkerInfo, stream_shard


#: Users merged at a time: a block's keys (shards x k per user) stay in cache. One merge of a whole batch spends more
#: time in fresh pages than in selecting: 0.37 s against 0.15 s for 65,536 users, k 100, 3 shards, on one core of the
#: development machine.
_MERGE_ROWS = 1024


@dataclass(frozen=True)
class ItemRange:
    """One worker's part of the catalogue.

    Attributes
    ----------
    index : int
        Its place among the ranges (rows increase with it).
    start, stop : int
        The item file rows it reads and validates, ``[start, stop)``; the ranges cover the file once.
    first : int
        The position of its first searched item among all searched items (the filter's passing items in file order,
        or every item).
    keep : np.ndarray of int64 or None
        The searched items' positions in ``[0, stop - start)`` (the rows the filter passes); None: every row.
    """

    index: int
    start: int
    stop: int
    first: int
    keep: np.ndarray | None = None

    @property
    def size(self) -> int:
        """Items this range searches."""
        return self.stop - self.start if self.keep is None else int(self.keep.size)


def split_catalogue(n_items: int, passing: np.ndarray | None, n_shards: int, grain: int) -> list[ItemRange]:
    """Cut the item file into ``n_shards`` contiguous row ranges that balance the searched items.

    The cuts fall between tiles of ``grain`` searched items (the item tile of a search of the whole catalogue), so
    that each range's search runs the unsharded search's GEMM calls: ``ceil(n / grain)`` tiles are dealt out
    evenly, earlier ranges first. A catalogue of fewer tiles than shards leaves the last ranges empty (they return
    no items) rather than cut a tile. Rows the filter removes go with the range before them, so every file row is
    read (and validated) by exactly one worker.

    Parameters
    ----------
    n_items : int
        Rows of the item file.
    passing : np.ndarray of int64 or None
        The increasing rows the item filter passes; None: every row.
    n_shards, grain : int
        Both >= 1.
    """
    n_searched = n_items if passing is None else int(passing.size)
    n_tiles = -(-n_searched // grain)
    firsts = [min(n_searched, -(-i * n_tiles // n_shards) * grain) for i in range(n_shards + 1)]

    def row_of(position: int) -> int:
        if position >= n_searched:
            return n_items
        return position if passing is None else int(passing[position])

    starts = [0] + [row_of(p) for p in firsts[1:-1]] + [n_items]
    ranges = []
    for i in range(n_shards):
        start, stop = starts[i], starts[i + 1]
        keep = None
        if passing is not None:
            keep = passing[firsts[i]:firsts[i + 1]] - start
        ranges.append(ItemRange(i, start, stop, firsts[i], keep))
    return ranges


@dataclass(frozen=True)
class RangeReady:
    """What a worker reports once its range is loaded: its :class:`WorkerInfo` (``n_items``: the items it searches;
    ``exclusion_pairs`` / ``unknown_exclusions``: the file's pairs, and of those the ones the parent could not map),
    the largest norm of its rows (every row, for the float32 overflow check of the whole job) and the rows
    it covers."""

    info: WorkerInfo
    item_norm: float
    start: int
    stop: int


@dataclass(frozen=True)
class _Bound:
    """What :func:`recall.jobs.files.check_scores_fit` reads of an engine, the whole catalogue's: its largest item
    norm, metric and l2 centre."""

    item_norm: float
    metric: str
    l2_centre: np.ndarray | None = None

    def centred(self, xp: Any, vecs: Any) -> Any:
        """``Engine.centred``: the vectors as the catalogue's engines score them."""
        return vecs if self.l2_centre is None else vecs - self.l2_centre


def catalogue_centre(spec: JobSpec, n_items: int) -> np.ndarray | None:
    """The l2 centre of the whole item file (``Engine.l2_centre`` of an engine over every item, as the unsharded job
    holds them): from its first rows, read (and validated) here. None under other metrics."""
    if spec.metric != "l2" or n_items == 0:
        return None
    _, vectors = read_embedding_rows(spec.items_path, 0, min(n_items, metrics.CENTRE_ROWS), spec.id_col,
                                     spec.vec_col)
    return metrics.far_centre(vectors)


def scored_dim(metric: str, dim: int) -> int:
    """The width of the vectors the backend scores (the metric's transform may widen them: l2)."""
    return int(metrics.prepare_users(metric, np, np.ones((1, dim), np.float32)).shape[1])


@dataclass(frozen=True)
class _Catalogue:
    """The attributes ``tuning.preferred_tiles`` reads of an engine, for the whole searched catalogue (the tiling
    the unsharded job would pick: its tune cache key counts every searched item, not a range's)."""

    backend: Any
    metric: str
    n_items: int
    options: EngineOptions
    tune_mode: str = "auto"
    precision: str = "exact"


class RangeScorer:
    """One item-shard worker's resident state: its range of the items in an :class:`recall.Engine`, the exclusions
    that fall in it; :meth:`topk` scores a user batch against it.

    The methods are called in order: :meth:`plan` (worker 0 only), :meth:`load`, then per user shard :meth:`begin`
    and :meth:`topk` for each of its batches.

    Parameters
    ----------
    spec : JobSpec
    device : {"auto", "cpu", "gpu"}
    worker : str

    Raises
    ------
    BackendUnavailable
        ``device="gpu"`` and no GPU.
    """

    def __init__(self, spec: JobSpec, device: str = "auto", worker: str = "0") -> None:
        self.spec, self.worker = spec, worker
        self.backend = backends.resolve(device)
        self.dim = embedding_dim(spec.items_path, spec.id_col, spec.vec_col)
        self.engine: Engine | None = None
        self.range: ItemRange | None = None
        self.n_searched = 0
        self.k = 0
        self.exclusions: ExclusionIndex | None = None
        self.shard_exclusions: Any = None
        self.local_filter: ItemFilter | None = None
        self.global_rows = np.zeros(0, np.int64)
        self.budget = check_budget(spec.memory_budget)

    # -- set-up ------------------------------------------------------------------------------------------------------
    def plan(self, n_searched: int, k: int) -> tuple[int | None, int, int]:
        """(dim, users per batch, grain) of the job: the items' dimension (None when row 0 has no usable vector: the
        worker that reads it says why), the batch size, and the item tile of a search of ``n_searched`` items for
        ``k`` (the output's width), on which :func:`split_catalogue` cuts the ranges."""
        dim = self.dim or 1
        batch_size = self.spec.batch_size or auto_batch_size(k, dim)
        if n_searched == 0:
            return self.dim, batch_size, 1
        users = np.empty((batch_size, scored_dim(self.spec.metric, dim)), np.float32)  # only its shape is read
        whole, preferred = self._whole_plan(users, n_searched, min(k, n_searched))
        # The widest tile a batch may use: a budget that shrinks the tiles halves them, and a shorter last batch
        # shrinks them less (a batch job's engines keep their tiles for few users: EngineOptions.few_user_tiles);
        # cuts on the preferred width fall on every halving of it.
        widest = min(preferred[1], n_searched)
        return self.dim, batch_size, widest if widest % whole.item_tile == 0 else whole.item_tile

    def _whole_plan(self, users: Any, n_searched: int, k: int) -> tuple[TilePlan, tuple[int, int, int]]:
        """The tiling (and the preferred tiles it came from) a search of ``users`` against all ``n_searched``
        items would use: ``Engine.run``'s planning with the whole catalogue's size. Every range runs it, so its
        user blocks and item tiles are the unsharded search's."""
        options = self.spec.options.engine
        whole = _Catalogue(self.backend, self.spec.metric, n_searched, options)
        preferred = options.tiles or tuning.preferred_tiles(whole, users, n_searched, k)
        preferred = (max(preferred[0], options.min_user_block), preferred[1], preferred[2])
        budget = self.engine.memory_budget if self.engine is not None else \
            (self.budget if self.budget is not None else self.backend.default_budget())
        plan = plan_tiles(int(users.shape[0]), n_searched, int(users.shape[1]), k, budget, preferred,
                          self.backend.state_bytes(k, n_searched), self.backend.workers,
                          tuning.few_users_area(self.backend, options))
        return plan, preferred

    def load(self, item_range: ItemRange, n_searched: int, k: int, centre: np.ndarray | None = None) -> RangeReady:
        """Read, validate and prepare the range's items; open the job's exclusions.

        ``n_searched``: the searched items of the whole catalogue; ``k``: the output's width; ``centre``: the whole
        catalogue's l2 centre (:func:`catalogue_centre`), which the range's engine takes.

        Raises
        ------
        InputError
            A bad item row (file, row and id, counted over the whole file), a zero vector under cosine.
        """
        t0 = time.perf_counter()
        spec = self.spec
        self.range, self.n_searched, self.k = item_range, n_searched, k
        norm = [0.0]

        def validate(ids: np.ndarray, vectors: np.ndarray, row: int) -> None:
            # Every row, searched or not: the unsharded job checks (and bounds its scores by) the whole file.
            if spec.metric == "cosine":
                check_nonzero(vectors, ids, spec.items_path, row)
            elif len(vectors):
                norms = metrics.row_norms(np, vectors if centre is None else vectors - centre)
                worst = int(norms.argmax())
                norm[0] = max(norm[0], float(norms[worst]))
                # The unsharded engine refuses such a row wherever it is, searched or not: so does every range.
                check_item_norm_row(float(norms[worst]), spec.metric, spec.items_path, row + worst, ids[worst])

        ids, vectors = read_embedding_rows(spec.items_path, item_range.start, item_range.stop, spec.id_col,
                                           spec.vec_col, dim=self.dim, keep=item_range.keep, on_batch=validate)
        n_rows = item_range.stop - item_range.start
        local = np.arange(n_rows, dtype=np.int64) if item_range.keep is None else item_range.keep
        self.global_rows = item_range.start + local
        if item_range.keep is not None:
            self.local_filter = ItemFilter.build(n_rows, allow=item_range.keep)
        if vectors.shape[0]:
            self.engine = item_engine(vectors, ids, spec.items_path, self.global_rows, metric=spec.metric,
                                      device=self.backend, memory_budget=spec.memory_budget,
                                      options=spec.options.engine, item_memory=spec.options.item_memory,
                                      l2_centre=centre)
        if spec.exclusions is not None and n_rows:
            self.exclusions = spec.exclusions.open()  # mapped once by the parent, rows of the whole catalogue
        engine = self.engine
        info = WorkerInfo(
            worker=self.worker, device=self.backend.name, device_detail=self.backend.describe(),
            host=socket.gethostname(), pid=os.getpid(), items_load_s=time.perf_counter() - t0,
            n_items=item_range.size, dim=self.dim or 0,
            exclusion_pairs=spec.exclusions.n_pairs if spec.exclusions is not None else 0,
            unknown_exclusions=spec.exclusions.n_unknown if spec.exclusions is not None else 0,
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            cpu_affinity=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            item_rows=[item_range.start, item_range.stop],
        )
        item_norm = 1.0 if spec.metric == "cosine" else norm[0]
        if engine is not None:
            info = replace(info, device=engine.device, device_detail=engine.backend.describe())
        return RangeReady(info, item_norm, item_range.start, item_range.stop)

    def memory_budget(self) -> int:
        """The search's working memory in bytes (the engine's, or what it would get)."""
        if self.engine is not None:
            return int(self.engine.memory_budget)
        return int(self.budget if self.budget is not None else self.backend.default_budget())

    # -- per shard ---------------------------------------------------------------------------------------------------
    def begin(self, user_ids: np.ndarray) -> int:
        """A new user shard: cut its users' exclusions (those in this range). Returns how many there are."""
        self.shard_exclusions = None
        if self.exclusions is not None:
            self.shard_exclusions = ExclusionIndex.in_rows(self.exclusions.for_shard(user_ids), self.range.start,
                                                           self.range.stop)
        return int(self.shard_exclusions.item_rows.size) if self.shard_exclusions is not None else 0

    def topk(self, row_start: int, user_vecs: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """The range's best ``min(k, range items)`` items for users ``row_start:row_start + n`` of the shard.

        Parameters
        ----------
        row_start : int
            The batch's first row in the shard (for its exclusions).
        user_vecs : np.ndarray of float32, shape (n, dim)
            The users' vectors as read (validated by the parent).

        Returns
        -------
        (scores (n, w) float32, rows (n, w) int64, device busy seconds)
            Best first in inner-product space of the metric's prepared vectors, equal scores lower row first; rows
            are item file rows, -1 (score -inf) where fewer items qualify.
        """
        n = int(user_vecs.shape[0])
        engine = self.engine
        if engine is None:  # a range without items (more shards than item tiles, or the filter passes none)
            return np.zeros((n, 0), np.float32), np.zeros((n, 0), np.int64), 0.0
        k_local = min(self.k, engine.n_items)
        exclude = None
        if self.shard_exclusions is not None:
            n_rows = self.range.stop - self.range.start
            exclude = normalise(self.shard_exclusions.block(row_start, row_start + n), n, n_rows)
            if self.local_filter is not None:
                exclude = self.local_filter.exclusions(exclude)
        else:
            exclude = normalise(None, n, engine.n_items)
        prepared = metrics.prepare_users(self.spec.metric, np, engine.centred(np, user_vecs))
        plan, _ = self._whole_plan(prepared, self.n_searched, min(self.k, self.n_searched))
        # The whole catalogue's tiles, cut to the range (a tile never wider than what it holds: the same calls).
        tile = min(plan.item_tile, engine.n_items)
        plan = replace(plan, item_tile=tile, tiles_per_call=max(1, min(plan.tiles_per_call,
                                                                       -(-engine.n_items // tile))))
        vals = engine.backend.empty_out((n, k_local), np.float32, True)
        rows = engine.backend.empty_out((n, k_local), np.int64, True)
        stats = engine.run(prepared, k_local, exclude, vals, rows, plan=plan)()
        vals, rows = engine.backend.to_host(vals), engine.backend.to_host(rows)
        rows = np.where(rows >= 0, self.global_rows[np.maximum(rows, 0)], -1)
        return np.ascontiguousarray(vals), rows, float((stats or {}).get("gpu_busy_s", 0.0))


class InlineReply:
    """A call already made, as a reply (its value, or its exception raised by ``result()``)."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class InlineHandle:
    """A :class:`RangeScorer` in this process, called at once (tests and tools; a job runs its workers apart)."""

    def __init__(self, scorer: RangeScorer) -> None:
        self.scorer, self.name = scorer, scorer.worker
        self.shard: str | None = None

    def submit(self, method: str, *args: Any) -> InlineReply:
        try:
            return InlineReply(getattr(self.scorer, method)(*args))
        except Exception as exc:  # noqa: BLE001 - raised by result(), in the caller's order
            return InlineReply(error=exc)

    def share(self, value: Any) -> Any:
        return value

    def drain(self) -> None:
        pass


class _Merged:
    """A batch sent to every worker: ``result()`` waits for their lists, merges them and finishes the scores."""

    def __init__(self, replies: list[Any], user_vecs: np.ndarray, k: int, metric: str) -> None:
        # ``user_vecs``: as the engines scored them (less the catalogue's l2 centre), for the metric's scores.
        self.replies, self.user_vecs, self.k, self.metric = replies, user_vecs, k, metric
        self.stats: dict = {}

    def result(self) -> SearchResult:
        parts = [reply.result() for reply in self.replies]
        n = int(self.user_vecs.shape[0])
        vals, rows = np.empty((n, self.k), np.float32), np.empty((n, self.k), np.int64)
        for start in range(0, n, _MERGE_ROWS):
            stop = min(n, start + _MERGE_ROWS)
            vals[start:stop], rows[start:stop] = merge_topk(np, [(p[0][start:stop], p[1][start:stop]) for p in parts],
                                                            self.k)
        self.stats = {"gpu_busy_s": sum(p[2] for p in parts)}
        # In the space the lists were selected in until here: l2's finish rounds, and could make two different
        # inner products equal (and order them by row, where the unsharded job orders them by score).
        vals = metrics.finish_scores(self.metric, np, vals, self.user_vecs)
        return SearchResult(indices=rows, scores=vals, ids=rows)


class ItemShardScorer:
    """The parent's side of an item-sharded job: the item ids and filter read once, the catalogue split, every
    worker's range loaded; :meth:`score` streams a user shard through every worker and merges.

    Parameters
    ----------
    spec : JobSpec
    handles : list
        One per item shard, in range order (see the module docstring).

    Attributes
    ----------
    infos : list of WorkerInfo
        The workers, once loaded (their ``item_rows``: the file rows each holds).
    totals : WorkerInfo
        The job as one worker would report it (the whole catalogue, every exclusion pair and filter id), for the
        summary.

    Raises
    ------
    InputError
        A bad item file (duplicate ids over the whole file, a bad row in any range), bad filter files.
    """

    def __init__(self, spec: JobSpec, handles: list[Any]) -> None:
        t0 = time.perf_counter()
        self.spec, self.handles = spec, handles
        ids = read_ids(spec.items_path, spec.id_col, spec.vec_col)  # whole column: unique over every range
        n_items = int(ids.size)
        self.item_id_type = pa.string() if ids.dtype == object else pa.int64()
        self.item_ids = id_lookup(ids)
        allow, deny = read_item_filter(spec.allow_path, spec.deny_path, ids)
        flt = ItemFilter.build(n_items, allow=None if allow is None else allow.rows,
                               deny=None if deny is None else deny.rows)
        del ids
        passing = None if flt is None else flt.rows
        n_searched = n_items if passing is None else int(passing.size)
        # The output's width, as one worker's (never wider than the catalogue, whatever the filter passes).
        self.k = min(spec.k, n_items)
        dim, self.batch_size, self.grain = handles[0].submit("plan", n_searched, self.k).result()
        self.n_searched = n_searched
        self.ranges = split_catalogue(n_items, passing, len(handles), self.grain)
        centre = catalogue_centre(spec, n_items)
        replies = [h.submit("load", r, n_searched, self.k, centre) for h, r in zip(handles, self.ranges)]
        readies: list[RangeReady] = [reply.result() for reply in replies]
        self.infos = [r.info for r in readies]
        self.dim = dim or 0
        self.bound = _Bound(max(r.item_norm for r in readies), spec.metric, centre)
        self.memory_budget = handles[0].submit("memory_budget").result()
        excl = spec.exclusions
        self.totals = replace(
            self.infos[0], worker="items", n_items=n_items, items_load_s=time.perf_counter() - t0,
            exclusion_pairs=excl.n_pairs if excl is not None else 0,
            unknown_exclusions=excl.n_unknown if excl is not None else 0,
            filter_ids=sum(f.n_ids for f in (allow, deny) if f is not None),
            unknown_filter_ids=sum(f.n_unknown for f in (allow, deny) if f is not None), item_rows=[0, n_items])

    @property
    def n_shards(self) -> int:
        return len(self.handles)

    def empty_notice(self) -> str | None:
        """What to say when some ranges hold no item (a catalogue of fewer item tiles than shards), else None."""
        empty = sum(r.size == 0 for r in self.ranges)
        if not empty or self.n_searched == 0:
            return None
        tiles = -(-self.n_searched // self.grain)
        return (f"--item-shards {self.n_shards}: the {self.n_searched:,} items searched make {tiles} item tile"
                f"{'s' if tiles != 1 else ''} of {self.grain:,} (the search's tile on this device), and a tile is "
                f"never cut, so that scores stay those of the unsharded job: {empty} of the {self.n_shards} item "
                f"shards {'hold' if empty != 1 else 'holds'} no item")

    def score(self, task: ShardTask, progress: Callable[[int], None] | None = None) -> ShardResult:
        """Score one user shard into ``task.out_path`` (atomically): every batch against every range, merged.

        Raises
        ------
        InputError
            A bad shard: the message names the file, the row and the id.
        """
        spec = self.spec
        t0 = time.perf_counter()
        for h in self.handles:
            h.shard = task.name  # for a worker's failure message
        user_ids = read_ids(task.path, spec.id_col, spec.vec_col)
        applied = sum(reply.result() for reply in [h.submit("begin", user_ids) for h in self.handles])
        t_ids = time.perf_counter() - t0

        def query(batch: Any) -> _Merged:
            # The whole catalogue's float32 bound (each worker knows only its range's largest norm).
            check_scores_fit(self.bound, batch.vectors, batch.ids, task.path, batch.row_start)
            vectors = self.handles[0].share(batch.vectors)
            return _Merged([h.submit("topk", batch.row_start, vectors) for h in self.handles],
                           self.bound.centred(np, batch.vectors), self.k, spec.metric)

        layout = OutputLayout(self.k, self.batch_size, self.dim, self.item_ids, self.item_id_type)
        try:
            written = stream_shard(task, spec, layout, user_ids, query, progress)
        except InputError:
            # A bad shard stopped half-way: the job goes on, and the replies of the batches sent ahead must not
            # answer the next shard's calls. (Any other failure ends the job: its workers are stopped, not waited
            # for.) The shard's own error is the one to report.
            for h in self.handles:
                with contextlib.suppress(Exception):
                    h.drain()
            raise
        return ShardResult(
            name=task.name, rows=written.rows, bytes=written.bytes, sha256=written.sha256,
            seconds=time.perf_counter() - t0, read_s=t_ids + written.stream.read_s,
            search_s=written.stream.search_s, write_s=written.stream.write_s, hash_s=written.hash_s,
            device_busy_s=written.stream.device_busy_s, batch_size=self.batch_size,
            memory_budget=self.memory_budget, device=self.infos[0].device, worker="items",
            exclusions_applied=applied, item_shards=self.n_shards,
        )


__all__ = ["InlineHandle", "ItemRange", "ItemShardScorer", "RangeReady", "RangeScorer", "split_catalogue"]
