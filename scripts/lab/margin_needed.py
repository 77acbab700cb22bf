"""How many candidates fast mode's first pass would need to certify a cell's users (``recall.engine.fast``'s
WIDE_FIRST), from the float64 scores of a sample of users against every item, on the CPU.

A model of the certificate (``recall.core.certificate``): a user is counted certified at a first pass of w candidates
where its exact k-th score beats its w-th by more than its bound (``FastUsers.bound``: E_u through the items' maxima,
or R_u where the items carry per-item bound columns, which this model then leaves out); "float16 tiles" adds the
stored scores' rounding, 2^-9 of the w-th score's distance to the user's shift (the sampled best over
``fast.shift_rows``' items, as the first pass shifts; or the exact k-th, as the widened pass does). The float16
pass's own choice of which w items it keeps is not modelled. Prints a table, writes JSON.

    PYTHONPATH=. python3 scripts/lab/margin_needed.py --kind skewed --dim 768 --items 1000000 --metric cosine \
        --k 100 --users 200 [--json margins.json]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from recall.bench.workloads import generate
from recall.core import certificate, metrics
from recall.engine import fast


def measure(kind: str, n_users: int, n_items: int, dim: int, metric: str, k: int, seed: int) -> dict:
    users, items = generate(kind, n_users, n_items, dim, seed=seed)
    items = metrics.prepare_items(metric, np, np.asarray(items, np.float32))
    users = metrics.prepare_users(metric, np, np.asarray(users, np.float32))
    fast_items = certificate.prepare_items(np, items, metrics.bias_column(metric, dim))
    bound = certificate.prepare_users(np, users, fast_items).bound
    scores = -np.sort(-(users.astype(np.float64) @ items.astype(np.float64).T), axis=1)
    kth = scores[:, k - 1]
    m = certificate.margin(k)
    sample = fast.shift_rows(n_items, min(k + m + 1, n_items))  # the items the first pass's shift is taken over
    sampled_best = (users.astype(np.float64) @ items[sample].astype(np.float64).T).max(axis=1)
    rows = []
    for mult in (1, 2, fast.WIDEN, 2 * fast.WIDEN):
        w = min(k + mult * m + 1, n_items)
        gap = kth - scores[:, w - 1]
        tiles = 2.0 ** -9 * np.abs(scores[:, w - 1] - sampled_best), 2.0 ** -9 * np.abs(scores[:, w - 1] - kth)
        rows.append({"margin": mult * m, "candidates": w, "gap_median": float(np.median(gap)),
                     "certified_f32_tiles": float((gap > bound).mean()),
                     "certified_f16_tiles_sampled_shift": float((gap > bound + tiles[0]).mean()),
                     "certified_f16_tiles_kth_shift": float((gap > bound + tiles[1]).mean())})
    return {"cell": {"kind": kind, "users": n_users, "items": n_items, "dim": dim, "metric": metric, "k": k,
                     "seed": seed},
            "per_item_bounds": fast_items.norms_at is not None, "bound_median": float(np.median(bound)),
            "kth_median": float(np.median(kth)), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="skewed")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--metric", default="cosine")
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    out = measure(args.kind, args.users, args.items, args.dim, args.metric, args.k, args.seed)
    print(f"{out['cell']}: bound median {out['bound_median']:.3g} (per-item bounds: {out['per_item_bounds']}), "
          f"k-th score median {out['kth_median']:.4g}")
    print(f"{'margin':>7} {'candidates':>10} {'gap median':>11} {'f32 tiles':>10} {'f16 sampled':>12} {'f16 k-th':>9}")
    for r in out["rows"]:
        print(f"{r['margin']:>7} {r['candidates']:>10} {r['gap_median']:>11.3g} {r['certified_f32_tiles']:>10.1%} "
              f"{r['certified_f16_tiles_sampled_shift']:>12.1%} {r['certified_f16_tiles_kth_shift']:>9.1%}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
