"""The public, embeddable API: an item matrix prepared once, searched many times."""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from . import backends, fast, metrics, scoring
from . import tune as tuning
from .errors import InputError
from .exclusions import Exclusions, normalise
from .result import SearchResult

log = logging.getLogger("recall")

# Largest score magnitude we let the float32 arithmetic reach: a margin under float32's 3.4e38 keeps every partial sum
# of the GEMM (bounded by |u|·|v|, Cauchy-Schwarz) and the l2 expansion finite.
_SCORE_LIMIT = 1e37
PRECISIONS = ("exact", "fast")


def check_k(k: Any) -> int:
    """``k`` as an int, or InputError unless it is an integer >= 1 (bools refused)."""
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or k < 1:
        raise InputError(f"k must be an integer >= 1, got {k!r}")
    return int(k)


def _is_device_array(arr: Any) -> bool:
    return hasattr(arr, "__cuda_array_interface__") or (
        hasattr(arr, "__dlpack_device__") and not isinstance(arr, np.ndarray) and arr.__dlpack_device__()[0] != 1
    )


def _check_matrix(xp: Any, arr: Any, what: str, dim: int | None = None) -> Any:
    """``arr`` as a C-contiguous float32 (n, dim) array of module ``xp``; InputError naming the first bad row."""
    shape = getattr(arr, "shape", None)
    if shape is None:
        arr = np.asarray(arr)
        shape = arr.shape
    if len(shape) != 2:
        raise InputError(f"{what}: expected a 2-d (n, dim) array, got shape {tuple(shape)}")
    kind = getattr(getattr(arr, "dtype", None), "kind", "f")
    if kind not in "fiu":
        raise InputError(f"{what}: expected real numbers, got dtype {arr.dtype}")
    if dim is not None and shape[1] != dim:
        raise InputError(f"{what}: dimension {shape[1]} does not match the items' dimension {dim}")
    if shape[1] < 1:
        raise InputError(f"{what}: vectors have dimension 0")
    if xp is np:
        if hasattr(arr, "get") and not isinstance(arr, np.ndarray):
            arr = arr.get()
        out = np.ascontiguousarray(arr, dtype=np.float32)
    else:
        if _is_device_array(arr) and not hasattr(arr, "__cuda_array_interface__"):
            arr = xp.from_dlpack(arr)  # e.g. a torch CUDA tensor, read in place
        out = xp.ascontiguousarray(xp.asarray(arr), dtype=xp.float32)  # host arrays: one upload
    finite = xp.isfinite(out).all(axis=1)
    if not bool(finite.all()):
        row = int(xp.argmax(~finite))
        raise InputError(f"{what}: row {row} has a NaN or infinite value")
    return out


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
    device : {"auto", "cpu", "gpu"}
        "auto" takes the GPU when one is usable and otherwise falls back to the CPU, saying so once.
    memory_budget : int, optional
        Bytes of working memory a search may use beyond the item matrix and its results; the search is tiled to fit.
        Default: a quarter of the free memory of the device, at most 1 GiB on the CPU and 8 GiB on a GPU.
    precision : {"exact", "fast"}
        "exact" scores in float32 (on a GPU: the fused scoring-and-filtering kernel of recall/kernels/fused.cu up to
        256 dimensions, else ``cublasSgemmStridedBatched``). "fast" scores float16 inputs on tensor cores,
        re-ranks k + max(16, k/4) candidates in float32 and proves from an error bound that the answer equals exact mode's,
        falling back to exact mode for the users where the proof fails (``stats["fallback_users"]``); on the CPU it
        emulates the same arithmetic and is for testing only (no faster).
    tune : {"auto", "force", "off"}
        Tiling: "auto" takes a matching entry of the ``recall tune`` cache, else the backend's heuristic; "force"
        tunes each new shape on its first search (and caches it); "off" always uses the heuristic. See recall.tune.

    Raises
    ------
    InputError
        Bad vectors (not 2-d, empty, NaN/Inf), duplicate ids, wrong-length ids, unknown metric, device, precision or
        tune mode.
    BackendUnavailable
        ``device="gpu"`` and no usable GPU.
    """

    def __init__(self, item_vecs: Any, ids: Any = None, metric: str = "ip", device: str = "auto",
                 memory_budget: int | None = None, precision: str = "exact", tune: str = "auto") -> None:
        self.metric = metrics.check_metric(metric)
        self.tune_mode = tuning.check_mode(tune)
        if precision not in PRECISIONS:
            raise InputError(f"unknown precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
        self.precision = precision
        self._fast_items: fast.FastItems | None = None
        self.backend = backends.resolve(device)
        # A GPU engine checks and prepares its items on the device, after one upload (a host array's checks, norms
        # included, cost a million-item job a fraction of a second of CPU before its first search).
        on_gpu = self.backend.name == "gpu"
        xp = self.backend.xp if on_gpu else np
        items = _check_matrix(xp, item_vecs, "item_vecs")
        if items.shape[0] < 1:
            raise InputError("item_vecs: there are no items")
        self.n_items, self.dim = int(items.shape[0]), int(items.shape[1])
        self.ids = self._check_ids(ids)
        if memory_budget is not None and (isinstance(memory_budget, (bool, np.bool_))
                                          or not isinstance(memory_budget, (int, np.integer)) or memory_budget <= 0):
            raise InputError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
        self.memory_budget = int(memory_budget) if memory_budget is not None else self.backend.default_budget()
        self._item_norm = float(metrics.row_norms(xp, items).max()) if self.metric != "cosine" else 1.0
        prepared = metrics.prepare_items(self.metric, xp, items)
        # Uploaded (or, on the CPU, copied) once and resident for every search: a caller refilling its buffer
        # afterwards must not change the engine's items.
        self._items = self.backend.asarray(prepared)
        # Host items on a GPU were copied by the upload; a caller's own array (host, or device) must not be shared.
        uploaded = on_gpu and not _is_device_array(item_vecs)
        if not uploaded and (self._items is item_vecs or self._items is items or self._items is prepared):
            self._items = self._items.copy()
        self.stats: dict = {}  # what the last search did: blocks, tiling, wall and (GPU) busy seconds

    def _xp_for(self, arr: Any) -> Any:
        """The array module an input is validated and prepared with: the device's for device arrays on a GPU
        engine (used in place), NumPy otherwise (a GPU engine stages host users to the device block by block)."""
        return self.backend.xp if self.backend.name == "gpu" and _is_device_array(arr) else np

    @property
    def device(self) -> str:
        """"cpu" or "gpu": where this engine runs."""
        return self.backend.name

    def _check_ids(self, ids: Any) -> np.ndarray | None:
        if ids is None:
            return None
        ids = np.array(ids.get() if hasattr(ids, "get") and not isinstance(ids, np.ndarray) else ids, copy=True)
        if ids.shape != (self.n_items,):
            raise InputError(f"ids: expected {self.n_items} ids (one per item row), got shape {ids.shape}")
        if ids.dtype.kind in "US":
            ids = ids.astype(object)
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

    def search(self, user_vecs: Any, k: int, exclude: Any = None, aggregate: str | None = None) -> SearchResult:
        """The exact top-k items for every user, best first; ties go to the lower item row.

        Parameters
        ----------
        user_vecs : array, shape (n_users, dim)
            NumPy, or a device array (CuPy, torch CUDA tensor via ``__dlpack__``) used in place on the GPU.
        k : int
            Items per user, >= 1. Where fewer than k items qualify (k > n_items, exclusions), rows are padded
            with index -1 and score -inf.
        exclude : mapping {user_row: iterable of item rows} or (indptr, item_rows) CSR, optional
            Items never to return to a user; removed before selection, so a user still gets k items if k remain.
        aggregate : {"max", "sum"}, optional
            For users with several vectors (``user_vecs`` of shape (n_users, n_interests, dim), or a list of
            (n_i, dim) arrays): an item's score is the max (default) or the sum over the user's interests.

        Returns
        -------
        SearchResult
            CuPy arrays when ``user_vecs`` lived on the GPU, NumPy arrays otherwise.

        Raises
        ------
        InputError
            k < 1, wrong dimension, NaN/Inf, zero vector under cosine, exclusions out of range.
        ResourceError
            The memory budget cannot hold even the smallest tile.
        """
        from . import interests

        if interests.is_multi(user_vecs):  # several vectors per user: recall/interests.py
            return interests.search(self, user_vecs, k, exclude, interests.check_aggregate(aggregate or "max"))
        if aggregate is not None:
            interests.check_aggregate(aggregate)
        k = check_k(k)
        xp, users, excl = self._check_users(user_vecs, exclude)
        vals, rows = self._search(metrics.prepare_users(self.metric, xp, users), k, excl)
        return self._result(xp, users, vals, rows)

    def search_async(self, user_vecs: Any, k: int, exclude: Any = None) -> "PendingSearch":
        """Start :meth:`search` and return once the users are handed over, before the results are back.

        On a GPU, in exact precision, with host (NumPy) users, the search runs on the device while the caller goes
        on (reads the next batch, starts the next search: the device then runs one search after the other without
        a gap); ``result()`` waits for it. ``user_vecs`` and ``exclude`` are copied before this returns, so the
        caller may reuse them. Everywhere else (CPU, fast precision, device users) the search runs here and
        ``result()`` returns at once. Parameters and errors as for :meth:`search` (errors in the input are raised
        here; a device failure is raised by ``result()``).
        """
        k = check_k(k)
        if self.backend.name != "gpu" or self.precision != "exact" or _is_device_array(user_vecs):
            done = self.search(user_vecs, k, exclude)
            return PendingSearch(lambda: done)
        xp, users, excl = self._check_users(user_vecs, exclude)
        k_sel = min(k, self.n_items)
        if users.shape[0] == 0:
            done = self.search(users, k, exclude)
            return PendingSearch(lambda: done)
        vals, rows, wait = self._run(metrics.prepare_users(self.metric, xp, users), self._items, k_sel, excl,
                                     host_out=True, wait=False)

        def finish() -> SearchResult:
            self.stats = wait()
            padded_vals, padded_rows = self._pad(vals, rows, k, np)
            return self._result(xp, users, padded_vals, padded_rows)

        return PendingSearch(finish)

    def _queue_on_device(self, user_vecs: np.ndarray, k: int, floor: Any = None) -> "QueuedSearch":
        """Queue an exact search of host users whose results stay on the backend (recall/early.py merges several),
        in inner-product space (the metric's order, per user), (n, min(k, n_items)). On the CPU it runs here.
        ``floor`` (GPU only: device float32, one per user, inner-product space): return only items scoring above it
        (see ``CupyBackend.run_blocks``)."""
        xp, users, excl = self._check_users(user_vecs, None)
        prepared = metrics.prepare_users(self.metric, xp, users)
        k_sel = min(k, self.n_items)
        if self.backend.name != "gpu":
            vals, rows = self._run(prepared, self._items, k_sel, excl)
            return QueuedSearch(self, vals, rows, None)
        vals, rows, wait = self._run(prepared, self._items, k_sel, excl, wait=False, floor=floor)
        return QueuedSearch(self, vals, rows, wait)

    def _check_users(self, user_vecs: Any, exclude: Any) -> tuple[Any, Any, Exclusions]:
        """(array module, validated users, normalised exclusions) of a single-vector search."""
        xp = self._xp_for(user_vecs)
        users = _check_matrix(xp, user_vecs, "user_vecs", self.dim)
        self._check_overflow(xp, users)
        return xp, users, normalise(exclude, int(users.shape[0]), self.n_items)

    def _result(self, xp: Any, users: Any, vals: Any, rows: Any) -> SearchResult:
        """The SearchResult of inner-product (vals, rows): on the host for host users, in the engine's metric."""
        if xp is np:
            vals, rows = self.backend.to_host(vals), self.backend.to_host(rows)
        vals = metrics.finish_scores(self.metric, xp, vals, users)
        return SearchResult(indices=rows, scores=vals, ids=self._map_ids(rows))

    def rescore(self, user_vecs: Any, candidates: Any, k: int) -> SearchResult:
        """Each user's exact top-k among its own candidate items, best first; ties go to the lower item row.

        Parameters
        ----------
        user_vecs : array, shape (n_users, dim)
            As for :meth:`search` (NumPy, or a device array used in place on the GPU).
        candidates : (indptr, item_rows) CSR, a list of n_users integer arrays, or an (n_users, width) matrix
            Item rows per user: ``item_rows[indptr[u]:indptr[u+1]]``, ``candidates[u]`` or row ``u``; any length,
            any order, duplicates count once. Host arrays, or device arrays on a GPU engine (read in place).
        k : int
            Items per user, >= 1; rows are padded with (-1, -inf) where a user has fewer than k distinct candidates.

        Returns
        -------
        SearchResult
            As :meth:`search` returns it, in the engine's metric.

        Raises
        ------
        InputError
            k < 1, bad vectors, a malformed candidate structure, or an item row out of range (naming user and row).
        """
        from . import rescore

        return rescore.rescore(self, user_vecs, candidates, k)

    def _check_overflow(self, xp: Any, users: Any) -> None:
        """Refuse vectors whose scores could overflow float32 (they would come out as +-inf or NaN and be lost)."""
        if self.metric == "cosine" or users.shape[0] == 0:
            return
        norms = metrics.row_norms(xp, users)
        row = int(xp.argmax(norms))
        top = float(norms[row])
        bound = (top + self._item_norm) ** 2 if self.metric == "l2" else top * self._item_norm
        if bound > _SCORE_LIMIT:
            raise InputError(
                f"user_vecs: row {row} has norm {top:.3g} and the largest item norm is {self._item_norm:.3g}: "
                f"metric {self.metric!r} scores could overflow float32; rescale the vectors"
            )

    def _search(self, users: Any, k: int, excl: Exclusions) -> tuple[Any, Any]:
        """(scores, item rows), each (n_users, k), in inner-product space."""
        # Host users get host results: a GPU backend then copies each block's results back while it searches the next.
        host = isinstance(users, np.ndarray)
        out_xp = np if host else self.backend.xp
        n_users = users.shape[0]
        k_sel = min(k, self.n_items)
        if n_users == 0:
            return out_xp.full((0, k), -np.inf, dtype=np.float32), out_xp.full((0, k), -1, dtype=np.int64)
        if self.precision == "fast":
            found_vals, found_rows = self._search_fast(users, k_sel, excl)
            if host:
                found_vals, found_rows = self.backend.to_host(found_vals), self.backend.to_host(found_rows)
        else:
            found_vals, found_rows = self._run(users, self._items, k_sel, excl, host_out=host)
            self.stats = dict(self.backend.stats)
        return self._pad(found_vals, found_rows, k, out_xp)

    @staticmethod
    def _pad(found_vals: Any, found_rows: Any, k: int, out_xp: Any) -> tuple[Any, Any]:
        """(n, k) results from (n, k_sel) ones, k_sel <= k: padded with -inf scores and -1 rows."""
        n_users, k_sel = found_vals.shape
        if k_sel == k:
            return found_vals, found_rows
        vals = out_xp.full((n_users, k), -np.inf, dtype=np.float32)
        rows = out_xp.full((n_users, k), -1, dtype=np.int64)
        vals[:, :k_sel], rows[:, :k_sel] = found_vals, found_rows
        return vals, rows

    def _run(self, users: Any, items: Any, k: int, excl: Exclusions, host_out: bool = False,
             wait: bool = True, floor: Any = None) -> Any:
        """One tiled pass of ``users`` against ``items`` (k <= n_items): (scores, rows) (n, k), in host memory
        (page-locked on a GPU) when ``host_out``, else on the backend. With ``wait`` False (GPU backend only), also
        a callable that waits for the pass and returns its stats: the arrays are filled by then."""
        backend = self.backend
        n_users, dim = users.shape
        vals = backend.empty_out((n_users, k), np.float32, host_out)
        rows = backend.empty_out((n_users, k), np.int64, host_out)
        plan = scoring.plan_tiles(n_users, self.n_items, dim, k, self.memory_budget,
                                  tuning.preferred_tiles(self, users, k), backend.state_bytes(k), backend.workers)
        if not wait:
            extra = {} if floor is None else {"floor": floor}
            return vals, rows, backend.run_blocks(plan, users, items, self.n_items, k, excl, vals, rows, wait=False,
                                                  **extra)
        backend.run_blocks(plan, users, items, self.n_items, k, excl, vals, rows)
        return vals, rows

    def _search_fast(self, users: Any, k: int, excl: Exclusions) -> tuple[Any, Any]:
        """Half-precision scores, exact float32 re-rank of k + m candidates, certificate, exact fallback."""
        backend, xp = self.backend, self.backend.xp
        if self._fast_items is None:
            host_items = backend.to_host(self._items)
            self._fast_items = fast.prepare_items(np, host_items)
            self._fast_items = fast.FastItems(backend.asarray_raw(self._fast_items.vecs16), self._fast_items.scale,
                                              self._fast_items.max_norm, self._fast_items.max_l1)
        items16 = self._fast_items
        uxp = np if isinstance(users, np.ndarray) else xp
        half = backend.score_dtype(np.float16) == np.float16
        users16, alpha, bound = fast.prepare_users(uxp, users, items16, half_scores=half)
        wide = min(k + fast.margin(k) + 1, self.n_items)
        approx_vals, approx_rows = self._run(users16, items16.vecs16, wide, excl)
        if half:
            approx_vals /= np.float32(fast.output_scale(self.dim))  # exact: a power of two
        run_stats = dict(backend.stats)
        n_cand = wide - 1 if wide < self.n_items else wide
        users_b = backend.asarray(users)
        cand_rows = approx_rows[:, :n_cand]
        n_users = users.shape[0]
        # The float32 re-rank: on the GPU one fused gather + dot product + top-k kernel (recall/kernels/rescore.cu)
        # over each user's candidates; elsewhere (or where k is beyond that kernel) a gathered matmul and a sort.
        fused = getattr(backend, "rescore_fused", None)
        vals = backend.empty_out((n_users, k), np.float32, False)
        rows = backend.empty_out((n_users, k), np.int64, False)
        if fused is None or not fused(users_b, self._items, np.arange(n_users + 1, dtype=np.int64) * n_cand,
                                      xp.ascontiguousarray(cand_rows).reshape(-1), k, vals, rows, self.memory_budget):
            chunk = max(1, self.memory_budget // (8 * n_cand * self.dim + 1))
            exact = fast.rescore(xp, users_b, self._items, cand_rows, chunk)
            vals, rows = fast.top_k(xp, exact, cand_rows, k)
        if wide < self.n_items:
            ok = fast.certified(xp, vals[:, k - 1], approx_vals[:, wide - 1], backend.asarray_raw(alpha),
                                items16.scale, backend.asarray_raw(bound))
            failed = np.flatnonzero(backend.to_host(~ok))
        else:
            failed = np.zeros(0, np.int64)  # every item was a candidate: nothing left out to certify against
        if failed.size:
            users_failed = users[failed] if uxp is np else users[xp.asarray(failed)]
            fv, fr = self._run(users_failed, self._items, k, excl.subset(failed))
            sel = xp.asarray(failed)
            vals[sel], rows[sel] = fv, fr
        self.stats = {**run_stats, "precision": "fast", "candidates": n_cand, "fallback_users": int(failed.size),
                      "fallback_fraction": failed.size / users.shape[0]}
        return vals, rows

    def _map_ids(self, rows: Any) -> Any:
        if self.ids is None:
            return rows
        host_rows = rows if isinstance(rows, np.ndarray) else self.backend.to_host(rows)
        if self.ids.dtype == object:
            out = np.empty(host_rows.shape, dtype=object)
            valid = host_rows >= 0
            out[valid] = self.ids[host_rows[valid]]
            return out
        out = self.ids[np.maximum(host_rows, 0)]
        out[host_rows < 0] = np.iinfo(out.dtype).max if out.dtype.kind == "u" else -1
        if host_rows is rows:
            return out
        return self.backend.xp.asarray(out)


class QueuedSearch:
    """A search queued by ``Engine._queue_on_device``: ``vals`` and ``rows`` (backend arrays) are being filled, on the
    engine's compute stream; calling it waits for them, sets the engine's stats and returns (vals, rows)."""

    def __init__(self, engine: Engine, vals: Any, rows: Any, wait: Any) -> None:
        self.vals, self.rows = vals, rows
        self._engine, self._wait = engine, wait

    def __call__(self) -> tuple[Any, Any]:
        if self._wait is not None:
            self._engine.stats = self._wait()
            self._wait = None
        return self.vals, self.rows


class PendingSearch:
    """A search started by :meth:`Engine.search_async`; :meth:`result` waits for it (once) and returns it."""

    def __init__(self, finish: Any) -> None:
        self._finish = finish
        self._result: SearchResult | None = None

    def result(self) -> SearchResult:
        if self._result is None:
            self._result = self._finish()
            self._finish = None
        return self._result
