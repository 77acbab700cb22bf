"""The benchmark matrix: named grids of cells around the named workloads (``recall bench --matrix NAME``).

A full cross product of shapes x dims x k x metrics x kinds x exclusions is far too big to run, so each grid is an
explicit list of cells, each one chosen for what it shows. A cell is written as one line of text::

    <shape>[:<users>] d<dim> k<k> <metric> <kind>[:<param>=<value>,...] [x<exclusions per user>]

e.g. ``S1:50k d64 k1000 cosine skewed x200``: the S1 catalogue (1M items) with 50,000 users (a cell whose point does
not need the full 100,000), dimension 64, top-1,000, cosine, the ``skewed`` kind, 200 exclusions per user. Numbers
take k/M suffixes. Shapes (users x items): ``tiny`` 2,000 x 5,000; ``cpu-small`` 20,000 x 100,000; ``S1`` 100,000 x
1,000,000; ``S4`` 1,000,000 x 1,000,000; ``item-heavy`` 10,000 x 10,000,000; ``user-heavy`` 1,000,000 x 100,000;
``small-catalogue`` 200,000 x 20,000 (a day's fresh items, say: fewer than the 65,536 items from which a search
samples 8,192 for its thresholds); ``few-items`` 1,000,000 x 4,096 (a category's items: under the 8,192 items from
which the threshold sample's share stops shrinking, where fixed costs a user take the time).

Grids
-----
``tiny`` (CPU, CI, a few seconds with faiss-cpu): dims 32-256, k 1-2,048, every metric, every kind, exclusions.

===  ==================================================
 #   tiny cell
===  ==================================================
 0   tiny d32 k10 ip normal
 1   tiny d64 k100 ip clustered
 2   tiny d32 k1 cosine skewed
 3   tiny d96 k10 l2 popular
 4   tiny d32 k10 ip ties
 5   tiny d32 k10 l2 adversarial
 6   tiny d32 k50 ip int8
 7   tiny d32 k10 ip clustered x50
 8   tiny d64 k100 cosine skewed x20
 9   tiny d32 k1000 l2 clustered
10   tiny d128 k10 ip skewed:user_sigma=1,item_sigma=1
11   tiny:500 d256 k2048 ip normal
===  ==================================================

``cpu-quick`` (the CPU against faiss-cpu, about 6 minutes on 2 cores): ``cpu-small`` at k 1 to 8,192 (8,192 on
2,000 users), dims 64 to 256, every metric, the kinds normal, skewed, clustered, int8 and ties, 50 exclusions per
user. Each OpenBLAS may be fastest under a different kernel choice (``OPENBLAS_CORETYPE``); both libraries load
theirs in one process, so comparing each at its best takes one run per choice (docs/benchmarks.md).

===  ==================================================
 #   cpu-quick cell
===  ==================================================
 0   cpu-small d64 k100 ip normal
 1   cpu-small d64 k100 ip skewed
 2   cpu-small d64 k100 ip clustered
 3   cpu-small d64 k100 ip int8
 4   cpu-small d64 k100 ip ties
 5   cpu-small d64 k100 l2 normal
 6   cpu-small d64 k100 cosine skewed
 7   cpu-small d64 k10 ip normal
 8   cpu-small d64 k1 ip skewed
 9   cpu-small d64 k1000 ip normal
10   cpu-small:2k d64 k8192 ip normal
11   cpu-small d64 k100 ip skewed x50
12   cpu-small d128 k100 ip clustered
13   cpu-small:5k d256 k100 ip clustered
===  ==================================================

``gpu-quick`` (one H200 run in under 8 minutes, repeat 2, everything included): each shape family once at full
size (S4 at d32, k10: it alone is a quarter of the run), the other cells on 10,000-50,000 users of S1 (enough for a
stable time where the cell's point is the data kind, the metric or k, not the size); dims 32 to 256; k 1 to 8,192
(8,192: FAISS and knn_gpu skip with reason); every metric; kinds skewed, ties, popular, adversarial, normal, int8,
clustered; 200 exclusions per user on S1 (and 20 on a smaller cell). Contenders: recall exact and fast, FAISS
GpuIndexFlat and knn_gpu, cuVS, torch fp32 (not torch-bf16: it is no exact anchor). :func:`estimate` puts it at
about 6.5 minutes on the H200 (printed before a run; the lead's per-search times for S1 scaled by each cell's work);
``--max-minutes`` stops starting cells once a budget is spent.

===  ==================================================
 #   gpu-quick cell
===  ==================================================
 0   S1 d64 k100 ip clustered
 1   S1 d64 k100 ip clustered x200
 2   S4 d32 k10 ip clustered
 3   item-heavy d64 k100 ip clustered
 4   user-heavy d64 k100 ip skewed
 5   S1:20k d32 k10 ip normal
 6   S1:20k d256 k100 ip clustered
 7   S1:20k d64 k1 ip skewed
 8   S1:20k d64 k10 cosine skewed
 9   S1:20k d64 k1000 cosine popular
10   S1:20k d64 k2048 l2 skewed
11   S1:10k d64 k8192 ip clustered
12   S1:50k d64 k100 l2 adversarial
13   S1:50k d64 k100 ip ties
14   S1:50k d64 k100 ip int8
15   S1:50k d64 k100 ip popular
16   S1:20k d64 k100 cosine normal
17   S1:20k d64 k1000 ip skewed x200
18   S1:10k d256 k1000 cosine skewed
19   user-heavy:200k d32 k1000 l2 popular
20   item-heavy:2k d32 k10 cosine skewed
21   S1:20k d64 k100 ip skewed x20
22   S1:10k d96 k100 ip clustered
23   S1:20k d128 k100 l2 clustered
24   small-catalogue d32 k10 l2 skewed
25   few-items d64 k10 ip skewed
26   small-catalogue:50k d64 k100 ip skewed
===  ==================================================

``gpu-fast`` (one H200 run of about 7 minutes for its first 12 cells): the cells in which fast mode was measured
slower than exact mode before its fused kernel (issue 18's table, 2026-12-01), log-normal user and item norms
(``skewed``) unless the kind says otherwise, with S2 and S4 on the same data: the tensor-core search against the
float32 one and the anchors on data it was not tuned on; many users against a small catalogue at d = 32, k = 10,
where the float16 pass gains least (its comparisons, not its products, take the time); and data whose certificates
failed wholesale before 2026-12-07: ip and cosine far from the origin, l2 with heavy-tailed item norms.

===  ==================================================
 #   gpu-fast cell
===  ==================================================
 0   S1 d64 k100 ip skewed
 1   S1 d64 k1000 ip skewed
 2   S1 d64 k100 l2 skewed
 3   S1:50k d256 k100 ip skewed
 4   user-heavy d64 k100 ip skewed
 5   S1:50k d64 k2048 ip skewed
 6   S1 d32 k10 ip skewed
 7   S1:50k d64 k100 ip int8
 8   S1 d64 k100 ip normal
 9   S1 d128 k100 ip skewed
10   S4 d64 k100 ip skewed
11   small-catalogue d32 k10 ip skewed
12   S1:50k d64 k100 ip normal:offset=300
13   S1:50k d64 k10 cosine normal:offset=30
14   S1:50k d64 k1000 l2 normal:pareto_alpha=1.5
===  ==================================================

``gpu-full`` (several runs: split it with ``--cells 0:20``, ``--cells 20:40``, ...): the full sizes of every shape
family, dims 32/64/96/128/256, k 1/10/100/1,000/2,048/8,192, each metric and kind, with and without exclusions;
``recall bench --list --matrix gpu-full`` prints its cells and estimate.

Each cell becomes a :class:`~recall.bench.workloads.Workload` (named ``<grid>:<index>``) run by the ordinary runner:
every contender with 1 warm-up and ``repeat`` timed searches, recall@k checked against the float64 oracle. The run's
summary (:func:`summarise`) has one row per cell: recall exact, recall fast (+ users that fell back to exact), FAISS
(the faster of GpuIndexFlat and knn_gpu), cuVS, torch, the best exact anchor and recall's time over it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from recall import InputError

from .workloads import METRICS, Workload, parse_kind

SHAPES: dict[str, tuple[int, int]] = {
    "tiny": (2_000, 5_000),
    "cpu-small": (20_000, 100_000),
    "S1": (100_000, 1_000_000),
    "S4": (1_000_000, 1_000_000),
    "item-heavy": (10_000, 10_000_000),
    "user-heavy": (1_000_000, 100_000),
    "small-catalogue": (200_000, 20_000),
    "few-items": (1_000_000, 4_096),
}
"""Shape families: (users, items)."""


def _count(text: str, what: str, cell: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmM]?)", text.replace("_", "").replace(",", ""))
    if not m:
        raise InputError(f"cell {cell!r}: {what} {text!r} is not a count (e.g. 50000, 50k, 1M)")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6}[m.group(2)]
    if value != int(value) or value < 1:
        raise InputError(f"cell {cell!r}: {what} {text!r} must be a whole number >= 1")
    return int(value)


def _short(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1_000 and n % 1_000 == 0:
        return f"{n // 1_000}k"
    return str(n)


@dataclass(frozen=True)
class Cell:
    """One point of a grid.

    Attributes
    ----------
    shape : str
        The shape family (a key of :data:`SHAPES`).
    n_users, n_items, dim, k : int
    metric : {"ip", "cosine", "l2"}
    kind : str
        A data kind spec (``"skewed"``, ``"skewed:user_sigma=0.8"``).
    excl : int
        Exclusions per user (0: none).
    """

    shape: str
    n_users: int
    n_items: int
    dim: int
    k: int
    metric: str = "ip"
    kind: str = "clustered"
    excl: int = 0

    @property
    def text(self) -> str:
        """The cell as :func:`parse_cell` reads it."""
        users = "" if self.n_users == SHAPES[self.shape][0] else f":{_short(self.n_users)}"
        return (f"{self.shape}{users} d{self.dim} k{self.k} {self.metric} {self.kind}"
                + (f" x{self.excl}" if self.excl else ""))

    @property
    def label(self) -> str:
        """Short description for tables: shape and size, dim, k, metric, kind, exclusions."""
        return (f"{self.shape} {_short(self.n_users)}x{_short(self.n_items)} d{self.dim} k{self.k} {self.metric} "
                f"{self.kind}" + (f" x{self.excl}" if self.excl else ""))

    def workload(self, name: str) -> Workload:
        """This cell as a workload called ``name``.

        Raises
        ------
        InputError
            When the cell is not a valid workload (e.g. more exclusions than items).
        """
        kind, params = parse_kind(self.kind)
        return Workload(name, self.n_users, self.n_items, self.dim, self.k, kind, why=self.label, params=params,
                        excl_per_user=self.excl, metric=self.metric, cell=self.label)


def parse_cell(text: str) -> Cell:
    """``"S1:50k d64 k1000 cosine skewed x200"`` -> :class:`Cell` (grammar in the module docstring).

    Raises
    ------
    InputError
        Unknown shape, metric or kind; a missing or repeated dim/k/metric/kind; a malformed count.
    """
    tokens = text.split()
    if not tokens:
        raise InputError("empty cell: expected '<shape>[:<users>] d<dim> k<k> <metric> <kind> [x<exclusions>]'")
    shape, _, users = tokens[0].partition(":")
    if shape not in SHAPES:
        raise InputError(f"cell {text!r}: unknown shape {shape!r}: expected one of {', '.join(SHAPES)}")
    n_users, n_items = SHAPES[shape]
    if users:
        n_users = _count(users, "users", text)
    found: dict[str, Any] = {}

    def put(key: str, value: Any) -> None:
        if key in found:
            raise InputError(f"cell {text!r}: {key} is given twice")
        found[key] = value

    counts = {"d": ("dim", "dim"), "k": ("k", "k"), "x": ("excl", "exclusions")}
    for tok in tokens[1:]:
        # d<dim>, k<k>, x<exclusions>: a count after the letter; "k-5" or "d1.5" is a bad count, not a data kind.
        if tok[0] in counts and re.fullmatch(r"[-+]?[\d_,.].*", tok[1:]):
            key, what = counts[tok[0]]
            put(key, _count(tok[1:], what, text))
        elif tok in METRICS:
            put("metric", tok)
        else:
            if "kind" in found:  # the kind is there: a token after it is one too many, not another kind
                raise InputError(f"cell {text!r}: {tok!r} is one token too many: a cell is "
                                 f"'<shape>[:<users>] d<dim> k<k> <metric> <kind> [x<exclusions>]'")
            try:
                parse_kind(tok)
            except InputError as exc:
                metric = "" if "metric" in found else f"; or the metric, one of {', '.join(METRICS)}"
                raise InputError(f"cell {text!r}: {exc}{metric}") from None
            put("kind", tok)
    missing = [key for key in ("dim", "k", "metric", "kind") if key not in found]
    if missing:
        raise InputError(f"cell {text!r}: missing {', '.join(missing)}")
    excl = found.get("excl", 0)
    if excl >= n_items:
        raise InputError(f"cell {text!r}: {excl:,} exclusions per user need more than the {n_items:,} items of "
                         f"{shape}")
    cell = Cell(shape, n_users, n_items, found["dim"], found["k"], found["metric"], found["kind"], excl)
    cell.workload("check")  # validates the rest of the combination
    return cell


def parse_cells(spec: str | None, n: int) -> list[int]:
    """Cell indices of ``--cells``: ``"0:20"``, ``"20:"``, ``"3"``, ``"1,4,7:9"``; None -> all ``n``.

    Raises
    ------
    InputError
        On a malformed part or an index outside [0, n).
    """
    if spec is None:
        return list(range(n))
    out: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"(-?\d*)(:?)(-?\d*)", part)
        if not m or (not m.group(1) and not m.group(2)):
            raise InputError(f"--cells: {part!r} is not an index or a slice a:b")
        if m.group(2):
            a = int(m.group(1)) if m.group(1) else 0
            b = int(m.group(3)) if m.group(3) else n
            chosen = list(range(n))[slice(a, b)]
            if not chosen:  # one part that selects nothing is a mistake even where another part selects cells
                raise InputError(f"--cells: {part!r} selects no cell of this grid's {n}")
        else:
            i = int(m.group(1))
            if not -n <= i < n:
                raise InputError(f"--cells: index {i} is outside this grid's {n} cells")
            chosen = [i % n]
        out.extend(chosen)
    if not out:
        raise InputError(f"--cells {spec!r} selects no cell of this grid's {n}")
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class Grid:
    """A named list of cells.

    Attributes
    ----------
    name : str
    device : {"cpu", "gpu"}
        Where it is meant to run.
    why : str
    cells : tuple of Cell
    repeat : int
        Timed searches per contender (after one warm-up).
    sample_users : int
        Users checked against the oracle.
    """

    name: str
    device: str
    why: str
    cells: tuple[Cell, ...]
    repeat: int = 2
    sample_users: int = 1000

    def workloads(self, indices: list[int] | None = None) -> list[Workload]:
        """The cells ``indices`` (default all) as workloads named ``<grid>:<index>``."""
        chosen = range(len(self.cells)) if indices is None else indices
        return [self.cells[i].workload(f"{self.name}:{i:02d}") for i in chosen]


def _grid(name: str, device: str, why: str, cells: list[str], **kw: Any) -> Grid:
    return Grid(name, device, why, tuple(parse_cell(c) for c in cells), **kw)


TINY = [
    "tiny d32 k10 ip normal",
    "tiny d64 k100 ip clustered",
    "tiny d32 k1 cosine skewed",
    "tiny d96 k10 l2 popular",
    "tiny d32 k10 ip ties",
    "tiny d32 k10 l2 adversarial",
    "tiny d32 k50 ip int8",
    "tiny d32 k10 ip clustered x50",
    "tiny d64 k100 cosine skewed x20",
    "tiny d32 k1000 l2 clustered",
    "tiny d128 k10 ip skewed:user_sigma=1,item_sigma=1",
    "tiny:500 d256 k2048 ip normal",
]

CPU_QUICK = [
    "cpu-small d64 k100 ip normal",
    "cpu-small d64 k100 ip skewed",
    "cpu-small d64 k100 ip clustered",
    "cpu-small d64 k100 ip int8",
    "cpu-small d64 k100 ip ties",
    "cpu-small d64 k100 l2 normal",
    "cpu-small d64 k100 cosine skewed",
    "cpu-small d64 k10 ip normal",
    "cpu-small d64 k1 ip skewed",
    "cpu-small d64 k1000 ip normal",
    "cpu-small:2k d64 k8192 ip normal",
    "cpu-small d64 k100 ip skewed x50",
    "cpu-small d128 k100 ip clustered",
    "cpu-small:5k d256 k100 ip clustered",
]

GPU_QUICK = [
    "S1 d64 k100 ip clustered",
    "S1 d64 k100 ip clustered x200",
    "S4 d32 k10 ip clustered",
    "item-heavy d64 k100 ip clustered",
    "user-heavy d64 k100 ip skewed",
    "S1:20k d32 k10 ip normal",
    "S1:20k d256 k100 ip clustered",
    "S1:20k d64 k1 ip skewed",
    "S1:20k d64 k10 cosine skewed",
    "S1:20k d64 k1000 cosine popular",
    "S1:20k d64 k2048 l2 skewed",
    "S1:10k d64 k8192 ip clustered",
    "S1:50k d64 k100 l2 adversarial",
    "S1:50k d64 k100 ip ties",
    "S1:50k d64 k100 ip int8",
    "S1:50k d64 k100 ip popular",
    "S1:20k d64 k100 cosine normal",
    "S1:20k d64 k1000 ip skewed x200",
    "S1:10k d256 k1000 cosine skewed",
    "user-heavy:200k d32 k1000 l2 popular",
    "item-heavy:2k d32 k10 cosine skewed",
    "S1:20k d64 k100 ip skewed x20",
    "S1:10k d96 k100 ip clustered",
    "S1:20k d128 k100 l2 clustered",
    "small-catalogue d32 k10 l2 skewed",
    "few-items d64 k10 ip skewed",
    "small-catalogue:50k d64 k100 ip skewed",
]


GPU_FAST = [
    "S1 d64 k100 ip skewed",
    "S1 d64 k1000 ip skewed",
    "S1 d64 k100 l2 skewed",
    "S1:50k d256 k100 ip skewed",
    "user-heavy d64 k100 ip skewed",
    "S1:50k d64 k2048 ip skewed",
    "S1 d32 k10 ip skewed",
    "S1:50k d64 k100 ip int8",
    "S1 d64 k100 ip normal",
    "S1 d128 k100 ip skewed",
    "S4 d64 k100 ip skewed",
    "small-catalogue d32 k10 ip skewed",
    # Data far from the origin (ip and cosine rounded about the centre) and heavy-tailed item norms under l2 (the
    # bound columns paying for their own accumulation): certificates that failed wholesale before 2026-12-07.
    "S1:50k d64 k100 ip normal:offset=300",
    "S1:50k d64 k10 cosine normal:offset=30",
    "S1:50k d64 k1000 l2 normal:pareto_alpha=1.5",
]


def _gpu_full() -> list[str]:
    """Full-size cells: every shape family at each dim for the common k, then k, metric, kind and exclusion sweeps."""
    cells = []
    for shape in ("S1", "S4", "item-heavy", "user-heavy", "small-catalogue", "few-items"):
        for dim in (32, 64, 96, 128, 256):
            cells.append(f"{shape} d{dim} k100 ip clustered")
    for shape in ("S1", "item-heavy", "user-heavy", "small-catalogue", "few-items"):
        for k in (1, 10, 1000, 2048, 8192):
            if k <= SHAPES[shape][1] // 2:  # k of at most half the catalogue
                cells.append(f"{shape} d64 k{k} ip skewed")
    cells += ["few-items d32 k10 l2 skewed", "few-items d128 k5 cosine normal"]
    for metric in ("cosine", "l2"):
        for shape in ("S1", "S4"):
            cells.append(f"{shape} d64 k100 {metric} skewed")
    for kind in ("normal", "clustered", "skewed", "popular", "adversarial", "ties", "int8"):
        cells.append(f"S1 d64 k100 ip {kind}")
        cells.append(f"S1 d64 k1000 l2 {kind}")
    for excl in (20, 200, 1000):
        cells.append(f"S1 d64 k100 ip clustered x{excl}")
        cells.append(f"S1 d64 k1000 cosine skewed x{excl}")
    cells += ["S4 d64 k100 ip clustered x20", "item-heavy d64 k100 ip skewed x200",
              "user-heavy d64 k100 ip skewed x20", "S1 d64 k8192 ip clustered x200"]
    return list(dict.fromkeys(cells))


GRIDS: dict[str, Grid] = {g.name: g for g in (
    _grid("tiny", "cpu", "CPU smoke of every axis (CI)", TINY, repeat=1),
    _grid("cpu-quick", "cpu", "the CPU against faiss-cpu in one run", CPU_QUICK, repeat=3),
    _grid("gpu-quick", "gpu", "one H200 run in under 8 minutes", GPU_QUICK, repeat=2),
    _grid("gpu-fast", "gpu", "fast mode's hard cells and S1-S4 on skewed norms", GPU_FAST, repeat=2),
    _grid("gpu-full", "gpu", "the full grid, over several runs (--cells)", _gpu_full(), repeat=2),
)}
"""Every grid, by name."""


def custom(texts: list[str], device: str | None = None) -> Grid:
    """The grid ``custom`` of the cells ``texts`` (``recall bench --cell``), meant for ``device`` (default: the
    GPU where one is usable, else the CPU).

    Raises
    ------
    InputError
        On a malformed cell (naming it).
    """
    if device is None:
        from recall.backends import cuda_status

        device = "gpu" if cuda_status()[0] else "cpu"
    return _grid("custom", device, "cells given with --cell", list(texts), repeat=2)


def get(name: str) -> Grid:
    """The named grid.

    Raises
    ------
    InputError
        On an unknown name.
    """
    try:
        return GRIDS[name]
    except KeyError:
        raise InputError(f"unknown matrix {name!r}: expected one of {', '.join(GRIDS)}") from None


# --- time estimate ------------------------------------------------------------------------------------------------

H200_S1_SECONDS = {"recall": 0.4, "recall-fast": 0.2, "faiss": 1.1, "faiss-knn": 1.1, "cuvs": 0.9, "torch": 1.6}
"""Seconds per search on an H200 for 100,000 x 1,000,000 x 64, k=100 (measured by the lead); the estimate scales
these by the work of a cell."""
CPU_GFLOPS = 100.0
"""Effective fp32 rate of the CPU contenders, for the rough CPU estimate (recall about 230 GFLOP/s on 2 cores at k=100,
faiss-cpu 60-150, 2026-12-01)."""
STARTUP_S = 30.0
"""One-off cost of a GPU run: imports, CUDA contexts, kernel compilation (NVRTC, cuVS, FAISS)."""


def _k_factor(k: int) -> float:
    """How much longer a search of top-``k`` takes than one of top-100 (selection grows with k)."""
    if k <= 100:
        return 0.8 + 0.2 * math.log10(max(k, 1)) / 2
    return 1.0 + 0.6 * math.log2(k / 100)


def _runs(name: str, cell: Cell) -> bool:
    if name in ("faiss", "faiss-knn") and cell.k + cell.excl > 2048:
        return False
    return True


def estimate_cell(cell: Cell, device: str, contenders: list[str], repeat: int, sample_users: int = 1000) -> float:
    """Seconds a cell takes (data, exclusions, oracle, every contender's prepare, warm-up, timed runs and check)."""
    work = cell.n_users * cell.n_items / 1e11  # relative to S1
    dim_f = 0.5 + 0.5 * cell.dim / 64
    n_sample = min(sample_users, cell.n_users)
    total = 0.05 + (cell.n_users + cell.n_items) * cell.dim * 4 * 4 / 50e9  # generation: a few passes over the data
    total += (0.3 + cell.n_items * 2e-7) * (2 if cell.excl else 1)  # oracle (twice with exclusions)
    if cell.excl:
        total += 0.1 + cell.n_users * 65_536 * 4 * max(1, cell.excl // 4) / 3e12
    for name in contenders:
        if not _runs(name, cell):
            continue
        if device == "gpu":
            base = H200_S1_SECONDS.get(name, 1.0)
            k_eff = cell.k + (cell.excl if name.startswith("faiss") else 0)
            t = base * work * dim_f * _k_factor(k_eff)
            if cell.excl and name.startswith("recall"):
                t += cell.n_users * cell.excl * 1.5e-7  # the engine normalises the host CSR per search
            prepare = 0.1 + cell.n_items * cell.dim * 4 / 2e10
        else:
            t = 2.0 * cell.n_users * cell.n_items * cell.dim / (CPU_GFLOPS * 1e9) * _k_factor(cell.k)
            prepare = 0.01
        check = 0.05 + n_sample * cell.k * cell.dim * 8 / 2e10
        total += prepare + (1 + repeat) * t + check
    return total


def estimate(grid: Grid, indices: list[int], contenders: list[str], repeat: int | None = None,
             sample_users: int | None = None) -> tuple[float, list[float]]:
    """(total seconds, seconds per chosen cell) of running ``indices`` of ``grid`` with ``contenders`` (names)."""
    repeat = grid.repeat if repeat is None else repeat
    sample_users = grid.sample_users if sample_users is None else sample_users
    per = [estimate_cell(grid.cells[i], grid.device, contenders, repeat, sample_users) for i in indices]
    return (STARTUP_S if grid.device == "gpu" else 1.0) + sum(per), per


def split(grid: Grid, contenders: list[str], budget_s: float = 480.0) -> list[str]:
    """``--cells`` slices of consecutive cells whose estimated run (startup included) stays within ``budget_s`` each
    (a cell over the budget alone gets a run of its own)."""
    _, per = estimate(grid, list(range(len(grid.cells))), contenders)
    start0 = STARTUP_S if grid.device == "gpu" else 1.0
    out, start, used = [], 0, start0
    for i, t in enumerate(per):
        if i > start and used + t > budget_s:
            out.append(f"{start}:{i}")
            start, used = i, start0
        used += t
    out.append(f"{start}:{len(per)}")
    return out


# --- summary -----------------------------------------------------------------------------------------------------

ANCHOR_FAMILIES = ("faiss", "cuvs", "torch")
"""Families whose exact contenders are anchors for recall's time."""


def _ok(r: dict[str, Any] | None) -> bool:
    return bool(r) and r["status"] == "ok" and bool(r.get("median_s"))


def _exact_ok(r: dict[str, Any]) -> bool:
    return _ok(r) and r["claims_exact"] and bool(r.get("check")) and r["check"]["exact"]


def _entry(r: dict[str, Any] | None) -> dict[str, Any]:
    """What a table cell shows of a contender's row."""
    if r is None:
        return {"median_s": None, "status": "absent", "reason": None}
    out = {"median_s": r.get("median_s") if r["status"] == "ok" else None, "status": r["status"],
           "reason": r.get("reason"), "contender": r["contender"]}
    if r.get("check"):
        out["recall"] = r["check"]["recall"]
        out["exact"] = r["check"]["exact"]
    return out


def summarise(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One summary per cell (workload) of a run: the numbers of the matrix table and heat-map.

    Returns
    -------
    list of dict
        Per cell: ``workload``, ``cell`` (label), ``recall``, ``recall_fast`` (each :func:`_entry`; ``recall_fast``
        also ``fallback_users``), ``faiss`` (the faster of GpuIndexFlat and knn_gpu), ``cuvs``, ``torch``, ``anchor``
        (name of the fastest anchor whose answer was exact), ``anchor_s``, ``ratio`` (recall exact / anchor: below 1
        recall is faster), ``speedup`` (its inverse), ``vs`` (recall / each anchor family), ``check`` ("ok" or what
        was wrong), ``status`` of the cell.
    """
    out = []
    for w in doc["workloads"]:
        rows = [r for r in doc["results"] if r["workload"] == w["name"] and r["mode"] == "kernel"]
        by_name = {r["contender"]: r for r in rows}
        rec = by_name.get("recall")
        fast = by_name.get("recall-fast")
        entry: dict[str, Any] = {"workload": w["name"], "cell": w.get("cell") or w["name"], "status": w["status"],
                                 "reason": w.get("reason"), "recall": _entry(rec), "recall_fast": _entry(fast)}
        if fast and fast.get("engine_stats"):
            entry["recall_fast"]["fallback_users"] = fast["engine_stats"].get("fallback_users")
        anchors: dict[str, dict[str, Any] | None] = {}
        for fam in ANCHOR_FAMILIES:
            cands = [r for r in rows if r["family"] == fam and r["claims_exact"]]
            ran = [r for r in cands if _ok(r)]
            pick = min(ran, key=lambda r: r["median_s"]) if ran else (cands[0] if cands else None)
            anchors[fam] = pick
            entry[fam] = _entry(pick)
        exact_anchors = [r for r in anchors.values() if r is not None and _exact_ok(r)]
        best = min(exact_anchors, key=lambda r: r["median_s"]) if exact_anchors else None
        entry["anchor"] = best["contender"] if best else None
        entry["anchor_s"] = best["median_s"] if best else None
        rec_s = rec["median_s"] if _ok(rec) else None
        entry["ratio"] = rec_s / best["median_s"] if rec_s and best else None
        entry["speedup"] = best["median_s"] / rec_s if rec_s and best else None
        entry["vs"] = {fam: (rec_s / r["median_s"] if rec_s and r is not None and _exact_ok(r) else None)
                       for fam, r in anchors.items()}
        wrong = [f"{r['contender']} {r['check']['recall']:.4f}" for r in rows
                 if r["status"] == "ok" and r["claims_exact"] and r.get("check") and not r["check"]["exact"]]
        errors = [r["contender"] for r in rows if r["status"] == "error"]
        if w["status"] != "ok":
            entry["check"] = "-"
        elif wrong or errors:
            entry["check"] = "; ".join(([f"WRONG {', '.join(wrong)}"] if wrong else [])
                                       + ([f"error {', '.join(errors)}"] if errors else []))
        else:
            entry["check"] = "ok"
        out.append(entry)
    return out


def contender_names(families: list[str], device: str) -> list[str]:
    """Names of the contenders a matrix run builds for ``families`` on ``device`` (for the estimate). On the CPU, only
    those that can run on this machine (cuVS never does; torch only where installed): the others are skipped in no
    time. A GPU grid's estimate is for the H200, whatever this machine has."""
    from . import contenders as cont

    built = cont.build(families, device, inexact=False)
    return [c.name for c in built if device != "cpu" or c.unavailable() is None]


def run(grid: Grid, indices: list[int], settings: Any, log: Any = lambda msg: None,
        argv: list[str] | None = None, checkpoint: Any = None) -> dict[str, Any]:
    """Run the cells ``indices`` of ``grid`` with ``settings`` (a ``runner.Settings`` whose workloads are replaced)
    and return the results document with its ``matrix`` section (grid, cells, estimate, :func:`summarise`).

    Raises
    ------
    InputError, BackendUnavailable
        As ``runner.run``.
    """
    from dataclasses import replace

    from . import runner

    s = replace(settings, workloads=grid.workloads(indices), inexact=False)
    names = contender_names(list(s.families), s.device)
    total, per = estimate(grid, indices, names, s.repeat, s.sample_users)
    log(f"matrix {grid.name}: {len(indices)} cells, contenders {', '.join(names)}, repeat {s.repeat}; "
        f"estimated {total / 60:.1f} min" + (" (H200)" if s.device == "gpu" else " (rough, CPU)"))
    doc = runner.run(s, log=log, argv=argv, checkpoint=checkpoint)
    doc["matrix"] = {"grid": grid.name, "why": grid.why, "indices": list(indices),
                     "cells": [grid.cells[i].text for i in indices], "estimate_s": total,
                     "estimate_per_cell_s": per, "summary": summarise(doc)}
    return doc
