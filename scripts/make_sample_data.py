#!/usr/bin/env python3
"""Make the bundled sample in ``data/``: clustered user and item embeddings, and a few exclusions.

Deterministic (fixed seed): running it again rewrites the same rows. ``recall demo`` scores this sample.

    python scripts/make_sample_data.py [--out data]

Files (all small, < 2 MB together):

- ``users.parquet``: 3,000 users, ``id`` int64, ``embedding`` fixed_size_list<float32>[32], row groups of 1,000;
- ``items.parquet``: 5,000 items, same schema, row groups of 2,000;
- ``exclusions.parquet``: ``user_id``, ``item_id`` int64 pairs, for a tenth of the users their 5 best items
  ("already bought"), so the demo shows exclusions at work.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SEED = 20240601
N_USERS, N_ITEMS, DIM, N_CLUSTERS = 3_000, 5_000, 32, 24


def _vectors(rng: np.random.Generator, centers: np.ndarray, n: int, spread: float) -> np.ndarray:
    """Points around random cluster centers: the structure that makes top-k lists differ between users."""
    which = rng.integers(0, len(centers), n)
    return (centers[which] + spread * rng.standard_normal((n, centers.shape[1]))).astype(np.float32)


def _table(ids: np.ndarray, vecs: np.ndarray) -> pa.Table:
    emb = pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel(), pa.float32()), vecs.shape[1])
    return pa.table({"id": pa.array(ids, pa.int64()), "embedding": emb})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "data")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a directory")
    args.out.mkdir(parents=True, exist_ok=True)

    rng = np.random.default_rng(SEED)
    centers = rng.standard_normal((N_CLUSTERS, DIM)).astype(np.float32)
    users = _vectors(rng, centers, N_USERS, 0.6)
    items = _vectors(rng, centers, N_ITEMS, 0.6)
    # Ids that are not row positions (and not in order), so that a mix-up of the two shows in the output.
    user_ids = 1_000_000 + rng.permutation(N_USERS).astype(np.int64)
    item_ids = 5_000_000 + rng.permutation(N_ITEMS).astype(np.int64) * 7

    # Exclude each chosen user's 5 best items by inner product, so the demo's lists visibly change.
    chosen = np.sort(rng.choice(N_USERS, N_USERS // 10, replace=False))
    scores = users[chosen].astype(np.float64) @ items.T.astype(np.float64)
    best = np.argsort(-scores, axis=1, kind="stable")[:, :5]
    excl = pa.table({
        "user_id": pa.array(np.repeat(user_ids[chosen], 5), pa.int64()),
        "item_id": pa.array(item_ids[best.ravel()], pa.int64()),
    })

    pq.write_table(_table(user_ids, users), args.out / "users.parquet", row_group_size=1_000, compression="zstd")
    pq.write_table(_table(item_ids, items), args.out / "items.parquet", row_group_size=2_000, compression="zstd")
    pq.write_table(excl, args.out / "exclusions.parquet", compression="zstd")
    for name in ("users.parquet", "items.parquet", "exclusions.parquet"):
        path = args.out / name
        print(f"{path}: {pq.ParquetFile(path).metadata.num_rows:,} rows, {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
