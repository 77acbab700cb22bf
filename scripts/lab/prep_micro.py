"""Fast mode's float16 copies of the users (``certificate.prepare_users``) on the GPU: where their time goes.

On the H200 the copies of 1M x 64 users took 24 ms of a 0.29 s fast search (synchronised phases,
docs/benchmarks.md), about ten times what their bytes cost. This times, for ``--users`` x ``--dim`` skewed users
against items of the same kind (``--metric``), each call between two synchronisations, median of ``--repeat``:

- ``prepare_users`` as shipped, and with ``--shift`` (the users' shift, as for float16 score tiles);
- the same with the rows' norms taken by a matrix-vector product (``(v * v) @ ones``, cuBLAS) instead of
  ``(v * v).sum(axis=1)`` (CuPy's reduction), with the largest relative difference of every output;
- the row norms alone, both ways, on one block of rows.

Run from the project root on a GPU machine::

    PYTHONPATH=. python3 scripts/lab/prep_micro.py [--users 1000000] [--dim 64] [--json $OUT/prep_micro.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from recall.bench.workloads import generate
from recall.core import certificate, metrics


def timed(fn, repeat):
    import cupy

    fn()
    times = []
    for _ in range(repeat):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        out = fn()
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def gemv_norms(xp, vecs):
    return xp.sqrt((vecs * vecs) @ xp.ones(vecs.shape[1], dtype=vecs.dtype))


def main() -> None:
    import cupy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=1_000_000)
    p.add_argument("--items", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--metric", default="ip")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    users, items = generate("skewed", a.users, a.items, a.dim, seed=0, device="gpu")
    users = metrics.prepare_users(a.metric, cupy, users)
    fast_items = certificate.prepare_items(cupy, metrics.prepare_items(a.metric, cupy, items),
                                           metrics.bias_column(a.metric, a.dim))
    shift = cupy.asarray(users[:, 0], dtype=cupy.float64)
    out = {}
    real = certificate._norms
    for name, norms in (("sum", real), ("gemv", gemv_norms)):
        certificate._norms = norms
        try:
            for label, sh in (("no shift", None), ("shift", shift)):
                t, got = timed(lambda: certificate.prepare_users(cupy, users, fast_items, half_scores=sh is not None,
                                                                 shift=sh), a.repeat)
                out[f"{name}, {label}"] = {"s": t, "result": got}
                print(f"| prepare_users, norms by {name}, {label} | {t * 1e3:.2f} ms |", flush=True)
        finally:
            certificate._norms = real
    for label in ("no shift", "shift"):
        x, y = out[f"sum, {label}"]["result"], out[f"gemv, {label}"]["result"]
        diffs = {}
        for field in ("alpha", "offset", "bound"):
            u, v = getattr(x, field), getattr(y, field)
            diffs[field] = float(cupy.max(cupy.abs(u - v) / cupy.maximum(cupy.abs(u), 1e-300)))
        diffs["vecs16 equal"] = bool((x.vecs16 == y.vecs16).all())
        print(f"| {label}: gemv against sum | {diffs} |", flush=True)
        out[f"diff, {label}"] = diffs
    block = users[: 1 << 17].astype(cupy.float64)
    for name, norms in (("sum", real), ("gemv", gemv_norms)):
        t, _ = timed(lambda: norms(cupy, block), a.repeat)
        print(f"| row norms of 131,072 x {a.dim} float64, by {name} | {t * 1e3:.3f} ms |", flush=True)
        out[f"norms {name}"] = {"s": t}
    if a.json:
        a.json.write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "result"}
                                      for k, v in out.items()}, indent=2, default=str))


if __name__ == "__main__":
    main()
