"""Helpers of the tests that watch worker processes and a batch job's metrics file."""
from __future__ import annotations

import json
from pathlib import Path

from recall.jobs.batch.outdir import METRICS


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def metrics(out: Path) -> dict:
    """The job's ``_metrics.json`` ({} while it is not written yet, or half written)."""
    try:
        return json.loads((out / METRICS).read_text())
    except (OSError, ValueError):
        return {}
