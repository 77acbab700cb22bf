"""The CPU claim of issue 2: recall's CPU backend against faiss-cpu ``IndexFlatIP`` on ``cpu-small``.

20,000 users x 100,000 items x 64, k = 100: the same seeded data for both, one warm-up then the median of
``--repeat`` runs each, recall@k of both checked against the float64 oracle on 1,000 sampled users. Prints a table and
writes results.json / results.md / throughput.png (``--out``, default ``bench-out/cpu``). It is a thin wrapper over
``recall bench --workload cpu-small --device cpu --contenders recall,faiss``.

Usage, from the project root::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=. python scripts/bench_cpu.py [--repeat 5] [--kind normal]

When timing against NumPy (the engine's CPU backend multiplies through NumPy's OpenBLAS), unset OPENBLAS_CORETYPE
and OPENBLAS_L2_SIZE for that command only, as above: a development machine may set them for its own reasons, and
they change which BLAS kernel NumPy uses, so the engine's time would reflect them rather than the library as a user
gets it. The environment recorded in results.json lists any OPENBLAS_* variables that were set.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per contender (median reported)")
    parser.add_argument("--kind", default=None, choices=["normal", "clustered", "adversarial", "ties"],
                        help="data kind (default: the workload's, normal)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-users", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=Path("bench-out/cpu"))
    args = parser.parse_args(argv)

    from recall.bench import report, runner, workloads
    from recall import InputError

    console = report.make_console()
    set_vars = [k for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ]
    if set_vars:
        console.print(f"note: {', '.join(set_vars)} set; see this script's docstring", style="yellow")
    try:
        w = workloads.get("cpu-small").with_kind(args.kind)
        settings = runner.Settings([w], device="cpu", families=["recall", "faiss"], repeat=args.repeat,
                                   seed=args.seed, sample_users=args.sample_users)
        doc = runner.run(settings, log=lambda m: console.print(m, style="dim", highlight=False),
                         argv=["python", "scripts/bench_cpu.py", *(sys.argv[1:] if argv is None else argv)])
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report.print_table(doc, console)
    for name, what in report.write(doc, args.out).items():
        console.print(f"{name}: {what}", style="dim", highlight=False)
    bad = runner.problems(doc)
    for line in bad:
        print(f"problem: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
