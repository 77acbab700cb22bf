"""Where fast mode's first float16 pass starts, counted on the CPU (no GPU needed): per cell, the scores a user passes
at its start (exact float64 scores, mean / p99) for the start before 2026-12-06 (the threshold sample's (k + m + 1)-th
best, or an estimate of it over evenly spaced rows) and for the need's (``selection.start_rank`` with need k + slack:
under l2 both from a sample half nearest the items' centroid, ``metrics.centroid_ranks``, whatever the catalogue's
size, and from evenly spaced rows); and, with ``--certify``, the users whose certificate would fail against a start
at the (ranked) sample's (k + slack)-th best, slacks 1-4: the pass's scores emulated from the float16 rows (their
products summed in float64, rounded to float32), the certificate's own test (``certificate.certified``) of each
user's exact k-th best against that start::

    python3 scripts/lab/need_counts.py [--cells skewed:8000:4096:32:10:l2,...] [--certify | --margins]

``--margins``: per first margin m (the shipped is ``certificate.margin(k)``, 16 at k = 10), the users whose
certificate fails and the candidates a user holds, where the pass starts at the need.

``--samples 512,1024,2048``: per threshold sample size, the scores a user passes at the need's rank (k + slack) of a
sample ranked as the pass ranks it (the largest norms, or under l2 the items nearest the centroid) and of evenly
spaced rows: what a larger sample would spare a pass that starts at its bound. ``--even-every 2,4,0``: ranked samples
that keep every n-th of their evenly spaced rows (``tiled.EVEN_EVERY``: a half as shipped, a quarter, none).
"""
from __future__ import annotations

import argparse

import numpy as np

from recall.backends.cupy.backend import preferred_width
from recall.backends.cupy.selection import estimate_rank, seed_size, start_rank
from recall.backends import tiled
from recall.backends.tiled import sample_rows
from recall.bench.workloads import generate
from recall.core import certificate, metrics
from recall.engine.fast import NEED_SLACK

CELLS = ("skewed:8000:4096:32:10:l2", "skewed:4000:4096:64:10:ip", "skewed:2000:20000:32:10:l2",
         "skewed:2000:20000:64:50:ip", "normal:3000:4096:32:10:l2", "clustered:3000:4096:64:10:l2")


def _data(spec: str, seed: int):
    kind, nu, ni, dim, k, metric = spec.split(":")
    nu, ni, dim, k = int(nu), int(ni), int(dim), int(k)
    users, items = generate(kind, nu, ni, dim, seed=seed)
    return users, items, nu, ni, dim, k, metric


def _pass_order(pi: np.ndarray, metric: str, dim: int) -> np.ndarray | None:
    """The order the pass ranks its threshold sample by over prepared items ``pi``: under l2 the items nearest the
    centroid (``metrics.centroid_ranks``), else their norms where the metric ranks by them, else None (evenly)."""
    order = metrics.centroid_ranks(np, pi, metric, dim)
    if order is None and metrics.norms_rank(metric):
        order = np.linalg.norm(pi.astype(np.float64), axis=1)
    return order


def _kth(s: np.ndarray, r: int) -> np.ndarray:
    return -np.partition(-s, r - 1, axis=1)[:, r - 1]


def passed(spec: str, slack: int) -> dict:
    users, items, nu, ni, dim, k, metric = _data(spec, 0)
    pu = metrics.prepare_users(metric, np, users).astype(np.float64)
    pi = metrics.prepare_items(metric, np, items).astype(np.float64)
    wide = min(k + certificate.margin(k) + 1, ni)
    size = seed_size(ni, wide, 4 * preferred_width(dim, wide), bound=False)
    norms = np.linalg.norm(pi, axis=1) if metrics.norms_rank(metric) else None
    ranks = metrics.centroid_ranks(np, pi, metric, dim)
    before = estimate_rank(wide, size, ni, norms is not None)
    rules = {"before": (sample_rows(np, ni, size, None if before else norms), before or wide)}
    order = ranks if ranks is not None else norms
    rank, even = start_rank(wide, k + slack, size, ni, order is not None)
    rules["need"] = (sample_rows(np, ni, size, None if even else order), rank or wide)
    if ranks is not None:  # the need's start from evenly spaced rows (l2 without the centroid's half)
        rank, even = start_rank(wide, k + slack, size, ni, False)
        rules["need, even"] = (sample_rows(np, ni, size), rank or wide)
    got = {name: [] for name in rules}
    for a in range(0, nu, 500):
        s = pu[a:a + 500] @ pi.T
        for name, (rows, r) in rules.items():
            got[name].append((s >= _kth(s[:, rows], r)[:, None]).sum(axis=1))
    return {name: (rules[name][1], np.concatenate(c)) for name, c in got.items()}


def sample_sizes(spec: str, slack: int, sizes, even_every=(2,)) -> dict:
    """Per sample size: ({tiled.EVEN_EVERY: scores a user passes from the ranked sample's (k + slack)-th best}, from
    evenly spaced rows'), each an array over the users."""
    users, items, nu, ni, dim, k, metric = _data(spec, 0)
    pu = metrics.prepare_users(metric, np, users).astype(np.float64)
    pi = metrics.prepare_items(metric, np, items).astype(np.float64)
    order = _pass_order(pi, metric, dim)
    shipped = tiled.EVEN_EVERY
    rows = {}
    try:
        for n in sizes:
            rows[(n, None)] = sample_rows(np, ni, n)
            for e in even_every:
                tiled.EVEN_EVERY = e
                rows[(n, e)] = sample_rows(np, ni, n, order)
    finally:
        tiled.EVEN_EVERY = shipped
    got = {key: [] for key in rows}
    for a in range(0, nu, 500):
        s = pu[a:a + 500] @ pi.T
        for key, r in rows.items():
            got[key].append((s >= _kth(s[:, r], k + slack)[:, None]).sum(axis=1))
    return {n: ({e: np.concatenate(got[(n, e)]) for e in even_every}, np.concatenate(got[(n, None)])) for n in sizes}


def _emulated(spec: str):
    """The cell's users (seed 1) in blocks of 2,000: per block (its float16 pass's scores, emulated from the float16
    rows: products summed in float64, rounded to float32; its exact scores; its FastUsers), with (k, the sample's
    rows: ranked as the pass ranks them, the FastItems)."""
    users, items, nu, ni, dim, k, metric = _data(spec, 1)
    pu = metrics.prepare_users(metric, np, users)
    pi = metrics.prepare_items(metric, np, items)
    fi = certificate.prepare_items(np, pi, metrics.bias_column(metric, dim))
    fu = certificate.prepare_users(np, pu, fi)
    order = _pass_order(pi, metric, dim)
    wide = min(k + certificate.margin(k) + 1, ni)
    rows = sample_rows(np, ni, seed_size(ni, wide, 4 * preferred_width(dim, wide), bound=False), order)
    v16 = fi.vecs16.astype(np.float64)

    def blocks():
        for a in range(0, nu, 2000):
            t = (fu.vecs16[a:a + 2000].astype(np.float64) @ v16.T).astype(np.float32).astype(np.float64)
            exact = pu[a:a + 2000].astype(np.float64) @ pi.astype(np.float64).T
            yield t, exact, fu.take(np.arange(a, min(a + 2000, nu)))

    return blocks(), k, rows, fi


def failures(spec: str, slacks=(1, 2, 3, 4)) -> dict:
    blocks, k, rows, fi = _emulated(spec)
    out = {s: 0 for s in slacks}
    for t, exact, sub in blocks:
        ts = -np.sort(-t[:, rows], axis=1)
        kth = _kth(exact, k)
        for s in slacks:
            out[s] += int((~certificate.certified(np, kth, ts[:, k + s - 1], sub, fi)).sum())
    return out


def margins(spec: str, slack: int, ms=(0, 1, 2, 4, 8, 16)) -> dict:
    """Per first margin m: (the users whose certificate fails, candidates a user holds) for a pass of k + m + 1
    that starts at the (ranked) sample's (k + slack)-th best: its candidates the items at or above the larger of the
    start and the (k + m + 1)-th best pass score, the best left out the larger of the start and the (k + m + 2)-th."""
    blocks, k, rows, fi = _emulated(spec)
    fails, held = {m: 0 for m in ms}, {m: [] for m in ms}
    for t, exact, sub in blocks:
        start = _kth(t[:, rows], k + slack)
        ts = -np.sort(-t, axis=1)
        for m in ms:
            kept = t >= np.maximum(start, ts[:, k + m])[:, None]
            kth = _kth(np.where(kept, exact, -np.inf), k)
            outside = np.maximum(start, ts[:, k + m + 1])
            fails[m] += int((~certificate.certified(np, kth, outside, sub, fi)).sum())
            held[m].append(kept.sum(axis=1))
    return {m: (fails[m], float(np.concatenate(held[m]).mean())) for m in ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default=",".join(CELLS))
    p.add_argument("--slack", type=int, default=NEED_SLACK)
    p.add_argument("--certify", action="store_true")
    p.add_argument("--margins", action="store_true",
                   help="per first margin m, the users whose certificate fails and the candidates a user holds, for a "
                        "pass that starts at the sample's (k + slack)-th best")
    p.add_argument("--samples", default="", help="comma-separated sample sizes: the scores a user passes from each")
    p.add_argument("--even-every", default="2",
                   help="with --samples: ranked samples keeping every n-th evenly spaced row (tiled.EVEN_EVERY; 0: "
                        "none), comma-separated")
    p.add_argument("--over", default="",
                   help="with --samples: also the share of users passing more than each of these counts (128, 256: "
                        "the GPU's warp merge holds 8 x 32 keys a user), comma-separated")
    a = p.parse_args()
    if a.samples:
        sizes = [int(n) for n in a.samples.split(",")]
        evens = [int(n) for n in a.even_every.split(",")]
        over = [int(n) for n in a.over.split(",")] if a.over else []

        def told(r):
            shares = "".join(f", over {n} {(r > n).mean():.3f}" for n in over)
            return f"{r.mean():.1f} / {np.percentile(r, 99):.0f}{shares}"

        print("| cell | sample: passed from the ranked sample (EVEN_EVERY), mean / p99; from evenly spaced rows |")
        print("| --- | --- |")
        for spec in a.cells.split(","):
            got = sample_sizes(spec, a.slack, sizes, evens)
            print(f"| {spec} | " + "; ".join(
                f"{n}: " + ", ".join(f"({e}) {told(r)}" for e, r in ranked.items()) + f", even {told(even)}"
                for n, (ranked, even) in got.items()) + " |", flush=True)
        return
    if a.margins:
        print("| cell | first margin m: certificates failed, candidates a user |")
        print("| --- | --- |")
        for spec in a.cells.split(","):
            got = margins(spec, a.slack)
            print(f"| {spec} | " + "; ".join(f"{m}: {f}, {c:.1f}" for m, (f, c) in got.items()) + " |", flush=True)
        return
    print("| cell | start before: rank, passed mean / p99 | the need's start: rank, passed mean / p99 |"
          + (" certificates failed at slack 1 / 2 / 3 / 4 |" if a.certify else ""))
    print("| --- | --- | --- |" + (" --- |" if a.certify else ""))
    for spec in a.cells.split(","):
        got = passed(spec, a.slack)
        cols = [f"{r}: {c.mean():.1f} / {np.percentile(c, 99):.0f}" for r, c in got.values()]
        cols[1] += f"; evenly spaced {cols.pop(2)}" if len(cols) > 2 else ""
        fails = ""
        if a.certify:
            f = failures(spec)
            fails = f" {' / '.join(str(f[s]) for s in sorted(f))} of {spec.split(':')[1]} |"
        print(f"| {spec} | {cols[0]} | {cols[1]} |{fails}", flush=True)


if __name__ == "__main__":
    main()
