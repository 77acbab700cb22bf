"""Random cells of hard data against the float64 oracle: exact mode, fast mode and exact mode's certified route.

Each cell draws a shape (1-600 users, 1-8,000 items, 1-257 dimensions, k from 1 to past the catalogue), a metric, a
data kind chosen to make certificates hard (small-integer ties, near-twin items, float16 rounding midpoints, norms
over six orders of magnitude, vectors far from the origin, float16's subnormal and overflow ranges, zero rows) and
exclusions or a shared item filter (empty and all-excluded users among them). It checks:

- exact mode against the float64 oracle (``tests/oracle.assert_topk_close``: padding, scores within float32
  rounding, every returned item's true score at its rank, no excluded or repeated item);
- on the CPU (``--device cpu``): fast mode (the GPU's float16 arithmetic emulated, ``EngineOptions.fast_emulation``)
  and the certified route (``certified_exact="on"``) against exact mode, rows and scores bit for bit (the
  certificate's claim: the float32 answer, whichever order the sums take);
- on the GPU (``--device gpu``): fast mode and exact mode's float32 search (``certified_exact="off"``) against the
  oracle too, and exact mode against its float32 search bit for bit wherever it took the certified route (whose
  sums are the fused kernel's);
- a NaN in the users is refused (``InputError``) in every mode.

    PYTHONPATH=.:tests python3 scripts/lab/soundness_sweep.py --minutes 30 --json sweep.json [--device gpu]
        [--float16-tiles]

``--float16-tiles`` (CPU): the emulation keeps the GPU's float16 score tiles (``NumpyBackend.float16_tiles``), as its
cuBLAS path does, and with them the users' shifted scores.

Prints one line a failing cell (its seed reproduces it: ``--cell SEED``) and a summary table; writes the cells' JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import oracle  # noqa: E402  (tests/oracle.py: the independent float64 reference)
from recall import Engine, EngineOptions, InputError  # noqa: E402

KINDS = ("normal", "skewed", "clustered", "ints", "twins", "midpoints", "range", "offset", "tiny", "huge", "zeros")
DIMS = (1, 2, 3, 5, 8, 16, 31, 32, 33, 64, 100, 128, 257)


def _data(rng: np.random.Generator, kind: str, n: int, dim: int, shared: dict) -> np.ndarray:
    """(n, dim) float32 rows of ``kind``; ``shared`` holds what users and items of a cell have in common."""
    if kind == "ints":
        return rng.integers(-2, 3, size=(n, dim)).astype(np.float32)
    if kind == "twins":  # groups of near-duplicates: a few float32 ulps apart, closer than float16 tells
        base = rng.standard_normal((max(1, n // 7 + 1), dim))
        rows = base[rng.integers(0, base.shape[0], n)]
        return (rows * (1 + rng.integers(-3, 4, size=(n, 1)) * 2.0 ** -22)).astype(np.float32)
    if kind == "midpoints":  # every value a float16 rounding midpoint, or a float32 ulp either side of one
        h = rng.standard_normal((n, dim)).astype(np.float16).astype(np.float32)
        ulp16 = np.spacing(np.abs(h).astype(np.float16)).astype(np.float32)
        mid = h + np.sign(h) * ulp16 / 2
        return (mid + rng.integers(-1, 2, size=(n, dim)) * np.spacing(mid)).astype(np.float32)
    if kind == "clustered":
        centres = shared.setdefault("centres", rng.standard_normal((int(rng.integers(1, 9)), dim)))
        return (centres[rng.integers(0, centres.shape[0], n)] + 0.05 * rng.standard_normal((n, dim))
                ).astype(np.float32)
    vecs = rng.standard_normal((n, dim))
    if kind == "skewed":
        vecs *= rng.lognormal(0.0, float(rng.choice([0.5, 1.0, 2.0])), size=(n, 1))
    elif kind == "range":
        vecs *= 10.0 ** rng.uniform(-3, 3, size=(n, 1))
    elif kind == "offset":
        vecs += shared.setdefault("offset", rng.standard_normal(dim) * float(rng.choice([10.0, 1000.0])))
    elif kind == "tiny":  # float16's subnormals and below
        vecs *= 1e-6
    elif kind == "huge":  # products past float16's range, sums within float32's
        vecs *= 3e4 / np.sqrt(dim)
    elif kind == "zeros":
        vecs[rng.random(n) < 0.3] = 0.0
    return vecs.astype(np.float32)


def _exclusions(rng: np.random.Generator, n_users: int, n_items: int) -> tuple[dict | None, dict]:
    """Per-user exclusions (None, or {user: rows} with empty and all-excluded users; past 8,000 items, at most 300
    rows a user and none all-excluded) and a shared filter."""
    excl = None
    if rng.random() < 0.5:
        excl = {}
        small = n_items <= 8000
        for u in range(n_users):
            r = rng.random()
            if r < 0.05 and small:
                excl[u] = list(range(n_items))
            elif r < 0.1:
                excl[u] = []
            elif r < 0.6 and small:
                excl[u] = rng.choice(n_items, int(rng.integers(0, n_items + 1)), replace=False).tolist()
            elif r < 0.6:
                excl[u] = np.unique(rng.integers(0, n_items, int(rng.integers(0, 301)))).tolist()
    filt: dict = {}
    r = rng.random()
    if r < 0.15:
        filt["allow"] = rng.random(n_items) < rng.uniform(0.01, 1.0)
    elif r < 0.3:
        filt["deny"] = rng.choice(n_items, int(rng.integers(0, n_items + 1)), replace=False)
    return excl, filt


def _passing(filt: dict, n_items: int) -> np.ndarray | None:
    if not filt:
        return None
    mask = np.ones(n_items, bool) if "allow" not in filt else filt["allow"].copy()
    if "deny" in filt:
        mask[filt["deny"]] = False
    return mask


def _modes(device: str) -> tuple[tuple[str, dict], ...]:
    """The engines a cell runs beside exact mode: (name, Engine keywords)."""
    if device == "cpu":
        return (("fast", dict(precision="fast", options=EngineOptions(fast_emulation=True))),
                ("certified", dict(options=EngineOptions(certified_exact="on"))))
    return (("fast", dict(precision="fast")), ("float32", dict(options=EngineOptions(certified_exact="off"))))


def _against_oracle(got: object, users: np.ndarray, items: np.ndarray, k: int, metric: str, excl: dict | None,
                    passing: np.ndarray | None, most: int = 400) -> None:
    """``tests/oracle.assert_topk_close`` of a result, on at most ``most`` evenly spaced users (a shared filter
    ``passing`` as each of their exclusions)."""
    rows, scores = oracle.as_numpy(got.indices), oracle.as_numpy(got.scores)
    take = np.arange(users.shape[0]) if users.shape[0] <= most else \
        np.linspace(0, users.shape[0] - 1, most).astype(np.int64)
    off = np.zeros(0, np.int64) if passing is None else np.flatnonzero(~passing)
    sub = None
    if excl is not None or off.size:  # CSR (indptr, rows): the oracle's mask is then built without a Python loop
        lists = [np.unique(np.concatenate([np.asarray((excl or {}).get(int(u), []), np.int64), off]))
                 for u in take]
        sub = (np.concatenate([[0], np.cumsum([a.size for a in lists])]), np.concatenate(lists))
    oracle.assert_topk_close(rows[take], scores[take], users[take], items, k, metric, sub)


def run_cell(seed: int, device: str = "cpu", large: bool = False) -> dict:
    """One cell (``large``: the shapes a GPU search takes its fused kernels and certified route on; the oracle then
    checks 400 of its users)."""
    rng = np.random.default_rng(seed)
    metric = str(rng.choice(["ip", "cosine", "l2"]))
    kind = str(rng.choice(KINDS))
    dim = int(rng.choice(DIMS))
    if large:
        n_items = int(rng.choice([8192, 20000, 65536, 150000]))
        n_users = int(rng.choice([1000, 20000, 100000]))
        k = int(rng.choice([1, 10, 100, 1000, 2048, 4096]))
    else:
        # Catalogues of 1-64 items in a fifth of the cells (k past them in most), larger ones in the rest.
        n_items = int(rng.choice([1, 2, 7, 64, 500, 2048, 3000, 8000], p=[0.05] * 4 + [0.2] * 4))
        n_users = int(rng.choice([1, 3, 64, 257, 600]))
        k = int(rng.choice([1, 2, 10, 50, 100, 300, 1000, max(1, n_items - 1), n_items, n_items + 7]))
    shared: dict = {}
    items = _data(rng, kind, n_items, dim, shared)
    users = _data(rng, kind, n_users, dim, shared)
    if metric == "cosine":  # a zero row has no direction: cosine refuses it (tested elsewhere)
        for vecs in (items, users):
            vecs[np.linalg.norm(vecs.astype(np.float64), axis=1) == 0, 0] = 1.0
    excl, filt = _exclusions(rng, n_users, n_items)
    cell = dict(seed=seed, metric=metric, kind=kind, dim=dim, n_users=n_users, n_items=n_items, k=k,
                exclusions=excl is not None, filter=sorted(filt))
    try:
        engine = Engine(items, metric=metric, device=device)
        exact = engine.search(users, k, exclude=excl, **filt)
        cell["exact"] = _stats(engine)
        passing = _passing(filt, n_items)
        _against_oracle(exact, users, items, k, metric, excl, passing)
        for name, opts in _modes(device):
            engine = Engine(items, metric=metric, device=device, **opts)
            got = engine.search(users, k, exclude=excl, **filt)
            cell[name] = _stats(engine)
            if device == "cpu" or (name == "float32" and cell["exact"].get("route") == "certified"):
                for what, a, b in (("rows", got.indices, exact.indices), ("scores", got.scores, exact.scores)):
                    np.testing.assert_array_equal(oracle.as_numpy(a), oracle.as_numpy(b),
                                                  err_msg=f"{name}: {what} differ from exact mode's")
            else:
                _against_oracle(got, users, items, k, metric, excl, passing)
        bad = users.copy()
        bad[int(rng.integers(0, n_users)), int(rng.integers(0, dim))] = np.nan
        for opts in ({}, dict(_modes(device))["fast"]):
            try:
                Engine(items, metric=metric, device=device, **opts).search(bad, k)
            except InputError:
                pass
            else:
                raise AssertionError("a NaN in the users was not refused")
        cell["ok"] = True
    except Exception as exc:  # noqa: BLE001 - a sweep reports every failure and goes on
        cell["ok"] = False
        cell["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        cell["trace"] = traceback.format_exc()[-3000:]
    return cell


def _stats(engine: Engine) -> dict:
    return {key: engine.stats[key] for key in ("precision", "route", "fallback_users", "widened_users",
                                                "fast_declined", "fused") if engine.stats.get(key) is not None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0, help="first cell's seed (cells take seed, seed + 1, ...)")
    ap.add_argument("--cell", type=int, help="run this one cell's seed and print it")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--large", action="store_true", help="GPU-sized cells (the oracle checks 400 users of each)")
    ap.add_argument("--float16-tiles", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.float16_tiles:
        from recall.backends.numpy.backend import NumpyBackend

        NumpyBackend.float16_tiles = True
    if args.cell is not None:
        cell = run_cell(args.cell, args.device, args.large)
        print(json.dumps(cell, indent=1))
        return 0 if cell["ok"] else 1
    cells, seed, stop = [], args.seed, time.monotonic() + 60 * args.minutes
    while time.monotonic() < stop:
        cell = run_cell(seed, args.device, args.large)
        cells.append(cell)
        if not cell["ok"]:
            print(f"FAIL seed {seed}: {cell['metric']} {cell['kind']} {cell['n_users']}x{cell['n_items']}x"
                  f"{cell['dim']} k={cell['k']}: {cell['error'][:300]}", flush=True)
        seed += 1
    failed = [c for c in cells if not c["ok"]]
    fell = sum(int((c.get("fast") or {}).get("fallback_users") or 0) for c in cells)
    print(f"{len(cells)} cells (seeds {args.seed}-{seed - 1}), {len(failed)} failed; fast mode's fallback users in "
          f"all: {fell}")
    print("| kind | cells | failed |\n| --- | ---: | ---: |")
    for kind in KINDS:
        mine = [c for c in cells if c["kind"] == kind]
        print(f"| {kind} | {len(mine)} | {sum(not c['ok'] for c in mine)} |")
    if args.json:
        args.json.write_text(json.dumps(cells, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
