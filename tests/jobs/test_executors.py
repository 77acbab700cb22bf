"""recall/distributed/: worker placement, the process-per-worker executor (CPU shares here, GPUs on the GPU machine),
worker failures, kill -9 of the parent (no orphan workers), and the Ray executor in local mode.

Every multi-worker output is compared byte for byte with the one-worker output of recall/batch.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from pacing import pace
from processes import alive, metrics, tracker_registrations
from test_batch import (
    REPO,
    SIZES,
    TESTS,
    K,
    _kill_mid_run,
    _manifest_done,
    _nan_shard,
    _outputs,
    _run,
    _sigterm_mid_shard,
    _wait_for,
    _write_job,
)
from typer.testing import CliRunner

from recall.cli.app import app
from recall.core.errors import InputError
from recall.jobs.batch import MANIFEST, SUCCESS, BatchError, run_batch

runner = CliRunner()


@pytest.fixture
def job(tmp_path: Path) -> dict:
    return _write_job(tmp_path)


@pytest.fixture
def reference(job: dict, tmp_path: Path) -> dict[str, bytes]:
    """The one-worker, in-process outputs of the job."""
    _run(job, tmp_path / "ref")
    return _outputs(tmp_path / "ref")






# ---- several worker processes --------------------------------------------------------------------------------------

needs_2_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores")


@needs_2_cores
def test_cpu_worker_processes_equal_one_worker(job: dict, tmp_path: Path, reference: dict,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    tracked = tracker_registrations(monkeypatch)
    summary = _run(job, out, workers=2)
    # No named semaphores (a multiprocessing queue's): a job stopped by a signal would leave them to the resource
    # tracker, which reports them on stderr after the job's last line.
    assert tracked == []
    assert summary.workers == 2 and summary.shards_scored == len(SIZES)
    assert _outputs(out) == reference
    # A worker still loading the items when the other has finished every shard is stopped without reporting.
    workers = metrics(out)["workers"]
    assert {w["worker"] for w in workers} <= {"cpu0", "cpu1"} and len({w["pid"] for w in workers}) == len(workers)
    assert os.getpid() not in {w["pid"] for w in workers}
    assert {s["worker"] for s in metrics(out)["shards"].values()} <= {w["worker"] for w in workers}
    if len(workers) == 2:
        assert not set(workers[0]["cpu_affinity"]) & set(workers[1]["cpu_affinity"])
    assert all(not alive(w["pid"]) for w in workers)


@needs_2_cores
def test_worker_input_errors_reach_the_parent(job: dict, tmp_path: Path) -> None:
    path = _nan_shard(job)
    with pytest.raises(InputError, match=f"^{path}: row 17 "):
        _run(job, tmp_path / "out", workers=2)
    # Items that pass the parent's footer checks but not a worker's read: every worker fails while loading them.
    from parquet_data import write_embeddings

    items = job["item_vecs"].copy()
    items[5, 1] = np.inf
    write_embeddings(job["items"], job["item_ids"], items)
    with pytest.raises(InputError, match=f"^{job['items']}: row 5 "):
        _run(job, tmp_path / "out2", workers=2)


@needs_2_cores
def test_a_dead_worker_fails_the_job_and_the_rerun_resumes(job: dict, tmp_path: Path, reference: dict,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    failure: list[BaseException] = []

    def target() -> None:
        try:
            _run(job, out, workers=2, after_batch=pace)  # the spawned workers sleep after each batch
        except BaseException as exc:  # noqa: BLE001
            failure.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    try:
        assert _wait_for(lambda: len(metrics(out).get("workers", [])) == 2 and _manifest_done(out) >= 1)
        victim = metrics(out)["workers"][0]
        os.kill(victim["pid"], signal.SIGKILL)
    finally:
        thread.join(60)
    assert len(failure) == 1 and isinstance(failure[0], BatchError), failure
    assert f"worker {victim['worker']} (pid {victim['pid']}) was killed by signal SIGKILL" in str(failure[0])
    assert "rerun the same command to resume" in str(failure[0])
    assert not any(alive(w["pid"]) for w in metrics(out)["workers"])  # the survivor was stopped too
    assert not (out / SUCCESS).exists() and metrics(out)["job"]["status"] == "failed"

    summary = _run(job, out, workers=2)
    assert summary.shards_skipped >= 1 and _outputs(out) == reference and (out / SUCCESS).exists()


@needs_2_cores
def test_kill_9_of_the_parent_kills_its_workers(job: dict, tmp_path: Path, reference: dict) -> None:
    out = tmp_path / "out"
    args = ["batch", "--users", str(job["users"]), "--items", str(job["items"]), "--k", str(K), "--out", str(out),
            "--device", "cpu", "--batch-size", "32", "--workers", "2", "--quiet"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{TESTS}"}
    _kill_mid_run(args, out, env)
    pids = [w["pid"] for w in metrics(out)["workers"]]
    assert len(pids) == 2
    assert _wait_for(lambda: not any(alive(pid) for pid in pids), timeout=10), "orphan workers outlived the job"
    proc = subprocess.run([sys.executable, "-m", "recall", *args], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "already done" in proc.stdout and _outputs(out) == reference


@needs_2_cores
def test_sigterm_of_the_parent_stops_its_workers_cleanly(job: dict, tmp_path: Path, reference: dict) -> None:
    """Issue 19.3 with worker processes: the parent stops them with SIGTERM, which unwinds each one, so the shard it
    was writing leaves no temporary file; the rerun resumes."""
    out = tmp_path / "out"
    args = ["batch", "--users", str(job["users"]), "--items", str(job["items"]), "--k", str(K), "--out", str(out),
            "--device", "cpu", "--batch-size", "32", "--workers", "2"]
    returncode, stderr, _ = _sigterm_mid_shard(args, out)
    assert returncode == 143, stderr
    assert stderr.strip().splitlines()[-1] == "error: terminated by SIGTERM; rerun the same command to resume"
    assert "resource_tracker" not in stderr, stderr
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    assert not any(alive(w["pid"]) for w in metrics(out)["workers"])
    summary = _run(job, out)
    assert summary.shards_skipped >= 1 and _outputs(out) == reference and (out / SUCCESS).exists()


# ---- Ray (local mode) ----------------------------------------------------------------------------------------------

def test_ray_local_equals_local_engine(job: dict, tmp_path: Path, reference: dict) -> None:
    """``--engine ray`` from the CLI, a local Ray started and stopped by the job: the same bytes, the same manifest
    outputs as the local engine; then resume (a corrupted and a missing output redone on Ray) and a bad shard."""
    ray = pytest.importorskip("ray")
    out = tmp_path / "out"
    result = runner.invoke(app, ["batch", "--users", str(job["users"]), "--items", str(job["items"]), "--k", str(K),
                                 "--out", str(out), "--device", "cpu", "--batch-size", "32", "--engine", "ray",
                                 "--workers", "2"])
    assert result.exit_code == 0, result.output
    assert "2 cpu workers (ray)" in result.stdout
    assert not ray.is_initialized()
    assert _outputs(out) == reference
    ref_manifest = json.loads((tmp_path / "ref" / MANIFEST).read_text())
    assert json.loads((out / MANIFEST).read_text())["outputs"] == ref_manifest["outputs"]
    workers = metrics(out)["workers"]
    assert sorted(w["worker"] for w in workers) == ["ray-cpu0", "ray-cpu1"]
    assert os.getpid() not in {w["pid"] for w in workers}

    names = sorted(reference)
    (out / names[0]).write_bytes(b"garbage")
    (out / names[3]).unlink()
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        summary = run_batch(job["users"], job["items"], out, K, device="cpu", batch_size=32, engine="ray")
        assert summary.shards_scored == 2 and summary.shards_skipped == len(SIZES) - 2
        assert _outputs(out) == reference and (out / SUCCESS).exists()
        assert ray.is_initialized()  # a Ray the job did not start is left running

        path = _nan_shard(job)
        bad = tmp_path / "bad"
        with pytest.raises(InputError, match=f"^{path}: row 17 "):
            run_batch(job["users"], job["items"], bad, K, device="cpu", batch_size=32, engine="ray")
        assert not (bad / SUCCESS).exists() and metrics(bad)["job"]["status"] == "failed"
    finally:
        ray.shutdown()


# ---- GPUs (run on the GPU machine) ---------------------------------------------------------------------------------

def _gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def _float_job(root: Path, n_shards: int = 8, users_per_shard: int = 4000, n_items: int = 20_000, dim: int = 64
               ) -> dict:
    """Standard-normal float vectors: scores are not exact small integers, so equality is a real determinism test."""
    from parquet_data import write_embeddings

    rng = np.random.default_rng(7)
    (root / "users").mkdir(parents=True)
    for i in range(n_shards):
        n = users_per_shard + 97 * i  # uneven
        write_embeddings(root / "users" / f"part-{i:03d}.parquet", np.arange(n) + 10**6 * i,
                         rng.standard_normal((n, dim)).astype(np.float32))
    write_embeddings(root / "items.parquet", np.arange(n_items), rng.standard_normal((n_items, dim)).astype(np.float32))
    return {"users": root / "users", "items": root / "items.parquet"}


@pytest.mark.gpu
def test_all_gpus_equal_one_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process per GPU: every GPU takes shards, the bytes equal the one-GPU run's."""
    n = _gpu_count()
    if n < 2:
        pytest.skip(f"needs 2 GPUs, {n} visible")
    job = _float_job(tmp_path)
    one = run_batch(job["users"], job["items"], tmp_path / "one", 50, device="gpu", gpus=1)
    # Each shard lasts long enough for every worker to take one.
    every = run_batch(job["users"], job["items"], tmp_path / "all", 50, device="gpu", gpus="all", after_batch=pace)
    assert one.workers == 1 and every.workers == n and every.device == "gpu"
    assert _outputs(tmp_path / "all") == _outputs(tmp_path / "one")
    done = metrics(tmp_path / "all")
    assert len({w["cuda_visible_devices"] for w in done["workers"]}) == n
    assert {s["worker"] for s in done["shards"].values()} == {w["worker"] for w in done["workers"]}
    assert all(s["device"] == "gpu" and s["device_busy_s"] > 0 for s in done["shards"].values())


@pytest.mark.gpu
def test_ray_gpu_actors_equal_local_gpu(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    n = _gpu_count()
    job = _float_job(tmp_path, n_shards=4, users_per_shard=2000)
    run_batch(job["users"], job["items"], tmp_path / "local", 50, device="gpu")
    ray.init(num_gpus=n, include_dashboard=False)
    try:
        summary = run_batch(job["users"], job["items"], tmp_path / "ray", 50, device="auto", gpus="all",
                            engine="ray")
    finally:
        ray.shutdown()
    assert summary.device == "gpu" and summary.workers == n
    assert _outputs(tmp_path / "ray") == _outputs(tmp_path / "local")
    assert pq.read_table(tmp_path / "ray" / "part-000.parquet").num_rows == 2000


def test_a_reset_channel_reads_as_its_end(monkeypatch) -> None:
    # A killed worker's end of a socket pair can read as a reset rather than an end of file: both mean the worker is
    # gone, and the parent names it (with its pid and shard) only where recv says EOFError.
    import multiprocessing as mp

    from recall.jobs.executors.channel import Channel

    ours, theirs = mp.Pipe(duplex=True)
    chan = Channel(ours)

    def reset(*_):
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(ours, "recv", reset)
    with pytest.raises(EOFError):
        chan.recv()
    theirs.send("x")
    with pytest.raises(EOFError):
        chan.recv(timeout=1.0)
    chan.close(0)
    theirs.close()


def test_ray_job_stopped_by_sigterm_exits_143_with_its_line(job: dict, tmp_path: Path) -> None:
    """A signal while the driver waits on Ray: the job's own line and exit status (ray.init puts Ray's handlers in
    place of the CLI's, and a handler that raised inside a Ray wait would leave it as Ray's SystemExit(1)); the
    killed actor's temporary file removed; the rerun resumes."""
    pytest.importorskip("ray")
    out = tmp_path / "out"
    args = ["batch", "--users", str(job["users"]), "--items", str(job["items"]), "--k", str(K), "--out", str(out),
            "--device", "cpu", "--batch-size", "32", "--engine", "ray"]
    returncode, stderr, _ = _sigterm_mid_shard(args, out)
    assert returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip().splitlines()[-1] == "error: terminated by SIGTERM; rerun the same command to resume"
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    assert "SIGTERM" in metrics(out)["job"]["error"]


def test_ray_refuses_more_cpu_actors_than_the_cluster_has(job: dict, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        with pytest.raises(InputError, match=r"--workers 2: the Ray cluster has 1 CPU\(s\)"):
            run_batch(job["users"], job["items"], tmp_path / "out", K, device="cpu", workers=2, engine="ray")
    finally:
        ray.shutdown()


class _Stop(Exception):
    pass


@pytest.mark.parametrize("init_fails", [False, True])
def test_a_signal_during_ray_init_waits_for_it(monkeypatch: pytest.MonkeyPatch, init_fails: bool) -> None:
    """A SIGTERM while ray.init runs is held until it returns, then handed to the handler from before (which stops the
    job): raised inside ray.init, it would leave Ray's agents half-started. Where ray.init fails, the signal still
    comes first."""
    ray = pytest.importorskip("ray")
    from recall.jobs.executors.ray import ray_session

    seen: list = []

    def init(**kwargs) -> None:
        signal.raise_signal(signal.SIGTERM)
        seen.append("init returned")
        if init_fails:
            raise ConnectionError("refused")

    def stop(signum: int, frame: object) -> None:
        seen.append(signum)
        raise _Stop

    monkeypatch.setattr(ray, "is_initialized", lambda: "init returned" in seen and not init_fails)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: seen.append("shutdown"))
    before = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(_Stop), ray_session(None) as poll:
            assert seen == ["init returned"]
            poll()
        assert seen == ["init returned", signal.SIGTERM] + ([] if init_fails else ["shutdown"])
        assert signal.getsignal(signal.SIGTERM) is stop
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_signal_after_the_drivers_last_look_still_stops_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray")
    from recall.jobs.executors.ray import ray_session

    seen: list = []

    def stop(signum: int, frame: object) -> None:
        seen.append(signum)
        raise _Stop

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # connected already: nothing started or shut down here
    before = signal.signal(signal.SIGINT, stop)
    try:
        with pytest.raises(_Stop), ray_session(None):
            signal.raise_signal(signal.SIGINT)  # recorded; the driver does not look again
            seen.append("body done")
        assert seen == ["body done", signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is stop
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_worker_done_with_its_work_dies_quietly_on_sigterm(tmp_path: Path) -> None:
    """A SIGTERM from the parent after a worker's work is over (in an exit hook, as numba's) ends it without
    "Exception ignored in atexit callback ... SystemExit" on the job's stderr."""
    child = (
        "import atexit, sys, time\n"
        "from recall.jobs.executors.local import _worker_signals\n"
        "with _worker_signals():\n"
        "    pass\n"
        "atexit.register(lambda: time.sleep(5))\n"
        "print('done', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "done"
    time.sleep(0.3)  # in the exit hook
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM, stderr
    assert "Exception ignored" not in stderr and "SystemExit" not in stderr, stderr
