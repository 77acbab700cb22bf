"""Audit of ``recall batch``'s crash, signal and published-state guarantees (docs/batch.md, docs/errors.md): each test
failed before the fix it names."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_batch import K, _run, _write_job

from recall.backends.placement import WorkerSlot
from recall.core.errors import InputError
from recall.jobs.batch import METRICS, SUCCESS, BatchProgress
from recall.jobs.batch.outdir import MANIFEST
from recall.jobs.executors.local import start_worker, stop_workers


@pytest.fixture
def job(tmp_path: Path) -> dict:
    return _write_job(tmp_path)


def _sigint_at_birth(name: str, spec: object, device: str, cores: object, conn, parent_pid: int) -> None:
    """A worker that gets SIGINT before it sets its own signal handlers, as a Ctrl-C at the terminal (sent to the
    whole process group) reaches one that is still importing; then says whether it lived through it."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    conn.send("alive")


def test_a_ctrl_c_while_a_worker_starts_does_not_reach_it() -> None:
    """Ctrl-C during the second or so a spawned worker spends importing printed its KeyboardInterrupt traceback on
    the job's stderr beside the one ``error: interrupted by SIGINT`` line: a worker must be born deaf to SIGINT (the
    parent stops it)."""
    proc, chan = start_worker(mp.get_context("spawn"), WorkerSlot("cpu0", "cpu"), _sigint_at_birth, "audit", None)
    try:
        assert chan.recv(timeout=60) == "alive"
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        stop_workers([(proc, chan)])


def test_a_rerun_that_writes_the_missing_success_marks_the_metrics_succeeded(job: dict, tmp_path: Path) -> None:
    """A run stopped after its last shard was recorded but before ``_SUCCESS`` (kill -9, SIGTERM) leaves
    ``_metrics.json`` at ``running`` or ``failed``; the rerun finds nothing to do and writes ``_SUCCESS``: the metrics
    beside it said the job was still running, or had failed."""

    class StopAtTheLast(BatchProgress):
        def shard_done(self, done: int, total: int) -> None:
            if done == total:
                raise KeyboardInterrupt  # as SIGTERM there

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        _run(job, out, progress=StopAtTheLast())
    assert not (out / SUCCESS).exists() and _status(out) == "failed"
    summary = _run(job, out)
    assert summary.shards_scored == 0 and (out / SUCCESS).exists()
    metrics = json.loads((out / METRICS).read_text())
    assert metrics["job"]["status"] == "succeeded" and "error" not in metrics["job"]
    assert len(metrics["shards"]) == len(job["shards"])


def _status(out: Path) -> str:
    return json.loads((out / METRICS).read_text())["job"]["status"]


def test_a_run_with_no_shard_to_score_does_not_read_the_exclusions(job: dict, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent read and mapped the whole exclusions file (billions of pairs at night: minutes, gigabytes) from the
    moment it took the lock, before it knew whether anything was to be scored: a rerun with nothing to do, and a
    refused one (another job in --out), paid for it, and a SIGTERM meanwhile waited for the read to end."""
    from recall.jobs.batch import exclusions as batch_exclusions

    excl = tmp_path / "excl.parquet"
    pq.write_table(pa.table({"user_id": pa.array(job["user_ids"][:30]), "item_id": pa.array(job["item_ids"][:30])}),
                   excl)
    out = tmp_path / "out"
    _run(job, out, exclude=excl)
    reads: list[str] = []
    read = batch_exclusions.ExclusionIndex.read.__func__

    def counted(cls, path, *args):
        reads.append(path)
        return read(cls, path, *args)

    monkeypatch.setattr(batch_exclusions.ExclusionIndex, "read", classmethod(counted))
    assert _run(job, out, exclude=excl).shards_scored == 0
    with pytest.raises(InputError, match="holds the output of a different job"):
        _run(job, out, exclude=excl, k=K + 1)
    assert reads == []
    (out / job["shards"][0][0].name).unlink()  # a shard to score again: the file is read, once
    assert _run(job, out, exclude=excl).shards_scored == 1 and reads == [str(excl)]


def test_overwrite_removes_the_output_of_a_shard_the_manifest_lists_only_under_the_job(job: dict,
                                                                                        tmp_path: Path) -> None:
    """A kill between an output's rename and the manifest's update leaves the output listed under the job's shards
    only; its shard then dropped, ``--overwrite`` called that output "not written by recall batch", left it in the
    dataset and wrote ``_SUCCESS`` beside it."""
    out = tmp_path / "out"
    _run(job, out)
    last = job["shards"][-1][0].name
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["outputs"][last]
    (out / MANIFEST).write_text(json.dumps(manifest))
    (out / SUCCESS).unlink()
    job["shards"][-1][0].unlink()
    notices: list[str] = []
    _run(job, out, overwrite=True, notice=notices.append)
    assert not (out / last).exists() and (out / SUCCESS).exists()
    assert not any("did not write" in n for n in notices)


@pytest.mark.parametrize("edit", ["bytes", "outputs", "shards", "sha256"])
def test_an_edited_manifest_is_refused_naming_it(job: dict, tmp_path: Path, edit: str) -> None:
    """A manifest edited into another shape (an output without its size, outputs or shards as lists) crashed the
    rerun with a TypeError or AttributeError traceback and exit 1, whose advice is to rerun."""
    out = tmp_path / "out"
    _run(job, out)
    manifest = json.loads((out / MANIFEST).read_text())
    first = job["shards"][0][0].name
    if edit == "bytes":
        del manifest["outputs"][first]["bytes"]
    elif edit == "sha256":
        manifest["outputs"][first]["sha256"] = 7
    elif edit == "outputs":
        manifest["outputs"] = []
    else:
        manifest["job"]["shards"] = list(manifest["job"]["shards"])
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=r"_manifest\.json: cannot be read as a recall batch manifest.*--overwrite"):
        _run(job, out)
    assert _run(job, out, overwrite=True).shards_scored == len(job["shards"])


def test_the_metrics_describe_every_shard_the_manifest_keeps(job: dict, tmp_path: Path) -> None:
    """A shard recorded in the manifest but not in ``_metrics.json`` (a kill between the two writes; a metrics file
    removed or damaged) was left out of the rerun's metrics; a finished job whose metrics were removed got none."""
    out = tmp_path / "out"
    _run(job, out)
    names = sorted(p.name for p, _, _ in job["shards"])
    (out / METRICS).unlink()
    assert _run(job, out).shards_scored == 0
    metrics = json.loads((out / METRICS).read_text())
    assert sorted(metrics["shards"]) == names and metrics["job"]["status"] == "succeeded"
    assert all(e["metrics_lost"] and e["rows"] == n for (p, _, n), e in
               zip(sorted(job["shards"]), (metrics["shards"][nm] for nm in names)))
    (out / METRICS).write_text("{not json")
    (out / names[0]).unlink()  # one shard to score again, the others kept
    assert _run(job, out).shards_scored == 1
    metrics = json.loads((out / METRICS).read_text())
    assert sorted(metrics["shards"]) == names
    assert metrics["shards"][names[1]]["earlier_run"] and metrics["shards"][names[1]]["metrics_lost"]
    assert "earlier_run" not in metrics["shards"][names[0]]


@pytest.mark.parametrize("change", ["dimension", "id_type", "folder"])
def test_shards_refused_as_a_whole_withdraw_the_outputs_of_those_that_changed(job: dict, tmp_path: Path,
                                                                              change: str) -> None:
    """Shards regenerated in place and then refused as a whole (every shard of another dimension than the items, a
    shard of string ids among integer ones, a shard that became a folder) left their outputs, computed from vectors
    that are gone, and ``_SUCCESS`` in --out: a reader took yesterday's candidates of today's users. The one shard
    changed alone was already withdrawn (its output removed before it is scored again)."""
    from parquet_data import write_embeddings

    out = tmp_path / "out"
    _run(job, out)
    names = [p.name for p, _, _ in job["shards"]]
    first, start, n = job["shards"][0]
    if change == "dimension":
        for path, s0, m in job["shards"]:
            write_embeddings(path, job["user_ids"][s0:s0 + m], np.ones((m, 3), np.float32))
        changed = names
    elif change == "id_type":
        write_embeddings(first, [f"u{i}" for i in job["user_ids"][start:start + n]], job["user_vecs"][start:start + n],
                         id_array=pa.array([f"u{i}" for i in job["user_ids"][start:start + n]], pa.string()))
        changed = names[:1]
    else:
        first.unlink()
        first.mkdir()
        (first / "part-0.parquet").write_bytes(b"")
        changed = names[:1]
    notices: list[str] = []
    with pytest.raises(InputError):
        _run(job, out, notice=notices.append)
    assert not (out / SUCCESS).exists()
    assert sorted(p.name for p in out.glob("*.parquet")) == sorted(set(names) - set(changed))
    assert len([m for m in notices if "its output is removed" in m]) == len(changed)


def test_a_shard_that_became_unreadable_is_not_reported_as_empty(job: dict, tmp_path: Path) -> None:
    """A shard overwritten with bytes that are not Parquet was reported as having changed from its 400 rows to
    "rows 400 -> 0": the shard was not read, its rows are not known."""
    out = tmp_path / "out"
    _run(job, out)
    first, _, n = job["shards"][0]
    first.write_bytes(b"not parquet at all")
    notices: list[str] = []
    with pytest.raises(InputError):
        _run(job, out, notice=notices.append)
    said = [m for m in notices if "the shard changed" in m]
    assert len(said) == 1 and f"rows {n:,} -> ?" in said[0] and "-> 0" not in said[0], notices
    assert "cannot be scored" in said[0] and "scored again" not in said[0]
    assert not (out / first.name).exists() and not (out / SUCCESS).exists()
