"""Helpers of the tests that watch worker processes and a batch job's metrics file."""
from __future__ import annotations

import json
import os
import subprocess
import sys
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


def python_code(code: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -c code`` with this checkout first on the path: its exit status, stdout and stderr."""
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout,
                          check=False)


def paced(args: list[str], repo: Path, tests: Path) -> subprocess.Popen:
    """``recall ARGS`` in a child process, slowed between batches (``tests/pacing.py``), its output captured."""
    env = {**os.environ, "PYTHONPATH": f"{repo}:{tests}"}
    return subprocess.Popen([sys.executable, "-m", "pacing", *args], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def tracker_registrations(monkeypatch) -> list[tuple[str, str]]:
    """What this process registers with multiprocessing's resource tracker from now on (named semaphores, shared
    memory): each one a job stopped by a signal has not given back is reported on stderr by the tracker, after the
    job's own last line."""
    import multiprocessing.resource_tracker as tracker

    seen: list[tuple[str, str]] = []
    register = tracker.register

    def spy(name: str, rtype: str) -> None:
        seen.append((name, rtype))
        register(name, rtype)

    monkeypatch.setattr(tracker, "register", spy)
    return seen
