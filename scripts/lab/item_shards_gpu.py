#!/usr/bin/env python3
"""Item shards on one GPU: the unsharded ``recall batch`` against N item shards run in one process (every range on
the same GPU, ``inline_item_shard_executor``), for each metric: are the output bytes the same, and what does each
cost. A machine with one GPU cannot run ``--item-shards N`` itself (one GPU per range), so this checks the GPU
arithmetic of ranges on the unsharded tile grid, not the processes.

    PYTHONPATH=. python3 scripts/lab/item_shards_gpu.py [--items 50000] [--users 80000] [--dim 64] [--k 100]
"""
from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recall.jobs.batch import run_batch
from recall.jobs.executors import item_shards as executors


def _write(path: Path, ids: np.ndarray, vecs: np.ndarray) -> None:
    col = pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), vecs.shape[1])
    pq.write_table(pa.table({"id": pa.array(ids), "embedding": col}), path, row_group_size=65_536)


def _digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.glob("*.parquet")):
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _differences(out: Path, ref: Path) -> str:
    """How two outputs differ: lists (item ids) and the largest score difference."""
    lists = worst = 0
    for p in sorted(ref.glob("*.parquet")):
        a, b = pq.read_table(p), pq.read_table(out / p.name)
        lists += sum(x != y for x, y in zip(a.column("item_ids").to_pylist(), b.column("item_ids").to_pylist()))
        for x, y in zip(a.column("scores").to_pylist(), b.column("scores").to_pylist()):
            if len(x) == len(y) and x:
                worst = max(worst, float(np.abs(np.array(x) - np.array(y)).max()))
    return f"DIFFERENT bytes: {lists} lists differ, largest score difference {worst:.3g}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=50_000)
    ap.add_argument("--users", type=int, default=80_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--shards", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--device", default="gpu")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="item-shards-"))
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((256, args.dim))
    items = (centres[rng.integers(0, 256, args.items)] + 0.6 * rng.standard_normal((args.items, args.dim)))
    items *= rng.lognormal(0, 0.5, (args.items, 1))
    _write(root / "items.parquet", np.arange(args.items), items.astype(np.float32))
    (root / "users").mkdir()
    per = args.users // 4
    for i in range(4):
        users = centres[rng.integers(0, 256, per)] + 0.6 * rng.standard_normal((per, args.dim))
        _write(root / "users" / f"part-{i}.parquet", np.arange(per) + i * per, users.astype(np.float32))
    allow = rng.choice(args.items, args.items * 3 // 4, replace=False)
    pq.write_table(pa.table({"item_id": pa.array(allow)}), root / "allow.parquet")
    executors.local_item_shard_executor = executors.inline_item_shard_executor  # every range in this process
    for metric in ("ip", "cosine", "l2"):
        for allow_path in (None, root / "allow.parquet"):
            line = []
            ref, ref_out = None, root
            for n in (1, *args.shards):
                out = root / f"{metric}-{'allow' if allow_path else 'all'}-{n}"
                t0 = time.perf_counter()
                summary = run_batch(root / "users", root / "items.parquet", out, args.k, metric=metric,
                                    device=args.device, item_shards=n, allow=allow_path)
                seconds = time.perf_counter() - t0
                digest = _digest(out)
                ref = ref or digest
                ref_out = ref_out if n > 1 else out
                line.append(f"N={n} {seconds:.2f} s {'same bytes' if digest == ref else _differences(out, ref_out)}")
                del summary
            print(f"{metric:6} {'allow' if allow_path else 'all':5} " + "; ".join(line), flush=True)


if __name__ == "__main__":
    main()
