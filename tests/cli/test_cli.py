"""The ``recall`` CLI: ``score`` and ``demo`` through typer's CliRunner, and a real ``python -m recall`` subprocess.

Every bad input of the foundation issue must give exit code 2, a clear message naming the file, row and id where
there is one, no traceback, and no output file.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from parquet_data import int_data, oracle_topk, write_embeddings
from recall.cli.app import app
from recall.cli.common import parse_bytes
from recall.core.errors import InputError

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def files(tmp_path: Path) -> dict:
    users, items = int_data(29, 17, 4, seed=1)
    user_ids, item_ids = 100 + np.arange(29), 7000 + np.arange(17)[::-1]
    return {
        "users": write_embeddings(tmp_path / "users.parquet", user_ids, users, "list32", row_group_size=8),
        "items": write_embeddings(tmp_path / "items.parquet", item_ids, items, row_group_size=5),
        "out": tmp_path / "out.parquet",
        "user_vecs": users, "item_vecs": items, "user_ids": user_ids, "item_ids": item_ids, "dir": tmp_path,
    }


def _score_args(f: dict, *extra: str, k: str = "3") -> list[str]:
    return ["score", "--users", str(f["users"]), "--items", str(f["items"]), "--k", k, "--out", str(f["out"]),
            "--device", "cpu", *extra]


def test_score(files: dict) -> None:
    result = runner.invoke(app, _score_args(files, "--batch-size", "6"))
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    assert "29 users x 17 items, dim 4, k 3" in lines[0] and "on cpu" in lines[0] and "users/s" in lines[0]
    table = pq.read_table(files["out"])
    rows, _ = oracle_topk(files["user_vecs"], files["item_vecs"], 3)
    assert table.column("user_id").to_pylist() == files["user_ids"].tolist()
    assert table.column("item_ids").to_pylist() == [files["item_ids"][r].tolist() for r in rows]


def test_score_verbose_and_options(files: dict) -> None:
    result = runner.invoke(app, _score_args(files, "--metric", "l2", "--memory-budget", "64KiB", "-v"))
    assert result.exit_code == 0, result.output
    assert "metric l2" in result.stdout and "stages (overlapping): read" in result.stdout


def test_score_compression(files: dict) -> None:
    from recall.cli.common import Compression
    from recall.io import COMPRESSIONS

    assert tuple(c.value for c in Compression) == COMPRESSIONS
    result = runner.invoke(app, _score_args(files, "--compression", "none"))
    assert result.exit_code == 0, result.output
    assert pq.ParquetFile(files["out"]).metadata.row_group(0).column(2).compression == "UNCOMPRESSED"
    result = runner.invoke(app, _score_args(files, "--compression", "gzip"))
    assert result.exit_code == 2
    assert "'gzip' is not one of 'none', 'snappy', 'lz4', 'zstd'" in " ".join(result.output.replace("│", " ").split())


def test_score_custom_columns(files: dict, tmp_path: Path) -> None:
    users = write_embeddings(tmp_path / "u2.parquet", files["user_ids"], files["user_vecs"], id_col="uid",
                             vec_col="vec")
    items = write_embeddings(tmp_path / "i2.parquet", files["item_ids"], files["item_vecs"], id_col="uid",
                             vec_col="vec")
    result = runner.invoke(app, ["score", "--users", str(users), "--items", str(items), "--k", "2", "--out",
                                 str(files["out"]), "--id-col", "uid", "--vec-col", "vec", "--device", "cpu"])
    assert result.exit_code == 0, result.output


def test_unknown_exclusion_ids_warn_with_count(files: dict) -> None:
    excl = files["dir"] / "x.parquet"
    pq.write_table(pa.table({"user_id": [100, 100, 999, 101], "item_id": [7000, 7001, 7000, 1]}), excl)
    result = runner.invoke(app, _score_args(files, "--exclude", str(excl)))
    assert result.exit_code == 0, result.output
    assert "warning: 2 of 4 exclusion pairs" in result.stderr
    items_of_100 = pq.read_table(files["out"]).column("item_ids").to_pylist()[0]
    assert 7000 not in items_of_100 and 7001 not in items_of_100


def test_demo(tmp_path: Path) -> None:
    out = tmp_path / "demo.parquet"
    result = runner.invoke(app, ["demo", "--out", str(out), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "3,000 users x 5,000 items, dim 32" in result.stdout
    assert result.stdout.count("  user ") == 3 and "already-seen items excluded" in result.stdout
    table = pq.read_table(out)
    assert table.num_rows == 3000 and {len(x) for x in table.column("item_ids").to_pylist()} == {10}


def test_demo_show_and_large_k(tmp_path: Path) -> None:
    out = tmp_path / "demo.parquet"
    result = runner.invoke(app, ["demo", "--out", str(out), "--device", "cpu", "--show", "0"])
    assert result.exit_code == 2 and "--show must be at least 1, got 0" in result.stderr and not out.exists()
    result = runner.invoke(app, ["demo", "--out", str(out), "--device", "cpu", "--k", "100000", "-q"])
    assert result.exit_code == 0, result.output
    assert "5,000 per user written" in result.stdout  # what was written: the whole catalogue


@pytest.mark.parametrize("args, needle", [
    (["--batch-size", str(2 ** 63)], "--batch-size must be below 2^31"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
    (["--item-memory", "8E"], "--item-memory must be a positive number of bytes"),
])
def test_score_refuses_sizes_it_cannot_take(tmp_path: Path, args: list, needle: str) -> None:
    data = Path(__file__).resolve().parents[2] / "data"
    out = tmp_path / "o.parquet"
    result = runner.invoke(app, ["score", "--users", str(data / "users.parquet"), "--items",
                                 str(data / "items.parquet"), "--k", "3", "--out", str(out), "--device", "cpu", *args])
    assert result.exit_code == 2 and needle in result.stderr and not out.exists()


def test_demo_missing_sample(tmp_path: Path) -> None:
    result = runner.invoke(app, ["demo", "--data", str(tmp_path), "--out", str(tmp_path / "o.parquet")])
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and "make_sample_data.py" in result.stderr


def test_no_args_shows_help_and_keeps_subcommands() -> None:
    result = runner.invoke(app, [])
    assert "score" in result.output and "demo" in result.output
    assert runner.invoke(app, ["--version"]).stdout.startswith("recall ")


@pytest.mark.parametrize("text,expected", [("1024", 1024), ("512MiB", 512 << 20), ("2G", 2 << 30),
                                           ("1.5k", 1536), ("64 KB", 64 << 10)])
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "0", "lots", "1X"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(InputError, match="--memory-budget"):
        parse_bytes(text)


# ---- bad input: exit 2, one line, no traceback, no output ------------------------------------------------------

def _break(f: dict, case: str) -> tuple[list[str], str]:
    """Arguments that make ``recall score`` fail, and a regex its one-line error must match."""
    d, users, items = f["dir"], f["user_vecs"], f["item_vecs"]
    if case == "missing_users":
        return _score_args({**f, "users": d / "nope.parquet"}), r"nope\.parquet: no such file"
    if case == "unreadable_items_dir":
        (d / "adir").mkdir()
        return _score_args({**f, "items": d / "adir"}), r"adir: is a directory"
    if case == "not_parquet":
        (d / "users.parquet").write_text("id,embedding\n")
        return _score_args(f), r"users\.parquet: not a Parquet file"
    if case == "truncated_items":
        data = f["items"].read_bytes()
        f["items"].write_bytes(data[:-40])
        return _score_args(f), r"items\.parquet: not a Parquet file, or truncated"
    if case == "missing_column":
        write_embeddings(f["items"], f["item_ids"], items, vec_col="vector")
        return _score_args(f), r"items\.parquet: no vector column 'embedding'; the columns are 'id', 'vector'"
    if case == "null_vector":
        arr = users.tolist()
        arr[19] = None
        write_embeddings(f["users"], f["user_ids"], None, vec_array=pa.array(arr, pa.list_(pa.float32())),
                         row_group_size=8)
        return _score_args(f), r"users\.parquet: row 19 \(id 119\) has a null vector"
    if case == "ragged":
        arr = users.tolist()
        arr[22] = arr[22][:2]
        write_embeddings(f["users"], f["user_ids"], None, vec_array=pa.array(arr, pa.list_(pa.float32())),
                         row_group_size=8)
        return _score_args(f, "--batch-size", "5"), r"users\.parquet: row 22 \(id 122\) has 2 values, expected 4"
    if case == "nan_items":
        bad = items.copy()
        bad[9, 3] = np.nan
        write_embeddings(f["items"], f["item_ids"], bad, row_group_size=5)
        return _score_args(f), rf"items\.parquet: row 9 \(id {f['item_ids'][9]}\) has a NaN or infinite value"
    if case == "inf_users":
        bad = users.copy()
        bad[27, 0] = -np.inf
        write_embeddings(f["users"], f["user_ids"], bad, "list64", row_group_size=8)
        return _score_args(f, "--batch-size", "4"), r"users\.parquet: row 27 \(id 127\) has a NaN or infinite value"
    if case == "dimension_mismatch":
        write_embeddings(f["items"], f["item_ids"], np.ones((17, 6), np.float32))
        return _score_args(f), r"users\.parquet: row 0 \(id 100\) has dimension 4, expected 6"
    if case == "duplicate_item_ids":
        ids = f["item_ids"].copy()
        ids[12] = ids[3]
        write_embeddings(f["items"], ids, items, row_group_size=5)
        return _score_args(f), rf"items\.parquet: duplicate id {ids[3]} at rows 3 and 12"
    if case == "empty_items":
        write_embeddings(f["items"], pa.array([], pa.int64()), np.zeros((0, 4), np.float32))
        return _score_args(f), r"items\.parquet: the file has no rows"
    if case == "k_zero":
        return _score_args(f, k="0"), r"k must be an integer >= 1, got 0"
    if case == "k_negative":
        return _score_args(f, k="-5"), r"k must be an integer >= 1, got -5"
    if case == "exclusion_columns":
        pq.write_table(pa.table({"user": [100], "item": [7000]}), d / "x.parquet")
        return _score_args(f, "--exclude", str(d / "x.parquet")), \
            r"x\.parquet: exclusion columns are 'user', 'item'; expected 'user_id' with 'item_id'"
    if case == "missing_exclusions":
        return _score_args(f, "--exclude", str(d / "nox.parquet")), r"nox\.parquet: no such file"
    if case == "bad_memory_budget":
        return _score_args(f, "--memory-budget", "a lot"), r"--memory-budget must be a positive number of bytes"
    if case == "batch_size_zero":
        return _score_args(f, "--batch-size", "0"), r"--batch-size must be an integer >= 1"
    # Issue 19.
    if case == "empty_users":
        write_embeddings(f["users"], pa.array([], pa.int64()), np.zeros((0, 4), np.float32))
        return _score_args(f), r"users\.parquet: the users file has no rows, so this would write an empty candidates " \
                               r"file to .*out\.parquet; pass --allow-empty"
    if case == "out_trailing_slash":
        return _score_args({**f, "out": f"{d}/newdir/"}), r"newdir/: names a directory \(it ends with '/'\)"
    if case == "out_dash":
        return _score_args({**f, "out": "-"}), r"'-': expected the path of the output Parquet file"
    if case == "memory_budget_fraction":
        return _score_args(f, "--memory-budget", "0.5"), r"--memory-budget must be at least 1 byte.*got '0\.5'"
    if case == "users_symlink_loop":
        (d / "loop1.parquet").symlink_to(d / "loop2.parquet")
        (d / "loop2.parquet").symlink_to(d / "loop1.parquet")
        return _score_args({**f, "users": d / "loop1.parquet"}), \
            r"loop1\.parquet: cannot open the embeddings file: Too many levels of symbolic links"
    if case == "k_unrepresentable":
        return _score_args(f, k="1000000000000"), r"k must be below 2\^31 .*got 1,000,000,000,000"
    if case == "overflow_users":
        bad = users.copy()
        bad[11] = 1e37
        write_embeddings(f["users"], f["user_ids"], bad, row_group_size=8)
        return _score_args(f, "--batch-size", "4"), \
            r"^error: .*users\.parquet: row 11 \(id 111\) has norm 2e\+37 and the largest item norm is .*overflow"
    raise AssertionError(case)


CASES = ["missing_users", "unreadable_items_dir", "not_parquet", "truncated_items", "missing_column", "null_vector",
         "ragged", "nan_items", "inf_users", "dimension_mismatch", "duplicate_item_ids", "empty_items", "k_zero",
         "k_negative", "exclusion_columns", "missing_exclusions", "bad_memory_budget", "batch_size_zero",
         "empty_users", "out_trailing_slash", "out_dash", "memory_budget_fraction", "users_symlink_loop",
         "k_unrepresentable", "overflow_users"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input(files: dict, case: str) -> None:
    args, pattern = _break(files, case)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert __import__("re").search(pattern, lines[0]), lines[0]
    assert "Traceback" not in result.output
    assert not files["out"].exists()
    assert not [p for p in files["dir"].iterdir() if ".tmp-" in p.name]
    assert not (files["dir"] / "newdir").exists() and not (files["dir"] / "-").exists()


def test_unknown_metric(files: dict) -> None:
    """Choices are checked by the argument parser: its usage error, exit 2, no output."""
    result = runner.invoke(app, _score_args(files, "--metric", "dot"))
    assert result.exit_code == 2
    flat = " ".join(result.output.replace("│", " ").split())
    assert "'dot' is not one of 'ip', 'cosine', 'l2'" in flat, result.output
    assert "Traceback" not in result.output and not files["out"].exists()


def test_gpu_without_gpu(files: dict) -> None:
    from recall.backends import cuda_status

    if cuda_status()[0]:
        pytest.skip("a GPU is usable here")
    args = _score_args(files)
    args[args.index("cpu")] = "gpu"
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and result.stderr.startswith("error: device='gpu' but no GPU is usable")
    assert not files["out"].exists()


# ---- a real process ----------------------------------------------------------------------------------------------

def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "recall", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_subprocess_score(files: dict) -> None:
    proc = _run(*_score_args(files, "--quiet"), cwd=files["dir"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # not a terminal: no progress bar; --quiet: no notices
    assert "29 users x 17 items" in proc.stdout
    assert pq.read_table(files["out"]).num_rows == 29


def test_subprocess_bad_input(files: dict) -> None:
    args, pattern = _break(files, "nan_items")
    proc = _run(*args, cwd=files["dir"])
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert __import__("re").search(pattern, proc.stderr)
    assert not files["out"].exists()


def test_progress_bar_only_on_a_terminal_without_quiet(files: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    import recall.cli.common as common
    import recall.cli.score as score_cli

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert common.show_progress(quiet=False) and not common.show_progress(quiet=True)
    # With the bar forced on, a run still succeeds and the summary still goes to stdout.
    monkeypatch.setattr(score_cli, "show_progress", lambda quiet: True)
    result = runner.invoke(app, _score_args(files, "--batch-size", "3"))
    assert result.exit_code == 0, result.output
    assert "29 users x 17 items" in result.stdout


def test_score_precision_fast_gives_the_exact_answer(tmp_path):
    # --precision fast certifies the exact top-k (on a GPU from float16 scores; the CPU, with no faster float16
    # arithmetic, searches in exact precision): the same file content.
    from typer.testing import CliRunner

    from recall.cli.app import app

    data = Path(__file__).resolve().parents[2] / "data"
    outs = {}
    for precision in ("exact", "fast"):
        out = tmp_path / f"{precision}.parquet"
        result = CliRunner().invoke(app, ["score", "--users", str(data / "users.parquet"), "--items",
                                          str(data / "items.parquet"), "--k", "7", "--out", str(out), "--device",
                                          "cpu", "--precision", precision, "--quiet"])
        assert result.exit_code == 0, result.output
        outs[precision] = pq.read_table(out)
    assert outs["exact"]["user_id"].equals(outs["fast"]["user_id"])
    assert outs["exact"]["item_ids"].equals(outs["fast"]["item_ids"])


def test_score_precision_fast_with_interests_is_refused(tmp_path):
    from typer.testing import CliRunner

    from recall.cli.app import app

    data = Path(__file__).resolve().parents[2] / "data"
    result = CliRunner().invoke(app, ["score", "--users", str(data / "users.parquet"), "--items",
                                      str(data / "items.parquet"), "--k", "7", "--out", str(tmp_path / "o.parquet"),
                                      "--interests", "max", "--precision", "fast"])
    assert result.exit_code == 2
    assert "--precision fast applies to single-vector users" in result.output
    assert not (tmp_path / "o.parquet").exists()


# ---- issue 19: what a failed, killed or odd run leaves -------------------------------------------------------------

def test_empty_users_keep_the_previous_output_unless_allowed(files: dict) -> None:
    assert runner.invoke(app, _score_args(files)).exit_code == 0
    before = files["out"].read_bytes()
    write_embeddings(files["users"], pa.array([], pa.int64()), np.zeros((0, 4), np.float32))
    result = runner.invoke(app, _score_args(files))
    assert result.exit_code == 2 and f"so this would replace {files['out']} ({len(before):,} bytes)" in result.stderr
    assert files["out"].read_bytes() == before
    result = runner.invoke(app, _score_args(files, "--allow-empty"))
    assert result.exit_code == 0, result.output
    assert pq.read_table(files["out"]).num_rows == 0


def test_k_beyond_the_catalogue_costs_what_k_n_items_costs(files: dict, tmp_path: Path) -> None:
    """Issue 19.4: the result was allocated at n_users x k (1.48 GB for k = 10^6 on 100 x 200; k = 2^31 - 1 would be
    terabytes): it is the whole catalogue, the same file as k = n_items."""
    assert runner.invoke(app, _score_args(files, k="17")).exit_code == 0
    want = files["out"].read_bytes()
    result = runner.invoke(app, _score_args(files, k=str(2 ** 31 - 1)))
    assert result.exit_code == 0, result.output
    assert files["out"].read_bytes() == want and f"k {2 ** 31 - 1:,}".replace(",", "") in result.stdout


def test_disk_full_is_one_line_naming_the_output(files: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    result = runner.invoke(app, _score_args(files))
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"error: {files['out']}: cannot write: No space left on device; the file at this path, if any, is as it was"]
    assert not files["out"].exists() and not [p for p in files["dir"].iterdir() if ".tmp-" in p.name]


def test_help_shows_no_value_after_plain_flags() -> None:
    for command in ("score", "rescore", "batch", "demo"):
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0 and "<bool>" not in result.output and "--quiet" in result.output


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_leftovers_of_killed_runs_are_removed_and_said_once(files: dict) -> None:
    """Issue 19.3: kill -9 leftovers were never removed nor mentioned by later runs into the same directory. Only
    those of dead processes go; a live writer's file stays."""
    dead = _dead_pid()
    leftover = files["dir"] / f".out.parquet.tmp-{dead}"
    leftover.write_bytes(b"x" * 76_500)
    other = files["dir"] / f".notes.txt.tmp-{dead}"  # another program's: not a Parquet file, left alone
    other.write_bytes(b"z")
    live = subprocess.Popen(["sleep", "30"])
    try:
        busy = files["dir"] / f".other.parquet.tmp-{live.pid}"
        busy.write_bytes(b"y")
        result = runner.invoke(app, _score_args(files))
        assert result.exit_code == 0, result.output
        notices = [line for line in result.stderr.splitlines() if "temporary file" in line]
        assert notices == [f"notice: {files['dir']}: removed 1 temporary file left by earlier runs that were killed "
                           f"(.out.parquet.tmp-{dead}; 0.1 MB)"]
        assert not leftover.exists() and busy.exists() and other.exists()
        result = runner.invoke(app, _score_args(files))
        assert result.exit_code == 0 and "temporary file" not in result.stderr
    finally:
        live.kill()
        live.wait()


def _slow_score(files: dict, tmp: Path) -> subprocess.Popen:
    """``recall score`` writing slowly (``python -m pacing``): 400 users in batches of 8, 50 ms each."""
    users, items = int_data(400, 17, 4, seed=2)
    write_embeddings(files["users"], 1000 + np.arange(400), users, row_group_size=64)
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{TESTS}", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen([sys.executable, "-m", "pacing", *_score_args(files, "--batch-size", "8")], cwd=tmp,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("sig,code,how", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "SIGINT")])
def test_a_signal_removes_the_temporary_file_and_says_so(files: dict, sig: int, code: int, how: str) -> None:
    """Issue 19.3: kill -TERM (and timeout) left a 76.5 MB .{name}.tmp-{pid}; Ctrl-C exited 130 without a word."""
    files["out"].write_bytes(b"yesterday")
    proc = _slow_score(files, files["dir"])
    try:
        deadline = time.monotonic() + 60
        while not any(".tmp-" in p.name and p.stat().st_size > 4 for p in files["dir"].iterdir()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, stderr
    assert stderr.strip().splitlines() == [f"interrupted: nothing written to {files['out']}; rerun to start again"]
    assert files["out"].read_bytes() == b"yesterday"
    assert not [p for p in files["dir"].iterdir() if ".tmp-" in p.name]


def test_rescore_empty_candidates_keep_the_previous_output(files: dict) -> None:
    cands = files["dir"] / "cands.parquet"
    pq.write_table(pa.table({"user_id": [100, 101], "item_ids": [[7000, 7001], [7002]]}), cands)
    args = ["rescore", "--users", str(files["users"]), "--items", str(files["items"]), "--candidates", str(cands),
            "--k", "2", "--out", str(files["out"]), "--device", "cpu"]
    assert runner.invoke(app, args).exit_code == 0
    before = files["out"].read_bytes()
    pq.write_table(pa.table({"user_id": pa.array([], pa.int64()), "item_ids": pa.array([], pa.list_(pa.int64()))}),
                   cands)
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {cands}: the candidates file has no rows")
    assert files["out"].read_bytes() == before
    assert runner.invoke(app, [*args, "--allow-empty"]).exit_code == 0
    assert pq.read_table(files["out"]).num_rows == 0


def test_first_run_compilation_is_said_on_a_terminal(files: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19.9: the first run after an install spends seconds compiling, which nothing said."""
    import recall.backends as backends
    import recall.cli.common as common

    assert backends.cpu_kernels_cache() is not None  # numba's cache can be inspected
    monkeypatch.setattr(backends, "cpu_kernels_cache", lambda: (False, "/some/where"))
    assert runner.invoke(app, _score_args(files)).stderr == ""  # not a terminal: nothing
    monkeypatch.setattr(common, "show_progress", lambda quiet: not quiet)
    monkeypatch.setattr("recall.cli.score.progress_bar", lambda enabled: common.progress_bar(False))
    result = runner.invoke(app, _score_args(files))
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == ["compiling the CPU kernels: the first run after an install takes a few "
                                          "seconds more (numba caches them under /some/where)"]
    assert runner.invoke(app, _score_args(files, "--quiet")).stderr == ""


@pytest.mark.parametrize("aggregate", ["max", "sum"])
def test_overflow_with_interests_names_the_file_row_and_id(tmp_path: Path, aggregate: str) -> None:
    users, items = int_data(12, 17, 4, seed=3)
    users[7] = 1e37 if aggregate == "max" else 4e36  # a sum of 3 interests: 3 x 4e36 x |v| overflows
    ids = np.repeat(200 + np.arange(4), 3)
    write_embeddings(tmp_path / "u.parquet", ids, users)
    write_embeddings(tmp_path / "i.parquet", np.arange(17), items)
    result = runner.invoke(app, ["score", "--users", str(tmp_path / "u.parquet"), "--items",
                                 str(tmp_path / "i.parquet"), "--k", "3", "--out", str(tmp_path / "o.parquet"),
                                 "--device", "cpu", "--interests", aggregate])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {tmp_path / 'u.parquet'}: row 7 (id 202) has norm "), result.stderr


def test_stdout_closed_by_its_reader_is_quiet(tmp_path: Path) -> None:
    """``recall demo | head -1``: the reader closes stdout; the command stops saying things, with no error line or
    traceback, and exits 141 (as a writer killed by SIGPIPE). Its file is written."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-m", "recall", "demo", "--device", "cpu", "--out", "d.parquet"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the first line: every write meets a closed pipe
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 141, stderr
    assert stderr == ""
    assert pq.read_table(tmp_path / "d.parquet").num_rows == 3000
