"""The nightly job's inputs and output directory as an operator gets them wrong at 3 a.m. (the second batch audit,
2026-12-05): a user shard written as a folder, an item file of another model, an empty --out, a dangling link, a
job-wide input refused into a new directory, a stray file beside the outputs; and a signal before the command
begins or once the job is complete."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from parquet_data import write_embeddings
from processes import python_code
from test_batch import DIM, K, _run, _write_job

from recall.core.errors import InputError
from recall.jobs.batch import SUCCESS


@pytest.fixture
def job(tmp_path: Path) -> dict:
    return _write_job(tmp_path)


def _as_folder(job: dict) -> Path:
    """The last shard moved into a folder of its own name, as Spark writes a dataset."""
    last = Path(job["shards"][-1][0])
    folder = last.with_name(last.name + ".tmp")
    folder.mkdir()
    shutil.move(last, folder / "part-0.parquet")
    folder.rename(last)
    return last


def test_a_shard_written_as_a_folder_is_refused_not_skipped(job: dict, tmp_path: Path) -> None:
    folder = _as_folder(job)
    out = tmp_path / "out"
    for users in (job["users"], str(job["users"] / "*.parquet")):
        with pytest.raises(InputError, match=rf"{folder}: is a directory \(a dataset written as a folder"):
            run_users = {"users": users}
            _run({**job, **run_users}, out)
        assert not out.exists()
    # A '**' pattern reads the files inside it.
    summary = _run({**job, "users": str(job["users"] / "**" / "*.parquet")}, out)
    assert summary.shards_total == len(job["shards"]) and (out / SUCCESS).exists()


def test_items_of_another_dimension_blame_the_items_and_leave_out_untouched(job: dict, tmp_path: Path) -> None:
    right = job["items"].read_bytes()
    write_embeddings(job["items"], job["item_ids"], np.ones((len(job["item_ids"]), DIM + 2), np.float32))
    out = tmp_path / "out"
    with pytest.raises(InputError, match=rf"{job['items']}: the items have dimension {DIM + 2}, but every user "
                                         rf"shard's vectors have dimension {DIM}"):
        _run(job, out)
    assert not out.exists()
    job["items"].write_bytes(right)  # the right file back: the same command runs
    assert _run(job, out).shards_scored == len(job["shards"])


@pytest.mark.parametrize("out", ["", "-"])
def test_an_empty_out_is_refused(job: dict, out: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=r"--out '-?': expected the path of the output directory"):
        _run(job, out)
    assert not (tmp_path / SUCCESS).exists() and not (tmp_path / "-").exists()


def test_a_dangling_link_as_out_is_named_as_such(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "nowhere" / "zz")
    with pytest.raises(InputError, match=rf"{out}: is a symbolic link to {tmp_path / 'nowhere' / 'zz'}, which does "
                                         rf"not exist"):
        _run(job, out)


def test_a_job_wide_input_refused_leaves_no_new_directory(job: dict, tmp_path: Path) -> None:
    vecs = np.ones((len(job["item_ids"]), DIM), np.float32)
    vecs[3, 1] = np.nan
    write_embeddings(job["items"], job["item_ids"], vecs)
    out = tmp_path / "new" / "out"
    with pytest.raises(InputError, match="NaN"):
        _run(job, out)
    assert not out.exists()  # its parent, made with it, stays
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(InputError, match="NaN"):
        _run(job, existing)
    assert existing.is_dir()  # a directory that was there stays


def test_a_stray_file_in_a_finished_out_is_named(job: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run(job, out)
    shutil.copy(job["shards"][0][0], out / "zz-extra.parquet")
    notices: list[str] = []
    summary = _run(job, out, notice=notices.append)
    assert summary.shards_scored == 0 and (out / SUCCESS).exists()
    assert any("holds 1 file(s) recall batch did not write (zz-extra.parquet)" in n for n in notices), notices


@pytest.mark.parametrize("when", ["while the summary prints", "while the process shuts down"])
def test_a_signal_once_the_job_is_complete_says_so(job: dict, tmp_path: Path, when: str) -> None:
    out = tmp_path / "out"
    argv = ["recall", "batch", "--users", str(job["users"]), "--items", str(job["items"]), "--k", str(K), "--out",
            str(out), "--device", "cpu", "--quiet"]
    if when == "while the summary prints":
        # The signal arrives as the summary's line is made: the job is complete.
        setup = ("import recall.jobs.batch as b\n"
                 "real = b.BatchSummary.line\n"
                 "def line(self):\n"
                 "    os.kill(os.getpid(), signal.SIGTERM)\n"
                 "    return real(self)\n"
                 "b.BatchSummary.line = line\n")
        run = "main()\n"
    else:
        setup = ""
        run = ("try:\n"
               "    main()\n"
               "except SystemExit:\n"
               "    os.kill(os.getpid(), signal.SIGTERM)\n"
               "    time.sleep(30)\n")
    done = python_code(f"import os, signal, sys, time\n{setup}sys.argv = {argv!r}\nfrom recall.cli import main\n{run}")
    assert done.returncode == 143, (done.returncode, done.stderr)
    assert done.stderr.splitlines()[-1] == f"terminated by SIGTERM: the job is complete ({out / SUCCESS})", \
        done.stderr
    assert "Traceback" not in done.stderr and (out / SUCCESS).exists()


@pytest.mark.parametrize("out", ["", "-"])
def test_the_command_line_passes_an_empty_out_as_typed(job: dict, out: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # click's Path type would make "" the current directory before the job saw it.
    from typer.testing import CliRunner

    from recall.cli.app import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["batch", "--users", str(job["users"]), "--items", str(job["items"]), "--k",
                                      str(K), "--out", out, "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error: --out {out!r}: expected the path of the output directory"
    assert not (tmp_path / SUCCESS).exists()
