"""What l2's exactness costs on the host, per batch of results: the metric's scores (``metrics.finish``: 2·s - |u|²),
the pass that puts equal reported scores in row order (``metrics.order_ties``: compiled, and as the array
operations the device takes), and moving users by the l2 centre (``Engine.centred``).

Lists are ``--users`` x ``--k``, best first, rows drawn from a million items: without ties, and with every list made
of runs of equal scores in random row order (the worst case; rounding makes a few such pairs in real lists).

Run from the project root on any machine::

    PYTHONPATH=. python3 scripts/lab/l2_host_costs.py [--users 100000] [--k 100] [--dim 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from recall.core import metrics


def _median_ms(fn, make, repeat: int) -> float:
    fn(*make())  # compiled on the first call
    times = []
    for _ in range(repeat):
        args = make()
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _array_order_ties(scores: np.ndarray, rows: np.ndarray) -> None:
    # The device's way (order_ties for a module other than NumPy), run by NumPy.
    class NotNumpy:
        def __getattr__(self, name):
            return getattr(np, name)

    metrics.order_ties(NotNumpy(), scores, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=100_000)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    n, k = args.users, args.k
    rows = rng.integers(0, 1_000_000, (n, k))
    plain = -np.sort(-rng.standard_normal((n, k)).astype(np.float32), axis=1)
    tied = -np.sort(-rng.integers(0, max(2, k // 4), (n, k)).astype(np.float32), axis=1)
    users = rng.standard_normal((n, args.dim)).astype(np.float32)
    centre = np.full(args.dim, 3000.0, np.float32)
    cases = {
        "finish (scores, ties ordered), no ties": (lambda s, r: metrics.finish("l2", np, s, r, users),
                                                   lambda: (plain.copy(), rows.copy())),
        "order_ties compiled, no ties": (lambda s, r: metrics.order_ties(np, s, r), lambda: (plain.copy(), rows.copy())),
        "order_ties compiled, all tied": (lambda s, r: metrics.order_ties(np, s, r), lambda: (tied.copy(), rows.copy())),
        "order_ties as array operations, all tied": (_array_order_ties, lambda: (tied.copy(), rows.copy())),
        "users less the centre": (lambda u: u - centre, lambda: (users,)),
    }
    out = {"users": n, "k": k, "dim": args.dim, "ms": {}}
    print(f"{n:,} users x k {k}, dim {args.dim}: median of {args.repeat}")
    for name, (fn, make) in cases.items():
        ms = _median_ms(fn, make, args.repeat)
        out["ms"][name] = round(ms, 2)
        print(f"  {name:45s} {ms:8.1f} ms")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
