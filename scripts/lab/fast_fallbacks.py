"""How many users fast mode's certificate fails for, on the CPU, emulating the GPU's arithmetic (issue 18).

For each case (data kind x metric x dim) the script runs fast mode's approximate pass the way the backends do
(float16 inputs from ``recall.core.certificate``, float32 accumulation; with ``--half`` also the GPU's float16 score
tiles: float32 result x ``output_scale``, rounded to float16), keeps the k + m + 1 best approximate scores per user,
re-scores the first k + m in float32, and asks ``certificate.certified`` for each user. It prints the fallback
fraction per case, for CPU scores (float32 tiles) and GPU scores (float16 tiles), and writes JSON.

Usage, from the project root::

    PYTHONPATH=. python scripts/lab/fast_fallbacks.py --users 20000 --items 200000 --out bench-out/fast-fallbacks.json
    PYTHONPATH=. python scripts/lab/fast_fallbacks.py --cases l2:normal:64 l2:lognormal:64 ip:lognormal:256

``--no-per-item`` and ``--no-shift`` take those parts of the certificate out, to measure what each does.

A case is ``metric:kind:dim``; kinds are ``recall.bench.workloads`` kinds or specs (``normal:item_sigma=0.5``), plus
``lognormal`` (normal directions, log-normal item norms, sigma 0.5: ``normal:item_sigma=0.5``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_CASES = ("ip:normal:64", "ip:lognormal:64", "ip:clustered:64", "ip:skewed:64", "l2:normal:64",
                 "l2:lognormal:64", "cosine:normal:64", "ip:lognormal:256", "ip:normal:256", "cosine:skewed:256",
                 "l2:clustered:128", "ip:ties:64")
ALIASES = {"lognormal": "normal:item_sigma=0.5"}


def emulate(users: np.ndarray, items: np.ndarray, metric: str, k: int, block: int = 256, shifts: bool = True) -> dict:
    """Fallback counts of fast mode's certificate for prepared users against prepared items, CPU and GPU scores:
    after the first pass, and (new interface) after the widened retry of the users whose first certificate failed."""
    from recall.core import certificate, metrics

    prep_items = metrics.prepare_items(metric, np, items)
    prep_users = metrics.prepare_users(metric, np, users)
    n_users, n_items = prep_users.shape[0], prep_items.shape[0]
    m = certificate.margin(k)
    fast = _Fast(certificate, prep_items, metrics.bias_column(metric, users.shape[1]))
    width = fast.items_f32.shape[1]
    g = np.float32(certificate.output_scale(width))
    sample = None
    if fast.new:
        from recall.engine import fast as fast_mode

        sample = prep_items[fast_mode.shift_rows(n_items, min(k + m + 1, n_items))]
    first = {False: 0, True: 0}
    final = {False: 0, True: 0}

    def one_pass(u, n_keep, half, shift=None):
        u16, ctx = fast.users(u, half, shift)
        raw = u16.astype(np.float32) @ fast.items_f32.T
        if half:
            raw = (raw * g).astype(np.float16).astype(np.float32)
        part = np.argpartition(-raw, n_keep, axis=1)[:, :n_keep + 1]
        vals = np.take_along_axis(raw, part, axis=1)
        order = np.argsort(-vals, axis=1, kind="stable")
        part, vals = np.take_along_axis(part, order, axis=1), np.take_along_axis(vals, order, axis=1)
        exact = np.einsum("ij,ikj->ik", u, prep_items[part[:, :n_keep]])  # float32, as the re-scoring
        kth = -np.partition(-exact, k - 1, axis=1)[:, k - 1]
        return kth, fast.certified(kth.astype(np.float32), vals[:, n_keep], ctx, half)

    for start in range(0, n_users, block):
        u = prep_users[start:start + block]
        for half in (False, True):
            # Float16 tiles: the engine shifts each user's scores by its best over a sample of items (fast.py).
            kth, ok = one_pass(u, k + m, half, (u @ sample.T).max(axis=1).astype(np.float64)
                               if half and sample is not None and shifts else None)
            first[half] += int((~ok).sum())
            failed = np.flatnonzero(~ok)
            if failed.size and fast.new and k + 4 * m < n_items:
                _, ok2 = one_pass(u[failed], k + 4 * m, half, kth[failed].astype(np.float64) if shifts else None)
                failed = failed[~ok2]
            final[half] += failed.size
    return {"users": n_users, "items": n_items, "k": k, "width": width,
            "first_fallback_cpu": first[False] / n_users, "first_fallback_gpu": first[True] / n_users,
            "fallback_cpu": final[False] / n_users, "fallback_gpu": final[True] / n_users}


class _Fast:
    """The certificate module's calls, whatever version of its interface this checkout has (the "before" numbers
    of issue 18 were taken with the interface of before it, which had no widened retry)."""

    def __init__(self, certificate, prep_items, bias_col):
        self.c = certificate
        self.new = hasattr(certificate, "FastUsers")
        if self.new:
            self.items = certificate.prepare_items(np, prep_items, bias_col)
        else:
            self.items = certificate.prepare_items(np, prep_items)
        self.items_f32 = self.items.vecs16.astype(np.float32)

    def users(self, u, half, shift=None):
        if self.new:
            fu = self.c.prepare_users(np, u, self.items, half_scores=half, shift=shift)
            return fu.vecs16, fu
        u16, alpha, bound = self.c.prepare_users(np, u, self.items, half_scores=half)
        return u16, (alpha, bound)

    def certified(self, kth, outside, ctx, half):
        if self.new:
            return self.c.certified(np, kth, outside, ctx, self.items)
        alpha, bound = ctx
        if half:
            outside = outside / np.float32(self.c.output_scale(self.items.vecs16.shape[1]))
        return self.c.certified(np, kth, outside, alpha, self.items.scale, bound)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=20_000)
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES), help="metric:kind:dim")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--no-per-item", action="store_true",
                        help="ablation: per-item bound columns only where a bias forces them (l2)")
    parser.add_argument("--no-shift", action="store_true", help="ablation: no shifted scores")
    args = parser.parse_args(argv)
    if args.no_per_item:
        from recall.core import certificate

        certificate._NORM_SPREAD = float("inf")

    from recall.bench import workloads

    results = []
    for case in args.cases:
        metric, rest = case.split(":", 1)
        kind, dim = rest.rsplit(":", 1)
        wall = time.perf_counter()
        users, items = workloads.generate(ALIASES.get(kind, kind), args.users, args.items, int(dim), seed=args.seed)
        res = {"case": case, **emulate(users, items, metric, args.k, shifts=not args.no_shift)}
        res["wall_s"] = round(time.perf_counter() - wall, 1)
        results.append(res)
        print(f"{case:20s} fallback cpu {res['fallback_cpu']:8.3%} (first pass {res['first_fallback_cpu']:8.3%})  "
              f"gpu {res['fallback_gpu']:8.3%} (first pass {res['first_fallback_gpu']:8.3%})  width {res['width']}  "
              f"({res['wall_s']} s)", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
