"""The embedded library's latency: a resident engine answering small batches of users, beside FAISS, cuVS and torch
in the same process, each with its items prepared once (not timed).

Run from the project root on a GPU machine (FAISS and cuVS staged as for ``recall bench``)::

    PYTHONPATH=. python3 scripts/lab/embedded_latency.py [--items 1000000] [--dim 64] [--k 100]
        [--batches 1,32,1024] [--contenders recall,faiss,cuvs,torch] [--variants fused=force] [--host]
        [--json $OUT/latency.json]

For every batch size: 5 warm-up calls, then ``--calls`` timed calls, each a search of the same users (arrays on the
``--device``, or NumPy arrays with ``--host``, as a job's batches come; generated from seed 0 with the items,
clustered) between two synchronisations; the median and the 90th
percentile in milliseconds. Contenders that cannot run are listed with the reason.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import time
from pathlib import Path

from recall.bench import contenders as bench_contenders
from recall.bench.workloads import generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--kind", default="clustered")
    p.add_argument("--batches", default="1,32,1024")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--contenders", default="recall,faiss,cuvs,torch")
    p.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    p.add_argument("--variants", default="",
                   help="comma-separated EngineOptions overrides, each an extra recall contender (fields of one joined "
                        "by +): fused=force,few_user_tiles=False,certified_exact=on+fast_sample=0")
    p.add_argument("--host", action="store_true", help="users as NumPy arrays (a job's batches), not the device's")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    users, items = generate(a.kind, max(batches), a.items, a.dim, seed=0, device=a.device)
    if a.host and hasattr(users, "get"):
        users = users.get()
    rows = []
    print(f"| contender | {' | '.join(f'{b} users: median / p90 ms' for b in batches)} |", flush=True)
    contenders = bench_contenders.build(a.contenders.split(","), a.device, inexact=False)
    # Commas inside parentheses belong to a value: tiles=(2048,8192,16).
    contenders += [_Variant(a.device, v) for v in re.split(r",(?![^()]*\))", a.variants) if v]
    for c in contenders:
        reason = c.unavailable() or c.unsupported(a.k, a.items)
        if reason:
            print(f"| {c.name} | skipped: {reason} |", flush=True)
            rows.append({"contender": c.name, "skipped": reason})
            continue
        c.prepare(items)
        cells = []
        entry = {"contender": c.name, "batches": {}}
        for b in batches:
            q = users[:b]
            for _ in range(5):
                c.search(q, a.k)
            c.sync()
            times = []
            for _ in range(a.calls):
                t0 = time.perf_counter()
                c.search(q, a.k)
                c.sync()
                times.append((time.perf_counter() - t0) * 1e3)
            engine = getattr(c, "_engine", None)
            if engine is not None:  # how this engine searched the batch
                st = engine.stats
                entry.setdefault("stats", {})[b] = {key: st.get(key) for key in ("fused", "tiles", "graph_blocks",
                                                                                 "seed_sample", "precision", "route")}
            times.sort()
            med, p90 = statistics.median(times), times[int(0.9 * (len(times) - 1))]
            cells.append(f"{med:.2f} / {p90:.2f}")
            entry["batches"][b] = {"median_ms": med, "p90_ms": p90}
        c.release()
        print(f"| {c.name} | {' | '.join(cells)} |", flush=True)
        if "stats" in entry:
            print(f"  {c.name}: {entry['stats']}", flush=True)
        rows.append(entry)
    if a.json:
        a.json.write_text(json.dumps({"items": a.items, "dim": a.dim, "k": a.k, "kind": a.kind, "host": a.host,
                                      "rows": rows},
                                     indent=2))


class _Variant(bench_contenders.RecallContender):
    """Exact recall with EngineOptions fields overridden (``name=value``, several joined by "+", each value read as a
    Python literal or a string)."""

    def __init__(self, device: str, spec: str) -> None:
        from recall import EngineOptions

        fields = {}
        for part in spec.split("+"):
            field, _, raw = part.partition("=")
            try:
                fields[field] = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                fields[field] = raw
        super().__init__(device, options=EngineOptions(**fields))
        self.name = f"recall ({spec})"


if __name__ == "__main__":
    main()
