"""What a `recall batch --exclude` job spends on its exclusions: wall time, each worker's start-up (items and, in
trees before the parent mapped them once, the exclusion file) and the parent's peak RSS, on the CPU. (A spawned
worker's own peak cannot be read from here: Linux counts the parent's size at the fork in a child's maximum.)

    PYTHONPATH=. python3 scripts/lab/batch_exclusions.py [--users 400000] [--per-user 20] [--workers 2]

Data: users in 4 shards, 5,000 items x 16, k=20, int ids, the given exclusions per user (uniform items), written
under a temporary folder from seed 0. One run per tree (the run is the measurement: start a process per tree).
"""
from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recall.jobs.batch import run_batch


def write(root: Path, n_users: int, per_user: int, n_items: int = 5000, dim: int = 16) -> dict:
    rng = np.random.default_rng(0)
    (root / "users").mkdir(parents=True)
    ids = np.arange(n_users, dtype=np.int64)
    for i, part in enumerate(np.array_split(ids, 4)):
        vecs = rng.standard_normal((part.size, dim), dtype=np.float32)
        pq.write_table(pa.table({"id": part, "embedding": pa.FixedSizeListArray.from_arrays(vecs.ravel(), dim)}),
                       root / "users" / f"part-{i}.parquet")
    items = rng.standard_normal((n_items, dim), dtype=np.float32)
    pq.write_table(pa.table({"id": np.arange(n_items, dtype=np.int64),
                             "embedding": pa.FixedSizeListArray.from_arrays(items.ravel(), dim)}),
                   root / "items.parquet")
    users = np.repeat(ids, per_user)
    pq.write_table(pa.table({"user_id": users, "item_id": rng.integers(0, n_items, users.size)}),
                   root / "excl.parquet")
    return {"users": root / "users", "items": root / "items.parquet", "exclude": root / "excl.parquet"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=400_000)
    p.add_argument("--per-user", type=int, default=20)
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = write(Path(tmp), a.users, a.per_user)
        t = time.perf_counter()
        summary = run_batch(files["users"], files["items"], Path(tmp) / "out", 20, device="cpu",
                            exclude=files["exclude"], workers=a.workers)
        wall = time.perf_counter() - t
    loads = [round(w.items_load_s, 3) for w in summary.worker_infos]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{a.users:,} users x {a.per_user} exclusions ({summary.exclusion_pairs:,} pairs), {a.workers} workers: "
          f"job {wall:.2f} s, workers' start-up {loads} s, parent peak RSS {rss:.0f} MB")


if __name__ == "__main__":
    main()
