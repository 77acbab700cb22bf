"""Peak host memory of ``recall score`` jobs, Parquet to Parquet on the CPU: each command run under GNU time (its
"Maximum resident set size"), optionally with another tree on PYTHONPATH to compare, and its wall time.

    PYTHONPATH=. python3 scripts/lab/job_memory.py --data DIR [--trees .,/tmp/old] [--json out.json]

DIR holds the files the cases name (``users``/``items``/``excl``: Parquet of the bench's layout, made with
``scripts/lab/job_memory.py --make DIR``: random float32, dim 64). Prints one row per case and tree.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CASES = {
    # name: (users file, items file, k, extra arguments)
    "20k x 1M items, k 10": ("u20k.parquet", "items1m.parquet", 10, []),
    "1.6M users in one row group x 20k, k 10": ("u1600k_1rg.parquet", "items20k.parquet", 10, []),
    "400k x 20k, k 100, 30 exclusions a user": ("u400k.parquet", "items20k.parquet", 100, ["--exclude", "excl400k.parquet"]),
}


def make(root: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)

    def emb(path: Path, n: int, row_group: int | None = None) -> None:
        v = rng.standard_normal((n, 64)).astype(np.float32)
        t = pa.table({"id": pa.array(np.arange(n)), "embedding": pa.FixedSizeListArray.from_arrays(pa.array(v.ravel()), 64)})
        pq.write_table(t, path, row_group_size=row_group)

    emb(root / "u20k.parquet", 20_000)
    emb(root / "items1m.parquet", 1_000_000, 65_536)
    emb(root / "items20k.parquet", 20_000)
    emb(root / "u1600k_1rg.parquet", 1_600_000, 1_600_000)
    emb(root / "u400k.parquet", 400_000, 65_536)
    users = np.repeat(np.arange(400_000), 30)
    pq.write_table(pa.table({"user_id": pa.array(users), "item_id": pa.array(rng.integers(0, 20_000, users.size))}),
                   root / "excl400k.parquet", row_group_size=1 << 20)


def run(tree: str, data: Path, case: tuple) -> dict:
    users, items, k, extra = case
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "recall", "score", "--users", str(data / users), "--items",
               str(data / items), "--k", str(k), "--out", f"{tmp}/out.parquet", "--device", "cpu", "--quiet",
               *[str(data / a) if a.endswith(".parquet") else a for a in extra]]
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        t0 = time.perf_counter()
        # Run from the temporary folder: ``python -m`` puts the working directory first on sys.path, ahead of
        # PYTHONPATH, which would run the current folder's tree whatever ``tree`` names.
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
        wall = time.perf_counter() - t0
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    return {"rc": proc.returncode, "peak_mib": int(m.group(1)) >> 10 if m else None, "wall_s": round(wall, 2),
            "err": proc.stderr.strip().splitlines()[0] if proc.returncode else ""}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--make", action="store_true", help="write the cases' files into --data first")
    p.add_argument("--trees", default=".")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if a.make:
        make(a.data)
    out = []
    for name, case in CASES.items():
        for tree in a.trees.split(","):
            r = run(tree, a.data, case)
            print(f"| {name} | {tree} | peak {r['peak_mib']} MiB | {r['wall_s']} s | rc {r['rc']} {r['err']} |", flush=True)
            out.append({"case": name, "tree": tree, **r})
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
