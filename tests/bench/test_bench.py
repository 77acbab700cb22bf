"""The benchmark harness: CLI and JSON report, the oracle, the workload generators, skipped contenders."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from recall.bench import ceilings, contenders, oracle, report, runner, workloads
from recall.cli.app import app
from recall.bench.workloads import Kind


TOP_KEYS = {"schema", "command", "environment", "settings", "ceilings", "workloads", "results", "plot", "elapsed_s"}
ENV_KEYS = {"date", "python", "platform", "cpu", "cpu_count", "loadavg", "numpy", "blas", "openblas_env", "faiss",
            "torch", "cupy", "numba", "git_commit", "recall_sources"}
WORKLOAD_KEYS = {"name", "kind", "n_users", "n_items", "dim", "k", "flops", "status", "reason", "floors",
                 "generate_s", "oracle_s", "n_sample", "metric", "kind_params", "excl_per_user", "excl_nnz",
                 "exclusions_s", "cell"}
ROW_KEYS = {"workload", "kind", "device", "contender", "family", "mode", "claims_exact", "status", "reason", "n_users",
            "n_items", "dim", "k", "prepare_s", "warmup_s", "times_s", "median_s", "users_per_s", "tflops", "check",
            "vs_faiss", "metric", "excl_per_user", "cell", "extra_runs", "gc_s"}  # "metric" on: schema 2
CHECK_KEYS = {"recall", "min_recall", "users_short", "invalid", "max_score_error", "rtol", "n_sample", "exact",
              "excluded_returned"}


# --- the harness end to end ---------------------------------------------------------------------------------------


def test_cli_tiny_cpu_writes_every_field(tmp_path):
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, ["bench", "--workload", "tiny", "--device", "cpu", "--contenders",
                                         "recall,faiss", "--repeat", "2", "--out", str(out), "--e2e"])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "results.json").read_text())
    assert TOP_KEYS <= doc.keys()
    assert ENV_KEYS <= doc["environment"].keys()
    assert doc["settings"]["repeat"] == 2 and doc["settings"]["device"] == "cpu"
    (w,) = doc["workloads"]
    assert WORKLOAD_KEYS <= w.keys()
    assert (w["name"], w["n_users"], w["n_items"], w["dim"], w["k"]) == ("tiny", 2000, 5000, 32, 10)
    assert w["n_sample"] >= 1000
    kernel = {r["contender"]: r for r in doc["results"] if r["mode"] == "kernel"}
    assert set(kernel) == {"recall", "faiss"} or set(kernel) == {"recall-exact", "recall-fast", "faiss"}
    for r in doc["results"]:
        assert ROW_KEYS <= r.keys()
        if r["mode"] == "e2e" and r["status"] == "skipped":
            assert r["reason"]  # the pipeline is not there yet: said, not dropped
            continue
        assert r["status"] == "ok", r
        assert 0 <= r["extra_runs"] <= runner.EXTRA_RUNS and len(r["times_s"]) == 2 + r["extra_runs"]
        assert r["median_s"] > 0
        assert r["users_per_s"] == pytest.approx(2000 / r["median_s"])
        assert r["tflops"] == pytest.approx(2 * 2000 * 5000 * 32 / r["median_s"] / 1e12)
        assert CHECK_KEYS <= r["check"].keys()
        if r["claims_exact"]:
            assert r["check"]["exact"] and r["check"]["recall"] == 1.0
    assert kernel["faiss"]["vs_faiss"] == pytest.approx(1.0)
    for r in kernel.values():
        assert r["vs_faiss"] == pytest.approx(kernel["faiss"]["median_s"] / r["median_s"])
    (e2e,) = [r for r in doc["results"] if r["mode"] == "e2e"]
    assert e2e["vs_resident"] == pytest.approx(e2e["median_s"] / kernel["recall"]["median_s"])
    assert e2e["stages"]["search_s"] > 0 and e2e["stages"]["batch_size"] > 0
    md = (out / "results.md").read_text()
    assert "x the resident search; start-up " in md and "; stages (overlapping) read " in md
    assert "| tiny |" in md and "recall@k" in md
    assert doc["plot"].startswith("wrote") or doc["plot"].startswith("skipped")


def test_e2e_rows_for_each_precision(tmp_path, monkeypatch):
    # Where the engine runs fast mode too (the GPU), the job runs in it too: fast mode's job hands the engine host
    # batches, which its resident search never sees. Each row is measured against its own precision's search.
    monkeypatch.setattr(contenders, "engine_precisions", lambda device="gpu": ["exact", "fast"])
    from recall import jobs

    precisions, score_files = [], jobs.score_files

    def spy(*args, **kwargs):
        precisions.append(kwargs.get("precision"))
        return score_files(*args, **kwargs)

    monkeypatch.setattr(jobs, "score_files", spy)
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, ["bench", "--workload", "tiny", "--device", "cpu", "--contenders", "recall",
                                      "--repeat", "1", "--sample-users", "200", "--out", str(out), "--e2e"])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "results.json").read_text())
    kernel = {r["contender"]: r for r in doc["results"] if r["mode"] == "kernel"}
    e2e = {r["contender"]: r for r in doc["results"] if r["mode"] == "e2e"}
    assert set(kernel) == set(e2e) == {"recall", "recall-fast"}
    assert set(precisions) == {"exact", "fast"}
    for name, r in e2e.items():
        assert r["status"] == "ok" and r["check"]["recall"] == 1.0, r
        assert r["vs_resident"] == pytest.approx(r["median_s"] / kernel[name]["median_s"])
    assert "recall-fast (e2e)" in (out / "results.md").read_text()


def test_missing_contender_is_reported_as_skipped_with_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(contenders, "_import_torch", lambda: (None, "torch is not installed (test)"))
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, ["bench", "-w", "tiny", "--device", "cpu", "--contenders", "faiss,torch",
                                         "--repeat", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = {r["contender"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert rows["torch"]["status"] == "skipped"
    assert rows["torch"]["reason"] == "torch is not installed (test)"
    assert rows["faiss"]["status"] == "ok"
    assert "skipped: torch is not installed (test)" in (out / "results.md").read_text()


def test_failing_contender_is_an_error_row_and_exit_1(monkeypatch, tmp_path):
    def boom(self, users, k):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(contenders.FaissContender, "search", boom)
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, ["bench", "-w", "tiny", "--device", "cpu", "--contenders", "faiss",
                                         "--repeat", "1", "--out", str(out)])
    assert result.exit_code == 1
    (row,) = json.loads((out / "results.json").read_text())["results"]
    assert row["status"] == "error" and "planted failure" in row["reason"]


@pytest.mark.parametrize("durations, runs", [
    ([1.0, 0.5, 0.3, 0.3, 0.3], [0.5, 0.3, 0.3, 0.3]),  # one slow first run: two more, the median is the usual time
    ([1.0, 0.3, 0.32, 9.0], [0.3, 0.32]),                # within 1.10x: no more runs (9.0 never happens)
    ([1.0, 0.5, 0.3, 0.7, 0.2, 9.0], [0.5, 0.3, 0.7, 0.2]),  # unsteady: at most 2 more
])
def test_unsteady_runs_get_more_runs(monkeypatch, tmp_path, durations, runs):
    # A clock that advances by the scripted duration of each search (the first is the warm-up): the rule, not the
    # machine's timing, decides how many runs there are.
    clock = [0.0]
    left = list(durations)
    real = contenders.FaissContender.search

    def search(self, users, k, **kw):
        clock[0] += left.pop(0)
        return real(self, users, k, **kw)

    monkeypatch.setattr(contenders.FaissContender, "search", search)
    monkeypatch.setattr(runner, "_clock", lambda: clock[0])
    doc = runner.run(runner.Settings([workloads.get("tiny")], device="cpu", families=["faiss"], repeat=2))
    (row,) = doc["results"]
    assert row["status"] == "ok", row["reason"]
    assert row["times_s"] == pytest.approx(runs)
    assert row["extra_runs"] == len(runs) - 2
    assert row["median_s"] == pytest.approx(float(np.median(runs)))
    assert row["check"]["exact"]
    assert ("more: unsteady" in report._note(row, True)) == (len(runs) > 2)


@pytest.mark.parametrize("args", [
    ["--contenders", "recall,annoy"],
    ["--users", "nope.parquet"],
    [],
])
def test_bad_arguments_are_one_line_and_exit_2(args, tmp_path):
    base = ["bench", "--device", "cpu", "--out", str(tmp_path)]
    if args and args[0] == "--contenders":
        base += ["-w", "tiny"]
    result = CliRunner().invoke(app, base + args)
    assert result.exit_code == 2
    assert "error:" in result.output and len(result.output.strip().splitlines()) == 1


def test_list_prints_every_workload():
    result = CliRunner().invoke(app, ["bench", "--list"])
    assert result.exit_code == 0
    for name in workloads.WORKLOADS:
        assert name in result.output


def test_users_own_parquet_files(tmp_path):
    users, items = workloads.generate("normal", 300, 700, 8, seed=3)
    runner._write_parquet(users, tmp_path / "u.parquet")
    runner._write_parquet(items, tmp_path / "i.parquet")
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, ["bench", "--users", str(tmp_path / "u.parquet"), "--items",
                                         str(tmp_path / "i.parquet"), "--k", "5", "--device", "cpu", "--contenders",
                                         "recall", "--repeat", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    (row,) = json.loads((out / "results.json").read_text())["results"]
    assert (row["kind"], row["n_users"], row["n_items"], row["k"]) == ("file", 300, 700, 5)
    assert row["check"]["exact"] and row["check"]["n_sample"] == 300


@pytest.mark.parametrize("family", ["recall", "faiss", "torch"])
def test_each_family_exact_on_tiny(device, family):
    """Same body on the CPU and (marked gpu) on the GPU: every contender that runs there is exact on tiny data."""
    w = workloads.get("tiny").with_kind("ties")
    doc = runner.run(runner.Settings([w], device=device, families=[family], repeat=1))
    assert doc["results"]
    for r in doc["results"]:
        if r["status"] == "skipped":
            assert r["reason"]
            continue
        assert r["status"] == "ok", r
        if r["claims_exact"]:
            assert r["check"]["exact"], r
        else:
            assert 0.5 < r["check"]["recall"] <= 1.0  # bf16 on integer data: close, not required exact


# --- the oracle -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small():
    users, items = workloads.generate("normal", 1500, 3000, 16, seed=11)
    rows = oracle.sample_rows(1500, 1000, seed=0)
    truth = oracle.exact_topk(users, items, 20, rows, memory_budget=1 << 18)  # tiny budget: many item chunks
    return users, items, rows, truth


def test_oracle_matches_full_float64_sort(small):
    users, items, rows, truth = small
    s = users[rows].astype(np.float64) @ items.T.astype(np.float64)
    ref = np.argsort(-s, axis=1, kind="stable")[:, :20]
    np.testing.assert_array_equal(truth.top_items, ref)
    np.testing.assert_allclose(truth.kth, np.take_along_axis(s, ref[:, -1:], axis=1)[:, 0])
    assert truth.rows.size == 1000 and np.unique(truth.rows).size == 1000


def test_oracle_accepts_the_exact_answer(small):
    users, items, rows, truth = small
    c = oracle.check(truth, items, truth.top_items, truth.top_scores.astype(np.float32), rows_are_sampled=True)
    assert c.exact and c.recall == 1.0 and c.invalid == 0 and c.max_score_error < 1e-6


@pytest.mark.parametrize("plant", ["worst_item", "duplicate", "padding", "out_of_range", "kth_plus_one"])
def test_oracle_catches_a_planted_wrong_answer(small, plant):
    users, items, rows, truth = small
    answer = truth.top_items.copy()
    u = 123
    s = users[rows[u]].astype(np.float64) @ items.T.astype(np.float64)
    if plant == "worst_item":
        answer[u, 5] = int(np.argmin(s))
    elif plant == "duplicate":
        answer[u, 7] = answer[u, 6]
    elif plant == "padding":
        answer[u, -1] = -1
    elif plant == "out_of_range":
        answer[u, 0] = items.shape[0]
    else:  # the (k+1)-th best item instead of the k-th: the subtlest wrong answer
        answer[u, -1] = int(np.argsort(-s, kind="stable")[20])
    c = oracle.check(truth, items, answer, rows_are_sampled=True)
    assert not c.exact
    assert c.users_short == 1 and c.recall == pytest.approx(1 - 1 / (20 * 1000))
    assert c.per_user[u] == pytest.approx(19 / 20)


def test_oracle_catches_wrong_answer_in_full_user_array(small):
    """Answers for all users (not just the sample) are indexed by the sampled rows."""
    users, items, rows, truth = small
    full = np.zeros((1500, 20), dtype=np.int64)
    full[rows] = truth.top_items
    assert oracle.check(truth, items, full).exact
    full[rows[0], 0] = full[rows[0], 1]
    assert oracle.check(truth, items, full).users_short == 1


def test_oracle_is_tie_aware():
    users, items = workloads.generate("ties", 1000, 2000, 8, seed=5)
    rows = np.arange(1000)
    truth = oracle.exact_topk(users, items, 10, rows)
    s = users.astype(np.float64) @ items.T.astype(np.float64)
    # Replace each user's k-th item by another item with the same score, where one exists: still exact.
    answer = truth.top_items.copy()
    swapped = 0
    for u in range(1000):
        same = np.flatnonzero(s[u] == truth.kth[u])
        others = np.setdiff1d(same, answer[u])
        if others.size:
            answer[u, -1] = others[0]
            swapped += 1
    assert swapped > 500
    assert oracle.check(truth, items, answer, rows_are_sampled=True).exact


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
def test_oracle_metrics_agree_with_the_engine(metric):
    from recall import Engine

    users, items = workloads.generate("clustered", 1200, 2500, 16, seed=2)
    rows = oracle.sample_rows(1200, 1000, seed=1)
    truth = oracle.exact_topk(users, items, 15, rows, metric=metric)
    res = Engine(items, metric=metric, device="cpu").search(users, 15)
    c = oracle.check(truth, items, res.indices, res.scores)
    assert c.exact and c.max_score_error < 1e-4


def test_oracle_k_larger_than_items():
    users, items = workloads.generate("normal", 1000, 30, 4, seed=1)
    truth = oracle.exact_topk(users, items, 50, np.arange(1000))
    assert truth.k_eff == 30
    answer = np.full((1000, 50), -1)
    answer[:, :30] = truth.top_items
    c = oracle.check(truth, items, answer, rows_are_sampled=True)
    assert c.exact and c.invalid == 0


# --- the workloads --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(Kind))
def test_generators_are_deterministic_with_right_shapes(kind):
    u1, i1 = workloads.generate(kind, 300, 700, 24, seed=7)
    u2, i2 = workloads.generate(kind, 300, 700, 24, seed=7)
    u3, i3 = workloads.generate(kind, 300, 700, 24, seed=8)
    assert u1.shape == (300, 24) and i1.shape == (700, 24)
    assert u1.dtype == np.float32 and i1.dtype == np.float32
    assert u1.flags.c_contiguous and i1.flags.c_contiguous
    np.testing.assert_array_equal(u1, u2)
    np.testing.assert_array_equal(i1, i2)
    assert not np.array_equal(u1, u3) and not np.array_equal(i1, i3)
    assert not np.array_equal(u1[:, :8], i1[:300, :8])  # users and items come from different streams


def test_clustered_has_clusters_and_lognormal_norms():
    users, items = workloads.generate("clustered", 2000, 20000, 32, seed=1)
    log_norms = np.log(np.linalg.norm(items, axis=1) / np.sqrt(32))
    assert np.std(log_norms) == pytest.approx(workloads.NORM_SIGMA, rel=0.1)
    # Items of a cluster point the same way: the best cosine to another item is much higher than for i.i.d. data.
    unit = items[:2000] / np.linalg.norm(items[:2000], axis=1, keepdims=True)
    cos = unit @ unit.T
    np.fill_diagonal(cos, -1)
    assert np.median(cos.max(axis=1)) > 0.8


def test_ties_really_tie():
    users, items = workloads.generate("ties", 200, 5000, 32, seed=1)
    assert np.array_equal(users, np.round(users)) and np.abs(items).max() <= workloads.TIE_RANGE
    s = np.sort(users @ items.T, axis=1)[:, ::-1]
    k = 10
    assert (s[:, k - 1] == s[:, k]).mean() > 0.5  # the k-th and (k+1)-th best are equal for most users
    assert max(np.unique(row).size for row in s) < 200  # a few hundred distinct scores among 5,000 items


def test_adversarial_scores_rise_along_the_items():
    users, items = workloads.generate("adversarial", 500, 8192, 32, seed=1)
    s = users.astype(np.float64) @ items.T.astype(np.float64)
    tiles = s.reshape(500, 8, 1024).max(axis=2)
    rising = (np.diff(tiles, axis=1) > 0).mean(axis=1)
    assert np.mean(rising >= 6 / 7) > 0.9  # most users: each tile's best beats the previous tile's best
    pos = np.arange(8192)
    corr = np.array([np.corrcoef(pos, row)[0, 1] for row in s])
    assert np.mean(corr > 0) > 0.95
    best = np.argsort(-s, axis=1)[:, :100]
    assert np.median(best) > 0.8 * 8192  # the true top-k sits in the last tiles


def test_named_workloads_match_the_design():
    expect = {"tiny": (2_000, 5_000, 32, 10), "cpu-small": (20_000, 100_000, 64, 100),
              "S1": (100_000, 1_000_000, 64, 100), "S2": (100_000, 1_000_000, 128, 100),
              "S3": (100_000, 1_000_000, 64, 1_000), "S4": (1_000_000, 1_000_000, 64, 100),
              "S5": (100_000, 1_000_000, 64, 100), "S6": (100_000, 1_000_000, 256, 100)}
    for name, shape in expect.items():
        w = workloads.get(name)
        assert (w.n_users, w.n_items, w.dim, w.k) == shape
    assert workloads.get("S4").flops == pytest.approx(128e12, rel=0.01)
    from recall import Engine

    if not hasattr(Engine, "rescore"):
        assert workloads.get("S5").unsupported.startswith("not yet supported")


def test_unsupported_workload_is_skipped_with_reason():
    w = workloads.get("tiny")
    w = type(w)(**{**w.__dict__, "name": "x", "unsupported": "not yet supported: test"})
    doc = runner.run(runner.Settings([w], device="cpu", families=["faiss"], repeat=1))
    assert doc["workloads"][0]["status"] == "skipped"
    assert [r["reason"] for r in doc["results"]] == ["not yet supported: test"]


def test_bad_generator_arguments():
    from recall.core.errors import InputError

    with pytest.raises(InputError):
        workloads.generate("zipf", 10, 10, 4)
    with pytest.raises(InputError):
        workloads.generate("normal", 0, 10, 4)
    with pytest.raises(InputError):
        workloads.get("S9")


# --- reports --------------------------------------------------------------------------------------------------------


def test_floors_and_h200_defaults():
    assert ceilings.defaults_for("NVIDIA H200") is not None
    assert ceilings.defaults_for("NVIDIA A100-SXM4-80GB") is None
    f = ceilings.floors(100_000, 1_000_000, 64, {"fp32_tflops": 50.0, "bf16_tflops": 800.0, "copy_tbps": 4.0})
    assert f["gemm_fp32_s"] == pytest.approx(12.8e12 / 50e12)
    assert f["gemm_bf16_s"] == pytest.approx(12.8e12 / 800e12)
    assert f["hbm_scores_s"] == pytest.approx(8e11 / 4e12)


def test_plot_without_matplotlib_says_so(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert report.plot({"results": []}, tmp_path / "x.png") == "skipped: matplotlib not installed"


def test_e2e_candidates_reader_pads_missing_users(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"user_id": pa.array([5, 2], pa.int64()),
                      "item_ids": pa.array([[9, 8, 7], [1]], pa.list_(pa.int64())),
                      "scores": pa.array([[3.0, 2.0, 1.0], [0.5]], pa.list_(pa.float32()))})
    pq.write_table(table, tmp_path / "c.parquet")
    idx, sc = runner._read_candidates(tmp_path / "c.parquet", np.array([2, 3, 5]), 2)
    np.testing.assert_array_equal(idx, [[1, -1], [-1, -1], [9, 8]])
    assert sc[2, 1] == 2.0 and np.isneginf(sc[1]).all()


@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
@pytest.mark.parametrize("make", [contenders.RecallContender, contenders.FaissContender], ids=["recall", "faiss"])
def test_allow_set_workload_checks_the_filter(make, metric: str) -> None:
    # A shared allow-set: each contender takes it and is exact; an answer with an item outside it is not exact.
    w = workloads.get("tiny-allow10")
    users, items = w.generate(0, "cpu")
    allowed = w.allowed(0)
    assert allowed.size == 500 and (np.diff(allowed) > 0).all()
    rows = oracle.sample_rows(w.n_users, 200, 0)
    truth = w.truth(users, items, rows, metric=metric, allowed=allowed)
    assert np.isin(truth.top_items[truth.top_items >= 0], allowed).all()
    c = make("cpu", metric=metric)
    if c.unavailable():
        pytest.skip(c.unavailable())
    assert c.check_workload(w) is None
    c.prepare(items)
    idx, sc = c.search(users, w.k, allow=allowed)
    assert w.check(truth, users, items, idx, sc).exact
    bad = np.array(idx)
    outside = np.setdiff1d(np.arange(w.n_items), allowed)
    bad[rows[0], 0] = outside[0]
    assert not w.check(truth, users, items, bad, None).exact


def test_faiss_with_fewer_allowed_items_than_k_pads() -> None:
    c = contenders.FaissContender("cpu")
    if c.unavailable():
        pytest.skip(c.unavailable())
    items = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 3.0], [1.0, 1.0]], np.float32)
    c.prepare(items)
    idx, sc = c.search(np.array([[1.0, 0.0], [0.0, 1.0]], np.float32), 4, allow=np.array([1, 2, 4]))
    np.testing.assert_array_equal(idx, [[2, 4, 1, -1], [4, 1, 2, -1]])
    np.testing.assert_array_equal(sc[:, :3], [[2.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert np.isneginf(sc[:, 3]).all()


def test_allow_bitset_sets_exactly_the_allowed_bits() -> None:
    from recall.bench.exclusions import allow_bitset

    allow = np.array([0, 1, 31, 32, 63, 64, 99])
    bits = allow_bitset(allow, 100)
    assert bits.dtype == np.uint32 and bits.shape == (4,)
    unpacked = np.unpackbits(bits.view(np.uint8), bitorder="little")[:100]
    np.testing.assert_array_equal(np.flatnonzero(unpacked), allow)
    assert not np.unpackbits(bits.view(np.uint8), bitorder="little")[100:].any()


def test_note_says_why_fast_mode_declined() -> None:
    from recall.bench.report import _note

    row = {"status": "ok", "mode": "resident", "claims_exact": True, "times_s": [1.0]}
    sampled = _note({**row, "engine_stats": {"fast_declined": "ties", "fast_sample": 400}}, False)
    assert sampled == "fast mode declined (a sample of 400 users): ran exact"
    at_once = _note({**row, "engine_stats": {"fast_declined": "1,250 candidates per user would be re-scored"}}, False)
    assert at_once == "fast mode declined (1,250 candidates per user would be re-scored): ran exact"


def test_source_digest_names_the_code_a_run_measured(tmp_path):
    # The device's copy of the tree may carry stale git metadata: the environment names the sources by content.
    from recall.bench import env

    pkg = tmp_path / "recall"
    (pkg / "backends" / "__pycache__").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "backends" / "k.cu").write_text("// kernel\n")
    (pkg / "backends" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\x00")
    (pkg / "notes.txt").write_text("not a source")
    first = env.source_digest(pkg)
    assert len(first) == 12 and env.source_digest(pkg) == first
    (pkg / "notes.txt").write_text("changed")
    (pkg / "backends" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\x01")
    assert env.source_digest(pkg) == first  # neither a source nor compiled output
    (pkg / "backends" / "k.cu").write_text("// kernel, changed\n")
    assert env.source_digest(pkg) != first
    (pkg / "backends" / "k.cu").write_text("// kernel\n")
    (pkg / "a.py").rename(pkg / "b.py")  # same content, other path
    assert env.source_digest(pkg) != first
    line = report.environment_line({"environment": {"date": "d", "cpu": "c", "cpu_count": 2, "loadavg": [0.5],
                                                    "numpy": "2", "git_commit": "abc1234+dirty",
                                                    "recall_sources": first}})
    assert line.endswith(f"recall abc1234+dirty, sources {first}")
    assert env.collect("cpu")["recall_sources"] == env.source_digest()


def test_timed_runs_record_the_garbage_collectors_pauses():
    # A run that forces a full collection is charged its pause; one that allocates nothing is not.
    import gc

    gc_s: list[float] = []
    kept = [[object() for _ in range(1000)] for _ in range(200)]  # objects for the collection to walk

    def once() -> float:
        if not gc_s:
            gc.collect()
        return 1.0

    assert runner._timed_runs([], 2, once, gc_s) == 0
    assert len(gc_s) == 2 and gc_s[0] > 0 and gc_s[1] < gc_s[0]
    assert not any(cb for cb in gc.callbacks if isinstance(cb, runner._GcPauses))
    row = runner._row(workloads.get("tiny"), "recall", "recall", "cpu", True)
    row.update(times_s=[1.0, 1.0], gc_s=[0.25, 0.0])
    assert "garbage collector 0.25, 0 s" in report._note(row, True)
    del kept


@pytest.mark.parametrize("spec", ["ties:offset=3000", "skewed:offset=300", "adversarial:offset=50"])
def test_offset_moves_every_vector_and_the_engine_stays_exact(spec):
    """``offset`` puts a kind's data around a point far from the origin; on integer data there the engine's l2 lists
    are the float64 oracle's (it centres the vectors)."""
    from recall import Engine

    kind, params = workloads.parse_kind(spec)
    base_u, base_i = workloads.generate(kind.value, 60, 500, 6, seed=3)
    users, items = workloads.generate(spec, 60, 500, 6, seed=3)
    np.testing.assert_allclose(users - base_u, params.offset, rtol=0, atol=params.offset * 1e-6)
    np.testing.assert_allclose(items - base_i, params.offset, rtol=0, atol=params.offset * 1e-6)
    assert workloads.kind_label(kind, params) == f"{kind.value}(offset={params.offset:g})"
    if kind is Kind.ties:
        res = Engine(items, metric="l2", device="cpu").search(users, 10)
        d = -((users[:, None, :].astype(np.float64) - items[None].astype(np.float64)) ** 2).sum(-1)
        order = np.lexsort((np.broadcast_to(np.arange(500), d.shape), -d), axis=-1)[:, :10]
        np.testing.assert_array_equal(res.indices, order)
        np.testing.assert_array_equal(res.scores, np.take_along_axis(d, order, 1).astype(np.float32))
