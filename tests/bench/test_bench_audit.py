"""``recall bench`` as a user meets it: every bad input one line and the right exit code, an answer judged by its top
k, a run that stops early saying what it left, no picture of an earlier run beside this one's results."""
from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
from typer.testing import CliRunner

from recall import InputError
from recall.bench import contenders, matrix, report, runner, workloads
from recall.cli.app import app

SMALL_CELL = "tiny:300 d8 k10 ip normal"


def _bench(*args: str):
    return CliRunner().invoke(app, ["bench", "--device", "cpu", *args])


def _one_error_line(result) -> str:
    """The single ``error: ...`` line of a refused command (no traceback, nothing else on stderr)."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# --- the check: an answer is its first k items ------------------------------------------------------------------------


def _worst_first(real):
    """A FAISS search whose answer is wrong in its first slot: the user's worst item, then the true list."""
    def search(self, users, k, **kw):
        idx, scores = real(self, users, k, **kw)
        worst = np.argmin(users @ self._xb.T, axis=1)[:, None]
        return np.concatenate([worst, idx], axis=1), np.concatenate([np.full_like(scores[:, :1], -1e30), scores], 1)

    return search


@pytest.mark.parametrize("width", ["k", "k+1"])
def test_a_wrong_answer_is_reported_whatever_its_width(monkeypatch, tmp_path, width):
    real = contenders.FaissContender.search
    wrong = _worst_first(real)
    if width == "k":  # the same wrong first slot, cut to k columns
        def search(self, users, k, **kw):
            idx, scores = wrong(self, users, k, **kw)
            return idx[:, :k], scores[:, :k]
    else:  # one column more than asked: the true top-k still sits in it, after the wrong item
        search = wrong
    monkeypatch.setattr(contenders.FaissContender, "search", search)
    out = tmp_path / "out"
    result = _bench("--cell", SMALL_CELL, "--contenders", "recall,faiss", "--repeat", "1", "--out", str(out))
    assert result.exit_code == 1, result.output
    rows = {r["contender"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert rows["recall"]["check"]["exact"]
    check = rows["faiss"]["check"]
    assert not check["exact"] and check["recall"] == pytest.approx(0.9) and check["users_short"] == 300
    assert "problem: custom:00/faiss (kernel): not exact, recall@10 0.900000" in result.stderr
    assert "WRONG" in (out / "results.md").read_text()


# --- bad inputs: one line, exit 2, nothing left behind ----------------------------------------------------------------


@pytest.mark.parametrize("cell, says", [
    ("tiny d16 k-5 ip normal", "k '-5' is not a count"),
    ("tiny d-3 k10 ip normal", "dim '-3' is not a count"),
    ("tiny d1.5 k10 ip normal", "dim '1.5' must be a whole number"),
    ("tiny d16 k10 ip normal x5000", "5,000 exclusions per user need more than the 5,000 items of tiny"),
    ("tiny d16 k10 ip nonsense", "unknown data kind 'nonsense'"),
    ("tiny d16 k10 ip normal:user_sigma=nan", "user_sigma=nan is not a finite number"),
    ("tiny d16 k10 ip clustered:noise=inf", "noise=inf is not a finite number"),
])
def test_a_bad_cell_is_named_with_what_is_wrong(tmp_path, cell, says):
    out = tmp_path / "new" / "out"
    result = _bench("--cell", SMALL_CELL, "--cell", cell, "--out", str(out))
    assert result.exit_code == 2
    line = _one_error_line(result)
    assert line.startswith(f"error: cell {cell!r}: ") and says in line, line
    assert "'check'" not in line
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("spec", ["normal:offset=inf", "ties:offset=nan", "skewed:user_sigma=nan"])
def test_non_finite_kind_parameters_are_refused(spec):
    with pytest.raises(InputError, match="is not a finite number"):
        workloads.parse_kind(spec)
    result = _bench("-w", "tiny", "--kind", spec)
    assert result.exit_code == 2 and "is not a finite number" in _one_error_line(result)


def test_an_out_that_cannot_be_a_folder_fails_before_the_run(monkeypatch, tmp_path):
    def never(*a, **kw):
        raise AssertionError("the run started")

    monkeypatch.setattr(runner, "run", never)
    (tmp_path / "a-file").write_text("")
    result = _bench("--cell", SMALL_CELL, "--out", str(tmp_path / "a-file" / "out"))
    assert result.exit_code == 2
    assert "cannot create the output directory: Not a directory" in _one_error_line(result)


def test_gpu_with_own_files_and_no_gpu_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(contenders, "_gpu_reason", lambda: "no GPU here (test)")
    users, items = workloads.generate("normal", 20, 50, 4, seed=1)
    runner._write_parquet(users, tmp_path / "u.parquet")
    runner._write_parquet(items, tmp_path / "i.parquet")
    result = CliRunner().invoke(app, ["bench", "--device", "gpu", "--users", str(tmp_path / "u.parquet"), "--items",
                                      str(tmp_path / "i.parquet"), "--k", "3", "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert _one_error_line(result) == "error: --device gpu: no usable GPU: no GPU here (test)"
    assert not (tmp_path / "out").exists()


def test_a_missing_vector_column_is_one_line_naming_the_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    users, _ = workloads.generate("normal", 20, 50, 4, seed=1)
    runner._write_parquet(users, tmp_path / "u.parquet")
    pq.write_table(pa.table({"id": [0, 1], "vec": [[0.0, 1.0], [1.0, 0.0]]}), tmp_path / "i.parquet")
    result = _bench("--users", str(tmp_path / "u.parquet"), "--items", str(tmp_path / "i.parquet"), "--k", "3",
                    "--out", str(tmp_path / "out"))
    assert result.exit_code == 2
    assert _one_error_line(result).endswith("i.parquet: no column 'embedding' (columns: id, vec)")


def test_layout_without_e2e_is_refused(tmp_path):
    result = _bench("-w", "tiny", "--layout", "warehouse", "--out", str(tmp_path / "out"))
    assert result.exit_code == 2 and "--e2e" in _one_error_line(result)


# --- a run that stops early -------------------------------------------------------------------------------------------


def _stopping_run(monkeypatch, stop, checkpoint_first: bool) -> None:
    def run(settings, log=None, argv=None, checkpoint=None):
        if checkpoint_first:
            checkpoint({"schema": runner.SCHEMA, "workloads": [], "results": []})
        stop()

    monkeypatch.setattr(runner, "run", run)


def test_ctrl_c_says_where_the_finished_workloads_are(monkeypatch, tmp_path):
    def ctrl_c():
        raise KeyboardInterrupt

    _stopping_run(monkeypatch, ctrl_c, checkpoint_first=True)
    out = tmp_path / "out"
    result = _bench("-w", "tiny", "--out", str(out))
    assert result.exit_code == 130
    assert result.stderr.strip() == (f"interrupted by SIGINT (Ctrl-C): the finished workloads are in "
                                     f"{out / report.PARTIAL_NAME}; results.json not written")
    assert sorted(os.listdir(out)) == [report.PARTIAL_NAME]


def test_sigterm_before_any_workload_leaves_nothing(monkeypatch, tmp_path):
    def sigterm():
        os.kill(os.getpid(), signal.SIGTERM)

    def not_handled(signum, frame):  # what the test process does if the command does not handle SIGTERM itself
        raise RuntimeError("SIGTERM not handled by recall bench")

    _stopping_run(monkeypatch, sigterm, checkpoint_first=False)
    previous = signal.signal(signal.SIGTERM, not_handled)
    try:
        out = tmp_path / "new" / "out"
        result = _bench("-w", "tiny", "--out", str(out))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.exit_code == 143
    assert result.stderr.strip() == f"terminated by SIGTERM: nothing written to {out}"
    assert not (tmp_path / "new").exists()


def test_out_of_memory_is_one_line(monkeypatch, tmp_path):
    def oom():
        raise MemoryError("Unable to allocate 745. GiB for an array")

    _stopping_run(monkeypatch, oom, checkpoint_first=True)
    result = _bench("-w", "tiny", "--out", str(tmp_path / "out"))
    assert result.exit_code == 1
    line = _one_error_line(result)
    assert line.startswith("error: out of host memory (Unable to allocate 745. GiB") and report.PARTIAL_NAME in line


# --- what a run leaves ----------------------------------------------------------------------------------------------


def test_no_picture_of_an_earlier_run_is_left_beside_the_results(monkeypatch, tmp_path):
    w = workloads.Workload("audit", 300, 1000, 8, 10)
    doc = runner.run(runner.Settings([w], device="cpu", families=["recall"], repeat=1, sample_users=300))
    for name in (report.PNG_NAME, report.HEATMAP_NAME):
        (tmp_path / name).write_bytes(b"an earlier run's picture")
    monkeypatch.setattr(report, "plot", lambda doc, path: "skipped: matplotlib not installed")
    status = report.write(doc, tmp_path)
    assert status[report.PNG_NAME].startswith("skipped")
    assert sorted(os.listdir(tmp_path)) == [report.JSON_NAME, report.MD_NAME]


def test_a_cpu_estimate_counts_only_contenders_that_can_run_here():
    names = matrix.contender_names(list(contenders.FAMILIES), "cpu")
    assert "recall" in names and "cuvs" not in names
    assert "cuvs" in matrix.contender_names(list(contenders.FAMILIES), "gpu")  # a GPU grid's estimate is the H200's


@pytest.mark.parametrize("metric", ["ip", "cosine"])
def test_the_oracle_tells_wrong_answers_on_data_far_from_the_origin(metric):
    """1e-4 of scores made of a large common offset admitted items ranked hundreds deep (the third audit,
    2026-12-05): the tolerance is capped by float32's rounding bound, and where even that spans a user's whole top k
    (cosine far from the origin) the check says so instead of passing any answer silently."""
    from recall.bench import oracle
    from recall.bench.workloads import generate

    users, items = generate("normal:offset=3000", 300, 4000, 32, seed=0)
    rows = np.arange(100)
    truth = oracle.exact_topk(users, items, 10, rows, metric)
    scores = oracle._metric_scores(metric, truth.user_vecs, np.asarray(items, np.float64))
    ranked = np.argsort(-scores, axis=1, kind="stable")
    right = oracle.check(truth, items, ranked[:, :10], rows_are_sampled=True)
    deep = oracle.check(truth, items, ranked[:, 200:210], rows_are_sampled=True)
    assert right.exact
    if metric == "ip":
        assert deep.recall == 0.0 and right.users_within_rounding == 0
    else:  # float32 cannot tell these cosines apart: the check cannot either, and says so
        assert right.users_within_rounding == deep.users_within_rounding == rows.size
        assert deep.as_dict()["users_within_rounding"] == rows.size


@pytest.mark.parametrize("args, line", [
    (["--out", ""], "error: --out '': expected the path of a folder"),
    (["--out", "-"], "error: --out '-': expected the path of a folder"),
    (["--users", ".", "--items", ".", "--k", "3", "--contenders", "recall"],
     "error: .: is a directory, expected a Parquet file"),
    (["--matrix", "tiny", "--cells", "0,50:"], "error: --cells: '50:' selects no cell of this grid's 12"),
    (["--cell", "tiny d32 k10 dot normal"], "error: cell 'tiny d32 k10 dot normal': unknown data kind 'dot': "
     "expected one of normal, clustered, adversarial, ties, skewed, popular, int8; or the metric, one of ip, "
     "cosine, l2"),
    (["--cell", "tiny d32 k10 ip normal extra"], "error: cell 'tiny d32 k10 ip normal extra': 'extra' is one token "
     "too many: a cell is '<shape>[:<users>] d<dim> k<k> <metric> <kind> [x<exclusions>]'"),
])
def test_bad_bench_arguments_are_one_line(args, line, tmp_path, monkeypatch):
    """The third audit (2026-12-05): an empty --out ran into the current directory and removed its pictures; a
    folder as --users, a slice past the grid and a bad metric in --cell got the parser's block or the wrong field."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "matrix.png").write_bytes(b"mine")
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == line
    assert (tmp_path / "matrix.png").read_bytes() == b"mine" and not (tmp_path / "results.json").exists()


def test_an_out_that_is_a_file_is_one_line(tmp_path):
    target = tmp_path / "afile"
    target.write_text("x")
    result = CliRunner().invoke(app, ["bench", "-w", "tiny", "--contenders", "recall", "--out", str(target)])
    assert result.exit_code == 2 and result.stderr.strip() == f"error: --out {target}: is a file, expected a folder"


def test_results_are_written_both_or_neither(tmp_path, monkeypatch):
    """A full disk while results.md was written left it empty beside a complete results.json: both go to temporary
    files first, and a failure leaves the folder as it was, with no temporary file."""
    w = workloads.get("tiny")
    doc = runner.run(runner.Settings([w], device="cpu", families=["recall"], repeat=1, sample_users=50))
    report.write(doc, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    real = type(tmp_path).write_text
    monkeypatch.setattr(type(tmp_path), "write_text",
                        lambda self, *a, **k: full() if self.name.startswith(".results.md") else real(self, *a, **k))
    with pytest.raises(OSError, match="results.md"):
        report.write({**doc, "argv": ["recall", "bench", "changed"]}, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
