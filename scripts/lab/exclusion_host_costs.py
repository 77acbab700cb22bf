"""What per-user exclusions cost on the host before a search: the validation of a CSR pair (``normalise``) and the
cut of it into two sets of users (``Exclusions.subset``, what fast mode's sample used to need), for S1-x200's shape
(100k users x 200 sorted exclusions, 20M pairs). Best of 3 after a first call (numba compiles there).

    PYTHONPATH=. python3 scripts/lab/exclusion_host_costs.py [--users 100000] [--per-user 200]
"""
from __future__ import annotations

import argparse

import numpy as np
from _timing import run_times

from recall.core.exclusions import Exclusions, normalise


def best(fn, repeat: int = 3) -> float:
    return min(run_times(fn, repeat))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=100_000)
    p.add_argument("--per-user", type=int, default=200)
    p.add_argument("--items", type=int, default=1_000_000)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    # Strictly increasing per user (sorted draws plus their position), as the bench's exclusions are.
    items = (np.sort(rng.integers(0, a.items, (a.users, a.per_user)), axis=1) + np.arange(a.per_user)).ravel()
    items = items.astype(np.int64)
    indptr = np.arange(a.users + 1, dtype=np.int64) * a.per_user
    n_items = a.items + a.per_user
    ex = Exclusions(indptr, items)
    sample = np.arange(a.users // 50, dtype=np.int64) * 50
    rest = np.setdiff1d(np.arange(a.users, dtype=np.int64), sample, assume_unique=True)
    print(f"{a.users:,} users x {a.per_user} exclusions ({items.size:,} pairs)")
    print(f"normalise (validate a CSR pair): {best(lambda: normalise((indptr, items), a.users, n_items)):.4f} s")
    print(f"subset into 1/50 and the rest:   {best(lambda: (ex.subset(sample), ex.subset(rest))):.4f} s")


if __name__ == "__main__":
    main()
