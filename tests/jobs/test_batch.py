"""``recall batch`` (recall/jobs/batch, recall/cli/batch.py): outputs, manifest, resume after kill -9, idempotence,
refusals, verification of outputs, uneven and empty shards, globs, exclusions, bad inputs, the nightly script.

Small-integer vectors make every score exact in float32 whatever the summation order, so outputs can be compared
byte for byte across batch sizes and with ``recall score``, and against a float64 oracle exactly.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from parquet_data import int_data, oracle_topk, write_embeddings
from processes import paced
from recall.io import atomic
from recall.io.atomic import sha256_file
from recall.jobs.batch import LOCK, MANIFEST, METRICS, SUCCESS, BatchProgress, row_group_rows, run_batch
from recall.jobs.batch.shards import discover_shards
from recall.cli.app import app
from recall.core.errors import BackendUnavailable, InputError
from recall.jobs import score_files

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
SIZES = (130, 7, 0, 260, 45)  # uneven, one empty
DIM, N_ITEMS, K = 6, 90, 5
runner = CliRunner()


def _write_job(root: Path, sizes: tuple[int, ...] = SIZES, seed: int = 0, string_ids: bool = False) -> dict:
    users, items = int_data(sum(sizes), N_ITEMS, DIM, seed=seed)
    user_ids = np.arange(sum(sizes)) * 3 + 11
    item_ids = 5000 + np.arange(N_ITEMS)[::-1]
    if string_ids:
        user_ids = np.array([f"u{i}" for i in user_ids], dtype=object)
        item_ids = np.array([f"i{i}" for i in item_ids], dtype=object)
    (root / "users").mkdir(parents=True)
    start, shards = 0, []
    for i, n in enumerate(sizes):
        path = root / "users" / f"part-{i:03d}.parquet"
        ids = user_ids[start:start + n]
        write_embeddings(path, ids.tolist() if string_ids else ids, users[start:start + n].reshape(n, DIM),
                         row_group_size=40, id_array=pa.array(ids.tolist(), pa.string()) if string_ids else None)
        shards.append((path, start, n))
        start += n
    write_embeddings(root / "items.parquet", item_ids.tolist() if string_ids else item_ids, items,
                     id_array=pa.array(item_ids.tolist(), pa.string()) if string_ids else None)
    return {"root": root, "users": root / "users", "items": root / "items.parquet", "user_vecs": users,
            "item_vecs": items, "user_ids": user_ids, "item_ids": item_ids, "shards": shards}


@pytest.fixture
def job(tmp_path: Path) -> dict:
    return _write_job(tmp_path)


def _run(job: dict, out: Path, **kw) -> object:
    kw.setdefault("device", "cpu")
    kw.setdefault("batch_size", 32)
    return run_batch(job["users"], job["items"], out, kw.pop("k", K), **kw)


def _snapshot(out: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of an output directory but the lock (which holds the pid of the last run): (bytes, mtime_ns)."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.iterdir()) if p.name != LOCK}


def _outputs(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.parquet"))}


def _cli(job: dict, out: Path, *extra: str, k: int = K) -> list[str]:
    return ["batch", "--users", str(job["users"]), "--items", str(job["items"]), "--k", str(k), "--out", str(out),
            "--device", "cpu", "--batch-size", "32", *extra]


# ---- outputs, manifest, metrics ------------------------------------------------------------------------------------

def test_outputs_are_exact_and_match_recall_score(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    summary = _run(job, out)
    assert summary.shards_total == summary.shards_scored == len(SIZES) and summary.shards_skipped == 0
    assert summary.users_scored == sum(SIZES) and summary.workers == 1
    for path, start, n in job["shards"]:
        table = pq.read_table(out / path.name)
        assert table.schema.names == ["user_id", "item_ids", "scores"] and table.num_rows == n
        rows, scores = oracle_topk(job["user_vecs"][start:start + n], job["item_vecs"], K)
        assert table.column("user_id").to_pylist() == job["user_ids"][start:start + n].tolist()
        assert table.column("item_ids").to_pylist() == [job["item_ids"][r].tolist() for r in rows]
        assert table.column("scores").to_pylist() == [s.astype(np.float32).tolist() for s in scores]
        # Same schema and content as `recall score` on that shard.
        single = tmp_path / f"single-{path.name}"
        score_files(path, job["items"], single, K, device="cpu", allow_empty=True)
        assert pq.read_table(single).equals(table)
    assert (out / SUCCESS).exists() and (out / SUCCESS).stat().st_size == 0
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    # The directory reads as one dataset: bookkeeping files start with "_" or ".", which readers skip.
    assert pq.read_table(out).num_rows == sum(SIZES)


def test_manifest_and_metrics(job: dict, tmp_path: Path) -> None:
    content_hash = atomic.content_hash
    out = tmp_path / "out"
    _run(job, out)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["format"] == "recall-batch/2"
    assert manifest["job"]["k"] == K and manifest["job"]["metric"] == "ip"
    assert manifest["job"]["items"]["xxh3_128"] == content_hash(job["items"])
    assert manifest["job"]["items"]["size"] == job["items"].stat().st_size
    assert manifest["shards_total"] == manifest["shards_done"] == len(SIZES)
    for path, _, n in job["shards"]:
        entry = manifest["outputs"][path.name]
        assert entry["rows"] == n and manifest["job"]["shards"][path.name]["rows"] == n
        assert manifest["job"]["shards"][path.name]["xxh3_128"] == content_hash(path)
        assert entry["sha256"] == sha256_file(out / path.name) and entry["bytes"] == (out / path.name).stat().st_size
        assert entry["device"] == "cpu" and entry["batch_size"] == 32
    metrics = json.loads((out / METRICS).read_text())
    assert metrics["job"]["status"] == "succeeded" and metrics["job"]["users_scored"] == sum(SIZES)
    assert metrics["job"]["shards_scored"] == len(SIZES) and metrics["job"]["users_per_s"] > 0
    assert len(metrics["workers"]) == 1 and metrics["workers"][0]["items_load_s"] >= 0
    for path, _, n in job["shards"]:
        shard = metrics["shards"][path.name]
        assert shard["rows"] == n and shard["seconds"] > 0 and "users_per_s" in shard and "search_s" in shard


def test_bytes_do_not_depend_on_batch_size(job: dict, tmp_path: Path) -> None:
    _run(job, tmp_path / "a", batch_size=7)
    _run(job, tmp_path / "b", batch_size=1000)
    assert _outputs(tmp_path / "a") == _outputs(tmp_path / "b")


def test_row_groups_are_fixed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert row_group_rows(K) == 65_536 and row_group_rows(100_000) == 1024 and row_group_rows(1000) == 5584
    monkeypatch.setattr("recall.jobs.batch.worker.row_group_rows", lambda k: 1000)
    job = _write_job(tmp_path, sizes=(2500,))
    for batch_size in (333, 4096):
        _run(job, tmp_path / f"out{batch_size}", batch_size=batch_size)
    meta = pq.ParquetFile(tmp_path / "out333" / "part-000.parquet").metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [1000, 1000, 500]
    assert set(meta.metadata) == {b"ARROW:schema"}  # nothing run-dependent (no timestamps) in the footer
    assert _outputs(tmp_path / "out333") == _outputs(tmp_path / "out4096")


# ---- resume and idempotence ----------------------------------------------------------------------------------------

def test_second_run_does_nothing(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run(job, out)
    before = _snapshot(out)
    summary = _run(job, out, batch_size=50)  # another batch size: still the same job
    assert summary.shards_scored == 0 and summary.shards_skipped == len(SIZES)
    assert "nothing to do" in summary.line()
    assert _snapshot(out) == before  # not one byte or mtime changed


def test_corrupted_and_truncated_outputs_are_redone(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run(job, out)
    reference = _outputs(out)
    first, second, third = (job["shards"][i][0].name for i in (0, 3, 4))
    data = bytearray((out / first).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different content: only the sha256 can tell
    (out / first).write_bytes(bytes(data))
    (out / second).write_bytes(reference[second][:100])  # truncated
    (out / third).unlink()
    notices: list[str] = []
    summary = _run(job, out, notice=notices.append)
    assert summary.shards_scored == 3 and summary.shards_skipped == len(SIZES) - 3
    assert any(first in n and "sha256" in n for n in notices)
    assert any(second in n and "bytes" in n for n in notices)
    assert any(third in n and "missing" in n for n in notices)
    assert _outputs(out) == reference and (out / SUCCESS).exists()


def test_a_damaged_output_goes_before_its_shard_is_scored_again(job: dict, tmp_path: Path) -> None:
    # The rerun stops before it gets to that shard (the largest goes first; it is a small one): the damaged bytes
    # must not be left at the output path meanwhile.
    out = tmp_path / "out"
    _run(job, out)
    small, large = job["shards"][1][0].name, job["shards"][3][0].name
    for name in (small, large):  # the large one is scored again first, and the run stops after it
        (out / name).write_bytes((out / name).read_bytes()[:50])

    class Boom(BatchProgress):
        def shard_done(self, done: int, total: int) -> None:
            raise KeyboardInterrupt

    notices: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        _run(job, out, progress=Boom(), notice=notices.append)
    assert not (out / small).exists() and not (out / SUCCESS).exists()
    assert any(small in n and "removed" in n for n in notices)


def test_interrupted_run_resumes(job: dict, tmp_path: Path) -> None:
    """A run that fails half-way (here: a progress callback raising) leaves a resumable directory: no _SUCCESS,
    the finished shards in the manifest, no temporary file at an output path; the rerun does only the rest."""
    ref = tmp_path / "ref"
    _run(job, ref)

    class Boom(BatchProgress):
        def shard_done(self, done: int, total: int) -> None:
            if done == 2:
                raise KeyboardInterrupt

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        _run(job, out, progress=Boom())
    assert not (out / SUCCESS).exists()
    assert json.loads((out / MANIFEST).read_text())["shards_done"] == 2
    assert json.loads((out / METRICS).read_text())["job"]["status"] == "failed"
    notices: list[str] = []
    summary = _run(job, out, batch_size=64, notice=notices.append)
    assert summary.shards_skipped == 2 and summary.shards_scored == len(SIZES) - 2
    assert _outputs(out) == _outputs(ref) and (out / SUCCESS).exists()  # exact integer scores: same bytes anyway
    assert len(notices) == 1 and "computed with device cpu, batch size 32" in notices[0] and "batch size 64" in \
        notices[0]
    metrics = json.loads((out / METRICS).read_text())
    assert metrics["job"]["notices"] == notices
    assert len(metrics["shards"]) == len(SIZES)  # the two kept shards' metrics come from the first run
    assert sum(bool(e.get("earlier_run")) for e in metrics["shards"].values()) == 2


def _wait_for(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _manifest_done(out: Path) -> int:
    try:
        return json.loads((out / MANIFEST).read_text())["shards_done"]
    except (OSError, ValueError, KeyError):
        return 0


def _kill_mid_run(args: list[str], out: Path, env: dict) -> None:
    """Start ``python -m recall batch ...`` and SIGKILL it once a shard is recorded and the next one's temporary file
    is open (``python -m pacing``: the worker sleeps after each batch it writes)."""
    proc = subprocess.Popen([sys.executable, "-m", "pacing", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ok = _wait_for(lambda: _manifest_done(out) >= 1 and any(".tmp-" in p.name for p in out.iterdir())
                       or proc.poll() is not None)
        assert ok and proc.poll() is None, f"the run ended before the kill: {proc.communicate()}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _sigterm_mid_shard(args: list[str], out: Path) -> tuple[int, str, float]:
    """Start ``python -m pacing ARGS``, SIGTERM it once a shard is recorded and the next one's temporary file is open;
    (exit status, stderr, seconds from the signal to the exit)."""
    proc = paced(args, REPO, TESTS)
    try:
        assert _wait_for(lambda: _manifest_done(out) >= 1 and any(".tmp-" in p.name for p in out.iterdir()))
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
        return proc.returncode, stderr, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kill_9_then_rerun_gives_identical_bytes(job: dict, tmp_path: Path) -> None:
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = [*_cli(job, out), "--quiet"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{TESTS}"}
    _kill_mid_run(args, out, env)
    assert not (out / SUCCESS).exists()
    done = _manifest_done(out)
    assert 1 <= done < len(SIZES)
    assert any(".tmp-" in p.name for p in out.iterdir())  # the kill landed while a shard was being written

    proc = subprocess.run([sys.executable, "-m", "recall", *args], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"{len(SIZES) - done} of {len(SIZES)} shards scored, {done} already done" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "recall", *_cli(job, ref), "--quiet"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert _outputs(out) == _outputs(ref)
    assert json.loads((out / MANIFEST).read_text())["outputs"] == json.loads((ref / MANIFEST).read_text())["outputs"]
    assert (out / SUCCESS).exists() and not [p for p in out.iterdir() if ".tmp-" in p.name]


def test_sigterm_records_the_failure_and_the_rerun_resumes(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    returncode, stderr, _ = _sigterm_mid_shard(_cli(job, out), out)
    assert returncode == 128 + signal.SIGTERM
    assert stderr.strip().splitlines()[-1] == "error: terminated by SIGTERM; rerun the same command to resume"
    metrics = json.loads((out / METRICS).read_text())
    assert metrics["job"]["status"] == "failed" and "SIGTERM" in metrics["job"]["error"]
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]  # the shard being written was aborted cleanly
    summary = _run(job, out)
    assert summary.shards_skipped >= 1 and (out / SUCCESS).exists()


# ---- refusals ------------------------------------------------------------------------------------------------------

def test_different_parameters_are_refused_unless_overwrite(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run(job, out)
    before = _snapshot(out)
    result = runner.invoke(app, _cli(job, out, k=K + 1))
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {out}: holds the output of a different job")
    assert f"k {K} -> {K + 1}" in lines[0] and "--overwrite" in lines[0]
    result = runner.invoke(app, _cli(job, out, "--metric", "l2"))
    assert result.exit_code == 2 and "metric 'ip' -> 'l2'" in result.stderr
    assert _snapshot(out) == before  # a refusal touches nothing

    result = runner.invoke(app, _cli(job, out, "--overwrite", k=K + 1))
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["job"]["k"] == K + 1 and manifest["shards_done"] == len(SIZES)
    first = job["shards"][0][0].name
    assert all(len(ids) == K + 1 for ids in pq.read_table(out / first).column("item_ids").to_pylist())


def test_different_item_file_is_refused(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run(job, out)
    items = pq.read_table(job["items"])
    vecs = items.column("embedding").combine_chunks()
    flat = vecs.values.to_numpy().copy()
    flat[0] += 1  # one value: same size, same row count
    pq.write_table(items.set_column(1, "embedding", pa.FixedSizeListArray.from_arrays(pa.array(flat), DIM)),
                   job["items"])
    with pytest.raises(InputError, match="item file content changed"):
        _run(job, out)


def _write_bare(path: Path, ids: np.ndarray, vecs: np.ndarray) -> None:
    """A shard whose footer says nothing about its values: uncompressed, no dictionary, no statistics."""
    pq.write_table(pa.table({"id": pa.array(ids), "embedding": pa.FixedSizeListArray.from_arrays(
        pa.array(vecs.ravel().astype(np.float32)), vecs.shape[1])}), path, compression="none", use_dictionary=False,
        write_statistics=False)


def test_shard_regenerated_in_place_is_scored_again(job: dict, tmp_path: Path) -> None:
    """Issue 19.1: a finished shard rewritten with one other vector value, same size and same footer bytes, must not
    keep its stale output: the content hash sees it, the stale output goes, the shard is scored again."""
    content_hash = atomic.content_hash

    path, start, n = job["shards"][0]
    ids, vecs = job["user_ids"][start:start + n], job["user_vecs"][start:start + n].copy()
    _write_bare(path, ids, vecs)
    out = tmp_path / "out"
    _run(job, out)
    footer = path.read_bytes()[-200:]
    vecs[3, 1] += 1  # one value: same size, same footer
    _write_bare(path, ids, vecs)
    assert path.stat().st_size == job["shards"][0][0].stat().st_size and path.read_bytes()[-200:] == footer
    notices: list[str] = []
    summary = _run(job, out, notice=notices.append)
    assert summary.shards_scored == 1 and summary.shards_skipped == len(SIZES) - 1
    assert [n_ for n_ in notices if "changed" in n_] == [
        next(n_ for n_ in notices if n_.startswith(f"{path}: the shard changed since its output was computed "
                                                   f"(xxh3_128 "))]
    fresh = tmp_path / "fresh.parquet"
    score_files(path, job["items"], fresh, K, device="cpu")
    assert pq.read_table(out / path.name).equals(pq.read_table(fresh))
    assert (out / SUCCESS).exists()
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["job"]["shards"][path.name]["xxh3_128"] == content_hash(path)


def test_success_goes_before_a_stale_output_even_when_the_run_then_fails(job: dict, tmp_path: Path) -> None:
    """A regenerated shard's output is removed at once; if the run fails before scoring (here: no GPU for
    device="gpu"), the directory must not keep _SUCCESS beside a manifest that lists the removed file."""
    out = tmp_path / "out"
    _run(job, out)
    path, start, n = job["shards"][1]
    vecs = job["user_vecs"][start:start + n].copy()
    vecs[0, 0] += 3
    _write_bare(path, job["user_ids"][start:start + n], vecs)
    with pytest.raises(BackendUnavailable):
        _run(job, out, device="gpu")
    assert not (out / path.name).exists() and not (out / SUCCESS).exists()
    assert _run(job, out).shards_scored == 1 and (out / SUCCESS).exists()


def test_regenerated_shard_through_the_cli(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    path, start, n = job["shards"][3]
    ids, vecs = job["user_ids"][start:start + n], job["user_vecs"][start:start + n].copy()
    _write_bare(path, ids, vecs)
    assert runner.invoke(app, _cli(job, out)).exit_code == 0
    vecs[0, 0] -= 2
    _write_bare(path, ids, vecs)
    result = runner.invoke(app, _cli(job, out))
    assert result.exit_code == 0, result.output
    assert "nothing to do" not in result.stdout and f"1 of {len(SIZES)} shards scored" in result.stdout
    assert f"notice: {path}: the shard changed since its output was computed" in result.stderr


def test_added_and_removed_shards_are_refused(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run(job, out)
    path, start, n = job["shards"][1]
    path.unlink()
    with pytest.raises(InputError, match=r"user shards removed: part-001\.parquet"):
        _run(job, out)
    write_embeddings(path, job["user_ids"][start:start + n], job["user_vecs"][start:start + n])
    write_embeddings(job["users"] / "part-009.parquet", [1], np.ones((1, DIM), np.float32))
    with pytest.raises(InputError, match=r"user shards added: part-009\.parquet"):
        _run(job, out)


def test_manifest_of_an_earlier_format_redoes_every_shard(job: dict, tmp_path: Path) -> None:
    """A recall-batch/1 manifest fingerprinted shards by their footer: its outputs cannot be trusted against today's
    inputs, so they are scored again (with a notice), not kept and not refused."""
    out = tmp_path / "out"
    _run(job, out)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["format"] = "recall-batch/1"
    manifest["job"]["items"] = {"size": 1, "sha256": "0" * 64}
    for entry in manifest["job"]["shards"].values():
        entry.pop("xxh3_128")
        entry["footer_sha256"] = "0" * 64
    (out / MANIFEST).write_text(json.dumps(manifest))
    notices: list[str] = []
    summary = _run(job, out, notice=notices.append)
    assert summary.shards_scored == len(SIZES)
    assert any("format 'recall-batch/1'" in n and "every shard is scored again" in n for n in notices)
    assert json.loads((out / MANIFEST).read_text())["format"] == "recall-batch/2" and (out / SUCCESS).exists()
    manifest["job"]["k"] = K + 1
    manifest["format"] = "recall-batch/1"
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=f"holds the output of a different job \\(k {K + 1} -> {K}"):
        _run(job, out)


def test_hashing_every_input_is_recorded(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run(job, out)
    metrics = json.loads((out / METRICS).read_text())["job"]
    total = sum(p.stat().st_size for p, _, _ in job["shards"]) + job["items"].stat().st_size
    assert metrics["fingerprint_bytes"] == total and metrics["fingerprint_s"] >= 0


# ---- bad shards ----------------------------------------------------------------------------------------------------

def test_every_good_shard_is_scored_and_every_bad_one_named(job: dict, tmp_path: Path) -> None:
    """Issue 19.6: two bad shards (a NaN at row 17, a file that is not Parquet) among good ones: the good ones are
    scored and kept, the job exits 2 naming both (file, row, reason) in one line and in _metrics.json, no _SUCCESS;
    once they are fixed the same command scores only them."""
    ref = tmp_path / "ref"
    _run(job, ref)
    nan = _nan_shard(job)
    broken = job["shards"][1][0]
    good_bytes = broken.read_bytes()
    broken.write_bytes(b"not parquet at all")
    out = tmp_path / "out"
    result = runner.invoke(app, _cli(job, out))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {broken}: not a Parquet file"), result.stderr
    assert f"{nan}: row 17 (id {job['user_ids'][job['shards'][3][1] + 17]}) has a NaN" in lines[0]
    assert f"2 of {len(SIZES)} shards are bad: the {len(SIZES) - 2} others are done and kept" in lines[0]
    assert not (out / SUCCESS).exists()
    good = sorted(p.name for p, _, _ in job["shards"] if p not in (nan, broken))
    assert sorted(_outputs(out)) == good and all(_outputs(out)[n] == _outputs(ref)[n] for n in good)
    metrics = json.loads((out / METRICS).read_text())
    assert metrics["job"]["status"] == "failed"
    bad = {e["shard"]: e for e in metrics["job"]["bad_shards"]}
    assert bad[nan.name]["row"] == 17 and "NaN" in bad[nan.name]["error"] and bad[nan.name]["path"] == str(nan)
    assert bad[broken.name]["row"] is None and "not a Parquet file" in bad[broken.name]["error"]
    assert metrics["shards"][nan.name]["status"] == "bad"
    assert json.loads((out / MANIFEST).read_text())["shards_done"] == len(good)

    broken.write_bytes(good_bytes)
    path, start, n = job["shards"][3]
    write_embeddings(path, job["user_ids"][start:start + n], job["user_vecs"][start:start + n].reshape(n, DIM))
    result = runner.invoke(app, _cli(job, out))
    assert result.exit_code == 0, result.output
    assert f"2 of {len(SIZES)} shards scored, {len(SIZES) - 2} already done" in result.stdout
    assert _outputs(out) == _outputs(ref) and (out / SUCCESS).exists()


def test_bad_shards_in_worker_processes(job: dict, tmp_path: Path) -> None:
    nan = _nan_shard(job)
    with pytest.raises(InputError, match=rf"^{nan}: row 17 .* \(1 of {len(SIZES)} shards is bad"):
        _run(job, tmp_path / "out", workers=2)
    assert len(_outputs(tmp_path / "out")) == len(SIZES) - 1


def test_a_job_of_empty_shards_is_refused_unless_allowed(tmp_path: Path) -> None:
    job = _write_job(tmp_path, sizes=(0, 0))
    with pytest.raises(InputError, match=r"every shard is empty \(2 shards, 0 users\).*--allow-empty"):
        _run(job, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert _run(job, tmp_path / "out", allow_empty=True).shards_scored == 2


def test_foreign_directory_is_refused(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="is not empty and has no _manifest.json"):
        _run(job, out)
    notices: list[str] = []
    summary = _run(job, out, overwrite=True, notice=notices.append)
    assert summary.shards_scored == len(SIZES)
    assert (out / "notes.txt").read_text() == "mine" and any("notes.txt" in n for n in notices)


def test_overwrite_removes_the_previous_jobs_outputs(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run(job, out)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(job["shards"][0][0], other / "only.parquet")
    run_batch(other, job["items"], out, K, device="cpu", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(["only.parquet", MANIFEST, METRICS, SUCCESS, LOCK])


def test_concurrent_run_is_refused(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with open(out / LOCK, "w") as f:
        f.write("4242\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(InputError, match=r"another recall batch \(pid 4242\) is writing to this directory"):
            _run(job, out)


def test_output_directory_holding_inputs_is_refused(job: dict, tmp_path: Path) -> None:
    before = {p.name: p.read_bytes() for p in job["users"].iterdir()}
    link = tmp_path / "link"
    link.symlink_to(job["users"])
    # The folder itself, through "..", through a symbolic link: refused, with --overwrite too, and no input touched.
    for out in (job["users"], job["users"] / ".." / "users", link):
        for overwrite in (False, True):
            with pytest.raises(InputError, match="is inside the output directory"):
                _run(job, out, overwrite=overwrite)
    assert {p.name: p.read_bytes() for p in job["users"].iterdir()} == before
    # A shard that is a link to a file in --out: refused too, the file kept.
    out = tmp_path / "out"
    out.mkdir()
    (out / "real.parquet").write_bytes(job["shards"][0][0].read_bytes())
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "part-000.parquet").symlink_to(out / "real.parquet")
    with pytest.raises(InputError, match="is inside the output directory"):
        run_batch(linked, job["items"], out, K, device="cpu", overwrite=True)
    assert (out / "real.parquet").read_bytes() == job["shards"][0][0].read_bytes()


def _nan_items(job: dict, path: Path) -> Path:
    items = job["item_vecs"].copy()
    items[42, 1] = np.nan
    write_embeddings(path, job["item_ids"], items)
    return path


def test_a_bad_items_file_leaves_no_new_directory_and_the_fixed_rerun_runs(job: dict, tmp_path: Path) -> None:
    # Found only once a worker reads the items' rows: the manifest is not written before that, so the same command,
    # fixed, is this job and not another one; the directory the job made for it goes again.
    out = tmp_path / "out"
    bad = _nan_items(job, tmp_path / "bad_items.parquet")
    with pytest.raises(InputError, match=r"bad_items.parquet: row 42 .* NaN"):
        run_batch(job["users"], bad, out, K, device="cpu")
    assert not out.exists()
    write_embeddings(bad, job["item_ids"], job["item_vecs"])
    summary = run_batch(job["users"], bad, out, K, device="cpu")
    assert summary.shards_scored == len(SIZES) and (out / SUCCESS).exists()


def test_a_bad_items_file_with_overwrite_keeps_the_previous_output(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run(job, out)
    before = _snapshot(out)
    bad = _nan_items(job, tmp_path / "bad_items.parquet")
    with pytest.raises(InputError, match="row 42"):
        run_batch(job["users"], bad, out, K + 1, device="cpu", overwrite=True)
    assert _snapshot(out) == before  # its outputs, manifest, metrics and _SUCCESS as they were


def test_a_bad_exclusions_file_leaves_no_new_directory(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    excl = tmp_path / "excl.parquet"
    pq.write_table(pa.table({"user_id": pa.array([11, 14], pa.int64()), "item_id": pa.array(["a", "b"])}), excl)
    with pytest.raises(InputError, match="column 'item_id' has type string"):
        _run(job, out, exclude=excl)
    assert not out.exists()


# ---- inputs --------------------------------------------------------------------------------------------------------

def test_glob_and_single_file(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    summary = run_batch(str(job["users"] / "part-00[13].parquet"), job["items"], out, K, device="cpu")
    assert summary.shards_total == 2 and sorted(_outputs(out)) == ["part-001.parquet", "part-003.parquet"]
    out1 = tmp_path / "out1"
    run_batch(job["shards"][0][0], job["items"], out1, K, device="cpu")
    assert list(_outputs(out1)) == ["part-000.parquet"]


def test_discovery_skips_hidden_and_refuses_duplicate_names(tmp_path: Path) -> None:
    d = tmp_path / "d"
    (d / "a").mkdir(parents=True)
    (d / "b").mkdir()
    for name in ("a/x.parquet", "b/x.parquet", "a/_SUCCESS", "a/.x.parquet.crc", "a/y.txt"):
        (d / name).write_bytes(b"")
    assert [p.name for p in discover_shards(d / "a")] == ["x.parquet"]
    with pytest.raises(InputError, match="has the same file name as"):
        discover_shards(str(d / "*" / "x.parquet"))
    with pytest.raises(InputError, match="no files match"):
        discover_shards(str(d / "*.nothing"))
    with pytest.raises(InputError, match="no such file or directory"):
        discover_shards(d / "missing")
    with pytest.raises(InputError, match=r"no \*\.parquet files"):
        discover_shards(d)


def test_exclusions_string_ids(tmp_path: Path) -> None:
    job = _write_job(tmp_path, string_ids=True)
    pairs = {"user_id": [], "item_id": []}
    rng = np.random.default_rng(3)
    for u in rng.choice(job["user_ids"], 60, replace=False):
        for i in rng.choice(job["item_ids"], 4, replace=False):
            pairs["user_id"].append(u)
            pairs["item_id"].append(i)
    pairs["user_id"] += ["nobody", job["user_ids"][0]]
    pairs["item_id"] += [job["item_ids"][0], "no-such-item"]
    excl = tmp_path / "excl.parquet"
    pq.write_table(pa.table({"user_id": pa.array(pairs["user_id"], pa.string()),
                             "item_id": pa.array(pairs["item_id"], pa.string())}), excl)
    out = tmp_path / "out"
    summary = run_batch(job["users"], job["items"], out, K, device="cpu", exclude=excl, batch_size=16)
    assert summary.exclusion_pairs == len(pairs["user_id"]) and summary.unknown_exclusions == 1
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["job"]["exclude"]["xxh3_128"] == atomic.content_hash(excl)
    for path, _, _ in job["shards"]:
        single = tmp_path / f"single-{path.name}"
        score_files(path, job["items"], single, K, device="cpu", exclude_path=excl, allow_empty=True)
        assert pq.read_table(single).equals(pq.read_table(out / path.name)), path.name
    applied = sum(e["exclusions_applied"] for e in manifest["outputs"].values())
    assert applied == 60 * 4  # the unknown user's and the unknown item's pairs are not applied


@pytest.mark.parametrize("string_ids, how", [(False, {}), (True, {}), (False, {"workers": 2}), (True, {"workers": 2}),
                                             (True, {"item_shards": 2}), (False, {"engine": "ray"})])
def test_exclusions_read_once_for_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: dict,
                                          string_ids: bool) -> None:
    # The parent reads and maps the exclusion file once; the workers (this process, worker processes, item-range
    # processes) take the index it saved. The file is deleted as soon as the parent has read it: a worker that read
    # it again would fail the job. The index's temporary files are gone afterwards.
    from recall.jobs.batch import exclusions as batch_exclusions

    if how.get("engine") == "ray":
        pytest.importorskip("ray")
    job = _write_job(tmp_path, string_ids=string_ids)
    rng = np.random.default_rng(4)
    users = rng.choice(job["user_ids"], 100, replace=False)
    pairs = [(u, i) for u in users for i in rng.choice(job["item_ids"], 5, replace=False)]
    col = pa.string() if string_ids else pa.int64()
    excl = tmp_path / "excl.parquet"
    pq.write_table(pa.table({"user_id": pa.array([u for u, _ in pairs], col),
                             "item_id": pa.array([i for _, i in pairs], col)}), excl)
    kept = tmp_path / "kept.parquet"
    shutil.copy(excl, kept)
    reads = []
    read = batch_exclusions.ExclusionIndex.read.__func__
    # The parent also hashes the file for the manifest, on other threads while the reader maps it: the file goes
    # once both are done (deleting it as soon as it was read made the hash fail now and then).
    from recall.jobs.batch import job as batch_job

    hashed = threading.Event()
    fingerprint_all = batch_job.fingerprint_all

    def fingerprint_then_say(*args, **kwargs):
        try:
            return fingerprint_all(*args, **kwargs)
        finally:
            hashed.set()

    def once(cls, path, *args):
        index = read(cls, path, *args)
        assert index.pairs.item_rows.dtype == np.int32  # 4 bytes a pair, in the parent and in the mapped files
        reads.append(path)
        hashed.wait(60)
        os.remove(path)
        return index

    monkeypatch.setattr(batch_job, "fingerprint_all", fingerprint_then_say)
    monkeypatch.setattr(batch_exclusions.ExclusionIndex, "read", classmethod(once))
    out = tmp_path / "out"
    summary = _run(job, out, exclude=excl, **how)
    assert reads == [str(excl)] and summary.exclusion_pairs == len(pairs) and summary.unknown_exclusions == 0
    assert not [p.name for p in out.iterdir() if "exclusions" in p.name]
    assert not [t for t in threading.enumerate() if t.name.startswith("recall-exclusions")]
    applied = sum(e["exclusions_applied"] for e in json.loads((out / MANIFEST).read_text())["outputs"].values())
    assert applied == len(pairs)
    for path, _, _ in job["shards"]:
        single = tmp_path / f"single-{path.name}"
        score_files(path, job["items"], single, K, device="cpu", exclude_path=kept, allow_empty=True)
        assert pq.read_table(single).equals(pq.read_table(out / path.name)), path.name


def test_exclusion_index_files_go_when_the_job_fails(job: dict, tmp_path: Path) -> None:
    excl = tmp_path / "excl.parquet"
    pq.write_table(pa.table({"user_id": pa.array(job["user_ids"][:20]), "item_id": pa.array(job["item_ids"][:20])}),
                   excl)
    bad = job["users"] / "part-999.parquet"
    bad.write_bytes(b"not parquet")
    out = tmp_path / "out"
    with pytest.raises(InputError, match="part-999"):
        _run(job, out, exclude=excl, workers=2)
    assert not [p.name for p in out.iterdir() if "exclusions" in p.name]
    # What a killed run left (another pid) is removed by the next run, which then succeeds.
    (out / ".exclusions-rows.tmp-999999").write_bytes(b"left by a killed run")
    shutil.copy(job["users"] / "part-001.parquet", bad)  # the bad shard fixed in place
    _run(job, out, exclude=excl, workers=2)
    assert not [p.name for p in out.iterdir() if "exclusions" in p.name]


def test_exclusions_list_form_and_empty_file(job: dict, tmp_path: Path) -> None:
    ids = job["user_ids"]
    lists = pq.read_table(job["items"]).column("id").to_pylist()
    excl = tmp_path / "lists.parquet"
    pq.write_table(pa.table({"user_id": pa.array(ids[::7].astype(np.uint64)),  # another integer type
                             "item_ids": [lists[i % 9:i % 9 + 3] for i in range(len(ids[::7]))]}), excl)
    out = tmp_path / "out"
    run_batch(job["users"], job["items"], out, K, device="cpu", exclude=excl)
    for path, _, _ in job["shards"]:
        single = tmp_path / f"single-{path.name}"
        score_files(path, job["items"], single, K, device="cpu", exclude_path=excl, allow_empty=True)
        assert pq.read_table(single).equals(pq.read_table(out / path.name)), path.name
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"user_id": pa.array([], pa.int64()), "item_id": pa.array([], pa.int64())}), empty)
    out2 = tmp_path / "out2"
    run_batch(job["users"], job["items"], out2, K, device="cpu", exclude=empty)
    run_batch(job["users"], job["items"], tmp_path / "plain", K, device="cpu")
    assert _outputs(out2) == _outputs(tmp_path / "plain")


# ---- the CLI -------------------------------------------------------------------------------------------------------

def test_cli_summary_line(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, _cli(job, out, "-v"))
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith(f"batch: {len(SIZES)} of {len(SIZES)} shards scored; {sum(SIZES):,} users x "
                               f"{N_ITEMS} items, k {K}, metric ip, 1 cpu worker (local)")
    assert lines[-1] == f"metrics: {out / METRICS}"
    result = runner.invoke(app, _cli(job, out, "--quiet"))
    assert result.exit_code == 0 and "nothing to do" in result.stdout and result.stderr == ""


def _nan_shard(job: dict) -> Path:
    path, start, n = job["shards"][3]
    vecs = job["user_vecs"][start:start + n].copy()
    vecs[17, 2] = np.nan
    write_embeddings(path, job["user_ids"][start:start + n], vecs)
    return path


@pytest.mark.parametrize("case", ["nan", "missing-items", "no-shards", "dim", "not-parquet", "gpus", "ray-address",
                                  "out-is-file", "bad-exclusions", "mixed-id-types"])
def test_bad_inputs_exit_2_with_one_line(job: dict, tmp_path: Path, case: str) -> None:
    out = tmp_path / "out"
    args = _cli(job, out)
    expect = ""
    if case == "nan":
        path = _nan_shard(job)
        expect = f"{path}: row 17 (id {job['user_ids'][job['shards'][3][1] + 17]}) has a NaN"
    elif case == "missing-items":
        args[args.index("--items") + 1] = str(tmp_path / "nope.parquet")
        expect = f"{tmp_path / 'nope.parquet'}: no such file"
    elif case == "no-shards":
        (tmp_path / "empty").mkdir()
        args[args.index("--users") + 1] = str(tmp_path / "empty")
        expect = "no *.parquet files"
    elif case == "dim":
        path = job["shards"][1][0]
        write_embeddings(path, [1, 2], np.ones((2, DIM + 1), np.float32))
        expect = f"{path}: vectors have dimension {DIM + 1}"
    elif case == "not-parquet":
        path = job["users"] / "zz.parquet"
        path.write_bytes(b"not parquet at all")
        expect = f"{path}: not a Parquet file"
    elif case == "gpus":
        args += ["--gpus", "two"]
        expect = "--gpus must be 'all' or an integer >= 1"
    elif case == "ray-address":
        args += ["--ray-address", "auto"]
        expect = "--ray-address needs --engine ray"
    elif case == "out-is-file":
        out.write_text("x")
        expect = "exists and is not a directory"
    elif case == "bad-exclusions":
        bad = tmp_path / "excl.parquet"
        pq.write_table(pa.table({"user": [1], "item": [2]}), bad)
        args += ["--exclude", str(bad)]
        expect = f"{bad}: exclusion columns are"
    elif case == "mixed-id-types":
        path = job["shards"][2][0]
        write_embeddings(path, None, np.ones((1, DIM), np.float32), id_array=pa.array(["a"]))
        expect = "every shard must use the same id type"
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], result.stderr
    assert "Traceback" not in result.output
    if case in ("nan", "dim", "not-parquet"):
        # A bad shard does not stop the job: the others are scored and recorded, nothing is marked done.
        bad = {"nan": job["shards"][3][0], "dim": job["shards"][1][0], "not-parquet": job["users"] / "zz.parquet"}
        assert not (out / SUCCESS).exists()
        assert json.loads((out / METRICS).read_text())["job"]["status"] == "failed"
        assert not (out / bad[case].name).exists()
        assert len(list(out.glob("*.parquet"))) == len(SIZES) - (case != "not-parquet")
    elif case != "out-is-file" and out.exists():
        assert not list(out.glob("*.parquet"))


def test_python_m_recall_batch_is_one_line_on_bad_input(job: dict, tmp_path: Path) -> None:
    path = _nan_shard(job)
    proc = subprocess.run([sys.executable, "-m", "recall", *_cli(job, tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"error: {path}: row 17") and \
        "Traceback" not in proc.stderr


# ---- the nightly script --------------------------------------------------------------------------------------------

def test_nightly_script(job: dict, tmp_path: Path) -> None:
    script = REPO / "scripts" / "nightly_recall.sh"
    env = {**os.environ, "RECALL": f"{sys.executable} -m recall", "USERS": str(job["users"]),
           "ITEMS": str(job["items"]), "OUT_ROOT": str(tmp_path / "recall"), "RUN_DATE": "2026-11-30",
           "LOG_DIR": str(tmp_path / "logs"), "K": str(K), "EXTRA_ARGS": "--device cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "recall" / "2026-11-30"
    assert (out / SUCCESS).exists() and len(_outputs(out)) == len(SIZES)
    log = (tmp_path / "logs" / "nightly_recall-2026-11-30.log").read_text()
    assert f"{len(SIZES)} of {len(SIZES)} shards scored" in log and "exit 0" in log
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)  # a rerun: nothing to do
    assert proc.returncode == 0 and "nothing to do" in (tmp_path / "logs" / "nightly_recall-2026-11-30.log").read_text()
    env["ITEMS"] = str(tmp_path / "missing.parquet")
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "missing.parquet" in proc.stderr


# ---- GPU -----------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_batch_equals_cpu_bytes(job: dict, tmp_path: Path) -> None:
    """Small-integer data: every score is exact, so the GPU's outputs are byte-equal to the CPU's."""
    _run(job, tmp_path / "cpu", device="cpu")
    summary = _run(job, tmp_path / "gpu", device="gpu")
    assert summary.device == "gpu"
    assert _outputs(tmp_path / "gpu") == _outputs(tmp_path / "cpu")


def test_no_gpu_is_refused_before_anything_is_written(job: dict, tmp_path: Path, gpu_available: bool) -> None:
    if gpu_available:
        pytest.skip("a GPU is usable here")
    out = tmp_path / "out"
    args = _cli(job, out)
    args[args.index("--device") + 1] = "gpu"
    result = runner.invoke(app, [*args, "--gpus", "2"])
    assert result.exit_code == 2 and result.stderr.startswith("error: --device gpu but no GPU is usable")
    assert not out.exists()  # nothing written: the directory the job made goes again
    assert _run(job, out).shards_scored == len(SIZES)


def test_leftovers_of_a_killed_run_are_removed_and_said_once(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run(job, out)
    (out / SUCCESS).unlink()
    (out / ".part-000.parquet.tmp-999999").write_bytes(b"x" * 2_000_000)
    notices: list[str] = []
    _run(job, out, notice=notices.append)
    assert [n for n in notices if "temporary file" in n] == [
        f"{out}: removed 1 temporary file left by earlier runs that were killed (.part-000.parquet.tmp-999999; "
        f"2.0 MB)"]
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


def test_k_beyond_the_catalogue_gives_the_bytes_of_k_n_items(job: dict, tmp_path: Path) -> None:
    """Issue 19.4 in the batch job: neither the results nor the row groups are sized by a k beyond the items."""
    _run(job, tmp_path / "n", k=N_ITEMS)
    summary = _run(job, tmp_path / "huge", k=2 ** 31 - 1)
    assert summary.k == 2 ** 31 - 1 and _outputs(tmp_path / "huge") == _outputs(tmp_path / "n")


def test_unreadable_shards_are_bad_shards_too(job: dict, tmp_path: Path) -> None:
    """A dangling link and a loop of links among the shards: reported with the others, not silently left out and
    not stopping the job."""
    (job["users"] / "zz-gone.parquet").symlink_to(tmp_path / "nowhere.parquet")
    (job["users"] / "zz-a.parquet").symlink_to(job["users"] / "zz-b.parquet")
    (job["users"] / "zz-b.parquet").symlink_to(job["users"] / "zz-a.parquet")
    with pytest.raises(InputError) as err:
        _run(job, tmp_path / "out")
    message = str(err.value)
    assert "zz-gone.parquet: is a symbolic link to" in message and "which does not exist" in message
    assert "zz-a.parquet: cannot open the embeddings file: Too many levels of symbolic links" in message
    assert f"(3 of {len(SIZES) + 3} shards are bad" in message
    assert len(_outputs(tmp_path / "out")) == len(SIZES)


@pytest.mark.parametrize("strings", [False, True])
@pytest.mark.parametrize("stop_at", [1, 3])
def test_exclusion_files_stopped_while_saved_leave_nothing(tmp_path: Path, monkeypatch, strings, stop_at) -> None:
    # ExclusionIndex.save writes the job's exclusion index as this process's temporary files; a signal raised (or a
    # full disk) part way removes the ones already written: the caller never got their names to remove.
    from recall.io import IdPairs
    from recall.jobs.batch import exclusions as batch_exclusions

    keys = np.array(["a", "b"], dtype=object) if strings else np.array([3, 9], np.int64)
    index = batch_exclusions.ExclusionIndex(keys, IdPairs(np.array([0, 2, 3]), np.array([1, 4, 2], np.int32),
                                                          np.array([True, True]), 3, 0))
    files = index.save(tmp_path)  # the whole save: every part, then removed by its owner
    assert sorted(Path(p).exists() for p in files.paths.values()) == [True] * len(files.paths)
    files.remove()
    assert list(tmp_path.iterdir()) == []
    real, calls = batch_exclusions._save, []

    def save(path, arr):
        calls.append(path)
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        real(path, arr)

    monkeypatch.setattr(batch_exclusions, "_save", save)
    with pytest.raises(KeyboardInterrupt):
        index.save(tmp_path)
    assert list(tmp_path.iterdir()) == []
