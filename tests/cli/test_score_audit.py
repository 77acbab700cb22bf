"""``recall score`` and ``recall rescore`` from the shell: the defects an audit of both commands found, each a test
that failed before its fix (exit 2 with one ``error:`` line naming the file and the reason, the previous output as it
was; what the docs say each command does)."""
from __future__ import annotations

import builtins
import errno
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from parquet_data import int_data, write_embeddings
from typer.testing import CliRunner

from recall.cli.app import app

runner = CliRunner()


@pytest.fixture
def files(tmp_path: Path) -> dict:
    users, items = int_data(9, 7, 4, seed=5)
    f = {
        "users": write_embeddings(tmp_path / "users.parquet", 100 + np.arange(9), users),
        "items": write_embeddings(tmp_path / "items.parquet", 7000 + np.arange(7), items),
        "cands": tmp_path / "cands.parquet",
        "out": tmp_path / "out.parquet",
        "dir": tmp_path,
    }
    pq.write_table(pa.table({"user_id": [100, 103], "item_ids": [[7000, 7001], [7002]]}), f["cands"])
    return f


def _score(f: dict, *extra: str) -> list[str]:
    return ["score", "--users", str(f["users"]), "--items", str(f["items"]), "--k", "3", "--out", str(f["out"]),
            "--device", "cpu", *extra]


def _rescore(f: dict, *extra: str) -> list[str]:
    return ["rescore", "--users", str(f["users"]), "--items", str(f["items"]), "--candidates", str(f["cands"]),
            "--k", "3", "--out", str(f["out"]), "--device", "cpu", *extra]


def _refused(f: dict, args: list[str], message: str) -> None:
    """Exit 2, exactly one line ``error: {message}``, the previous output untouched and no temporary file."""
    f["out"].write_bytes(b"yesterday")
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: {message}"], result.stderr
    assert f["out"].read_bytes() == b"yesterday"
    assert not [p for p in f["dir"].iterdir() if ".tmp-" in p.name]


def test_rescore_allow_empty_writes_an_empty_file_for_an_empty_users_file(files: dict) -> None:
    """--allow-empty: 'Write an empty output when the users or the candidates file has no rows'. With no users, every
    candidate names an unknown user, which was refused as a candidates file of another catalogue (exit 2)."""
    write_embeddings(files["users"], pa.array([], pa.int64()), np.zeros((0, 4), np.float32))
    assert runner.invoke(app, _rescore(files)).exit_code == 2  # without --allow-empty: refused, as documented
    result = runner.invoke(app, _rescore(files, "--allow-empty"))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("rescored 0 users x 0 candidate pairs (of 7 items)")
    assert pq.read_table(files["out"]).num_rows == 0


def _duplicated(names: list[str], columns: list[pa.Array]) -> pa.Table:
    return pa.Table.from_arrays(columns, names=names)


@pytest.mark.parametrize("case", ["users_id", "items_vector", "interests_vector", "exclude_user_id",
                                  "exclude_item_ids", "allow_item_id", "candidates_user_id"])
def test_a_column_named_twice_is_refused(files: dict, case: str) -> None:
    """A file with two columns of the name a reader wants: the embeddings readers said 'no id column 'id'' while
    listing it; the pairs reader took the second 'user_id' as the item ids (every exclusion silently ignored), or
    failed with a KeyError / AttributeError traceback (exit 1)."""
    d, vecs = files["dir"], pa.array(np.ones((9, 4)).tolist(), pa.list_(pa.float32()))
    ids = pa.array(100 + np.arange(9))
    bad = d / "bad.parquet"
    if case == "users_id":
        pq.write_table(_duplicated(["id", "id", "embedding"], [ids, ids, vecs]), bad)
        args, col = _score({**files, "users": bad}), "id"
    elif case in ("items_vector", "interests_vector"):
        pq.write_table(_duplicated(["id", "embedding", "embedding"], [ids, vecs, vecs]), bad)
        args, col = _score({**files, "items": bad}), "embedding"
        if case == "interests_vector":
            args = _score({**files, "users": bad}, "--interests", "max")
    elif case == "exclude_user_id":
        pq.write_table(_duplicated(["user_id", "user_id", "item_id"], [pa.array([100]), pa.array([100]),
                                                                       pa.array([7000])]), bad)
        args, col = _score(files, "--exclude", str(bad)), "user_id"
    elif case == "exclude_item_ids":
        pq.write_table(_duplicated(["user_id", "item_ids", "item_ids"], [pa.array([100]), pa.array([[7000]]),
                                                                         pa.array([[7001]])]), bad)
        args, col = _score(files, "--exclude", str(bad)), "item_ids"
    elif case == "allow_item_id":
        pq.write_table(_duplicated(["item_id", "item_id"], [pa.array([7000]), pa.array([7001])]), bad)
        args, col = _score(files, "--allow", str(bad)), "item_id"
    else:
        pq.write_table(_duplicated(["user_id", "user_id", "item_ids"], [pa.array([100]), pa.array([100]),
                                                                        pa.array([[7000]])]), bad)
        args, col = _rescore({**files, "cands": bad}), "user_id"
    names = ", ".join(repr(n) for n in pq.read_schema(bad).names)
    _refused(files, args, f"{bad}: 2 columns are named {col!r} (the columns are {names}); expected one")


@pytest.mark.parametrize("command,option,what", [
    ("score", "--users", "embeddings"), ("score", "--items", "embeddings"), ("score", "--exclude", "exclusions"),
    ("score", "--allow", "allow items"), ("score", "--deny", "deny items"), ("rescore", "--candidates", "candidates"),
    ("rescore", "--users", "embeddings"),
])
def test_an_unreadable_input_is_one_error_line(files: dict, monkeypatch: pytest.MonkeyPatch, command: str,
                                                option: str, what: str) -> None:
    """click checked readability itself and answered with its usage error (4 lines, 'Usage: ...', 'Error: Invalid
    value for '--users': path ... is not readable.') where every other bad path gets recall's one ``error:`` line.
    Unreadable is simulated for both checks (os.access, open), so that the test also runs as root."""
    secret = files["dir"] / "secret.parquet"
    if option in ("--allow", "--deny"):
        pq.write_table(pa.table({"item_id": [7000]}), secret)
    else:
        secret.write_bytes((files["cands"] if option == "--candidates" else files["users"]).read_bytes())
    real_access, real_open = os.access, builtins.open

    def access(path: object, mode: int, *args: object, **kwargs: object) -> bool:
        return False if os.fspath(path) == str(secret) and mode & os.R_OK else real_access(path, mode, *args, **kwargs)

    def denied_open(path: object, *args: object, **kwargs: object) -> object:
        if os.fspath(path) == str(secret):
            raise PermissionError(13, "Permission denied", str(secret))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr("recall.io.parquet.open", denied_open, raising=False)
    base = _score if command == "score" else _rescore
    args = base(files) + [option, str(secret)]  # a repeated option: click keeps the last
    _refused(files, args, f"{secret}: cannot read the {what} file: Permission denied")


def test_rescore_batch_size_is_checked_as_score_checks_it(files: dict) -> None:
    """rescore spelled its own check (and left 2^31 to the job, whose message named 'batch_size', not the option)."""
    _refused(files, _rescore(files, "--batch-size", "0"), "--batch-size must be an integer >= 1, got 0")
    _refused(files, _rescore(files, "--batch-size", str(2 ** 31)), "--batch-size must be below 2^31, got 2,147,483,648")


def test_rescore_says_on_a_terminal_that_the_first_run_compiles(files: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """reference.md, conventions of the Parquet commands (rescore among them): on a terminal, the first CPU run after
    an install says that it compiles the CPU kernels. rescore said nothing."""
    from recall import backends
    from recall.cli import common

    monkeypatch.setattr(backends, "cpu_kernels_cache", lambda: (False, "/some/where"))
    monkeypatch.setattr(common, "show_progress", lambda quiet: not quiet)
    result = runner.invoke(app, _rescore(files))
    assert result.exit_code == 0, result.output
    notice = ("compiling the CPU kernels: the first run after an install takes a few seconds more (numba caches them "
              "under /some/where)")
    assert result.stderr.splitlines() == [notice]
    assert runner.invoke(app, _rescore(files, "--quiet")).stderr == ""


def test_batch_items_unreadable_and_batch_size_as_score_says_them(files: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """recall batch's --items had click's readability check (its usage error), and --batch-size a check of its own."""
    secret = files["dir"] / "secret.parquet"
    secret.write_bytes(files["items"].read_bytes())
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, *a, **kw: False if os.fspath(path) == str(secret)
                        else real_access(path, mode, *a, **kw))
    out = files["dir"] / "job"
    base = ["batch", "--users", str(files["users"]), "--k", "3", "--out", str(out), "--device", "cpu"]
    result = runner.invoke(app, base + ["--items", str(secret)])
    assert "Usage" not in result.output and "not readable" not in result.output, result.output
    result = runner.invoke(app, base + ["--items", str(files["items"]), "--batch-size", "0"])
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        "error: --batch-size must be an integer >= 1, got 0"], result.stderr


@pytest.mark.parametrize("code, exit_code", [(errno.ENOSPC, 1), (errno.EDQUOT, 1), (errno.EACCES, 2)])
def test_creating_the_output_fails_with_the_system_or_the_path(files: dict, monkeypatch: pytest.MonkeyPatch,
                                                              code: int, exit_code: int) -> None:
    """A disk full while the output's temporary file is created was exit 2 (bad input); it is the system's: exit 1,
    one line naming the output, the previous file kept. A path that cannot take a file stays exit 2."""
    real_open = builtins.open

    def failing_open(path: object, *args: object, **kwargs: object) -> object:
        if ".tmp-" in os.fspath(path):
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("recall.io.writer.open", failing_open, raising=False)
    files["out"].write_bytes(b"yesterday")
    result = runner.invoke(app, _score(files))
    assert result.exit_code == exit_code, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {files['out']}") and os.strerror(code) in lines[0], lines
    assert "cannot create" in lines[0]
    assert files["out"].read_bytes() == b"yesterday"


@pytest.mark.parametrize("code, exit_code", [(errno.ENOSPC, 1), (errno.EIO, 1), (errno.EACCES, 2), (errno.EEXIST, 2)])
def test_creating_the_job_directory_fails_with_the_system_or_the_path(files: dict, monkeypatch: pytest.MonkeyPatch,
                                                                      code: int, exit_code: int) -> None:
    """recall batch's output directory: every mkdir error was exit 2 (bad input); a disk full or an I/O error is the
    system's, exit 1; a path that cannot take one stays exit 2; either way one line naming the directory."""
    out = files["dir"] / "job"
    real_mkdir = Path.mkdir

    def failing_mkdir(self: Path, *args: object, **kwargs: object) -> None:
        if self == out:
            raise OSError(code, os.strerror(code))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", failing_mkdir)
    result = runner.invoke(app, ["batch", "--users", str(files["users"]), "--items", str(files["items"]), "--k", "3",
                                 "--out", str(out), "--device", "cpu"])
    assert result.exit_code == exit_code, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "cannot create the output directory" in lines[0] and os.strerror(code) in lines[0]
    assert lines[0].startswith(f"error: {out}: "), lines
    assert not out.exists()


def test_a_signal_after_the_job_is_complete_says_so(files: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM while recall batch prints its summary (the job complete, _SUCCESS written) killed it silently (-15);
    now one line says the job is complete, exit 143, and a rerun has nothing to do."""
    import signal

    from recall.jobs.batch.job import BatchSummary

    real_line = BatchSummary.line

    def killed(self: BatchSummary) -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        return real_line(self)

    monkeypatch.setattr(BatchSummary, "line", killed)
    out = files["dir"] / "job"
    args = ["batch", "--users", str(files["users"]), "--items", str(files["items"]), "--k", "3", "--out", str(out),
            "--device", "cpu", "--quiet"]
    result = runner.invoke(app, args)
    assert result.exit_code == 143, result.output
    assert result.stderr.splitlines()[-1] == f"terminated by SIGTERM: the job is complete ({out / '_SUCCESS'})", \
        result.stderr
    assert (out / "_SUCCESS").exists()
    monkeypatch.setattr(BatchSummary, "line", real_line)
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert again.stdout.startswith("batch: all 1 shard "), again.stdout  # nothing scored again
