"""Named benchmark workloads and the seeded generators of their data.

Every workload is generated from a seed, so a run can be repeated. Vectors are float32. The data kinds vary what
real embeddings vary (``../shared/design/WORKLOADS.md``): direction structure (clusters), user norms, item norms
(log-normal or heavy-tailed), and integer quantisation (ties). Each kind has default parameters
(:data:`KIND_DEFAULTS`); a kind *spec* overrides some, e.g. ``"skewed:user_sigma=0.8,centres=1024"``.

=============  ======================================================================================================
kind           what it stands for
=============  ======================================================================================================
``normal``     i.i.d. N(0, 1) users and items: no structure, the textbook case.
``clustered``  ``centres`` (256) shared N(0, 1) centres, every vector = its centre + ``noise`` (0.35) x N(0, 1); item
               norms log-normal (``item_sigma`` 0.5), as recommender embeddings are (popular items have large
               norms). This changes how fast a running top-k threshold settles, which threshold filtering lives on.
``skewed``     ``clustered`` with log-normal USER norms too (``user_sigma`` 0.5, ``item_sigma`` 0.5): real user towers
               do not emit unit vectors, so one user's scores are on another scale than the next user's.
``popular``    ``clustered`` directions with heavy-tailed item norms, ``sqrt(dim) * Pareto(pareto_alpha)`` (alpha 2.0,
               scaled to median sqrt(dim)): a few "popular" items have norms 10-1000x the median and sit in almost
               every user's top-k.
``adversarial``  users share a common direction and items are ordered by rising score against the mean user, so
               each item tile beats the previous one for most users: the worst case for threshold filtering.
``ties``       small-integer vectors in [-``tie_range``, ``tie_range``] (2): many scores are exactly equal, which
               exercises the tie rule (equal scores go to the lower item row).
``int8``       ``clustered`` (with its norms) quantised to integers in [-127, 127] with one scale per matrix, as int8
               embedding exports are: scores are exact integers in float32 (for dim <= 1,040) and ties are common.
=============  ======================================================================================================

Parameters (:class:`KindParams`): ``user_sigma`` and ``item_sigma`` (log-normal sigma of user / item norms, 0 = as
drawn; norms become ``sqrt(dim) * LogNormal(0, sigma)``), ``centres`` and ``noise`` (the clusters), ``pareto_alpha``
(> 0: heavy-tailed item norms instead of ``item_sigma``), ``tie_range``, ``offset`` (added to every coordinate of
users and items: data far from the origin, e.g. ``"ties:offset=3000"``). Not every parameter applies to every kind:
integer kinds take no norm spread, ``adversarial`` no item norm spread (it would undo the ordering); asking for one
raises :class:`~recall.InputError`.

Data can be generated on the host (NumPy) or directly on the GPU (CuPy, ``device="gpu"``), so that a 10M x 64 matrix
never crosses PCIe. Generation works in row chunks where it transforms a matrix (centres, norms, quantisation,
ordering), so a matrix needs about one chunk of scratch beside itself, never a full extra copy. The two random
streams differ: the same seed gives the same data on every run of the same device, but NumPy data and CuPy data for
one seed are different (and equally distributed).

A workload may carry per-user exclusions (``excl_per_user``, see :mod:`recall.bench.exclusions`) and its own metric
(matrix cells do; otherwise ``--metric`` decides).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from recall import InputError

from .rng import Rng, candidate_rows, module_for

N_CENTRES = 256
"""Number of cluster centres of the ``clustered`` kind (default of ``KindParams.centres``)."""
NOISE = 0.35
"""Per-coordinate noise around a centre (centres are N(0, 1)): clusters are tight but overlap a little."""
NORM_SIGMA = 0.5
"""Sigma of the log-normal item norms of the ``clustered`` kind."""
ADVERSARIAL_BIAS = 2.0
"""Strength of the ``adversarial`` users' shared direction, relative to their N(0, 1) noise (cosine to it ~0.9)."""
TIE_RANGE = 2
"""``ties`` vectors have integer coordinates in [-TIE_RANGE, TIE_RANGE]: scores are small integers, exact in float32."""
PARETO_ALPHA = 2.0
"""Tail index of the ``popular`` item norms: the largest of 1M items is ~1,000x the median."""
INT8_MAX = 127
"""``int8`` coordinates are integers in [-INT8_MAX, INT8_MAX]."""

# Generation works in row chunks so that a 10M x 256 matrix needs about one extra chunk of scratch, not a full copy.
_CHUNK_ROWS = 1 << 16


class Kind(str, enum.Enum):
    """The data kinds a workload can be generated with (see the module docstring)."""

    normal = "normal"
    clustered = "clustered"
    adversarial = "adversarial"
    ties = "ties"
    skewed = "skewed"
    popular = "popular"
    int8 = "int8"


@dataclass(frozen=True)
class KindParams:
    """Parameters of a data kind (see the module docstring); :data:`KIND_DEFAULTS` has each kind's.

    Attributes
    ----------
    user_sigma, item_sigma : float
        Sigma of the log-normal user / item norms (norms ``sqrt(dim) * LogNormal(0, sigma)``); 0 keeps the norms the
        vectors were drawn with.
    centres : int
        Cluster centres of the clustered kinds (``clustered``, ``skewed``, ``popular``, ``int8``).
    noise : float
        Per-coordinate noise around a centre, relative to the N(0, 1) centres.
    pareto_alpha : float
        > 0: item norms ``sqrt(dim) * Pareto(alpha) / 2**(1/alpha)`` (median sqrt(dim)), replacing ``item_sigma``.
    tie_range : int
        ``ties`` coordinates are integers in [-tie_range, tie_range].
    offset : float
        Added to every coordinate of users and items (any kind): data around a point far from the origin, where
        ``l2``'s float32 expansion loses the digits of the distances unless the vectors are centred first.
    """

    user_sigma: float = 0.0
    item_sigma: float = 0.0
    centres: int = N_CENTRES
    noise: float = NOISE
    pareto_alpha: float = 0.0
    tie_range: int = TIE_RANGE
    offset: float = 0.0

    def diff(self, other: "KindParams") -> dict[str, Any]:
        """The fields whose value differs from ``other``'s, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)}


KIND_DEFAULTS: dict[Kind, KindParams] = {
    Kind.normal: KindParams(),
    Kind.clustered: KindParams(item_sigma=NORM_SIGMA),
    Kind.adversarial: KindParams(),
    Kind.ties: KindParams(),
    Kind.skewed: KindParams(user_sigma=0.5, item_sigma=0.5),
    Kind.popular: KindParams(pareto_alpha=PARETO_ALPHA),
    Kind.int8: KindParams(item_sigma=NORM_SIGMA),
}
"""Default parameters of each kind."""

_CLUSTERED = (Kind.clustered, Kind.skewed, Kind.popular, Kind.int8)
# Which parameters each kind reads; a spec that sets another one is an error, not silently ignored.
_APPLIES: dict[Kind, tuple[str, ...]] = {
    Kind.normal: ("user_sigma", "item_sigma", "pareto_alpha", "offset"),
    Kind.adversarial: ("user_sigma", "offset"),
    Kind.ties: ("tie_range", "offset"),
    **{k: ("user_sigma", "item_sigma", "centres", "noise", "pareto_alpha", "offset") for k in _CLUSTERED},
}


def _kind(kind: Kind | str) -> Kind:
    try:
        return Kind(kind)
    except ValueError:
        raise InputError(f"unknown data kind {kind!r}: expected one of {', '.join(k.value for k in Kind)}") from None


def parse_kind(spec: "Kind | str", params: KindParams | None = None) -> tuple[Kind, KindParams]:
    """``"skewed:user_sigma=0.8,centres=1024"`` -> (Kind.skewed, its defaults with those two replaced).

    Parameters
    ----------
    spec : Kind or str
        A kind name, optionally followed by ``:name=value,...`` overrides of :class:`KindParams` fields.
    params : KindParams, optional
        Explicit parameters (then ``spec`` must be a bare kind name).

    Raises
    ------
    InputError
        Unknown kind or parameter, a value that does not parse or is out of range, or a parameter the kind does
        not read.
    """
    text = spec.value if isinstance(spec, Kind) else str(spec)
    name, _, rest = text.partition(":")
    kind = _kind(name.strip())
    if params is not None:
        if rest:
            raise InputError(f"kind {text!r}: give parameters either in the spec or as KindParams, not both")
        out = params
    else:
        out = KIND_DEFAULTS[kind]
        types = {f.name: f.type for f in fields(KindParams)}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or key not in types:
                raise InputError(f"kind {text!r}: expected name=value with a name among {', '.join(types)}, "
                                 f"got {item!r}")
            try:
                val: Any = int(value) if types[key] in (int, "int") else float(value)
            except ValueError:
                raise InputError(f"kind {text!r}: {key}={value!r} is not a number") from None
            out = replace(out, **{key: val})
    _check_params(kind, out, text)
    return kind, out


def _check_params(kind: Kind, p: KindParams, text: str) -> None:
    for name, value in p.diff(KindParams()).items():
        if name not in _APPLIES[kind]:
            raise InputError(f"kind {text!r}: {name} does not apply to {kind.value} data")
        if not np.isfinite(value):  # nan passes every comparison below and would generate NaN data
            raise InputError(f"kind {text!r}: {name}={value!r} is not a finite number")
    if p.user_sigma < 0 or p.item_sigma < 0 or p.noise < 0 or p.pareto_alpha < 0:
        raise InputError(f"kind {text!r}: sigmas, noise and pareto_alpha must be >= 0, got {p}")
    if p.centres < 1 or p.tie_range < 1:
        raise InputError(f"kind {text!r}: centres and tie_range must be >= 1, got {p}")


def kind_label(kind: Kind, params: KindParams) -> str:
    """``"skewed"``, or ``"skewed(user_sigma=0.8)"`` where the parameters differ from the kind's defaults."""
    extra = params.diff(KIND_DEFAULTS[kind])
    if not extra:
        return kind.value
    return kind.value + "(" + ",".join(f"{k}={v:g}" for k, v in extra.items()) + ")"


METRICS = ("ip", "cosine", "l2")


@dataclass(frozen=True)
class Workload:
    """One benchmark shape: ``n_users`` users against ``n_items`` items of dimension ``dim``, top ``k``.

    Attributes
    ----------
    name : str
        The name ``recall bench --workload`` takes.
    n_users, n_items, dim, k : int
        The shape of the search.
    kind : Kind or str
        The data kind generated by default (``--kind`` overrides it); "file" for users' own data.
    device : {"cpu", "gpu"}
        Where the workload is meant to run (a hint for the listing; ``--device`` decides).
    why : str
        What the workload stands for.
    candidates : int
        Per-user candidate count for re-scoring workloads (S5); 0 for full searches.
    unsupported : str
        Empty when the harness can run the workload, else the reason it is skip-listed.
    interests : int
        Vectors per user for multi-interest workloads (S7); 0 for one vector per user.
    aggregate : {"max", "sum"}
        How a multi-interest user's scores combine.
    params : KindParams, optional
        The data kind's parameters; None: the kind's defaults.
    excl_per_user : int
        Items excluded per user ("already seen"), generated from the seed (:mod:`recall.bench.exclusions`); 0: none.
    metric : {"ip", "cosine", "l2"}, optional
        The metric of this workload (matrix cells); None: the run's ``--metric``.
    cell : str
        The matrix cell this workload stands for ("" outside a matrix run).
    allow_fraction : float
        A shared item filter (an allow-set of this fraction of the catalogue, drawn from the seed; 0: none): every
        user may get only those items.
    """

    name: str
    n_users: int
    n_items: int
    dim: int
    k: int
    kind: Kind | str = Kind.normal
    device: str = "cpu"
    why: str = ""
    candidates: int = 0
    unsupported: str = ""
    interests: int = 0
    aggregate: str = "max"
    params: KindParams | None = None
    excl_per_user: int = 0
    metric: str | None = None
    cell: str = ""
    allow_fraction: float = 0.0

    def __post_init__(self) -> None:
        for what in ("n_users", "n_items", "dim", "k"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise InputError(f"workload {self.name!r}: {what} must be an integer >= 1, got {value!r}")
        if not isinstance(self.excl_per_user, (int, np.integer)) or self.excl_per_user < 0:
            raise InputError(f"workload {self.name!r}: excl_per_user must be an integer >= 0, "
                             f"got {self.excl_per_user!r}")
        if self.excl_per_user and self.excl_per_user >= self.n_items:
            raise InputError(f"workload {self.name!r}: {self.excl_per_user} exclusions per user need more than "
                             f"{self.n_items} items")
        if self.excl_per_user and (self.candidates or self.interests):
            raise InputError(f"workload {self.name!r}: exclusions apply to single-vector full searches only")
        if not 0.0 <= self.allow_fraction < 1.0:
            raise InputError(f"workload {self.name!r}: allow_fraction must be in [0, 1), got {self.allow_fraction!r}")
        if self.allow_fraction and (self.candidates or self.interests):
            raise InputError(f"workload {self.name!r}: item filters apply to single-vector full searches here")
        if self.metric is not None and self.metric not in METRICS:
            raise InputError(f"workload {self.name!r}: unknown metric {self.metric!r}: expected ip, cosine or l2")
        if self.params is not None and isinstance(self.kind, Kind):
            _check_params(self.kind, self.params, self.kind.value)

    @property
    def flops(self) -> float:
        """Floating-point operations of a full search, 2 * n_users * n_items * dim (per-user candidates for S5,
        times the interests per user for S7)."""
        per_user = self.candidates if self.candidates else self.n_items
        return 2.0 * self.n_users * max(1, self.interests) * per_user * self.dim

    @property
    def bytes_moved(self) -> float:
        """For re-scoring (memory-bound): the candidate vectors read once plus the results written (float32 score,
        int64 row per slot), the bytes its HBM-bandwidth efficiency is measured by; 0 for other workloads."""
        if not self.candidates:
            return 0.0
        return float(self.n_users) * (self.candidates * self.dim * 4 + self.k * 12)

    @property
    def kind_params(self) -> KindParams | None:
        """The parameters the data is generated with (None for users' own files)."""
        if not isinstance(self.kind, Kind):
            return None
        return self.params if self.params is not None else KIND_DEFAULTS[self.kind]

    @property
    def kind_label(self) -> str:
        """The data kind as text ("normal", "skewed(user_sigma=0.8)", ..., or "file")."""
        if not isinstance(self.kind, Kind):
            return str(self.kind)
        return kind_label(self.kind, self.kind_params)

    def with_kind(self, kind: Kind | str | None) -> "Workload":
        """This workload with its data kind replaced (unchanged when ``kind`` is None); ``kind`` may be a spec with
        parameters, e.g. ``"skewed:user_sigma=0.8"``."""
        if kind is None:
            return self
        k, p = parse_kind(kind)
        return replace(self, kind=k, params=p)

    def generate(self, seed: int = 0, device: str = "cpu") -> tuple[Any, Any]:
        """The (users, items) of this workload; see :func:`generate`. Re-scoring workloads give
        :class:`CandidateUsers` as users, multi-interest ones :class:`MultiInterestUsers`."""
        n_vecs = self.n_users * max(1, self.interests)
        users, items = generate(self.kind, n_vecs, self.n_items, self.dim, seed=seed, device=device,
                                params=self.params)
        if self.interests:
            users = MultiInterestUsers(users.reshape(self.n_users, self.interests, self.dim), self.aggregate)
        if self.candidates:
            users = CandidateUsers(users, candidate_rows(self.n_users, self.n_items, self.candidates, seed, device))
        return users, items

    def exclusions(self, users: Any, items: Any, seed: int = 0, metric: str = "ip") -> Any:
        """This workload's per-user exclusions (:class:`recall.bench.exclusions.Exclusions`, on the users' device),
        or None when it has none; see :func:`recall.bench.exclusions.generate`."""
        if not self.excl_per_user:
            return None
        from . import exclusions

        return exclusions.generate(users, items, self.excl_per_user, k=self.k, seed=seed, metric=metric)

    def allowed(self, seed: int = 0) -> np.ndarray | None:
        """The rows of the shared allow-set (host int64, increasing), or None without one."""
        if not self.allow_fraction:
            return None
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0xA110]))
        n = max(1, int(round(self.allow_fraction * self.n_items)))
        return np.sort(rng.choice(self.n_items, n, replace=False)).astype(np.int64)

    def truth(self, users: Any, items: Any, rows: Any, metric: str = "ip", exclude: Any = None,
              allowed: np.ndarray | None = None) -> Any:
        """The exact float64 answer for the sampled user ``rows`` (``oracle.Truth``): over each user's own candidates
        for re-scoring, over the aggregate of its interests for multi-interest users, else ``oracle.exact_topk``
        (honouring ``exclude``)."""
        from . import oracle

        if isinstance(users, CandidateUsers):
            return _candidate_truth(users, items, self.k, rows, metric)
        if isinstance(users, MultiInterestUsers):
            return _interest_truth(users, items, self.k, rows, metric)
        return oracle.exact_topk(users, items, self.k, rows, metric=metric, exclude=exclude, allowed=allowed)

    def check(self, truth: Any, users: Any, items: Any, indices: Any, scores: Any = None,
              rtol: float | None = None) -> Any:
        """``oracle.check`` of an answer (all users' rows) against :meth:`truth`, for every kind of workload."""
        from . import oracle

        rtol = oracle.DEFAULT_RTOL if rtol is None else rtol
        if isinstance(users, CandidateUsers):
            return _candidate_check(truth, users, items, indices, scores, rtol)
        if isinstance(users, MultiInterestUsers):
            return _interest_check(truth, users, items, indices, scores, rtol)
        return oracle.check(truth, items, indices, scores, rtol=rtol)


def _rescore_reason(what: str = "Engine.rescore()") -> str:
    """Why S5 (or S7) cannot run, or "" when it can: the engine needs a per-user re-scoring entry point. (The
    runner judges these workloads with ``Workload.truth`` / ``Workload.check``, not the full-search oracle.)"""
    from recall import Engine

    if not hasattr(Engine, "rescore"):
        return "not yet supported: recall.Engine has no rescore() for per-user candidate re-scoring"
    return ""


def _workloads() -> dict[str, Workload]:
    w = [
        Workload("tiny", 2_000, 5_000, 32, 10, Kind.normal, "cpu", "demo, smoke, CI"),
        Workload("cpu-small", 20_000, 100_000, 64, 100, Kind.normal, "cpu", "CPU backend vs faiss-cpu IndexFlatIP"),
        Workload("S1", 100_000, 1_000_000, 64, 100, Kind.clustered, "gpu", "typical two-tower recall"),
        Workload("S2", 100_000, 1_000_000, 128, 100, Kind.clustered, "gpu", "wider embeddings"),
        Workload("S3", 100_000, 1_000_000, 64, 1_000, Kind.clustered, "gpu", "deep candidate lists"),
        Workload("S4", 1_000_000, 1_000_000, 64, 100, Kind.clustered, "gpu", "nightly scale (128 TFLOP of fp32)"),
        Workload("S5", 100_000, 1_000_000, 64, 100, Kind.clustered, "gpu",
                 "per-user re-scoring of 1,000 own candidates: memory-bound", candidates=1_000,
                 unsupported=_rescore_reason()),
        Workload("S6", 100_000, 1_000_000, 256, 100, Kind.clustered, "gpu", "GEMM-bound"),
        Workload("S7", 100_000, 1_000_000, 64, 100, Kind.clustered, "gpu",
                 "multi-interest users: 4 vectors each, score = max over them", interests=4,
                 unsupported=_rescore_reason("multi-interest search")),
        Workload("S5-small", 2_000, 50_000, 32, 10, Kind.clustered, "cpu",
                 "S5 in small: 500 own candidates per user", candidates=500, unsupported=_rescore_reason()),
        Workload("S7-small", 2_000, 20_000, 32, 10, Kind.clustered, "cpu",
                 "S7 in small: 4 vectors per user, max", interests=4,
                 unsupported=_rescore_reason("multi-interest search")),
        Workload("tiny-x50", 2_000, 5_000, 32, 10, Kind.clustered, "cpu",
                 "tiny, clustered, 50 exclusions per user: smoke of the exclusion path", excl_per_user=50),
        Workload("cpu-small-x50", 20_000, 100_000, 64, 100, Kind.normal, "cpu",
                 "cpu-small + 50 exclusions per user", excl_per_user=50),
        Workload("S1-x200", 100_000, 1_000_000, 64, 100, Kind.clustered, "gpu",
                 "S1 + 200 exclusions per user (already seen): FAISS over-fetches k + 200", excl_per_user=200),
        Workload("S4-x20", 1_000_000, 1_000_000, 64, 100, Kind.clustered, "gpu",
                 "S4 + 20 exclusions per user", excl_per_user=20),
        Workload("S1-allow10", 100_000, 1_000_000, 64, 100, Kind.clustered, "gpu",
                 "S1 with a shared allow-set of 10% of the catalogue (the items of the day)", allow_fraction=0.1),
        Workload("tiny-allow10", 2_000, 5_000, 32, 10, Kind.clustered, "cpu",
                 "tiny with a shared allow-set of 10%", allow_fraction=0.1),
        Workload("cpu-small-allow10", 20_000, 100_000, 64, 100, Kind.normal, "cpu",
                 "cpu-small with a shared allow-set of 10% of the catalogue", allow_fraction=0.1),
    ]
    return {x.name: x for x in w}


WORKLOADS: dict[str, Workload] = _workloads()
"""Every named workload, by name, in the order of WORKLOADS.md (exclusion variants last)."""


def get(name: str) -> Workload:
    """The named workload.

    Raises
    ------
    InputError
        If there is no workload of that name.
    """
    try:
        return WORKLOADS[name]
    except KeyError:
        raise InputError(f"unknown workload {name!r}: expected one of {', '.join(WORKLOADS)}") from None


# --- generators ---------------------------------------------------------------------------------------------------


def _streams(seed: int) -> tuple[int, int, int]:
    """Independent seeds for (shared parameters, users, items), derived from one seed."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"seed must be an integer >= 0, got {seed!r}")
    children = np.random.SeedSequence(int(seed)).generate_state(3, dtype=np.uint32)
    return int(children[0]), int(children[1]), int(children[2])


def _clustered(rng: Rng, centres: Any, n: int, noise: float = NOISE) -> Any:
    out = rng.normal((n, centres.shape[1]))
    out *= noise
    for start in range(0, n, _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, n)
        out[start:stop] += centres[rng.integers(0, centres.shape[0], (stop - start,))]
    return out


def _rescale_rows(xp: Any, vecs: Any, target: Any) -> None:
    """Rescale rows in place to the norms ``target`` (n,), one chunk of rows at a time."""
    n = vecs.shape[0]
    for start in range(0, n, _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, n)
        block = vecs[start:stop]
        norms = xp.sqrt(xp.einsum("ij,ij->i", block, block))
        block *= (target[start:stop] / xp.maximum(norms, xp.float32(1e-12)))[:, None]


def _set_norms(rng: Rng, vecs: Any, sigma: float = NORM_SIGMA) -> None:
    """Rescale rows in place to norms sqrt(dim) * LogNormal(0, sigma): skewed popularity, same typical scale."""
    n, dim = vecs.shape
    _rescale_rows(rng.xp, vecs, rng.lognormal(sigma, n) * np.float32(np.sqrt(dim)))


def _set_pareto_norms(rng: Rng, vecs: Any, alpha: float) -> None:
    """Rescale rows in place to norms sqrt(dim) * Pareto(alpha) / median: a heavy tail of "popular" items."""
    xp = rng.xp
    n, dim = vecs.shape
    u = rng.uniform(n)
    # Inverse CDF of the Pareto distribution with scale 1: (1 - u)^(-1/alpha) >= 1, median 2^(1/alpha).
    target = (xp.float32(1.0) - u) ** xp.float32(-1.0 / alpha)
    target *= xp.float32(np.sqrt(dim) / 2.0 ** (1.0 / alpha))
    _rescale_rows(xp, vecs, target)


def _quantise_int8(xp: Any, vecs: Any) -> None:
    """Round rows in place to integers in [-INT8_MAX, INT8_MAX] with one symmetric scale for the whole matrix."""
    n = vecs.shape[0]
    peak = 0.0
    for start in range(0, n, _CHUNK_ROWS):  # max |x| a chunk at a time: xp.abs(vecs) would be a full copy
        peak = max(peak, float(xp.abs(vecs[start:start + _CHUNK_ROWS]).max()))
    scale = xp.float32(INT8_MAX / peak) if peak > 0 else xp.float32(1.0)
    for start in range(0, n, _CHUNK_ROWS):
        block = vecs[start:start + _CHUNK_ROWS]
        block *= scale
        xp.rint(block, out=block)


def _ordered_items(ri: Rng, direction: Any, n: int, dim: int) -> Any:
    """i.i.d. N(0, 1) items, ordered by rising projection on the unit vector ``direction`` (dim,) float32.

    Sorting the rows of a normal matrix by their projection is the same, in distribution, as drawing the orthogonal
    part and the projections independently and sorting only the projections: an (n,) sort instead of a permuted
    full copy of the matrix."""
    xp = ri.xp
    items = ri.normal((n, dim))
    proj = xp.sort(ri.normal((n,)))
    for start in range(0, n, _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, n)
        block = items[start:stop]
        block -= (block @ direction)[:, None] * direction[None, :]
        block += proj[start:stop, None] * direction[None, :]
    return items


def generate(kind: Kind | str, n_users: int, n_items: int, dim: int, seed: int = 0,
             device: str = "cpu", params: KindParams | None = None) -> tuple[Any, Any]:
    """Seeded users and items of one data kind.

    Parameters
    ----------
    kind : Kind or str
        The data kind, or a spec with parameters such as ``"skewed:user_sigma=0.8"`` (see the module docstring).
    n_users, n_items, dim : int
        Shapes, all >= 1.
    seed : int
        Same seed, same device -> same data. NumPy and CuPy streams differ, so the same seed gives different data on
        "cpu" and "gpu".
    device : {"cpu", "gpu"}
        "gpu" generates with CuPy directly in device memory (nothing crosses PCIe).
    params : KindParams, optional
        The kind's parameters (default :data:`KIND_DEFAULTS`); not together with a spec that has parameters.

    Returns
    -------
    users : array of float32, shape (n_users, dim)
    items : array of float32, shape (n_items, dim)
        NumPy arrays for "cpu", CuPy arrays for "gpu"; C-contiguous.

    Raises
    ------
    InputError
        Unknown kind, parameter or device, non-positive shapes, negative seed, or "gpu" without CuPy.
    """
    kind, p = parse_kind(kind, params)
    for what, value in (("n_users", n_users), ("n_items", n_items), ("dim", dim)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InputError(f"{what} must be an integer >= 1, got {value!r}")
    users, items = _generate(kind, p, n_users, n_items, dim, seed, module_for(device))
    if p.offset:
        users += np.float32(p.offset)
        items += np.float32(p.offset)
    return users, items


def _generate(kind: Kind, p: KindParams, n_users: int, n_items: int, dim: int, seed: int,
              xp: Any) -> tuple[Any, Any]:
    """:func:`generate` but for the offset."""
    s_shared, s_users, s_items = _streams(seed)
    shared, ru, ri = Rng(xp, s_shared), Rng(xp, s_users), Rng(xp, s_items)

    if kind is Kind.ties:
        # Integer coordinates; every score is an integer well below 2**24, so float32 scores are exact and the
        # scores of distinct items collide often.
        r = p.tie_range
        users = ru.integers(-r, r + 1, (n_users, dim), np.int8 if r < 128 else np.int32).astype(xp.float32)
        items = ri.integers(-r, r + 1, (n_items, dim), np.int8 if r < 128 else np.int32).astype(xp.float32)
        return users, items

    if kind is Kind.adversarial:
        # Users lean one common way (a shared preference direction twice as strong as the noise), so "the mean
        # user" is a meaningful direction and ordering items by their score against it makes scores rise along the
        # item rows for most users, not just on average: with a weaker lean, a third of users see tiles that don't.
        bias = shared.normal((1, dim))
        bias *= ADVERSARIAL_BIAS
        users = ru.normal((n_users, dim))
        users += bias
        if p.user_sigma:
            _set_norms(ru, users, p.user_sigma)  # a positive factor per user keeps each user's order of items
        mean_user = users.mean(axis=0, dtype=xp.float64)
        direction = (mean_user / xp.linalg.norm(mean_user)).astype(xp.float32)
        return users, _ordered_items(ri, direction, n_items, dim)

    if kind is Kind.normal:
        users, items = ru.normal((n_users, dim)), ri.normal((n_items, dim))
    else:
        centres = shared.normal((p.centres, dim))
        users = _clustered(ru, centres, n_users, p.noise)
        items = _clustered(ri, centres, n_items, p.noise)
    if p.pareto_alpha:
        _set_pareto_norms(ri, items, p.pareto_alpha)
    elif p.item_sigma:
        _set_norms(ri, items, p.item_sigma)
    if p.user_sigma:
        _set_norms(ru, users, p.user_sigma)
    if kind is Kind.int8:
        _quantise_int8(xp, users)
        _quantise_int8(xp, items)
    return users, items


# --- re-scoring (S5) and multi-interest (S7) workloads -----------------------------------------------------------


@dataclass(frozen=True)
class CandidateUsers:
    """Users of a re-scoring workload: their vectors and each one's own candidate item rows.

    vecs : (n_users, dim) float32; candidates : (n_users, c) int64, distinct within a row, in random order. NumPy, or
    CuPy on the GPU."""

    vecs: Any
    candidates: Any

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.vecs.shape)


@dataclass(frozen=True)
class MultiInterestUsers:
    """Users of a multi-interest workload: vecs (n_users, n_interests, dim) float32, and how scores combine."""

    vecs: Any
    aggregate: str = "max"

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.vecs.shape[0]), int(self.vecs.shape[2]))


def _host(arr: Any) -> np.ndarray:
    """A NumPy copy of a NumPy, CuPy or torch (CUDA) array."""
    from . import oracle

    return oracle.to_host(arr)


def _truth_from(rows: np.ndarray, user_vecs: np.ndarray, k: int, scores: np.ndarray, items_of: np.ndarray,
                metric: str, n_items: int) -> Any:
    """``oracle.Truth`` from every candidate's true score: best first, equal scores by item row."""
    from . import oracle

    order = np.lexsort((items_of, -scores), axis=1)[:, :k]
    top_s = np.take_along_axis(scores, order, axis=1)
    top_i = np.take_along_axis(items_of, order, axis=1)
    kth = top_s[:, -1].copy()
    scale = np.maximum(np.abs(top_s[:, 0]), np.abs(kth))
    scale[~(scale > 0)] = 1.0
    return oracle.Truth(rows=rows, user_vecs=user_vecs, k=int(k), top_scores=top_s, top_items=top_i.astype(np.int64),
                        kth=kth, scale=scale, metric=metric, n_items=n_items)


def _candidate_truth(users: CandidateUsers, items: Any, k: int, rows: Any, metric: str) -> Any:
    """Exact float64 top-k of the sampled users over their own candidates (k <= candidates per user)."""
    from . import oracle

    rows = np.asarray(rows, dtype=np.int64)
    u = oracle._metric_users(metric, oracle._rows_f64(users.vecs, rows))
    cand = _sampled(users.candidates, rows)
    scores = np.empty(cand.shape)
    block = max(1, int(oracle.DEFAULT_BUDGET // max(1, 8 * cand.shape[1] * u.shape[1])))
    for a in range(0, rows.size, block):
        b = min(a + block, rows.size)
        uniq, inv = np.unique(cand[a:b].ravel(), return_inverse=True)
        v = oracle._rows_f64(items, uniq)[inv.ravel()].reshape(b - a, cand.shape[1], -1)
        scores[a:b] = oracle._pair_scores(metric, u[a:b], v)
    return _truth_from(rows, u, min(k, cand.shape[1]), scores, cand, metric, int(items.shape[0]))


def _sampled(arr: Any, rows: np.ndarray) -> np.ndarray:
    """``arr[rows]`` on the host (gathered on the array's device so only the rows cross)."""
    if isinstance(arr, np.ndarray):
        return arr[rows]
    from . import oracle

    return _host(arr[oracle._index_rows(arr, rows)])


def _candidate_check(truth: Any, users: CandidateUsers, items: Any, indices: Any, scores: Any, rtol: float) -> Any:
    """``oracle.check``, with any returned item that is not among the user's candidates counted as a miss."""
    from . import oracle

    rows = truth.rows
    idx = _sampled(indices, rows).astype(np.int64)
    cand = _sampled(users.candidates, rows)
    base = (np.arange(rows.size, dtype=np.int64) * (truth.n_items + 1))[:, None]
    own = np.isin(idx + base, cand + base) & (idx >= 0)
    idx = np.where(own, idx, -1)
    sc = _sampled(scores, rows) if scores is not None else None
    return oracle.check(truth, items, idx, sc, rtol=rtol, rows_are_sampled=True)


def _interest_truth(users: MultiInterestUsers, items: Any, k: int, rows: Any, metric: str) -> Any:
    """Exact float64 top-k of the sampled users over every item, scoring an item by the max (or sum) over the
    user's interests; chunked over items like ``oracle.exact_topk``."""
    from . import oracle

    rows = np.asarray(rows, dtype=np.int64)
    n, m, dim = rows.size, int(users.vecs.shape[1]), int(users.vecs.shape[2])
    vecs = _sampled(users.vecs, rows).astype(np.float64).reshape(n * m, dim)
    u = oracle._metric_users(metric, vecs)
    n_items = int(items.shape[0])
    k_eff = min(int(k), n_items)
    chunk = int(max(k_eff, min(n_items, oracle.DEFAULT_BUDGET // max(1, 8 * n * m + 12 * dim))))
    best_s, best_i = np.full((n, 0), -np.inf), np.zeros((n, 0), dtype=np.int64)
    for start in range(0, n_items, chunk):
        stop = min(start + chunk, n_items)
        s = oracle._metric_scores(metric, u, oracle._slice_f64(items, start, stop)).reshape(n, m, stop - start)
        agg = s.max(axis=1) if users.aggregate == "max" else s.sum(axis=1)
        best_s, best_i = oracle._merge(best_s, best_i, agg, start, k_eff)
    return _truth_from(rows, u.reshape(n, m, dim), k_eff, best_s, best_i, metric, n_items)


def _interest_check(truth: Any, users: MultiInterestUsers, items: Any, indices: Any, scores: Any,
                    rtol: float) -> Any:
    """Tie-aware recall@k as ``oracle.check`` computes it, with the true score of a returned item aggregated over the
    user's interests (``truth.user_vecs`` is (n_sample, m, dim))."""
    from . import oracle

    idx = _sampled(indices, truth.rows).astype(np.int64)
    sc = _sampled(scores, truth.rows).astype(np.float64) if scores is not None else None
    n, k_ret = idx.shape
    valid = oracle.answer_validity(idx, truth.n_items)
    safe = np.where(valid, idx, 0)
    uniq, inv = np.unique(safe.ravel(), return_inverse=True)
    v = oracle._rows_f64(items, uniq)[inv.ravel()].reshape(n, k_ret, -1)
    per = np.stack([oracle._pair_scores(truth.metric, truth.user_vecs[:, j], v)
                    for j in range(truth.user_vecs.shape[1])], axis=1)
    true_s = per.max(axis=1) if users.aggregate == "max" else per.sum(axis=1)
    return oracle.check_from_true_scores(truth, valid, true_s, sc, rtol)
