#!/usr/bin/env python3
"""Make a nightly-batch dataset for ``recall batch``: an items file, a directory of user shards of uneven sizes, and
optionally exclusions. Deterministic: the same arguments (seed included) write the same rows.

    python scripts/make_batch_data.py --out /tmp/batch --users 400000 --items 1000000 --dim 64 --shards 16 \
        [--exclusions-per-user 5] [--seed 0]
    recall batch --users /tmp/batch/users --items /tmp/batch/items.parquet [--exclude /tmp/batch/exclusions.parquet] ...

Files, in the schemas ``recall batch`` reads (README, "Parquet contracts"):

- ``items.parquet``: ``id`` int64, ``embedding`` fixed_size_list<float32>[dim];
- ``users/part-NNNNN.parquet``: the same schema; shard sizes spread evenly between 1x and 3x the smallest, in a
  shuffled order, so that a multi-worker run has to balance them; user ids are unique over all shards;
- ``exclusions.parquet`` (only with ``--exclusions-per-user`` > 0): ``user_id``, ``item_id`` int64 pairs, for every
  user E items of the user's own cluster ("already bought": items that score high for that user).

Vectors are points around a few hundred Gaussian cluster centres (N(0, 1) centres, noise 0.6), so users' top-k
lists differ. Rows are generated and written in chunks of :data:`CHUNK` rows (one row group each): memory stays at a
few chunks whatever the sizes, and 1,000,000 x 64 floats take seconds.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CHUNK = 65_536
SPREAD = 0.6
EXCL_SCHEMA = pa.schema([("user_id", pa.int64()), ("item_id", pa.int64())])


def _emb_schema(dim: int) -> pa.Schema:
    return pa.schema([("id", pa.int64()), ("embedding", pa.list_(pa.float32(), dim))])


def _emb_table(ids: np.ndarray, vecs: np.ndarray) -> pa.Table:
    emb = pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel(), pa.float32()), vecs.shape[1])
    return pa.table({"id": pa.array(ids, pa.int64()), "embedding": emb})


def _points(rng: np.random.Generator, centers: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(len(labels), dim) float32: each row its cluster's centre plus Gaussian noise."""
    vecs = rng.standard_normal((labels.size, centers.shape[1]), dtype=np.float32)
    vecs *= SPREAD
    vecs += centers[labels]
    return vecs


def shard_sizes(n_users: int, n_shards: int, rng: np.random.Generator) -> np.ndarray:
    """``n_shards`` sizes summing to ``n_users``, proportional to weights 1..3 in a shuffled order."""
    weights = rng.permutation(np.linspace(1.0, 3.0, n_shards))
    sizes = np.floor(n_users * weights / weights.sum()).astype(np.int64)
    sizes[np.argsort(-weights, kind="stable")[: n_users - int(sizes.sum())]] += 1
    return sizes


def _describe(path: Path, rows: int) -> str:
    return f"{path}: {rows:,} rows, {path.stat().st_size / 2**20:,.1f} MiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output directory (created if missing)")
    parser.add_argument("--users", type=int, default=400_000, help="users over all shards")
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--shards", type=int, default=16, help="user shards (files)")
    parser.add_argument("--exclusions-per-user", type=int, default=0, metavar="E", help="0: no exclusions file")
    parser.add_argument("--clusters", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("users", "items", "dim", "shards", "clusters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.shards > args.users:
        parser.error("--shards must not exceed --users")
    if args.exclusions_per_user < 0:
        parser.error("--exclusions-per-user must be >= 0")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a directory")

    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    n_users, n_items, dim, excl = args.users, args.items, args.dim, args.exclusions_per_user
    out, users_dir = args.out, args.out / "users"
    users_dir.mkdir(parents=True, exist_ok=True)
    # Shards of an earlier run with other sizes would join this dataset: remove what this script writes.
    for old in [*users_dir.glob("part-*.parquet"), out / "exclusions.parquet"]:
        old.unlink(missing_ok=True)

    centers = rng.standard_normal((args.clusters, dim), dtype=np.float32)

    # Items: ids are neither row positions nor in order, so a mix-up of the two shows in the output.
    item_labels = rng.integers(0, args.clusters, n_items)
    item_ids = 5_000_000_000 + 7 * rng.permutation(n_items).astype(np.int64)
    items_path = out / "items.parquet"
    with pq.ParquetWriter(items_path, _emb_schema(dim)) as w:
        for s in range(0, n_items, CHUNK):
            w.write_table(_emb_table(item_ids[s:s + CHUNK], _points(rng, centers, item_labels[s:s + CHUNK])))
    print(_describe(items_path, n_items))

    # Items grouped by cluster: a user's exclusions are drawn from its own cluster's items.
    by_cluster = np.argsort(item_labels, kind="stable")
    first = np.searchsorted(item_labels[by_cluster], np.arange(args.clusters))
    count = np.bincount(item_labels, minlength=args.clusters)

    sizes = shard_sizes(n_users, args.shards, rng)
    user_ids = 1_000_000_000 + 3 * rng.permutation(n_users).astype(np.int64)
    excl_writer = pq.ParquetWriter(out / "exclusions.parquet", EXCL_SCHEMA) if excl else None
    start = 0
    try:
        for i, size in enumerate(sizes):
            path = users_dir / f"part-{i:05d}.parquet"
            with pq.ParquetWriter(path, _emb_schema(dim)) as w:
                for s in range(start, start + int(size), CHUNK):
                    ids = user_ids[s:min(s + CHUNK, start + int(size))]
                    labels = rng.integers(0, args.clusters, ids.size)
                    w.write_table(_emb_table(ids, _points(rng, centers, labels)))
                    if excl_writer is not None:
                        u = rng.random((ids.size, excl))
                        n = count[labels][:, None]
                        pos = np.minimum(first[labels][:, None] + (u * n).astype(np.int64), n_items - 1)
                        # A cluster without items (tiny datasets): any item.
                        rows = np.where(n > 0, by_cluster[pos], (u * n_items).astype(np.int64))
                        excl_writer.write_table(pa.table({"user_id": np.repeat(ids, excl),
                                                          "item_id": item_ids[rows.ravel()]}, schema=EXCL_SCHEMA))
            start += int(size)
    finally:
        if excl_writer is not None:
            excl_writer.close()
    print(f"{users_dir}/part-*.parquet: {args.shards} shards, {n_users:,} users, {sizes.min():,} to "
          f"{sizes.max():,} rows per shard, "
          f"{sum(p.stat().st_size for p in users_dir.glob('part-*.parquet')) / 2**20:,.1f} MiB")
    if excl:
        print(_describe(out / "exclusions.parquet", n_users * excl) + f" ({excl} per user)")
    print(f"dim {dim}, {args.clusters} clusters, seed {args.seed}: written in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
