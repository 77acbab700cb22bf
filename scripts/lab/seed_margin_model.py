"""How far the threshold sample's margin moves fast mode's estimated starts, on the CPU: users and items of the
bench's data kinds made into float16 rows as fast mode makes them (``certificate.prepare_items`` / ``prepare_users``,
unshifted, as the fused passes' users are; ``--shifted``: shifted where they hold bound or bias columns, the rule for
float32 scores until 2026-12-04), float32 products standing in for the tensor cores' sums, each sampled score lowered
by ``A·P + R·|s| + Z`` (``certificate.seed_margin``) for four choices of P >= Σ|u_i v_i|, and the estimate's rank
(``selection.estimate_rank``) taken: the items above each user's start, the median and 99th percentile over the
users, and the share of users left with fewer than k + m + 1 (short).

    whole norms      P = |u|·|v|, the rows' whole norms (recall_seed before 2026-12-02 21:3x)
    constant column  P = |u'|·|v'| + |u_s|·2^15, the shift column's product on its own (until 2026-12-05)
    bias columns     the same, l2's bias columns also on their own: + max|u_b|·Σ|v_b| (Hölder; as shipped)
    |products|       P = Σ|u_i v_i| itself, the tightest any bound can be

Run from the project root (a few seconds)::

    PYTHONPATH=. python3 scripts/lab/seed_margin_model.py [--users 300]
"""
from __future__ import annotations

import argparse

import numpy as np

from recall.backends.cupy.selection import estimate_rank
from recall.backends.tiled import sample_rows
from recall.bench.workloads import generate
from recall.core import certificate, metrics

# (kind, items, dim, k, metric, sample size: the GPU's seed_size for a block of 4,096 users)
CELLS = [("popular", 100_000, 32, 2048, "l2", 16384), ("popular", 100_000, 32, 1000, "l2", 16384),
         ("skewed", 100_000, 64, 2048, "l2", 32768),
         ("popular", 100_000, 64, 1000, "cosine", 16384), ("clustered", 100_000, 128, 1000, "l2", 16384),
         ("skewed", 100_000, 64, 1000, "ip", 16384)]


def cell(kind: str, n_users: int, n_items: int, dim: int, k: int, metric: str, size: int, shifted: bool) -> None:
    users, items = generate(kind, n_users, n_items, dim, seed=0)
    pi = metrics.prepare_items(metric, np, items).astype(np.float32)
    pu = metrics.prepare_users(metric, np, users).astype(np.float32)
    fi = certificate.prepare_items(np, pi, metrics.bias_column(metric, dim))
    head = pi[np.arange(1024) * n_items // 1024]
    # Shifted where users held bound or bias columns (the product's rule for float32 scores until 2026-12-04).
    held = shifted and (fi.bias_at is not None or (fi.norms_at is not None and fi.max_resid > 0))
    shift = (pu.astype(np.float64) @ head.T.astype(np.float64)).max(axis=1) if held else None
    fu = certificate.prepare_users(np, pu, fi, half_scores=False, shift=shift)
    u16, v16 = fu.vecs16.astype(np.float64), fi.vecs16.astype(np.float64)
    t = (fu.vecs16.astype(np.float32) @ fi.vecs16.astype(np.float32).T)
    wide = k + certificate.margin(k) + 1
    rows = sample_rows(np, n_items, size)
    s = t[:, rows].astype(np.float64)
    a, r, z = certificate.seed_margin(u16.shape[1], True, False)
    col = fi.shift_at
    rest = [c for c in range(u16.shape[1]) if c != col]
    shift = np.abs(u16[:, col])[:, None] * 2.0 ** 15
    lo, hi = fi.bias_columns or (0, 0)
    dots = [c for c in rest if not lo <= c < hi]
    bounds = {
        "whole norms": np.linalg.norm(u16, axis=1)[:, None] * np.linalg.norm(v16[rows], axis=1)[None, :],
        "constant column": (np.linalg.norm(u16[:, rest], axis=1)[:, None] * np.linalg.norm(v16[rows][:, rest], axis=1)
                            + shift),
        "bias columns": (np.linalg.norm(u16[:, dots], axis=1)[:, None] * np.linalg.norm(v16[rows][:, dots], axis=1)
                         + np.abs(u16[:, lo:hi]).max(axis=1, initial=0.0)[:, None]
                         * np.abs(v16[rows][:, lo:hi]).sum(axis=1)[None, :] + shift),
        "|products|": np.abs(u16) @ np.abs(v16[rows]).T,
    }
    ke = estimate_rank(wide, size, n_items)
    parts = []
    for name, p in bounds.items():
        low = s - (a * p + r * np.abs(s) + z)
        start = -np.sort(-low, axis=1)[:, ke - 1]
        above = (t > start[:, None]).sum(axis=1)
        parts.append(f"{name} {np.median(above):.0f} / {np.percentile(above, 99):.0f}, short "
                     f"{float((above < wide).mean()):.3f}")
    print(f"| {kind} {metric} d{dim} k{k}, {n_items:,} items, sample {size:,}, KE {ke}, k + m + 1 = {wide} | "
          + " | ".join(parts) + " |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=300)
    p.add_argument("--shifted", action="store_true", help="users shifted where they hold bound or bias columns")
    a = p.parse_args()
    print("| cell | " + " | ".join(f"{n}: items above the start, median / p99" for n in
                                     ("whole norms", "constant column", "bias columns", "|products|")) + " |")
    for kind, n_items, dim, k, metric, size in CELLS:
        cell(kind, a.users, n_items, dim, k, metric, size, a.shifted)


if __name__ == "__main__":
    main()
