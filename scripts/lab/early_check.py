"""Check the answers of searches merged part by part (``recall.jobs.early``) against one whole search, on the GPU.

Run from the project root on a GPU machine::

    PYTHONPATH=. python3 scripts/lab/early_check.py [--users 200000] [--items 1000000] [--dim 64] [--k 100] [--job]

Part 1 searches the users against the parts ``EarlyStart`` would make (the first 1/16 of the rows, then each eighth),
each with the floor of the merge so far, merges them (``Engine.merge_topk``) and compares every part and the merge
with one search over all the items: rows out of range, rows or scores that differ. ``--job`` also runs
``recall.jobs.score_files`` Parquet to Parquet with early searches on and off and compares the two files.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from recall import Engine
from recall.bench import layouts
from recall.bench.workloads import generate
from recall.core.options import DEFAULT_OPTIONS


def _describe(name: str, rows: np.ndarray, vals: np.ndarray, n_items: int, ref_rows: np.ndarray | None = None,
              ref_vals: np.ndarray | None = None) -> None:
    bad = (rows < -1) | (rows >= n_items)
    line = f"{name}: shape {rows.shape}, rows out of range {int(bad.sum())}"
    if bad.any():
        u, c = np.nonzero(bad)
        line += f" (users {u[:5].tolist()}, columns {c[:5].tolist()}, rows {rows[bad][:5].tolist()}, " \
                f"scores {vals[bad][:5].tolist()})"
    if ref_rows is not None:
        diff = (rows != ref_rows).any(axis=1)
        line += f"; users differing from the whole search {int(diff.sum())}"
        if diff.any():
            u = int(np.flatnonzero(diff)[0])
            cols = np.flatnonzero(rows[u] != ref_rows[u])[:5]
            line += f" (user {u}: columns {cols.tolist()}, got {rows[u, cols].tolist()} {vals[u, cols].tolist()}, " \
                    f"want {ref_rows[u, cols].tolist()} {ref_vals[u, cols].tolist()})"
    print(line, flush=True)


def parts_check(users: np.ndarray, items: np.ndarray, k: int, parts: int, device: str) -> None:
    whole = Engine(items, device=device)
    ref = whole.search(users, k)
    ref_rows, ref_vals = np.asarray(ref.indices), np.asarray(ref.scores)
    n = items.shape[0]
    bounds = [0, -(-n // (2 * parts))]
    step = -(-n // parts)
    while bounds[-1] < n:
        bounds.append(min(n, bounds[-1] + step))
    args = dict(device=whole.backend, memory_budget=max(1, whole.backend.free_memory() // 2 // (parts + 1)),
                tune="off", options=replace(DEFAULT_OPTIONS, min_user_block=8192))
    best = None
    engines = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        engine = Engine(items[lo:hi], **args)
        engines.append(engine)
        floor = best.vals[:, k - 1] if best is not None and best.vals.shape[1] >= k else None
        part = engine.search_topk(users, k, floor=floor)
        part.wait()
        prow, pval = whole.backend.to_host(part.rows), whole.backend.to_host(part.vals)
        _describe(f"part [{lo}, {hi}) floor={floor is not None}", prow, pval, hi - lo)
        best = engine.merge_topk(best, part, lo, k)
        part.wait()
        whole.backend.synchronize()
        _describe(f"  merged through {hi}", whole.backend.to_host(best.rows), whole.backend.to_host(best.vals), n)
    got = whole.finish_topk(best, users)
    _describe("merged", got.indices, got.scores, n, ref_rows, ref_vals)


def job_check(users: np.ndarray, items: np.ndarray, k: int, device: str) -> None:
    import pyarrow.parquet as pq

    from recall.jobs import JobOptions, score_files

    with tempfile.TemporaryDirectory(prefix="recall-early-check-") as tmp:
        up, ip = Path(tmp) / "users.parquet", Path(tmp) / "items.parquet"
        layouts.write(users, up)
        layouts.write(items, ip)
        tables = {}
        for mode in ("on", "off"):
            out = Path(tmp) / f"out-{mode}.parquet"
            t0 = time.perf_counter()
            summary = score_files(up, ip, out, k, device=device, options=JobOptions(early=mode))
            print(f"job early={mode}: {time.perf_counter() - t0:.2f} s, early users {summary.early_users}",
                  flush=True)
            tables[mode] = pq.read_table(out)
        on, off = tables["on"], tables["off"]
        ids_on = np.asarray(on.column("item_ids").combine_chunks().flatten())
        print(f"early on: item ids out of range {int(((ids_on < 0) | (ids_on >= items.shape[0])).sum())}; "
              f"files equal {on.equals(off)}", flush=True)
        if not on.equals(off):
            a = on.column("item_ids").to_pylist()
            b = off.column("item_ids").to_pylist()
            bad = [i for i in range(len(a)) if a[i] != b[i]]
            print(f"  rows differing {len(bad)}, first {bad[:10]}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=200_000)
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--parts", type=int, default=8)
    p.add_argument("--job", action="store_true")
    p.add_argument("--device", default="gpu")
    a = p.parse_args()
    users, items = generate("clustered", a.users, a.items, a.dim, seed=0, device="cpu")
    parts_check(users, items, a.k, a.parts, a.device)
    if a.job:
        job_check(users, items, a.k, a.device)


if __name__ == "__main__":
    main()
