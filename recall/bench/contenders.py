"""The contenders of a benchmark: this engine, FAISS, cuVS and torch, behind one small interface.

A contender is measured like this (``runner.py``)::

    reason = c.unavailable() or c.unsupported(k, n_items) or c.unsupported_workload(w)
                                     # None, or why it cannot run here -> reported as skipped, never dropped
    c.prepare(items)                 # not timed: build the index, upload / convert the items
    c.search(users, k[, exclude])    # warm-up
    c.sync(); t0; c.search(users, k[, exclude]); c.sync(); t1     # timed, repeated

``search`` returns ``(indices, scores)``, each ``(n_users, k)``, where the contender left them: on the device for GPU
contenders, so that copying a 100,000 x 1,000 answer back to the host is not charged to the kernel comparison. The
runner brings the sampled users' rows to the host afterwards, for the oracle. Users and items are already resident on
the device for every GPU contender alike (generated there by CuPy; torch sees them through DLPack, FAISS through raw
device pointers, cuVS through the CUDA array interface), so the timed region is the search itself.

Exclusions (``exclude``: :class:`recall.bench.exclusions.Exclusions`, on the data's device) are applied the way each
library's users apply them, and that work is timed: this engine takes the CSR (``Engine.search(exclude=)``); cuVS a
per-query bitmap prefilter built on the device per batch of users; FAISS over-fetches ``k + max exclusions per user``
and post-filters (only while that stays within its k limit); torch masks the score block (``masked_fill``) before
``topk``.

Contenders (``--contenders`` takes families):

==============  ==========  ==========================================================================================
name            family      what
==============  ==========  ==========================================================================================
recall          recall      ``recall.Engine``, exact precision (``recall-fast``: ``precision="fast"``, GPU only)
faiss           faiss       ``IndexFlatIP``/``IndexFlatL2`` on the CPU, ``GpuIndexFlatIP``/``L2`` on the GPU (k <= 2048)
faiss-knn       faiss       ``faiss.knn_gpu`` (``bfKnn``) on device pointers, no index (GPU only, k <= 2048)
cuvs            cuvs        ``cuvs.neighbors.brute_force`` (GPU only, any k), users in batches of 8,192
torch           torch       chunked ``torch.matmul`` + ``torch.topk`` in fp32 (``torch-bf16``: bfloat16, GPU, inexact)
==============  ==========  ==========================================================================================

Names ``xq`` (queries = users), ``xb`` (database = items), ``D`` (distances = scores) and ``I`` (indices) mirror FAISS.
"""
from __future__ import annotations

import inspect
from typing import Any

from recall import InputError
from recall.core.results import pad

FAMILIES = ("recall", "faiss", "cuvs", "torch")
"""The contender families ``--contenders`` takes."""
FAISS_GPU_MAX_K = 2048
"""GpuIndexFlat and knn_gpu refuse k > 2048 (verified on the H200 with FAISS 1.15.1)."""
TORCH_SCORE_BYTES = 1 << 30
"""Bytes of one torch score chunk (users_chunk x n_items): big enough to saturate the GPU, far from its memory."""
CUVS_BATCH_USERS = 8_192
"""Users per cuVS search call: its temporary tiles and outputs fit the GPU whatever the catalogue."""
CUVS_BITMAP_BYTES = 1 << 30
"""Most bytes of one batch's per-query bitmap (8,192 users x 1M items); batches shrink for larger catalogues."""


def synchronize(device: str) -> None:
    """Wait for every queued kernel on the current GPU (all streams: FAISS and cuVS run on their own); no-op on the
    CPU."""
    if device != "gpu":
        return
    import cupy

    cupy.cuda.runtime.deviceSynchronize()


def _gpu_reason() -> str | None:
    """Why there is no usable GPU here, or None."""
    from recall.backends import cuda_status

    usable, reason = cuda_status()
    return None if usable else reason


class Contender:
    """Base class: one way of computing the top-k, on one device.

    Attributes
    ----------
    name : str
        Row label in the report, e.g. "recall", "faiss", "torch-bf16".
    family : str
        "recall", "faiss", "cuvs" or "torch".
    device : {"cpu", "gpu"}
    exact : bool
        Whether the method claims exact results (bf16 does not; its recall is reported, not required).
    """

    name = "?"
    family = "?"
    exact = True

    def __init__(self, device: str, metric: str = "ip") -> None:
        self.device = device
        self.metric = metric

    def unavailable(self) -> str | None:
        """None when this contender can run here, else the reason it cannot (one line)."""
        return None

    def unsupported(self, k: int, n_items: int) -> str | None:
        """None when this contender can answer a top-``k`` query, else why not (e.g. FAISS GPU k > 2048)."""
        return None

    supports_allow = False
    """Whether ``search`` takes ``allow`` (a shared allow-set of item rows, host int64)."""

    def unsupported_workload(self, w: Any) -> str | None:
        """None when this contender can run workload ``w`` (re-scoring and multi-interest ones included: ``search``
        then gets :class:`~recall.bench.workloads.CandidateUsers` / ``MultiInterestUsers``; exclusions: ``search``
        gets ``exclude``; a shared filter: ``allow``), else why not."""
        return None

    def check_workload(self, w: Any) -> str | None:
        """:meth:`unsupported_workload`, and the shared filter the contender may not take."""
        if getattr(w, "allow_fraction", 0) and not self.supports_allow:
            return "not benchmarked with a shared item filter yet"
        return self.unsupported_workload(w)

    def prepare(self, item_vecs: Any) -> None:
        """Build whatever the search needs from the items (not timed). ``item_vecs``: (n_items, dim) float32."""
        raise NotImplementedError

    def search(self, user_vecs: Any, k: int, exclude: Any = None) -> tuple[Any, Any]:
        """(indices (n_users, k) int64, scores (n_users, k) float) of the best ``k`` items per user (timed); never an
        item of ``exclude`` (:class:`~recall.bench.exclusions.Exclusions`), padding (-1, -inf) where too few
        remain."""
        raise NotImplementedError

    def sync(self) -> None:
        """Wait for this contender's queued work (called around the timed region)."""
        synchronize(self.device)

    def stats(self) -> dict[str, Any]:
        """What the contender reports of its last search (this engine: blocks, tiling, GPU busy time...)."""
        return {}

    def release(self) -> None:
        """Drop the prepared index, so the next contender gets the memory."""


# --- this engine ----------------------------------------------------------------------------------------------------


def engine_precisions(device: str = "gpu") -> list[str | None]:
    """The engine's precision modes to benchmark: ["exact", "fast"] on a GPU when ``Engine`` takes ``precision``
    (on the CPU "fast" searches in exact precision: no float16 arithmetic faster there), else [None]."""
    from recall import Engine

    if "precision" in inspect.signature(Engine).parameters:
        return ["exact", "fast"] if device == "gpu" else ["exact"]
    return [None]


def recall_name(precision: str | None) -> str:
    """The contender name of recall in ``precision`` (None: the engine's default), in tables and end-to-end rows."""
    return "recall" if precision in (None, "exact") else f"recall-{precision}"


class RecallContender(Contender):
    """``recall.Engine`` on the CPU or the GPU, in one precision mode (None: the engine has no such parameter).

    Exclusions go in as the host CSR pair ``Engine.search(exclude=(indptr, item_rows))`` takes (copied from the
    device once, outside the timed region: the engine does not take device CSR); the engine's own handling of them
    (validation, sorting, upload) is timed."""

    family = "recall"

    def __init__(self, device: str, metric: str = "ip", precision: str | None = None,
                 memory_budget: int | None = None, options: Any = None) -> None:
        super().__init__(device, metric)
        self.precision = precision
        self.memory_budget = memory_budget
        self.options = options  # EngineOptions, or None for the defaults
        self.name = recall_name(precision)
        self.exact = True  # "fast" is certified exact too: it must score recall 1.0 like "exact"
        self._engine = None

    def unavailable(self) -> str | None:
        if self.device == "gpu":
            # An engine that cannot use the GPU after all raises BackendUnavailable in prepare: a skip with reason.
            return _gpu_reason()
        return None

    def prepare(self, item_vecs: Any) -> None:
        from recall import Engine

        kwargs: dict[str, Any] = {"metric": self.metric, "device": self.device, "memory_budget": self.memory_budget,
                                  "options": self.options}
        if self.precision is not None:
            kwargs["precision"] = self.precision
        self._engine = Engine(item_vecs, **kwargs)

    def unsupported_workload(self, w: Any) -> str | None:
        if (w.candidates or w.interests) and self.precision not in (None, "exact"):
            return f"precision {self.precision!r} applies to single-vector full searches"
        return None

    supports_allow = True

    def search(self, user_vecs: Any, k: int, exclude: Any = None, allow: Any = None) -> tuple[Any, Any]:
        from .workloads import CandidateUsers, MultiInterestUsers

        if isinstance(user_vecs, CandidateUsers):
            res = self._engine.rescore(user_vecs.vecs, user_vecs.candidates, k)
        elif isinstance(user_vecs, MultiInterestUsers):
            res = self._engine.search(user_vecs.vecs, k, aggregate=user_vecs.aggregate)
        elif exclude is not None:
            res = self._engine.search(user_vecs, k, exclude=exclude.host())
        else:
            res = self._engine.search(user_vecs, k, allow=allow)
        return res.indices, res.scores

    def stats(self) -> dict[str, Any]:
        st = dict(self._engine.stats) if self._engine is not None else {}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in st.items()}

    def release(self) -> None:
        self._engine = None


# --- FAISS ----------------------------------------------------------------------------------------------------------


def _optional(module: str, label: str, hint: str = "", probe: tuple[str, ...] = ()) -> tuple[Any, str | None]:
    """(the module, None), or (None, why not): not installed (with ``hint``), or failing at import (a broken
    shared-library setup or a wheel built for another CUDA fails with assorted errors). ``probe``: submodules that
    must import too."""
    import importlib

    try:
        mod = importlib.import_module(module)
        for sub in probe:
            importlib.import_module(f"{module}.{sub}")
    except ImportError as exc:
        return None, f"{label} is not installed ({exc}){'; ' + hint if hint else ''}"
    except Exception as exc:  # noqa: BLE001 - every import failure is a skip reason, never a bench crash
        return None, f"{label} failed to import: {type(exc).__name__}: {exc}"
    return mod, None


def _import_faiss() -> tuple[Any, str | None]:
    return _optional("faiss", "faiss", "install the 'bench' extra (faiss-cpu) or 'bench-gpu' (faiss-gpu)")


def _faiss_gpu_reason(faiss: Any) -> str | None:
    if not hasattr(faiss, "StandardGpuResources"):
        return "this faiss has no GPU support (faiss-cpu); install faiss-gpu >= 1.15 (sm_90 code for Hopper)"
    if faiss.get_num_gpus() < 1:
        return "faiss sees no GPU"
    return None


def _overfetch_reason(w: Any, what: str) -> str | None:
    """Why FAISS's over-fetch of k + exclusions cannot answer workload ``w`` on the GPU, or None."""
    need = w.k + w.excl_per_user
    if w.excl_per_user and need > FAISS_GPU_MAX_K:
        return (f"{what} supports k <= {FAISS_GPU_MAX_K}: exclusions need an over-fetch of k + {w.excl_per_user} "
                f"= {need}")
    return None


class FaissContender(Contender):
    """FAISS brute force: ``IndexFlatIP`` on the CPU, ``GpuIndexFlatIP`` on the GPU (``IndexFlatL2`` for l2).

    For ``l2`` FAISS returns squared distances; they are negated so that, like the engine's, higher is better.
    ``cosine`` normalises users and items first, as the engine does. With exclusions it searches
    ``k + max exclusions per user`` and post-filters (:func:`recall.bench.exclusions.post_filter`), timed. A shared
    filter searches a flat index of the allowed items (built in the timed search).
    """

    family = "faiss"
    name = "faiss"

    def __init__(self, device: str, metric: str = "ip") -> None:
        super().__init__(device, metric)
        self._index = None
        self._res = None
        self._faiss = None
        self._xb = None

    def unavailable(self) -> str | None:
        faiss, reason = _import_faiss()
        if reason:
            return reason
        if self.device == "gpu":
            return _faiss_gpu_reason(faiss)
        return None

    def unsupported(self, k: int, n_items: int) -> str | None:
        if self.device == "gpu" and k > FAISS_GPU_MAX_K:
            return f"GpuIndexFlat supports k <= {FAISS_GPU_MAX_K}, asked for k={k}"
        return None

    def unsupported_workload(self, w: Any) -> str | None:
        if w.candidates:
            return "a flat FAISS index searches every item: no per-user candidate lists"
        if w.interests:
            return "a flat FAISS index has no multi-vector users"
        if self.device == "gpu":
            return _overfetch_reason(w, "GpuIndexFlat")
        return None

    def _normalised(self, x: Any) -> Any:
        if self.metric != "cosine":
            return x
        xp = _array_module(x)
        norms = xp.sqrt(xp.einsum("ij,ij->i", x.astype(xp.float64), x.astype(xp.float64)))
        out = (x / norms[:, None]).astype(xp.float32)
        # FAISS reads device memory on its own stream: the normalised copy must be complete before it does.
        synchronize(self.device)
        return out

    def prepare(self, item_vecs: Any) -> None:
        faiss, _ = _import_faiss()
        self._faiss = faiss
        if self.device == "gpu":
            self._res = faiss.StandardGpuResources()
        self._xb = self._normalised(item_vecs)
        self._index = self._build(self._xb)

    def _build(self, xb: Any) -> Any:
        """A flat index over ``xb`` (n, dim) float32, on this contender's device."""
        faiss = self._faiss
        dim = int(xb.shape[1])
        if self.device == "gpu":
            import cupy

            xb = cupy.ascontiguousarray(xb, dtype=cupy.float32)
            cfg = faiss.GpuIndexFlatConfig()
            cfg.device = _current_gpu()
            index = (faiss.GpuIndexFlatL2 if self.metric == "l2" else faiss.GpuIndexFlatIP)(self._res, dim, cfg)
            # add_c with a device pointer: FAISS copies device-to-device, the items never visit the host.
            synchronize("gpu")
            index.add_c(int(xb.shape[0]), faiss.cast_integer_to_float_ptr(int(xb.data.ptr)))
            synchronize("gpu")  # the copy is done: the source may go
            return index
        import numpy as np

        index = faiss.IndexFlatL2(dim) if self.metric == "l2" else faiss.IndexFlatIP(dim)
        index.add(np.ascontiguousarray(xb, dtype=np.float32))
        return index

    def _query(self, index: Any, xq: Any, k_fetch: int) -> tuple[Any, Any]:
        if self.device == "gpu":
            import cupy

            n = int(xq.shape[0])
            xq = cupy.ascontiguousarray(xq, dtype=cupy.float32)
            D = cupy.empty((n, k_fetch), dtype=cupy.float32)
            I = cupy.empty((n, k_fetch), dtype=cupy.int64)
            f = self._faiss
            # Device pointers in, device pointers out: GpuIndex runs on resident data (what faiss.contrib.torch_utils
            # does for torch tensors). FAISS works on its own stream; the runner synchronises the whole device.
            index.search_c(n, f.cast_integer_to_float_ptr(int(xq.data.ptr)), k_fetch,
                           f.cast_integer_to_float_ptr(int(D.data.ptr)), f.cast_integer_to_idx_t_ptr(int(I.data.ptr)))
            return D, I
        return index.search(xq, k_fetch)

    supports_allow = True

    def search(self, user_vecs: Any, k: int, exclude: Any = None, allow: Any = None) -> tuple[Any, Any]:
        xq = self._normalised(user_vecs)
        if allow is not None:
            return self._search_allowed(xq, k, allow)
        n_items = int(self._index.ntotal)
        k_fetch = min(k + exclude.max_per_user, n_items) if exclude is not None else k
        D, I = self._query(self._index, xq, k_fetch)
        return _faiss_finish(self.metric, self.device, D, I, k, exclude)

    def _search_allowed(self, xq: Any, k: int, allow: Any) -> tuple[Any, Any]:
        """A shared filter as a FAISS user applies one to a flat index whatever the device (``GpuIndexFlat`` takes no
        ``IDSelector``): a flat index of the allowed items only, built here and timed, its labels mapped back to
        item rows."""
        xp = _array_module(self._xb)
        rows = xp.asarray(allow, dtype=xp.int64)
        index = self._build(self._xb[rows])
        D, I = self._query(index, xq, min(k, int(rows.shape[0])))
        synchronize(self.device)  # FAISS writes D and I on its own stream
        I, D = _faiss_finish(self.metric, self.device, D, rows[I], k, None)
        D, I = pad(_array_module(D), D, I, k)
        return I, D

    def release(self) -> None:
        self._index = None
        self._res = None
        self._xb = None


def _faiss_finish(metric: str, device: str, D: Any, I: Any, k: int, exclude: Any) -> tuple[Any, Any]:
    """FAISS output (distances D, labels I) to (indices, scores): post-filtered (exclusions), higher is better."""
    if device == "gpu" and (exclude is not None or metric == "l2"):
        synchronize(device)  # FAISS writes D and I on its own stream; what follows runs on CuPy's
    if exclude is not None:
        from .exclusions import post_filter

        I, D = post_filter(exclude, 0, I, D, k)
    if metric == "l2":
        D = -D
    return I, D


class FaissKnnContender(Contender):
    """``faiss.knn_gpu`` (the ``bfKnn`` brute-force kernel) on device pointers: no index, no copy of the items.

    The Python ``faiss.knn_gpu`` takes NumPy arrays (or torch tensors with ``faiss.contrib.torch_utils``); with CuPy
    data this fills the same ``GpuDistanceParams`` with the raw device pointers of users, items and preallocated
    outputs, which is what ``torch_utils`` does for torch tensors. Metrics, cosine and exclusions as
    :class:`FaissContender`.
    """

    family = "faiss"
    name = "faiss-knn"

    def __init__(self, device: str, metric: str = "ip") -> None:
        super().__init__(device, metric)
        self._faiss = None
        self._res = None
        self._xb = None
        self._out: tuple[Any, Any] | None = None

    def unavailable(self) -> str | None:
        if self.device != "gpu":
            return "faiss.knn_gpu runs on the GPU only"
        faiss, reason = _import_faiss()
        if reason:
            return reason
        reason = _faiss_gpu_reason(faiss)
        if reason:
            return reason
        if not (hasattr(faiss, "GpuDistanceParams") and hasattr(faiss, "bfKnn")):
            return "this faiss has no bfKnn / GpuDistanceParams"
        return None

    def unsupported(self, k: int, n_items: int) -> str | None:
        if k > FAISS_GPU_MAX_K:
            return f"knn_gpu supports k <= {FAISS_GPU_MAX_K}, asked for k={k}"
        return None

    def unsupported_workload(self, w: Any) -> str | None:
        if w.candidates or w.interests:
            return "knn_gpu searches every item with one vector per user"
        return _overfetch_reason(w, "knn_gpu")

    _normalised = FaissContender._normalised

    def prepare(self, item_vecs: Any) -> None:
        import cupy

        faiss, _ = _import_faiss()
        self._faiss = faiss
        self._res = faiss.StandardGpuResources()
        self._xb = cupy.ascontiguousarray(self._normalised(item_vecs), dtype=cupy.float32)
        synchronize("gpu")

    def _outputs(self, n: int, k: int) -> tuple[Any, Any]:
        """Preallocated (D, I), reused while the shape stays."""
        import cupy

        if self._out is None or self._out[0].shape != (n, k):
            self._out = None
            self._out = (cupy.empty((n, k), dtype=cupy.float32), cupy.empty((n, k), dtype=cupy.int64))
        return self._out

    def search(self, user_vecs: Any, k: int, exclude: Any = None) -> tuple[Any, Any]:
        import cupy

        f = self._faiss
        xq = cupy.ascontiguousarray(self._normalised(user_vecs), dtype=cupy.float32)
        n, dim = int(xq.shape[0]), int(xq.shape[1])
        n_items = int(self._xb.shape[0])
        k_fetch = min(k + exclude.max_per_user, n_items) if exclude is not None else min(k, n_items)
        D, I = self._outputs(n, k_fetch)
        args = f.GpuDistanceParams()
        args.metric = f.METRIC_L2 if self.metric == "l2" else f.METRIC_INNER_PRODUCT
        args.k = k_fetch
        args.dims = dim
        args.vectors = f.cast_integer_to_float_ptr(int(self._xb.data.ptr))
        args.vectorsRowMajor = True
        args.vectorType = f.DistanceDataType_F32
        args.numVectors = n_items
        args.queries = f.cast_integer_to_float_ptr(int(xq.data.ptr))
        args.queriesRowMajor = True
        args.queryType = f.DistanceDataType_F32
        args.numQueries = n
        args.outDistances = f.cast_integer_to_float_ptr(int(D.data.ptr))
        args.outIndices = f.cast_integer_to_idx_t_ptr(int(I.data.ptr))
        args.outIndicesType = f.IndicesDataType_I64
        args.device = _current_gpu()
        if hasattr(args, "use_cuvs"):
            args.use_cuvs = False  # FAISS's own kernels: cuVS is measured as its own contender
        f.bfKnn(self._res, args)
        if k > k_fetch and exclude is None:  # k > n_items: pad as FAISS's index does
            synchronize("gpu")
            D, I = pad(cupy, D, I, k)
        return _faiss_finish(self.metric, "gpu", D, I, k, exclude)

    def release(self) -> None:
        self._out = None
        self._xb = None
        self._res = None


# --- cuVS -----------------------------------------------------------------------------------------------------------


def _import_cuvs() -> tuple[Any, str | None]:
    return _optional("cuvs", "cuVS", "install cuvs-cu12 (or cuvs-cu13) from the RAPIDS index, or stage it as "
                     "shared/device/README.md says", probe=("neighbors.brute_force", "neighbors.filters"))


_CUVS_METRIC = {"ip": "inner_product", "l2": "sqeuclidean", "cosine": "cosine"}


def _cuvs_finish(metric: str, D: Any, I: Any) -> None:
    """In place, cuVS (distances, neighbors) -> (scores, item rows): inner products as they are, l2 -||u - v||^2,
    cosine 1 - distance; a slot cuVS could not fill from allowed items (it leaves the worst value there: -FLT_MAX
    for inner product, which it ranks descending, +inf or FLT_MAX for the distances) -> (-inf, -1)."""
    xp = _array_module(D)
    masked = (D <= -3.0e38) if metric == "ip" else (D >= 3.0e38)
    if metric == "l2":
        xp.negative(D, out=D)
    elif metric == "cosine":
        xp.subtract(1.0, D, out=D)
    D[masked] = -xp.inf
    I[masked] = -1


class CuvsContender(Contender):
    """``cuvs.neighbors.brute_force``: the index built once in ``prepare``, users searched in batches.

    Metrics: ip -> "inner_product" (cuVS returns the inner products, best first), l2 -> "sqeuclidean" (reported as
    -||u - v||^2 like the engine), cosine -> "cosine" (distance 1 - cos, reported as cos). Inputs are CuPy device
    arrays; each batch's answer is copied into CuPy arrays reused between searches. cuVS runs on its own
    ``Resources`` stream: CuPy's stream is synchronised before each batch's search (queries, bitmap written) and cuVS's
    after it (the bitmap is rewritten for the next batch), and those waits are timed, as a cuVS user would pay them.
    Exclusions go in as a per-query bitmap, a shared filter as one bitset (``filters.from_bitset``).
    """

    family = "cuvs"
    name = "cuvs"

    def __init__(self, device: str, metric: str = "ip", batch_users: int = CUVS_BATCH_USERS) -> None:
        super().__init__(device, metric)
        if isinstance(batch_users, bool) or not isinstance(batch_users, int) or batch_users < 1:
            raise InputError(f"cuVS batch_users must be an integer >= 1, got {batch_users!r}")
        self.batch_users = batch_users
        self._index = None
        self._res = None
        self._keep = None
        self._out: tuple[Any, Any] | None = None
        self._bits = None

    def unavailable(self) -> str | None:
        if self.device != "gpu":
            return "cuVS brute_force runs on the GPU only"
        reason = _gpu_reason()
        if reason:
            return reason
        _, reason = _import_cuvs()
        return reason

    def unsupported_workload(self, w: Any) -> str | None:
        if w.candidates or w.interests:
            return "cuVS brute_force searches every item with one vector per user"
        return None

    def prepare(self, item_vecs: Any) -> None:
        import cupy
        from cuvs.common import Resources
        from cuvs.neighbors import brute_force

        # cuVS's own stream: handing it a CuPy stream (Resources(stream=ptr)) crashes cuVS 26.10 in build on this
        # image (scripts/lab/cuvs_probe.py), so the two meet at synchronisations instead.
        self._res = Resources()
        xb = cupy.ascontiguousarray(item_vecs, dtype=cupy.float32)
        synchronize("gpu")  # the items were written on CuPy's stream; cuVS reads them on its own
        self._index = brute_force.build(xb, metric=_CUVS_METRIC[self.metric], resources=self._res)
        self._res.sync()
        self._keep = xb  # the index refers to the device dataset, it does not copy it
        self._n_items = int(xb.shape[0])

    def _batch(self, exclude: Any) -> int:
        if exclude is None:
            return self.batch_users
        # A batch's bitmap is batch x n_items bits: keep it to CUVS_BITMAP_BYTES, however large the catalogue.
        return max(1, min(self.batch_users, CUVS_BITMAP_BYTES * 8 // max(1, self._n_items)))

    def _outputs(self, n: int, k: int) -> tuple[Any, Any]:
        import cupy

        if self._out is None or self._out[0].shape != (n, k):
            self._out = None
            self._out = (cupy.empty((n, k), dtype=cupy.float32), cupy.empty((n, k), dtype=cupy.int64))
        return self._out

    supports_allow = True

    def search(self, user_vecs: Any, k: int, exclude: Any = None, allow: Any = None) -> tuple[Any, Any]:
        import cupy
        from cuvs.neighbors import brute_force, filters

        from .exclusions import allow_bitset, bitmap_into, bitmap_words

        shared = None
        if allow is not None:
            # A shared filter the cuVS way: one bitset over the items for every query (built here, timed).
            shared = filters.from_bitset(cupy.asarray(allow_bitset(allow, self._n_items)))
        n = int(user_vecs.shape[0])
        k_sel = min(k, self._n_items)
        D, I = self._outputs(n, k_sel)
        batch = self._batch(exclude)
        stream = cupy.cuda.get_current_stream()
        xq = cupy.ascontiguousarray(user_vecs, dtype=cupy.float32)
        if exclude is not None:
            words = bitmap_words(min(batch, n), self._n_items)
            if self._bits is None or self._bits.shape[0] < words:
                self._bits = None
                self._bits = cupy.empty(words, dtype=cupy.uint32)
        for a in range(0, n, batch):
            b = min(a + batch, n)
            prefilter = shared
            if exclude is not None:
                prefilter = filters.from_bitmap(bitmap_into(self._bits, exclude, a, b))
            stream.synchronize()  # what CuPy wrote (queries, bitmap) is there before cuVS's stream reads it
            d, i = brute_force.search(self._index, xq[a:b], k_sel, resources=self._res, prefilter=prefilter)
            self._res.sync()
            D[a:b] = cupy.asarray(d)
            I[a:b] = cupy.asarray(i)
        _cuvs_finish(self.metric, D, I)
        D, I = pad(cupy, D, I, k)
        return I, D

    def sync(self) -> None:
        if self._res is not None:
            self._res.sync()
        synchronize(self.device)

    def release(self) -> None:
        self._index = None
        self._res = None
        self._out = None
        self._bits = None
        self._keep = None


# --- torch ----------------------------------------------------------------------------------------------------------


def _import_torch() -> tuple[Any, str | None]:
    return _optional("torch", "torch")


class TorchContender(Contender):
    """Chunked ``torch.matmul`` + ``torch.topk``: the baseline anyone would write first.

    fp32 runs with TF32 off (``torch.backends.cuda.matmul.allow_tf32 = False``), so it is exact up to float32
    rounding; ``bf16`` (GPU only) casts users and items to bfloat16 and is not exact: its recall is reported.
    Users are taken in chunks whose score block is ``TORCH_SCORE_BYTES``.
    """

    family = "torch"

    def __init__(self, device: str, metric: str = "ip", dtype: str = "fp32") -> None:
        super().__init__(device, metric)
        self.dtype_name = dtype
        self.name = "torch" if dtype == "fp32" else f"torch-{dtype}"
        self.exact = dtype == "fp32"
        self._items = None
        self._items_t = None
        self._torch = None

    def unavailable(self) -> str | None:
        torch, reason = _import_torch()
        if reason:
            return reason
        if self.device == "gpu" and not torch.cuda.is_available():
            return "torch sees no CUDA GPU"
        if self.device == "cpu" and self.dtype_name != "fp32":
            return f"{self.dtype_name} is benchmarked on the GPU only"
        return None

    def _tensor(self, x: Any) -> Any:
        torch = self._torch
        if self.device == "gpu":
            t = torch.from_dlpack(x)  # zero-copy view of the CuPy array
        else:
            t = torch.from_numpy(x)
        return t

    def _prepare_metric(self, t: Any, items: bool) -> Any:
        torch = self._torch
        if self.metric == "cosine":
            return torch.nn.functional.normalize(t.double(), dim=1).float()
        if self.metric == "l2":
            # Same augmentation as the engine: rank by u.v - |v|^2/2 with users [u, 1] and items [v, -|v|^2/2].
            extra = (-0.5 * (t.double() ** 2).sum(1, keepdim=True)).float() if items else torch.ones_like(t[:, :1])
            return torch.cat([t, extra], dim=1)
        return t

    def prepare(self, item_vecs: Any) -> None:
        torch, _ = _import_torch()
        self._torch = torch
        # "highest" keeps fp32 matmuls off TF32 tensor cores; the default may change between torch versions.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        items = self._prepare_metric(self._tensor(item_vecs), items=True)
        if self.dtype_name == "bf16":
            items = items.to(torch.bfloat16)
        self._items_t = items.t()  # (dim, n_items) view: matmul(users, items.T) without a copy
        self._items = items

    def unsupported_workload(self, w: Any) -> str | None:
        if w.excl_per_user and self.dtype_name != "fp32":
            return f"{self.dtype_name} is benchmarked without exclusions"
        if (w.candidates or w.interests) and self.dtype_name != "fp32":
            return f"{self.dtype_name} is benchmarked on single-vector full searches only"
        return None

    supports_allow = True

    def search(self, user_vecs: Any, k: int, exclude: Any = None, allow: Any = None) -> tuple[Any, Any]:
        from .workloads import CandidateUsers, MultiInterestUsers

        if isinstance(user_vecs, CandidateUsers):
            return self._search_candidates(user_vecs, k)
        if isinstance(user_vecs, MultiInterestUsers):
            return self._search_interests(user_vecs, k)
        torch = self._torch
        users = self._tensor(user_vecs)
        n_users, n_items = int(users.shape[0]), int(self._items.shape[0])
        k_sel = min(k, n_items)
        elem = 2 if self.dtype_name == "bf16" else 4
        # With exclusions a bool mask of the block sits beside the scores: 1 byte more per score.
        chunk = max(1, min(n_users, TORCH_SCORE_BYTES // ((elem + (exclude is not None)) * n_items)))
        D = torch.empty((n_users, k_sel), dtype=torch.float32, device=users.device)
        I = torch.empty((n_users, k_sel), dtype=torch.int64, device=users.device)
        denied = None
        if allow is not None:
            # What a torch user writes for a shared filter: a column mask, built on the device, timed.
            denied = torch.ones(n_items, dtype=torch.bool, device=users.device)
            denied[self._tensor(allow)] = False
        for start in range(0, n_users, chunk):
            stop = min(start + chunk, n_users)
            xq = self._prepare_metric(users[start:stop], items=False)
            if self.dtype_name == "bf16":
                xq = xq.to(torch.bfloat16)
            s = torch.matmul(xq, self._items_t)
            if denied is not None:
                s.masked_fill_(denied[None, :], float("-inf"))
            if exclude is not None:
                # What a torch user writes: a dense mask of the block from the CSR, built on the device.
                rows, cols = (self._tensor(a) for a in exclude.entries(start, stop))
                mask = torch.zeros(s.shape, dtype=torch.bool, device=s.device)
                mask[rows, cols] = True
                s.masked_fill_(mask, float("-inf"))
                del mask
            vals, idx = torch.topk(s, k_sel, dim=1)
            if exclude is not None or denied is not None:
                idx[torch.isneginf(vals)] = -1  # fewer than k allowed items: the rest is padding
            D[start:stop] = vals
            I[start:stop] = idx
        if self.metric == "l2":
            sq = (users.double() ** 2).sum(1, keepdim=True).float()
            D = 2.0 * D - sq
        return I, D

    def _search_candidates(self, users: Any, k: int) -> tuple[Any, Any]:
        """Re-scoring baseline: gather each user's candidate vectors, ``torch.bmm``, ``torch.topk``."""
        torch = self._torch
        vecs, cands = self._tensor(users.vecs), self._tensor(users.candidates)
        n_users, per_user = int(cands.shape[0]), int(cands.shape[1])
        k_sel = min(k, per_user)
        chunk = max(1, min(n_users, TORCH_SCORE_BYTES // (4 * per_user * int(self._items.shape[1]))))
        D = torch.empty((n_users, k_sel), dtype=torch.float32, device=vecs.device)
        I = torch.empty((n_users, k_sel), dtype=torch.int64, device=vecs.device)
        for start in range(0, n_users, chunk):
            rows = cands[start:start + chunk]
            xq = self._prepare_metric(vecs[start:start + chunk], items=False)
            scores = torch.bmm(self._items[rows], xq.unsqueeze(2)).squeeze(2)  # (chunk, per_user)
            vals, pos = torch.topk(scores, k_sel, dim=1)
            D[start:start + chunk] = vals
            I[start:start + chunk] = rows.gather(1, pos)
        if self.metric == "l2":
            D = 2.0 * D - (vecs.double() ** 2).sum(1, keepdim=True).float()
        return I, D

    def _search_interests(self, users: Any, k: int) -> tuple[Any, Any]:
        """Multi-interest baseline: ``torch.matmul`` of every interest, max (or sum) over a user's, ``torch.topk``."""
        torch = self._torch
        vecs = self._tensor(users.vecs)
        n_users, m, dim = (int(x) for x in vecs.shape)
        n_items = int(self._items.shape[0])
        k_sel = min(k, n_items)
        chunk = max(1, min(n_users, TORCH_SCORE_BYTES // (4 * m * n_items)))
        D = torch.empty((n_users, k_sel), dtype=torch.float32, device=vecs.device)
        I = torch.empty((n_users, k_sel), dtype=torch.int64, device=vecs.device)
        for start in range(0, n_users, chunk):
            flat = vecs[start:start + chunk].reshape(-1, dim)
            s = torch.matmul(self._prepare_metric(flat, items=False), self._items_t)
            if self.metric == "l2":
                s -= 0.5 * (flat.double() ** 2).sum(1, keepdim=True).float()  # each interest's own -|u - v|^2 / 2
            s = s.view(-1, m, n_items)
            agg = s.amax(dim=1) if users.aggregate == "max" else s.sum(dim=1)
            vals, idx = torch.topk(agg, k_sel, dim=1)
            D[start:start + chunk] = vals
            I[start:start + chunk] = idx
        if self.metric == "l2":
            D = 2.0 * D
        return I, D

    def sync(self) -> None:
        if self.device == "gpu" and self._torch is not None:
            self._torch.cuda.synchronize()
        synchronize(self.device)

    def release(self) -> None:
        self._items = None
        self._items_t = None


# --- helpers --------------------------------------------------------------------------------------------------------


def _array_module(x: Any) -> Any:
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    import numpy

    return numpy


def _current_gpu() -> int:
    import cupy

    return int(cupy.cuda.Device().id)


def parse_families(spec: str | list[str] | None) -> list[str]:
    """``"recall,faiss"`` -> ["recall", "faiss"]; None -> every family.

    Raises
    ------
    InputError
        On an unknown family name or an empty list.
    """
    if spec is None:
        return list(FAMILIES)
    parts = spec if isinstance(spec, list) else [spec]
    names = [p.strip() for part in parts for p in part.split(",") if p.strip()]
    if not names:
        raise InputError("--contenders is empty: expected a comma-separated list of " + ", ".join(FAMILIES))
    for n in names:
        if n not in FAMILIES:
            raise InputError(f"unknown contender {n!r}: expected some of {', '.join(FAMILIES)}")
    return list(dict.fromkeys(names))


def build(families: list[str], device: str, metric: str = "ip", memory_budget: int | None = None,
          inexact: bool = True) -> list[Contender]:
    """The contenders of ``families`` on ``device``, in report order: every engine precision mode; on the GPU also
    FAISS's ``knn_gpu`` and (with ``inexact``) torch-bf16.

    Raises
    ------
    InputError
        On an unknown family.
    """
    out: list[Contender] = []
    for fam in parse_families(families):
        if fam == "recall":
            out += [RecallContender(device, metric, p, memory_budget) for p in engine_precisions(device)]
        elif fam == "faiss":
            out.append(FaissContender(device, metric))
            if device == "gpu":
                out.append(FaissKnnContender(device, metric))
        elif fam == "cuvs":
            out.append(CuvsContender(device, metric))
        elif fam == "torch":
            out.append(TorchContender(device, metric, "fp32"))
            if device == "gpu" and inexact:
                out.append(TorchContender(device, metric, "bf16"))
    return out
