"""Operator-side failures of ``recall doctor``, ``recall tune``, the tune cache and the scripts in ``scripts/``: a tune
cache nested too deeply for the JSON decoder, no home directory (no cache location), a data shape that does not fit in
memory, a cache directory that cannot be made (found before the trials), arguments given to the nightly script, its
RUN_DATE and RECALL settings, an earlier run's files in gpu_run.sh's $OUT, and --out naming a file in the data
makers. CPU only, a few seconds in all.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import pwd
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from recall import Engine
from recall.cli.app import app
from recall.engine import tuning
from recall.tools import tune as tune_tool

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
SMALL_TUNE = ["tune", "--device", "cpu", "--k", "5", "--users", "20", "--items", "300", "--dim", "8"]


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    tuning.reset_state()
    yield tmp_path / "xdg"
    tuning.reset_state()


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return rng.standard_normal((400, 8)).astype(np.float32), rng.standard_normal((30, 8)).astype(np.float32)


def test_deeply_nested_cache_file_is_ignored_not_raised(cache_home: Path, caplog: pytest.LogCaptureFixture) -> None:
    items, users = _data()
    want = Engine(items, device="cpu", tune="off").search(users, 5)
    path = cache_home / "recall" / "tune.json"
    path.parent.mkdir(parents=True)
    path.write_text("[" * 100_000 + "]" * 100_000)  # valid JSON shape, too deep for the decoder: RecursionError
    with caplog.at_level(logging.WARNING, logger="recall"):
        got = Engine(items, device="cpu").search(users, 5)
    assert np.array_equal(got.indices, want.indices)
    assert "ignoring the tune cache" in caplog.text and "nested too deeply" in caplog.text
    assert tuning.cache_info()["status"].startswith("corrupt")
    result = runner.invoke(app, ["doctor", "--device", "cpu", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["tune_cache"]["status"].startswith("corrupt")


@pytest.fixture
def no_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """HOME and XDG_CACHE_HOME unset, and no passwd entry for this user id (a container run with --user 1234)."""
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def getpwuid(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", getpwuid)
    tuning._cache_path.cache_clear()
    yield
    tuning._cache_path.cache_clear()


def test_no_home_directory_searches_use_the_heuristic(no_home: None, caplog: pytest.LogCaptureFixture) -> None:
    items, users = _data()
    with caplog.at_level(logging.WARNING, logger="recall"):
        auto = Engine(items, device="cpu").search(users, 5)
        forced = Engine(items, device="cpu", tune="force").search(users, 5)
    want = Engine(items, device="cpu", tune="off").search(users, 5)
    assert np.array_equal(auto.indices, want.indices) and np.array_equal(forced.indices, want.indices)
    assert caplog.text.count("no directory for the tune cache") == 1


def test_no_home_directory_doctor_and_tune(no_home: None) -> None:
    result = runner.invoke(app, ["doctor", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.stdout.splitlines() if x.startswith("tune cache:"))
    assert line.startswith("tune cache: - (unavailable: no directory for the tune cache")
    report = json.loads(runner.invoke(app, ["doctor", "--device", "cpu", "--json"]).stdout)
    assert report["tune_cache"]["path"] is None and report["tune_cache"]["status"].startswith("unavailable")

    result = runner.invoke(app, SMALL_TUNE)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: no directory for the tune cache") and "set XDG_CACHE_HOME" in result.stderr
    assert "[1/" not in result.stderr and result.stderr.count("\n") == 1  # refused before the trials, one line
    assert runner.invoke(app, [*SMALL_TUNE, "--no-save", "-q"]).exit_code == 0


def test_tune_data_too_large_for_memory_is_one_line_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    def generate(*args: object, **kwargs: object) -> None:
        raise MemoryError("Unable to allocate 2.91 TiB for an array with shape (100000000000, 8) and data type "
                          "float32")

    monkeypatch.setattr(tune_tool, "generate", generate)
    result = runner.invoke(app, ["tune", "--device", "cpu", "--k", "5", "--users", "100000000000", "--items", "10",
                                 "--dim", "8", "--no-save"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: not enough memory for the data of this shape")
    assert "--users, --items or --dim" in result.stderr and "--batch-size" not in result.stderr
    assert result.stderr.count("\n") == 1


def test_tune_cache_dir_that_cannot_be_made_fails_before_the_trials(cache_home: Path) -> None:
    cache_home.mkdir()
    (cache_home / "recall").write_text("a file where the cache directory goes")
    result = runner.invoke(app, SMALL_TUNE)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"error: {cache_home / 'recall'}") and "[1/" not in result.stderr


# -- scripts --------------------------------------------------------------------------------------------------------

def _fake_recall(tmp_path: Path) -> Path:
    """A stand-in for the recall command that records each call and succeeds."""
    fake = tmp_path / "fake-recall"
    fake.write_text(f'#!/bin/sh\necho "$@" >>"{tmp_path / "calls"}"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return fake


def _nightly(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "LOG_DIR": str(tmp_path / "log"), "OUT_ROOT": str(tmp_path / "out"),
            "USERS": "u", "ITEMS": "i", "RECALL": str(_fake_recall(tmp_path)), "RETRY_DELAY": "0"}
    return subprocess.run(["bash", str(REPO / "scripts" / "nightly_recall.sh"), *args], env={**base, **env},
                          capture_output=True, text=True, timeout=30, check=False)


def test_nightly_runs_with_good_settings(tmp_path: Path) -> None:
    proc = _nightly(tmp_path, RUN_DATE="2026-11-30")
    assert proc.returncode == 0, proc.stderr
    assert "--out " + str(tmp_path / "out" / "2026-11-30") in (tmp_path / "calls").read_text()


@pytest.mark.parametrize(("args", "env", "message"), [
    (["2026-11-30"], {}, "nightly_recall: takes no arguments (got: 2026-11-30)"),
    ([], {"RUN_DATE": "2026-1-30"}, "nightly_recall: RUN_DATE must be a date YYYY-MM-DD, got '2026-1-30'"),
    ([], {"RUN_DATE": "2026-02-30"}, "nightly_recall: RUN_DATE must be a date YYYY-MM-DD, got '2026-02-30'"),
    ([], {"RUN_DATE": "2026-11-30", "RECALL": "/nonexistent/recall"},
     "nightly_recall: RECALL=/nonexistent/recall: command not found"),
])
def test_nightly_refuses_bad_settings_with_exit_2(tmp_path: Path, args: list[str], env: dict[str, str],
                                                  message: str) -> None:
    proc = _nightly(tmp_path, *args, **env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1
    assert not (tmp_path / "calls").exists()  # nothing run, nothing retried


def test_gpu_run_never_reports_an_earlier_runs_files(tmp_path: Path) -> None:
    out, work, bin_dir = tmp_path / "out", tmp_path / "work", tmp_path / "bin"
    (out / "bench").mkdir(parents=True)
    (out / "bench" / "results.md").write_text("| STALE table of an earlier run |\n")
    (out / "gpu-tests.log").write_text("3 passed in 9.0s (STALE)\n")
    work.mkdir()
    bin_dir.mkdir()
    fake = bin_dir / "python3"  # the bench fails at once, as without a GPU
    fake.write_text('#!/bin/sh\necho "error: --device gpu: no usable GPU"\nexit 2\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "RUN_TESTS": "0", "WORKLOADS": "S1"}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_run.sh")], cwd=work, env=env, capture_output=True,
                          text=True, timeout=30, check=False)
    assert proc.returncode != 0
    assert "STALE" not in proc.stdout and "gpu tests (rc 0): not run" in proc.stdout
    assert "error: --device gpu: no usable GPU" in proc.stdout


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("name", "args"), [
    ("make_batch_data", ["--users", "10", "--items", "5", "--dim", "4", "--shards", "2"]),
    ("make_sample_data", []),
])
def test_data_makers_refuse_out_naming_a_file(tmp_path: Path, capsys: pytest.CaptureFixture, name: str,
                                              args: list[str]) -> None:
    target = tmp_path / "a-file"
    target.write_text("not a directory")
    with pytest.raises(SystemExit) as exc:
        _script(name).main(["--out", str(target), *args])
    assert exc.value.code == 2
    assert f"error: --out {target} exists and is not a directory" in capsys.readouterr().err
    assert target.read_text() == "not a directory"


@pytest.mark.parametrize("command", ["doctor", "tune"])
def test_doctor_and_tune_stop_on_sigterm_with_one_line(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The house signal policy: SIGTERM in the middle of the work gives one line and exit 143, no traceback."""
    import signal as signal_mod

    from typer.testing import CliRunner

    from recall.cli.app import app
    from recall.tools import doctor as doctor_tool
    from recall.tools import tune as tune_tool

    def terminated(*args, **kwargs):
        signal_mod.raise_signal(signal_mod.SIGTERM)
        raise AssertionError("the SIGTERM handler did not stop the command")

    monkeypatch.setattr(doctor_tool if command == "doctor" else tune_tool, "run", terminated)
    args = ["doctor", "--device", "cpu"] if command == "doctor" else \
        ["tune", "--device", "cpu", "--k", "5", "--users", "10", "--items", "20", "--dim", "4", "--no-save"]
    def not_handled(signum, frame):  # where the command does not handle SIGTERM itself (not the test's death)
        raise RuntimeError("SIGTERM not handled by the command")

    before = signal_mod.signal(signal_mod.SIGTERM, not_handled)
    try:
        result = CliRunner().invoke(app, args)
        assert signal_mod.getsignal(signal_mod.SIGTERM) is not_handled
    finally:
        signal_mod.signal(signal_mod.SIGTERM, before)
    assert result.exit_code == 143, result.output
    assert result.stderr.strip().splitlines() == [
        "terminated by SIGTERM: " + ("no report" if command == "doctor" else "no result")]
