"""How many scores a user passes the GPU's fused filter in a seeded search, counted on the CPU: each cell's users
scored exactly (float64) against every item, the threshold sample drawn by the GPU's rules (``selection.seed_size``,
``tiled.sample_rows``: half of an inner-product sample from the largest norms), and the scores at or above each
user's threshold counted for two launch schedules:

- one launch over every item from the sample's k-th best (the float32 search as shipped: one segment of up to
  65,536 items), or, for the float16 pass of fast mode and the certified route, from its KE-th best where the pass
  may start at an estimate (``selection.estimate_rank``; its sample is then evenly spaced);
- a first launch of F items (``EngineOptions.fused_first_segment``), whose merge raises each threshold to the k-th
  best of those items (or keeps the seed's, if higher), then the rest. sqrt(sample x items) (marked *) is the F
  that the model "the sample's k-th best is the (k items / sample)-th best" says passes fewest (about 2 k
  sqrt(items / sample) against k items / sample).

Under l2 each search is counted again with its sample ranked as kernel_profile.py's ``float32-l2-centroid`` ranks
the float32 search's: half its rows from the items nearest the items' centroid (2 c.v - |v|^2 largest), as an inner
product's take the largest norms; the float16 pass so ranked then estimates only where an inner-product pass would
(``estimate_rank``'s ``ranked``), which loses the estimate where it counted fewer.

A count, not a timing: the kernels' work per survivor (its append, a divergent branch of its warp, and the merge's
selection) grows with it. The last column counts what the float16 kernel's epilogue meets (fused_w.cu): the share
of a warp's groups of 8 users x 32 items that hold a survivor, each taking the warp into its appending branch, and
the rounds that branch goes (the most survivors a lane holds), per group. Exact scores: fast mode's float16 pass
keeps scores within its certificate's bound of the threshold too, so its counts are somewhat higher. No GPU
needed::

    python3 scripts/lab/pass_counts.py [--cells skewed:2000:20000:32:10:l2,...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from recall.backends.cupy.backend import preferred_width
from recall.backends.cupy.selection import estimate_rank, seed_size
from recall.backends.tiled import sample_rows
from recall.bench.workloads import generate

CELLS = ("skewed:2000:20000:32:10:ip", "skewed:2000:20000:32:10:l2", "skewed:1000:10000:64:100:ip",
         "skewed:2000:4096:64:10:ip", "normal:2000:20000:32:10:ip", "normal:1000:20000:64:100:l2",
         "clustered:1000:100000:64:10:cosine", "popular:1000:30000:64:200:ip", "popular:1000:30000:64:100:l2",
         "skewed:1000:100000:64:100:l2", "clustered:1000:50000:64:10:l2", "ties:1000:50000:64:100:l2")
FIRSTS = (2048, 4096, 8192, 16384)


def _scores(users: np.ndarray, items: np.ndarray, metric: str) -> np.ndarray:
    s = users @ items.T
    if metric == "l2":  # -|u - v|^2 + |u|^2: the same order per user
        s = 2.0 * s - np.einsum("ij,ij->i", items, items)[None, :]
    return s


def _kth(s: np.ndarray, k: int) -> np.ndarray:
    return -np.partition(-s, k - 1, axis=1)[:, k - 1] if s.shape[1] >= k else np.full(s.shape[0], -np.inf)


def _patches(passed: np.ndarray) -> tuple[int, int, int]:
    """(patches with a survivor, the divergent appends' rounds, patches) of a block of users' pass mask (rows a
    multiple of 8) as fused_w.cu's epilogue meets them: a warp's group of 8 scores a lane covers 8 users (consecutive
    rows) x 32 consecutive items, lane (g, t) holding user g's items 8j + 2t + c (j < 4, c < 2); a patch with a
    survivor takes the warp into the branch that appends, which goes round as often as its lane with the most."""
    n, ni = passed.shape
    pad = -ni % 32
    p = np.pad(passed, ((0, 0), (0, pad))).reshape(n // 8, 8, (ni + pad) // 32, 4, 4, 2)
    per_lane = p.sum(axis=(3, 5))  # (user groups, g, patches, t)
    rounds = per_lane.max(axis=(1, 3))
    return int((rounds > 0).sum()), int(rounds.sum()), rounds.size


def count(spec: str, firsts: tuple[int, ...] = FIRSTS, chunk: int = 256) -> dict:
    kind, nu, ni, dim, k, metric = spec.split(":")
    nu, ni, dim, k = int(nu), int(ni), int(dim), int(k)
    users, items = generate(kind, nu, ni, dim, seed=0)
    users, items = np.asarray(users, np.float64), np.asarray(items, np.float64)
    if metric == "cosine":
        users = users / np.maximum(np.linalg.norm(users, axis=1, keepdims=True), 1e-300)
        items = items / np.maximum(np.linalg.norm(items, axis=1, keepdims=True), 1e-300)
    capacity = 4 * preferred_width(dim, k)  # one GEMM call's tiles
    ranked = metric == "ip"
    norms = np.linalg.norm(items, axis=1) if ranked else None
    # The float32 search starts at a bound; the float16 pass at an estimate where one applies (over evenly spaced
    # rows: then its sample is not ranked), with the rule's smaller sample for it.
    # l2 also with its samples ranked by the distance to the items' centroid (the nearest half).
    centroid = -((items - items.mean(axis=0)) ** 2).sum(axis=1) if metric == "l2" else None
    passes = {}
    for name, bound, key in (("float32 search", True, norms), ("float16 pass", False, norms),
                             *((("float32 search, l2 centroid", True, centroid),
                                ("float16 pass, l2 centroid (no estimate)", False, centroid))
                               if metric == "l2" else ())):
        m = seed_size(ni, k, capacity, bound=bound)
        ke = 0 if bound else estimate_rank(k, m, ni, key is not None)
        rows = sample_rows(np, ni, m, key if key is not None and not ke else None)
        rule = math.isqrt(m * ni)
        firsts_here = sorted({min(ni, -(-f // 128) * 128) for f in (*firsts, rule)})
        passes[name] = (m, ke or k, rows, rule, firsts_here)
    got: dict[tuple, list] = {}
    patches: dict[tuple, np.ndarray] = {}
    nu -= nu % 8  # whole warps' groups of 8 users
    for u0 in range(0, nu, chunk):
        s = _scores(users[u0:min(u0 + chunk, nu)], items, metric)
        for name, (m, rank, rows, rule, firsts_here) in passes.items():
            seed = _kth(s[:, rows], rank)
            for f in (0, *firsts_here):
                if f:
                    raised = np.maximum(seed, _kth(s[:, :f], k))
                    passed = np.concatenate([s[:, :f] >= seed[:, None], s[:, f:] >= raised[:, None]], axis=1)
                else:
                    passed = s >= seed[:, None]
                got.setdefault((name, f), []).append(passed.sum(1))
                patches[(name, f)] = patches.get((name, f), np.zeros(3, np.int64)) + _patches(passed)
    out = {"cell": spec, "passes": {}}
    for name, (m, rank, rows, rule, firsts_here) in passes.items():
        sched = {}
        for f in (0, *firsts_here):
            c = np.concatenate(got[(name, f)])
            hit, rounds, total = patches[(name, f)]
            sched["one launch" if f == 0 else f"first {f}"] = {
                "mean": float(c.mean()), "p99": float(np.percentile(c, 99)), "patches_hit": float(hit / total),
                "rounds_per_patch": float(rounds / total)}
        out["passes"][name] = {"sample": m, "start_rank": rank, "rule_first": min(ni, -(-rule // 128) * 128),
                               "schedules": sched}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default=",".join(CELLS))
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    results = []
    print("| cell | search | sample | starts at rank | one launch | first launch of F items: F = passed (mean / p99) "
          "| warp groups with a survivor (rounds a group): one launch; F* |")
    print("| --- | --- | ---: | ---: | ---: | --- | --- |")
    for spec in a.cells.split(","):
        r = count(spec)
        results.append(r)
        for name, ps in r["passes"].items():
            one = ps["schedules"]["one launch"]
            firsts = [f"{f.split()[1]}{'*' if int(f.split()[1]) == ps['rule_first'] else ''} = {c['mean']:.0f} / "
                      f"{c['p99']:.0f}" for f, c in ps["schedules"].items() if f != "one launch"]
            rule = ps["schedules"][f"first {ps['rule_first']}"]
            print(f"| {spec} | {name} | {ps['sample']} | {ps['start_rank']} | {one['mean']:.0f} / {one['p99']:.0f} "
                  f"| {'; '.join(firsts)} | {one['patches_hit']:.1%} ({one['rounds_per_patch']:.2f}); "
                  f"{rule['patches_hit']:.1%} ({rule['rounds_per_patch']:.2f}) |", flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
