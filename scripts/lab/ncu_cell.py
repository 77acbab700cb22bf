"""One cell of ``kernel_profile.CELLS`` (or ``GRID:INDEX``) searched twice, graphs off, for Nsight Compute to pick
launches from: a warm-up search and one more. A measurement aid, no timing of its own.

Run from the project root on a GPU machine whose ncu reads the counters (KINDS.md: Firecracker machines), e.g. one
launch each of the float16 kernel, its merge and the threshold select from the second search of a cell whose 49 user
blocks make 98 + 98 + 49 such launches a search::

    PYTHONPATH=. ncu --clock-control none -k regex:'recall_fused_filter_w|recall_merge_fused_h|seed' \\
        --launch-skip 250 --launch-count 4 --set full python3 scripts/lab/ncu_cell.py uh-l2-k2048
"""
from __future__ import annotations

import sys
from pathlib import Path

import cupy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_profile import cell_spec  # noqa: E402

from recall import Engine  # noqa: E402
from recall.bench.workloads import generate  # noqa: E402
from recall.core.options import EngineOptions  # noqa: E402


def main() -> None:
    kind, n_users, n_items, dim, k, metric, _ = cell_spec(sys.argv[1])
    users, items = generate(kind, n_users, n_items, dim, seed=0, device="gpu")
    engine = Engine(items, metric=metric, device="gpu", options=EngineOptions(cuda_graphs=False))
    for _ in range(2):
        engine.search(users, k)
        cupy.cuda.Device().synchronize()
    print(engine.stats.get("route"), engine.stats.get("tiles"), engine.stats.get("seed_estimate"))


if __name__ == "__main__":
    main()
