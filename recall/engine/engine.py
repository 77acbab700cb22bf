"""The public, embeddable API: an item matrix prepared once, searched many times.

One query pipeline over the backend protocol (``recall.backends.protocol``): validate the users (once, here),
transform them for the metric, plan the tiling, let the backend search, pad, finish the scores, map the ids. The
same code runs on the CPU and the GPU; nothing here asks which one it is.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import backends
from ..core import metrics
from ..core.checks import PRECISIONS, check_budget, check_choice, check_k
from ..core.errors import InputError
from ..core.exclusions import Exclusions, normalise
from ..core.filters import ItemFilter
from ..core.options import DEFAULT_OPTIONS, EngineOptions
from ..core.results import SearchResult, pad, take_ids
from ..core.tiling import plan_tiles
from . import fast, inputs, interests, streamed, tuning
from .candidates import normalise_candidates


_views_lock = threading.Lock()  # guards every engine's ``_views`` (searched from several threads at once)


def _new_views_lock() -> None:
    global _views_lock
    _views_lock = threading.Lock()  # a forked child's: a thread of the parent may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_views_lock)


class Engine:
    """Exact top-k search of users against a resident item matrix.

    Parameters
    ----------
    item_vecs : array, shape (n_items, dim)
        Item embeddings, any real dtype (converted to float32); NumPy, or a device array (CuPy, anything with
        ``__dlpack__``) for the GPU backend. Uploaded once and kept on the device.
    ids : array, shape (n_items,), optional
        Item ids (integers or strings), unique. ``SearchResult.ids`` maps rows to these; row positions when omitted.
    metric : {"ip", "cosine", "l2"}
        Inner product, cosine similarity, or negative squared Euclidean distance.
    device : {"auto", "cpu", "gpu"} or a backend
        "auto" takes the GPU when one is usable and otherwise falls back to the CPU, saying so once. A backend from
        ``recall.backends.resolve`` (or another engine's ``backend``) is shared: its streams and workspaces serve
        both engines, and their results can be merged on the device.
    memory_budget : int, optional
        Bytes of working memory a search may use beyond the item matrix and its results; the search is tiled to fit.
        Default: a quarter of the free memory of the device, at most 1 GiB on the CPU and 8 GiB on a GPU.
    precision : {"exact", "fast"}
        "exact" scores in float32 (on a GPU: the fused scoring-and-filtering kernel up to 256 dimensions, else
        ``cublasSgemmStridedBatched``); on a GPU, large searches that would run the fused kernel find their
        candidates on tensor cores and re-score them with that kernel's own sums: the same answer, bit for bit
        (``EngineOptions.certified_exact``, ``stats["route"]``). "fast" scores float16 inputs on tensor cores,
        re-ranks k + max(16, k/4) candidates in float32 and proves from an error bound that the answer equals exact
        mode's, falling back to exact mode for the users where the proof fails (``stats["fallback_users"]``). The
        CPU has no faster float16 arithmetic: there "fast" searches in exact precision (``stats["fast_declined"]``),
        unless ``EngineOptions.fast_emulation`` asks for the emulation (for tests: slower than exact).
    tune : {"auto", "force", "off"}
        Tiling: "auto" takes a matching entry of the ``recall tune`` cache, else the backend's heuristic; "force"
        tunes each new shape on its first search (and caches it); "off" always uses the heuristic.
    options : EngineOptions, optional
        Tuning knobs (tiling, CUDA graphs, the fused kernel's geometry...); none changes an answer.
    item_memory : int, optional
        Bytes the resident items (with what the backend derives from them: the GPU's transposed copy, about twice
        the float32 matrix) may take on the device. Items that need more are kept, checked and prepared, in
        page-locked host memory and streamed to the device in segments of half this size at every search
        (``recall.engine.streamed``): the same answer, for about the cost of the copies where the search is
        compute-bound. Default: what the device can hold beside the memory budget (on the CPU: no limit, the
        items are resident there; set it to exercise the streamed path). ``stats["streamed"]`` says when a search
        streamed. Fast precision needs resident items: a streamed engine searches in exact precision and says so
        (``stats["fast_declined"]``).
    l2_centre : "auto", None or array of shape (dim,)
        Under ``l2``, a point subtracted from items and users before they are scored, which leaves every distance
        as it is: "auto" takes the mean of the first 4,096 items where it lies far from the origin (more than 8
        times the items' spread: there float32 products would lose the digits that tell the distances apart), and
        none elsewhere. Engines whose search results are merged (``merge_topk``: each over a part of a catalogue)
        must share it: give each the whole catalogue's (:attr:`l2_centre`). Ignored under ``ip`` and ``cosine``.
    copy : bool
        False: where the engine would keep an exact copy of ``item_vecs`` (float32, C-contiguous, ``ip``, on the
        backend that holds the array), it keeps the array itself, and the caller must not change it afterwards: a
        catalogue the caller lets go is then held once, not twice while the engine is built. Under ``cosine`` and
        ``l2`` the engine keeps vectors it derived either way. Default True.

    Raises
    ------
    InputError
        Bad vectors (not 2-d, empty, NaN/Inf), duplicate ids, wrong-length ids, unknown metric, device, precision or
        tune mode, bad options.
    BackendUnavailable
        ``device="gpu"`` and no usable GPU.
    """

    def __init__(self, item_vecs: Any, ids: Any = None, metric: str = "ip", device: Any = "auto",
                 memory_budget: int | None = None, precision: str = "exact", tune: str = "auto",
                 options: EngineOptions | None = None, item_memory: int | None = None,
                 l2_centre: Any = "auto", copy: bool = True) -> None:
        self.metric = metrics.check_metric(metric)
        self.tune_mode = tuning.check_mode(tune)
        self.precision = check_choice(precision, PRECISIONS, "precision")
        if options is not None and not isinstance(options, EngineOptions):
            raise InputError(f"options must be a recall.EngineOptions, got {type(options).__name__}")
        self.options = options or DEFAULT_OPTIONS
        budget = check_budget(memory_budget)
        self.item_memory = check_budget(item_memory, "item_memory")
        self.backend = backends.resolve(device)
        xp = self.backend.xp
        self.memory_budget = budget if budget is not None else self.backend.default_budget()
        shape = tuple(getattr(item_vecs, "shape", ()))
        cap = None
        if len(shape) == 2 and shape[0] >= 1:
            cap = streamed.needs_streaming(self.backend, shape[0], metrics.scored_width(self.metric, shape[1]),
                                           self.item_memory, self.memory_budget)
        if cap is not None:
            # Beyond the device: checked and prepared a chunk at a time, kept in host memory, streamed per search.
            self._set_centre(l2_centre, int(shape[1]), lambda: self.backend.to_host(inputs.matrix(
                self.backend, xp, item_vecs[:metrics.CENTRE_ROWS], "item_vecs")))
            self._items, self.item_norm = streamed.prepare(self.backend, self.metric, item_vecs, cap, self.l2_centre)
            inputs.check_item_norm(self.item_norm, self.metric)
            self.prepared_items = self._items.host
            self.n_items, self.dim = int(shape[0]), int(shape[1])
        else:
            # Checked and prepared where the engine keeps them: on a GPU after one upload (a host array's checks,
            # norms included, cost a million-item job a fraction of a second of CPU before its first search).
            items = inputs.matrix(self.backend, xp, item_vecs, "item_vecs", own=self.metric == "ip" and bool(copy))
            if items.shape[0] < 1:
                raise InputError("item_vecs: there are no items")
            self.n_items, self.dim = int(items.shape[0]), int(items.shape[1])
            self._set_centre(l2_centre, self.dim, lambda: self.backend.to_host(items[:metrics.CENTRE_ROWS]))
            # (n_items, scored dim), on the backend; under l2 less the centre, where there is one
            self.prepared_items = metrics.prepare_items(self.metric, xp, items, centre=self._centre_on)
            self.item_norm = 1.0
            if self.metric != "cosine":
                norms = metrics.row_norms(xp, self.prepared_items[:, :self.dim])  # the vectors as scored
                self.item_norm = float(norms.max())
                inputs.check_item_norm(self.item_norm, self.metric, lambda: int(xp.argmax(norms)), self.l2_centre)
            self._items = self.backend.load_items(self.prepared_items, metrics.norms_rank(self.metric))
        self.ids = inputs.item_ids(ids, self.n_items)
        self._fast: fast.FastState | None = None
        self._filter: ItemFilter | None = None  # set_item_filter's: applies to every search
        self._views: dict[str, Engine] = {}  # filtered catalogues by filter key (the last few)
        self.stats: dict = {}  # what the last search did: blocks, tiling, wall and (GPU) busy seconds

    def __getstate__(self) -> dict:
        """A CPU engine pickles (for ``multiprocessing``'s spawn, Spark): its prepared items, ids, filter and options;
        not the caches made from them (filtered catalogues, fast mode's float16 copy), which the unpickled engine
        makes again as it needs them. The backend pickles itself (the CPU's without its pool, remade in the receiving
        process; the GPU's raises ``TypeError`` saying what to do instead)."""
        state = dict(self.__dict__)
        state.update(_views={}, _fast=None)
        return state

    def _set_centre(self, centre: Any, dim: int, first_rows: Callable[[], np.ndarray]) -> None:
        """``l2_centre`` (see the class), checked: ``self.l2_centre`` (host float32 or None), and its device copy;
        ``first_rows()``: the items' first ``metrics.CENTRE_ROWS`` rows on the host, checked, for "auto"."""
        self.l2_centre = None
        if isinstance(centre, str):
            if centre != "auto":
                raise InputError(f"l2_centre: expected 'auto', None or a vector, got {centre!r}")
            if self.metric == "l2":
                self.l2_centre = metrics.far_centre(first_rows())
        elif centre is not None and self.metric == "l2":
            vec = np.asarray(centre)
            if vec.shape != (dim,) or vec.dtype.kind not in "fiu" or not np.isfinite(vec).all():
                raise InputError(f"l2_centre: expected {dim} finite numbers, got shape {vec.shape} of {vec.dtype}")
            with np.errstate(over="ignore"):
                self.l2_centre = vec.astype(np.float32)
            if not np.isfinite(self.l2_centre).all():
                raise InputError(f"l2_centre: coordinate {int(np.flatnonzero(~np.isfinite(self.l2_centre))[0])} is "
                                 f"beyond the float32 range")
        self._centre_on = None if self.l2_centre is None else self.backend.xp.asarray(self.l2_centre)

    def centred(self, xp: Any, vecs: Any) -> Any:
        """Vectors (n, dim) of module ``xp`` as the engine scores them: less its l2 centre, where it has one."""
        if self.l2_centre is None:
            return vecs
        return vecs - (self._centre_on if xp is self.backend.xp else self.l2_centre)

    @property
    def device(self) -> str:
        """"cpu" or "gpu": where this engine runs."""
        return self.backend.name

    @property
    def streamed(self) -> bool:
        """Whether the items live in host memory and are streamed to the device at every search (``item_memory``)."""
        return isinstance(self._items, streamed.StreamedItems)

    @property
    def resident_items(self) -> Any:
        """The backend's resident form of the prepared items (what ``Backend.run_blocks`` and ``rescore`` take)."""
        return self._items

    @property
    def asynchronous(self) -> bool:
        """Whether :meth:`search_async` returns before the search is done (the device works meanwhile)."""
        return self.backend.asynchronous

    # -- the query pipeline ---------------------------------------------------------------------------------------
    def search(self, user_vecs: Any, k: int, exclude: Any = None, aggregate: str | None = None, *,
               allow: Any = None, deny: Any = None) -> SearchResult:
        """The exact top-k items for every user, best first; ties go to the lower item row.

        Parameters
        ----------
        user_vecs : array, shape (n_users, dim)
            NumPy, or a device array (CuPy, torch CUDA tensor via ``__dlpack__``) used in place on the GPU. Users
            with several vectors: an (n_users, n_interests, dim) array, or a list of (n_i, dim) arrays.
        k : int
            Items per user, >= 1 and below 2^31. The result has ``min(k, n_items)`` columns: a k beyond the
            catalogue returns the whole catalogue and costs no more memory than ``k = n_items``. Where fewer items
            qualify (exclusions), rows are padded with index -1 and score -inf.
        exclude : mapping {user_row: iterable of item rows} or (indptr, item_rows) CSR, optional
            Items never to return to a user; removed before selection, so a user still gets k items if k remain.
        aggregate : {"max", "sum"}, optional
            For users with several vectors: an item's score is the max (default) or the sum over the user's
            interests.
        allow, deny : array of item rows, or boolean mask of shape (n_items,), optional
            A shared item filter for this search: only allowed items (all when ``allow`` is None) that are not
            denied can be returned, to every user; applied before selection (k results whenever k items pass),
            together with the engine's own filter (:meth:`set_item_filter`) and each user's exclusions.

        Returns
        -------
        SearchResult
            (n_users, min(k, n_items)) arrays: CuPy arrays when ``user_vecs`` lived on the GPU, NumPy arrays
            otherwise.

        Raises
        ------
        InputError
            k < 1 or >= 2^31, wrong dimension, NaN/Inf, zero vector under cosine, exclusions or filter rows out of
            range.
        ResourceError
            The memory budget cannot hold even the smallest tile.
        """
        if interests.is_multi(user_vecs):
            k = check_k(k)
            aggregate = interests.check_aggregate(aggregate or "max")
            flt = self._effective_filter(allow, deny)
            if flt is None:
                return interests.search(self, user_vecs, k, exclude, aggregate)
            n_users = interests.count_users(user_vecs)
            if flt.n_passing == 0:
                interests.check(self, user_vecs, aggregate)  # nothing to search: still the same errors
            return self._filtered(flt, n_users, k, normalise(exclude, n_users, self.n_items),
                                  lambda view, ex: interests.search(view, user_vecs, k, ex, aggregate))
        if aggregate is not None:
            interests.check_aggregate(aggregate)
        return self.search_async(user_vecs, k, exclude, allow=allow, deny=deny).result()

    def set_item_filter(self, allow: Any = None, deny: Any = None) -> None:
        """Keep a shared item filter for every later search (the catalogue of the day): only allowed items (all when
        ``allow`` is None) that are not denied are returned. The filtered catalogue is gathered once, on the device
        for a GPU engine, and kept until the filter changes; ``set_item_filter()`` removes it.

        Parameters
        ----------
        allow, deny : array of item rows (int, any order, repeats allowed), or boolean mask (n_items,), optional
            Host or device arrays.

        Raises
        ------
        InputError
            A row out of range, a mask of the wrong length.
        """
        self._filter = ItemFilter.build(self.n_items, allow, deny)

    @property
    def item_filter(self) -> ItemFilter | None:
        """The filter :meth:`set_item_filter` set (None: every item)."""
        return self._filter

    def _effective_filter(self, allow: Any, deny: Any) -> ItemFilter | None:
        """The engine's filter combined with a search's own (an item must pass both)."""
        kept = self._filter  # read once: set_item_filter may replace it from another thread meanwhile
        call = ItemFilter.build(self.n_items, allow, deny)
        if call is None or kept is None:
            return call or kept
        return ItemFilter.build(self.n_items, allow=np.intersect1d(call.rows, kept.rows, assume_unique=True))

    def _view(self, flt: ItemFilter) -> "Engine":
        """An engine over the rows ``flt`` passes (the prepared items gathered once, on this backend), kept for the
        next searches with the same filter."""
        def make_room() -> None:  # under _views_lock: at most two catalogues kept, the oldest dropped
            while len(self._views) >= 2:
                self._views.pop(next(iter(self._views)))

        with _views_lock:
            view = self._views.get(flt.key)
            if view is None:
                make_room()  # before the gather: never three catalogues in memory
        if view is None:
            view = Engine.__new__(Engine)
            view.__dict__.update(metric=self.metric, tune_mode=self.tune_mode, precision=self.precision,
                                 options=self.options, backend=self.backend, n_items=flt.n_passing, dim=self.dim,
                                 ids=None, memory_budget=self.memory_budget, item_memory=self.item_memory,
                                 item_norm=self.item_norm, l2_centre=self.l2_centre, _centre_on=self._centre_on,
                                 _fast=None, _filter=None, _views={}, stats={})
            view._catalogue_rows = self.backend.xp.asarray(flt.rows)  # on the device: rows mapped back there
            if self.streamed:  # gathered in host memory: resident when the passing rows fit on the device
                view._items, view.prepared_items = streamed.gather(self.backend, self.metric, self._items,
                                                                   flt.rows, self.item_memory, self.memory_budget)
            else:
                view.prepared_items = self.prepared_items[view._catalogue_rows]
                view._items = self.backend.load_items(view.prepared_items, metrics.norms_rank(self.metric))
            with _views_lock:  # another thread may have made the same view meanwhile: the first one kept
                if flt.key in self._views:
                    return self._views[flt.key]
                make_room()
                self._views[flt.key] = view
        return view

    def _filtered(self, flt: ItemFilter, n_users: int, k: int, excl: Exclusions,
                  search: Callable[["Engine", Exclusions], SearchResult]) -> SearchResult:
        """``search(view, exclusions)`` on the filtered catalogue, its rows mapped back to this engine's, or host
        padding everywhere when nothing passes."""
        width = min(k, self.n_items)  # as wide as an unfiltered search: padded where fewer items pass
        if flt.n_passing == 0:
            rows = np.full((n_users, width), -1, dtype=np.int64)
            self.stats = {"filtered_items": 0}
            return SearchResult(indices=rows, scores=np.full((n_users, width), -np.inf, np.float32),
                                ids=self.map_ids(rows))
        view = self._view(flt)
        res = search(view, flt.exclusions(excl))
        self.stats = {**view.stats, "filtered_items": flt.n_passing}
        return self._from_view(view, flt, res, width)

    def _from_view(self, view: "Engine", flt: ItemFilter, res: SearchResult, width: int) -> SearchResult:
        """A filtered catalogue's answer in this engine's rows, padded to ``width`` columns."""
        xp = np if isinstance(res.indices, np.ndarray) else self.backend.xp
        table = flt.rows if xp is np else view._catalogue_rows
        scores, rows = pad(xp, res.scores, flt.to_catalogue(xp, res.indices, table), width)
        return SearchResult(indices=rows, scores=scores, ids=self.map_ids(rows))

    def search_async(self, user_vecs: Any, k: int, exclude: Any = None, *, allow: Any = None,
                     deny: Any = None) -> "PendingSearch":
        """Start :meth:`search` and return once the users are handed over, before the results are back.

        Where the engine is :attr:`asynchronous` (a GPU) and the precision exact, the search runs on the device
        while the caller goes on (reads the next batch, starts the next search: the device then runs one search
        after the other without a gap); ``result()`` waits for it. ``user_vecs`` and ``exclude`` are copied before
        this returns, so the caller may reuse them. Elsewhere the search runs here and ``result()`` only fetches its
        results to the host (for host users) and finishes their scores.
        Parameters and errors as for :meth:`search` (errors in the input are raised here; a device failure is raised
        by ``result()``).
        """
        k = check_k(k)
        flt = self._effective_filter(allow, deny)
        if flt is not None:
            return self._search_filtered_async(flt, user_vecs, k, exclude)
        xp, users, excl = self._check_users(user_vecs, exclude)
        prepared = self._prepared(xp, users)
        if self.metric == "l2":
            # The scores are finished (2·s - |u|²) when the result is taken: from the engine's copy of the users
            # (the prepared matrix's first columns), not the caller's array, which it may reuse once this returns.
            users = prepared[:, :self.dim]
        k_sel = min(k, self.n_items)
        host = xp is np
        if users.shape[0] == 0:
            vals, rows = xp.full((0, k_sel), -np.inf, dtype=np.float32), xp.full((0, k_sel), -1, dtype=np.int64)
            return PendingSearch(lambda: self._result(xp, users, vals, rows))
        certified = self.precision == "exact" and fast.certifies_exact(self, prepared, k_sel)
        declined = self._fast_declined()
        if (self.precision == "fast" and declined is None) or certified:
            vals, rows = fast.search(self, prepared, k_sel, excl, ordered=certified)
            # The results are fetched and finished when they are taken: by a job's writer thread, while this one
            # starts the next batch's search (users here is the engine's copy where finishing reads it: l2).
            return PendingSearch(lambda: self._result(xp, users, vals, rows), self.stats)
        vals = self.backend.empty_out((users.shape[0], k_sel), np.float32, host)
        rows = self.backend.empty_out((users.shape[0], k_sel), np.int64, host)
        wait = self.run(prepared, k_sel, excl, vals, rows)

        pending = PendingSearch(None)

        def finish() -> SearchResult:
            stats = wait()
            if declined is not None:
                stats = {**stats, "precision": "exact", "fallback_users": 0, "widened_users": 0,
                         "fallback_fraction": 0.0, "fast_declined": declined}
            pending.stats = self.stats = stats
            return self._result(xp, users, vals, rows)

        pending._finish = finish
        return pending

    def _fast_declined(self) -> str | None:
        """Why fast precision searches in exact precision on this engine whatever the search (None: it does not, or
        the engine is exact): items streamed from host memory, or a backend whose float16 arithmetic is no faster
        than its float32 search (the CPU, unless ``options.fast_emulation``)."""
        if self.precision != "fast":
            return None
        if self.streamed:
            return "items streamed from host memory"
        if not (self.backend.float16_faster() or self.options.fast_emulation):
            return (f"the {self.backend.name} backend's float16 arithmetic is no faster than its float32 search "
                    f"(it would be emulated: EngineOptions.fast_emulation): exact precision, the answer fast mode "
                    f"certifies, at its speed")
        return None

    def _search_filtered_async(self, flt: ItemFilter, user_vecs: Any, k: int, exclude: Any) -> "PendingSearch":
        """:meth:`search_async` against the catalogue ``flt`` passes, rows mapped back when the result is taken."""
        xp, users, excl = self._check_users(user_vecs, exclude, centred=False)  # the view moves them itself
        n_users = int(users.shape[0])
        width = min(k, self.n_items)  # as wide as an unfiltered search: padded where fewer items pass
        if flt.n_passing == 0 or n_users == 0:
            vals = xp.full((n_users, width), -np.inf, dtype=np.float32)
            rows = xp.full((n_users, width), -1, dtype=np.int64)
            self.stats = {"filtered_items": flt.n_passing}
            return PendingSearch(lambda: SearchResult(indices=rows, scores=vals, ids=self.map_ids(rows)), self.stats)
        view = self._view(flt)
        inner = view.search_async(users, k, exclude=flt.exclusions(excl))
        pending = PendingSearch(None)

        def finish() -> SearchResult:
            res = inner.result()
            pending.stats = self.stats = {**inner.stats, "filtered_items": flt.n_passing}
            return self._from_view(view, flt, res, width)

        pending._finish = finish
        return pending

    def run(self, users: Any, k: int, excl: Exclusions, out_vals: Any, out_rows: Any, items: Any = None,
            floor: Any = None, plan: Any = None, options: EngineOptions | None = None,
            left_out: Any = None, best_first: bool = True, need: int = 0) -> Callable[[], dict]:
        """One tiled pass of prepared ``users`` (``metrics.prepare_users``) against resident items (default: the
        engine's; fast mode passes its float16 copy) into the (n, k) arrays ``out_vals`` / ``out_rows`` (from
        ``backend.empty_out``; k <= the items' rows); returns the backend's wait (see ``Backend.run_blocks``). The
        building block of every search mode; ``plan`` replaces the tiling the engine would choose, ``options`` the
        engine's options; ``left_out`` and ``need`` (Backend.run_blocks) a pass checked user by user (fast mode's),
        ``best_first`` False a pass whose results are re-ranked (they may come in any order). Over streamed items
        (``item_memory``) the search is done when this returns (and sorted)."""
        if items is None and self.streamed:
            if left_out is not None:
                left_out[:] = -np.inf  # the streamed search's thresholds are lower bounds
            return streamed.run(self, self._items, users, k, excl, out_vals, out_rows, plan)
        items = self._items if items is None else items
        n_items = int(items.shape[0])
        plan = plan or self.plan(users, n_items, k)
        return self.backend.run_blocks(plan, users, items, n_items, k, excl, out_vals, out_rows,
                                       options or self.options, floor, left_out, best_first, need)

    def plan(self, users: Any, n_items: int, k: int) -> Any:
        """The tiling of a pass of prepared ``users`` against ``n_items`` items keeping ``k``: the options' tiles, a
        tuned entry or the backend's heuristic, fitted to the engine's memory budget."""
        preferred = self.options.tiles or tuning.preferred_tiles(self, users, n_items, k)
        preferred = (max(preferred[0], self.options.min_user_block), preferred[1], preferred[2])
        return plan_tiles(int(users.shape[0]), n_items, int(users.shape[1]), k, self.memory_budget, preferred,
                          self.backend.state_bytes(k, n_items), self.backend.workers,
                          tuning.few_users_area(self.backend, self.options))

    def _check_users(self, user_vecs: Any, exclude: Any, centred: bool = True) -> tuple[Any, Any, Exclusions]:
        """(array module, validated users, normalised exclusions) of a single-vector search; the users as the engine
        scores them (less the l2 centre: :meth:`centred`), or with ``centred=False`` as given (for another engine
        sharing the centre, which moves them itself)."""
        if isinstance(user_vecs, (list, tuple)) and len(user_vecs) == 0:
            user_vecs = np.zeros((0, self.dim), np.float32)  # no users: what a (0, dim) array gives
        xp = self.backend.module_of(user_vecs)
        # Finiteness is checked from the rows' norms, with the overflow bound: the largest in one pass and one
        # transfer from the device; every row's, to name the first bad one, only where that is not clearly fine.
        users = inputs.matrix(self.backend, xp, user_vecs, "user_vecs", self.dim, finite=False)
        moved = self.centred(xp, users)
        if not inputs.clearly_fine(self.backend.largest_norm(moved), self.item_norm, self.metric):
            inputs.check_overflow(xp, metrics.row_norms(xp, moved), self.item_norm, self.metric, lambda r: f"row {r}",
                                  centre=self.l2_centre)
        return xp, moved if centred else users, normalise(exclude, int(users.shape[0]), self.n_items)

    def _prepared(self, xp: Any, users: Any) -> Any:
        """``metrics.prepare_users`` of checked ``users`` (module ``xp``), their row norms taken by the backend."""
        return metrics.prepare_users(self.metric, xp, users, self.backend.row_norms)

    def check_users(self, user_vecs: Any) -> None:
        """Raise what :meth:`search` would raise for these users (dimension, NaN/Inf, float32 overflow)."""
        self._check_users(user_vecs, None)

    def _result(self, xp: Any, users: Any, vals: Any, rows: Any) -> SearchResult:
        """The SearchResult of inner-product (vals, rows): on the host for host users, in the engine's metric
        (``users`` as :meth:`_check_users` gives them: less the l2 centre)."""
        if xp is np:
            vals, rows = self.backend.to_host(vals), self.backend.to_host(rows)
        vals = metrics.finish_scores(self.metric, xp, vals, users, self.backend.row_norms, self.backend.finish_l2)
        return SearchResult(indices=rows, scores=vals, ids=self.map_ids(rows))

    def map_ids(self, rows: Any) -> Any:
        """Item ids of item rows (n, k) (-1, or the largest unsigned id, where padded); the rows themselves when the
        engine has no ids. Host rows give host ids; device rows give device ids (integers) or host ids (strings)."""
        if self.ids is None:
            return rows
        host_rows = self.backend.to_host(rows)
        if self.ids.dtype == object:
            out = np.empty(host_rows.shape, dtype=object)
            valid = host_rows >= 0
            out[valid] = self.ids[host_rows[valid]]
            return out
        out = take_ids(self.ids, host_rows, np.iinfo(self.ids.dtype).max if self.ids.dtype.kind == "u" else -1)
        return out if host_rows is rows else self.backend.xp.asarray(out)

    # -- re-scoring -----------------------------------------------------------------------------------------------
    def rescore(self, user_vecs: Any, candidates: Any, k: int, *, allow: Any = None,
                deny: Any = None) -> SearchResult:
        """Each user's exact top-k among its own candidate items, best first; ties go to the lower item row.

        Parameters
        ----------
        user_vecs : array, shape (n_users, dim)
            As for :meth:`search` (NumPy, or a device array used in place on the GPU).
        candidates : (indptr, item_rows) CSR, a list of n_users integer arrays, or an (n_users, width) matrix
            Item rows per user: ``item_rows[indptr[u]:indptr[u+1]]``, ``candidates[u]`` or row ``u``; any length,
            any order, duplicates count once. Host arrays, or device arrays on a GPU engine (read in place).
        k : int
            Items per user, >= 1; the result has ``min(k, n_items)`` columns, padded with (-1, -inf) where a user has
            fewer distinct candidates.
        allow, deny : array of item rows, or boolean mask (n_items,), optional
            A shared item filter, with the engine's own (:meth:`set_item_filter`): candidates it removes are never
            returned.

        Returns
        -------
        SearchResult
            As :meth:`search` returns it, in the engine's metric.

        Raises
        ------
        InputError
            k < 1, bad vectors, a malformed candidate structure, or an item row out of range (naming user and row).
        """
        import time

        k = min(check_k(k), self.n_items)  # no user has more distinct candidates than there are items
        xp, users, _ = self._check_users(user_vecs, None)
        cands = normalise_candidates(candidates, int(users.shape[0]), self.n_items, self.backend)
        flt = self._effective_filter(allow, deny)
        if flt is not None:
            cands = cands.filtered(flt.inverse >= 0, np if isinstance(cands.rows, np.ndarray) else self.backend.xp)
        wall = time.perf_counter()
        path = "none"
        if users.shape[0] and cands.nnz and self.streamed:
            vals, rows, path = streamed.rescore(self, self._items, self._prepared(xp, users), cands.indptr, cands.rows,
                                                k)
        elif users.shape[0] and cands.nnz:
            vals, rows, path = self.backend.rescore(self._prepared(xp, users), self._items, cands.indptr, cands.rows, k,
                                                    self.memory_budget, self.options)
        else:
            vals = xp.full((users.shape[0], k), -np.inf, dtype=np.float32)
            rows = xp.full((users.shape[0], k), -1, dtype=np.int64)
        self.stats = {"rescore_path": path, "users": int(users.shape[0]), "candidates": cands.nnz,
                      "wall_s": time.perf_counter() - wall}
        return self._result(xp, users, vals, rows)

    # -- searches of a part of the items, merged on the backend (the job runner's search while items load) ---------
    def search_topk(self, user_vecs: Any, k: int, floor: Any = None, exclude: Any = None) -> "TopK":
        """Queue an exact search of host users whose results stay on the backend, in inner-product space (the
        metric's order, per user): (n, min(k, n_items)) arrays being filled. ``floor``: backend float32 (n,), a
        score per user at or below which no item need be returned (the k-th best of items searched before).
        ``exclude``: as for :meth:`search`, in this engine's rows."""
        k = check_k(k)
        xp, users, excl = self._check_users(user_vecs, exclude)
        prepared = self._prepared(xp, users)
        k_sel = min(k, self.n_items)
        vals = self.backend.empty_out((users.shape[0], k_sel), np.float32, False)
        rows = self.backend.empty_out((users.shape[0], k_sel), np.int64, False)
        return TopK(vals, rows, self.run(prepared, k_sel, excl, vals, rows, floor=floor))

    def merge_topk(self, best: "TopK | None", part: "TopK", row_offset: int, k: int) -> "TopK":
        """The best ``k`` per user of ``best`` (item rows of this engine's numbering) and ``part`` (whose rows start at
        ``row_offset``), on the backend, queued after both; ``part`` must come from an engine sharing this backend."""
        parts = [(part.vals, part.rows, row_offset)]
        if best is not None:
            parts.insert(0, (best.vals, best.rows, 0))
        vals, rows = self.backend.merge(parts, k)
        return TopK(vals, rows, part.wait)

    def finish_topk(self, best: "TopK", users: Any) -> SearchResult:
        """The SearchResult of merged (inner-product) results of host ``users``: host arrays, the metric's scores,
        item rows as ids (the engine's ids are not applied: the caller maps rows)."""
        vals, rows = self.backend.to_host(best.vals), self.backend.to_host(best.rows)
        vals = metrics.finish_scores(self.metric, np, vals, self.centred(np, np.asarray(users, dtype=np.float32)),
                                     self.backend.row_norms)
        return SearchResult(indices=rows, scores=vals, ids=rows)


@dataclass
class TopK:
    """Results on the backend in inner-product space, best first: ``vals`` (n, k) float32 and ``rows`` (n, k) int64,
    being filled until ``wait()`` (the backend's wait of the search that fills them) returns."""

    vals: Any
    rows: Any
    wait: Callable[[], dict]


class PendingSearch:
    """A search started by :meth:`Engine.search_async`; :meth:`result` waits for it (once) and returns it.
    ``stats`` holds what the search did (as ``Engine.stats``) once :meth:`result` has returned."""

    def __init__(self, finish: Callable[[], SearchResult] | None, stats: dict | None = None) -> None:
        self._finish = finish
        self._result: SearchResult | None = None
        self.stats: dict = stats or {}

    def result(self) -> SearchResult:
        if self._result is None:
            self._result = self._finish()
            self._finish = None
        return self._result
