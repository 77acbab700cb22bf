"""The benchmark's matrix, exclusions, data kinds and GPU contenders (the latter against stand-ins, on the CPU).

The GPU contenders (cuVS, knn_gpu, torch on CUDA) and the device oracle cannot run here; what can be checked on the
CPU is: they skip with their reason, and the parts of them that are plain array code (the cuVS contender's batching,
bitmap and score conversion; the device oracle's chunk compaction) compute the right answer when CuPy and cuVS are
replaced by NumPy stand-ins that follow the documented semantics of the real ones.
"""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
from typer.testing import CliRunner

from recall import InputError
from recall.bench import contenders, exclusions, layouts, matrix, oracle, report, runner, workloads
from recall.cli.app import app


# --- the tiny grid end to end -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    result = CliRunner().invoke(app, ["bench", "--matrix", "tiny", "--device", "cpu", "--contenders",
                                         "recall,faiss,cuvs,torch", "--repeat", "1", "--sample-users", "200",
                                         "--out", str(out)])
    return result, out


def test_tiny_grid_runs_every_cell_exactly(tiny_run):
    pytest.importorskip("faiss")
    result, out = tiny_run
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "results.json").read_text())
    assert doc["schema"] == runner.SCHEMA == 2
    mx = doc["matrix"]
    assert mx["grid"] == "tiny" and len(mx["summary"]) == len(matrix.get("tiny").cells) == 12
    assert mx["cells"] == [c.text for c in matrix.get("tiny").cells]
    for m in mx["summary"]:
        assert m["status"] == "ok" and m["check"] == "ok", m
        assert m["recall"]["median_s"] > 0 and m["faiss"]["median_s"] > 0
        assert m["anchor"] == "faiss" and m["ratio"] == pytest.approx(m["recall"]["median_s"] / m["anchor_s"])
        assert m["speedup"] == pytest.approx(1 / m["ratio"])
        assert m["cuvs"]["status"] == "skipped" and "GPU" in m["cuvs"]["reason"]
    metrics = {w["metric"] for w in doc["workloads"]}
    assert metrics == {"ip", "cosine", "l2"}
    excl = [w for w in doc["workloads"] if w["excl_per_user"]]
    assert excl and all(w["excl_nnz"] > 0 for w in excl)
    for r in doc["results"]:
        assert {"metric", "excl_per_user", "cell"} <= r.keys()
        if r["status"] == "ok":
            assert r["check"]["exact"] and r["check"]["excluded_returned"] == 0, r
    md = (out / "results.md").read_text()
    assert "## Matrix `tiny` (12 cells)" in md and "| recall@k |" in md and "skipped cuvs in cells" in md
    if doc["matrix"]["heatmap"].startswith("wrote"):
        assert (out / report.HEATMAP_NAME).stat().st_size > 1000
    assert "tiny 2kx5k d32 k10 ip clustered x50" in result.output  # the console shows the matrix table


def test_heatmap_without_matplotlib_says_so(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    doc = {"matrix": {"summary": [{"vs": {}, "ratio": 1.0}], "grid": "x"}}
    assert report.heatmap(doc, tmp_path / "m.png") == "skipped: matplotlib not installed"


def test_heatmap_marks_slower_cells(tmp_path):
    pytest.importorskip("matplotlib")
    summary = [{"cell": "a", "vs": {"faiss": 0.5, "cuvs": 2.0, "torch": None}, "ratio": 0.5},
               {"cell": "b", "vs": {"faiss": 1.5, "cuvs": None, "torch": 3.0}, "ratio": 1.5}]
    doc = {"matrix": {"summary": summary, "grid": "g"}, "settings": {"device": "cpu"},
           "environment": {"cpu": "test"}}
    assert report.heatmap(doc, tmp_path / "m.png").startswith("wrote")
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


# --- cells and grids ------------------------------------------------------------------------------------------------


def test_parse_cell_reads_every_field():
    c = matrix.parse_cell("S1:50k d64 k1000 cosine skewed:user_sigma=0.8 x200")
    assert (c.shape, c.n_users, c.n_items, c.dim, c.k, c.metric, c.kind, c.excl) == \
        ("S1", 50_000, 1_000_000, 64, 1000, "cosine", "skewed:user_sigma=0.8", 200)
    assert matrix.parse_cell(c.text) == c
    w = c.workload("g:01")
    assert w.metric == "cosine" and w.excl_per_user == 200 and w.kind_label == "skewed(user_sigma=0.8)"
    assert matrix.parse_cell("item-heavy d32 k1 l2 ties").n_items == 10_000_000
    assert matrix.parse_cell("tiny:1.5k d8 k2 ip normal").n_users == 1500


@pytest.mark.parametrize("text", [
    "", "S9 d64 k10 ip normal", "S1 d64 k10 ip", "S1 d64 ip normal", "S1 d64 k10 ip normal k20",
    "S1 d64 k10 manhattan normal", "S1 d64 k10 ip zipf", "S1:0 d64 k10 ip normal", "tiny d8 k10 ip normal x5000",
    "tiny d8 k10 ip ties:user_sigma=1", "tiny d8 k10 ip skewed:sigma=1", "tiny:abc d8 k1 ip normal",
])
def test_bad_cells_are_input_errors(text):
    with pytest.raises(InputError):
        matrix.parse_cell(text)


def test_parse_cells_slices():
    assert matrix.parse_cells(None, 5) == [0, 1, 2, 3, 4]
    assert matrix.parse_cells("0:2", 5) == [0, 1]
    assert matrix.parse_cells("3:", 5) == [3, 4]
    assert matrix.parse_cells("4,0:2,1", 5) == [4, 0, 1]
    assert matrix.parse_cells("-1", 5) == [4]
    for bad in ("7", "a:b", "5:", "x"):
        with pytest.raises(InputError):
            matrix.parse_cells(bad, 5)


def test_grids_are_documented_and_gpu_quick_fits_its_budget():
    doc = matrix.__doc__
    for cell in matrix.TINY + matrix.GPU_QUICK + matrix.GPU_FAST:
        assert cell in doc, cell
    g = matrix.get("gpu-quick")
    names = ["recall", "recall-fast", "faiss", "faiss-knn", "cuvs", "torch"]
    total, per = matrix.estimate(g, list(range(len(g.cells))), names)
    assert 20 <= len(g.cells) <= 30 and g.repeat == 2
    assert total < 7 * 60 and len(per) == len(g.cells)
    covered = {(c.shape, c.n_users == matrix.SHAPES[c.shape][0]) for c in g.cells}
    shapes = ("S1", "S4", "item-heavy", "user-heavy", "small-catalogue", "few-items")
    assert {(shape, True) for shape in shapes} <= covered
    assert {c.k for c in g.cells} >= {1, 10, 1000, 2048, 8192} and {c.dim for c in g.cells} >= {32, 256}
    assert {c.metric for c in g.cells} == {"ip", "cosine", "l2"}
    assert {c.kind for c in g.cells} >= {"skewed", "ties", "popular", "adversarial", "normal"}
    assert any(c.shape == "S1" and c.excl == 200 for c in g.cells)
    full = matrix.get("gpu-full")
    assert len(full.cells) > len(g.cells) and len(set(full.cells)) == len(full.cells)
    runs = matrix.split(full, names)
    covered = [i for r in runs for i in matrix.parse_cells(r, len(full.cells))]
    assert covered == list(range(len(full.cells))) and len(runs) > 1
    for r in runs:
        idx = matrix.parse_cells(r, len(full.cells))
        assert len(idx) == 1 or matrix.estimate(full, idx, names)[0] <= 480
    with pytest.raises(InputError):
        matrix.get("huge")


def test_list_prints_a_grid(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--list", "--matrix", "gpu-quick"])
    assert result.exit_code == 0, result.output
    assert "S1:20k d64 k2048 l2 skewed" in result.output and "estimated" in result.output


@pytest.mark.parametrize("args", [["--matrix", "tiny", "-w", "tiny"], ["--cells", "0:2", "-w", "tiny"],
                                  ["--matrix", "tiny", "--cells", "40:"], ["-w", "tiny", "--kind", "zipf"],
                                  ["--matrix", "tiny", "--max-minutes", "0"],
                                  ["--cell", "tiny d32 k10 ip normal", "--matrix", "tiny"],
                                  ["--cell", "tiny d32 k10 ip normal", "-w", "tiny"],
                                  ["--cell", "tiny d32 k10 ip normal", "--k", "5"],
                                  ["--cell", "tiny d32 k10 ip"], ["--cell", "huge d32 k10 ip normal"]])
def test_bad_matrix_arguments_exit_2(args, tmp_path):
    result = CliRunner().invoke(app, ["bench", "--device", "cpu", "--out", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output


def test_own_cells_run_as_the_custom_grid(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--device", "cpu", "--contenders", "recall", "--out", str(tmp_path),
                                      "--cell", "tiny:300 d50 k7 cosine skewed", "--cell", "tiny:200 d16 k3 l2 ties x4"])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["matrix"]["grid"] == "custom"
    shapes = [(w["n_users"], w["dim"], w["k"], w["metric"], w["excl_per_user"]) for w in doc["workloads"]]
    assert shapes == [(300, 50, 7, "cosine", 0), (200, 16, 3, "l2", 4)]
    rows = [r for r in doc["results"] if r["contender"] == "recall"]
    assert len(rows) == 2 and all(r["check"]["recall"] == 1.0 for r in rows)


def test_time_budget_skips_the_rest():
    ws = [workloads.get("tiny"), workloads.get("tiny").with_kind("ties")]
    ws[1] = type(ws[1])(**{**ws[1].__dict__, "name": "tiny-2"})
    doc = runner.run(runner.Settings(ws, device="cpu", families=["recall"], repeat=1, sample_users=50,
                                     max_seconds=1e-9))
    assert doc["workloads"][1]["status"] == "skipped" and "time budget" in doc["workloads"][1]["reason"]


def test_checkpoint_after_every_workload_and_partial_file_removed_at_the_end(tmp_path):
    ws = [workloads.get("tiny"), workloads.get("tiny").with_kind("ties")]
    ws[1] = type(ws[1])(**{**ws[1].__dict__, "name": "tiny-2"})
    seen = []
    runner.run(runner.Settings(ws, device="cpu", families=["recall"], repeat=1, sample_users=50),
               checkpoint=lambda doc: seen.append([w["name"] for w in doc["workloads"]]))
    assert seen == [["tiny"], ["tiny", "tiny-2"]]
    result = CliRunner().invoke(app, ["bench", "--device", "cpu", "-w", "tiny", "--contenders", "recall",
                                      "--repeat", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "results.json").exists() and not (tmp_path / "results.partial.json").exists()


# --- the oracle with exclusions ------------------------------------------------------------------------------------


def _brute(users, items, k, rows, banned):
    """Every sampled user's true scores with banned items at -inf, and its allowed top-k by a stable argsort."""
    s = users[rows].astype(np.float64) @ items.T.astype(np.float64)
    for j, r in enumerate(rows):
        s[j, banned[r]] = -np.inf
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return s, order


def test_oracle_honours_exclusions_with_ties_and_empty_users():
    users, items = workloads.generate("ties", 60, 40, 6, seed=3)
    k = 8
    rng = np.random.default_rng(1)
    banned = [rng.choice(40, size=rng.integers(0, 10), replace=False) for _ in range(60)]
    banned[5] = np.arange(40)                # every item excluded: nothing to return
    banned[6] = np.arange(35)                # fewer allowed items (5) than k
    s0 = users[7].astype(np.float64) @ items.T.astype(np.float64)
    kth_item = int(np.argsort(-s0, kind="stable")[k - 1])
    banned[7] = np.array([kth_item])         # the k-th item excluded (ties: others share its score)
    ex = exclusions.from_lists(banned, 40)
    rows = np.arange(60)
    truth = oracle.exact_topk(users, items, k, rows, exclude=ex, memory_budget=1 << 12)
    s, ref = _brute(users, items, k, rows, banned)
    allowed = 40 - np.array([b.size for b in banned])
    np.testing.assert_array_equal(truth.k_user, np.minimum(k, allowed))
    for j in range(60):
        kk = truth.k_user[j]
        np.testing.assert_allclose(truth.top_scores[j, :kk], np.take(s[j], ref[j, :kk]))
        assert np.isneginf(truth.top_scores[j, kk:]).all() and (truth.top_items[j, kk:] == -1).all()
        assert not np.isin(truth.top_items[j, :kk], banned[j]).any()
    assert truth.k_user[5] == 0 and np.isneginf(truth.kth[5])
    # The same truth from the CSR pair (indptr, items) over all users.
    pair = oracle.exact_topk(users, items, k, rows, exclude=ex.host())
    np.testing.assert_array_equal(pair.top_scores, truth.top_scores)
    # The exact answer passes, padding included.
    c = oracle.check(truth, items, truth.top_items, truth.top_scores, rows_are_sampled=True)
    assert c.exact and c.recall == 1.0 and c.excluded_returned == 0 and c.invalid == 0


def test_check_fails_an_answer_with_an_excluded_item():
    users, items = workloads.generate("normal", 30, 50, 4, seed=2)
    k = 5
    plain = oracle.exact_topk(users, items, k, np.arange(30))
    banned = [np.array([plain.top_items[u, 0]]) for u in range(30)]  # each user's best item excluded
    banned[3] = np.arange(1, 50)                                      # user 3: only item 0 allowed
    ex = exclusions.from_lists(banned, 50)
    truth = oracle.exact_topk(users, items, k, np.arange(30), exclude=ex)
    c = oracle.check(truth, items, plain.top_items, rows_are_sampled=True)  # ignores the exclusions
    assert not c.exact and c.excluded_returned >= 30 and c.users_short == 30
    # User 3 gets item 0 then excluded items in its "padding" slots: still wrong.
    answer = truth.top_items.copy()
    answer[3] = [0, 1, 2, 3, 4]
    c = oracle.check(truth, items, answer, rows_are_sampled=True)
    assert not c.exact and c.users_short == 1 and c.excluded_returned == 4
    answer[3] = [0, -1, -1, -1, -1]
    assert oracle.check(truth, items, answer, rows_are_sampled=True).exact


def test_device_oracle_compaction_matches_the_host_oracle(monkeypatch):
    """``_topk_device`` with NumPy standing in for CuPy: small chunks so that both the compacted and the whole-chunk
    merge run; adversarial data (rising scores) and exclusions."""
    monkeypatch.setitem(sys.modules, "cupy", _numpy_cupy())
    monkeypatch.setattr(oracle, "DEVICE_BUDGET", 8 * 100 * 300)
    monkeypatch.setattr(oracle, "DEVICE_FIRST_CHUNK", 64)
    for kind in ("clustered", "adversarial"):
        users, items = workloads.generate(kind, 100, 3000, 8, seed=4)
        ex = exclusions.generate(users, items, 20, k=30, seed=1)
        rows = np.arange(0, 100, 2)
        ip, it = ex.for_rows(rows)
        er = np.repeat(np.arange(rows.size), np.diff(ip))
        for metric in ("ip", "cosine", "l2"):
            u = oracle._metric_users(metric, users[rows].astype(np.float64))
            dev_s, dev_i = oracle._topk_device(u, items, 30, metric, er, it)
            host_s, host_i = oracle._topk_host(u, items, 30, metric, er, it, 1 << 16)
            np.testing.assert_allclose(np.sort(dev_s, axis=1), np.sort(host_s, axis=1))
            assert not any(np.isin(dev_i[j], it[ip[j]:ip[j + 1]]).any() for j in range(rows.size))


# --- exclusions -------------------------------------------------------------------------------------------------------


def test_generated_exclusions_are_sorted_unique_seeded_and_hit_the_top():
    users, items = workloads.generate("clustered", 300, 4000, 16, seed=5)
    a = exclusions.generate(users, items, 40, k=50, seed=3)
    b = exclusions.generate(users, items, 40, k=50, seed=3)
    np.testing.assert_array_equal(a.indptr, b.indptr)
    np.testing.assert_array_equal(a.items, b.items)
    counts = np.diff(a.indptr)
    assert counts.max() <= 40 and counts.mean() > 35 and a.max_per_user == counts.max()
    for u in range(300):
        mine = a.items[a.indptr[u]:a.indptr[u + 1]]
        assert (np.diff(mine) > 0).all() and mine.min() >= 0 and mine.max() < 4000
    rows = np.arange(0, 300, 3)
    truth = oracle.exact_topk(users, items, 50, rows)
    ip, it = a.for_rows(rows)
    hit = [np.isin(truth.top_items[j], it[ip[j]:ip[j + 1]]).sum() for j in range(rows.size)]
    assert np.mean(np.array(hit) > 0) > 0.9  # the hot share takes some of almost every user's true top-k
    planted = exclusions.plant(a, rows, truth.top_items, seed=0)
    ip, it = planted.for_rows(rows)
    for j in range(rows.size):
        mine = it[ip[j]:ip[j + 1]]
        assert truth.top_items[j, 0] in mine and truth.top_items[j, -1] in mine and mine.size <= 40
    others = np.setdiff1d(np.arange(300), rows)
    np.testing.assert_array_equal(planted.for_rows(others)[1], a.for_rows(others)[1])


def test_bitmap_matches_the_documented_layout():
    rng = np.random.default_rng(0)
    lists = [rng.choice(37, size=rng.integers(0, 12), replace=False) for _ in range(9)]
    ex = exclusions.from_lists(lists, 37)
    allowed = np.ones((9, 37), dtype=bool)
    for u, row in enumerate(lists):
        allowed[u, row] = False
    for a, b in ((0, 9), (2, 5), (8, 9)):
        buf = np.zeros(exclusions.bitmap_words(9, 37) + 2, dtype=np.uint32)
        got = exclusions.bitmap_into(buf, ex, a, b)
        # bit j of query i at i * n_items + j, least significant first, 1 = allowed (cuvs_smoke.py's packing)
        want = np.packbits(allowed[a:b].ravel(), bitorder="little")
        want = np.concatenate([want, np.zeros(-want.size % 4, np.uint8)]).view(np.uint32)
        np.testing.assert_array_equal(got, want)


def test_post_filter_keeps_order_and_pads():
    ex = exclusions.from_lists([[1, 2], [], [0, 1, 2, 3]], 10)
    idx = np.array([[1, 5, 2, 7, 8], [3, 4, 5, 6, 7], [0, 1, 2, 3, -1]])
    sc = -np.arange(15, dtype=np.float32).reshape(3, 5)
    out_i, out_s = exclusions.post_filter(ex, 0, idx, sc, 3)
    np.testing.assert_array_equal(out_i, [[5, 7, 8], [3, 4, 5], [-1, -1, -1]])
    np.testing.assert_array_equal(out_s[0], [-1, -3, -4])
    assert np.isneginf(out_s[2]).all()
    # A block of users starting at row 1 sees user 1's and 2's lists.
    out_i, _ = exclusions.post_filter(ex, 1, idx[1:], sc[1:], 2)
    np.testing.assert_array_equal(out_i, [[3, 4], [-1, -1]])


def test_exclusion_workloads_are_named_and_validated():
    assert workloads.get("S1-x200").excl_per_user == 200 and workloads.get("S4-x20").excl_per_user == 20
    assert workloads.get("cpu-small-x50").n_items == 100_000
    with pytest.raises(InputError):
        workloads.Workload("x", 10, 20, 4, 5, excl_per_user=20)
    with pytest.raises(InputError):
        workloads.Workload("x", 10, 20, 4, 5, excl_per_user=2, candidates=5)


# --- data kinds -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["skewed", "popular", "int8", "normal:user_sigma=0.7,item_sigma=0.3",
                                  "clustered:centres=16,noise=0.1", "ties:tie_range=5"])
def test_kinds_with_parameters_are_seeded(spec):
    u1, i1 = workloads.generate(spec, 200, 500, 16, seed=9)
    u2, i2 = workloads.generate(spec, 200, 500, 16, seed=9)
    u3, _ = workloads.generate(spec, 200, 500, 16, seed=10)
    np.testing.assert_array_equal(u1, u2)
    np.testing.assert_array_equal(i1, i2)
    assert not np.array_equal(u1, u3)
    assert u1.dtype == np.float32 and i1.flags.c_contiguous and np.isfinite(i1).all()


def test_norm_spreads_are_as_asked():
    users, items = workloads.generate("normal:user_sigma=0.8,item_sigma=0.3", 20_000, 20_000, 16, seed=1)
    for vecs, sigma in ((users, 0.8), (items, 0.3)):
        log_norms = np.log(np.linalg.norm(vecs, axis=1) / 4.0)
        assert np.std(log_norms) == pytest.approx(sigma, rel=0.05)
        assert np.median(log_norms) == pytest.approx(0.0, abs=0.05)
    users, items = workloads.generate("skewed", 20_000, 20_000, 16, seed=1)
    for vecs in (users, items):
        assert np.std(np.log(np.linalg.norm(vecs, axis=1))) == pytest.approx(0.5, rel=0.05)
    plain_u, _ = workloads.generate("clustered", 20_000, 10, 16, seed=1)
    assert np.std(np.log(np.linalg.norm(plain_u, axis=1))) < 0.3  # clustered leaves user norms alone


def test_popular_items_have_a_heavy_tail():
    _, items = workloads.generate("popular", 10, 100_000, 16, seed=2)
    norms = np.linalg.norm(items, axis=1) / 4.0
    assert np.median(norms) == pytest.approx(1.0, rel=0.05)
    assert norms.max() > 50 * np.median(norms)  # Pareto(2): the largest of 1e5 is ~300x the median
    assert np.mean(norms > 10) == pytest.approx(1 / 200, rel=0.3)  # P(X > 10 median) = (10 * 2**0.5)**-2


def test_int8_is_quantised_and_ties():
    users, items = workloads.generate("int8", 300, 3000, 32, seed=3)
    for vecs in (users, items):
        assert np.array_equal(vecs, np.round(vecs)) and np.abs(vecs).max() == workloads.INT8_MAX
    s = users.astype(np.float64) @ items.T.astype(np.float64)
    assert np.array_equal(s, (users @ items.T).astype(np.float64))  # exact in float32


@pytest.mark.parametrize("spec", ["ties:item_sigma=0.5", "adversarial:item_sigma=0.5", "skewed:centres=0",
                                  "normal:user_sigma=-1", "popular:alpha=2", "clustered:noise=x"])
def test_bad_kind_parameters(spec):
    with pytest.raises(InputError):
        workloads.generate(spec, 10, 10, 4)


# --- contenders without a GPU --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [contenders.CuvsContender, contenders.FaissKnnContender])
def test_gpu_only_contenders_skip_on_the_cpu(cls):
    assert "GPU only" in cls("cpu", "ip").unavailable()


@pytest.mark.parametrize("name", ["cuvs", "faiss-knn", "recall"])
def test_gpu_contenders_skip_with_a_reason_here(name):
    from recall.backends import cuda_status

    if cuda_status()[0]:
        pytest.skip("a usable GPU is here")
    c = {"cuvs": contenders.CuvsContender, "faiss-knn": contenders.FaissKnnContender,
         "recall": contenders.RecallContender}[name]("gpu", "ip")
    reason = c.unavailable()
    assert isinstance(reason, str) and len(reason) > 10


def test_cuvs_missing_is_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuvs", None)
    monkeypatch.setitem(sys.modules, "cuvs.neighbors", None)
    _, reason = contenders._import_cuvs()
    assert reason.startswith("cuVS is not installed")


def test_faiss_over_fetch_limit_is_a_reason():
    w = workloads.get("S1-x200")
    assert contenders.FaissKnnContender("gpu").unsupported_workload(w) is None
    big = type(w)(**{**w.__dict__, "k": 2000})
    assert "k + 200 = 2200" in contenders.FaissKnnContender("gpu").unsupported_workload(big)
    assert "k + 200" in contenders.FaissContender("gpu").unsupported_workload(big)
    assert contenders.FaissContender("cpu").unsupported_workload(big) is None
    assert contenders.FaissKnnContender("gpu").unsupported(8192, 10**6).startswith("knn_gpu supports k <= 2048")


def test_build_has_cuvs_and_knn_gpu():
    names = [c.name for c in contenders.build(["recall", "faiss", "cuvs", "torch"], "gpu", inexact=False)]
    assert names[-4:] == ["faiss", "faiss-knn", "cuvs", "torch"] and "torch-bf16" not in names
    assert [c.name for c in contenders.build(["faiss", "cuvs"], "cpu")] == ["faiss", "cuvs"]


# --- the cuVS contender against a NumPy stand-in of cuVS -----------------------------------------------------------


def _numpy_cupy() -> types.ModuleType:
    """NumPy under CuPy's name, with the few ``cupy.cuda`` pieces the bench touches."""
    cp = types.ModuleType("cupy")
    for name in dir(np):
        if not name.startswith("__"):
            setattr(cp, name, getattr(np, name))
    cp.asnumpy = np.asarray

    class Stream:
        def __init__(self, non_blocking: bool = False) -> None:
            self.ptr = 1

        def __enter__(self) -> "Stream":
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def synchronize(self) -> None:
            return None

    cp.cuda = types.SimpleNamespace(Stream=Stream, get_current_stream=Stream, runtime=types.SimpleNamespace(deviceSynchronize=lambda: None),
                                    Device=lambda: types.SimpleNamespace(id=0))
    return cp


def _fake_cuvs() -> dict[str, types.ModuleType]:
    """cuVS brute force as documented: inner products best first (masked: -FLT_MAX), sqeuclidean and cosine
    distances ascending (masked: +inf), a row-major per-query bitmap with 1 = allowed, outputs written in place or
    allocated."""
    lowest = np.float32(-np.finfo(np.float32).max)

    def build(dataset, metric="sqeuclidean", metric_arg=2.0, resources=None):
        return types.SimpleNamespace(data=np.asarray(dataset), metric=metric)

    def search(index, queries, k, neighbors=None, distances=None, resources=None, prefilter=None):
        q, x = np.asarray(queries, np.float64), index.data.astype(np.float64)
        ip = q @ x.T
        if index.metric == "inner_product":
            key, fill = -ip, lowest
        elif index.metric == "sqeuclidean":
            key = (q ** 2).sum(1)[:, None] + (x ** 2).sum(1)[None, :] - 2 * ip
            fill = np.inf
        else:
            key = 1 - ip / np.linalg.norm(q, axis=1)[:, None] / np.linalg.norm(x, axis=1)[None, :]
            fill = np.inf
        value = -key if index.metric == "inner_product" else key
        if prefilter is not None:
            bits = np.unpackbits(prefilter.bits.view(np.uint8), bitorder="little")[:q.shape[0] * x.shape[0]]
            allowed = bits.reshape(q.shape[0], x.shape[0]).astype(bool)
            key = np.where(allowed, key, np.inf)
            value = np.where(allowed, value, fill)
        order = np.argsort(key, axis=1, kind="stable")[:, :k]
        if neighbors is None:
            neighbors, distances = np.empty(order.shape, np.int64), np.empty(order.shape, np.float32)
        neighbors[...] = order
        distances[...] = np.take_along_axis(value, order, axis=1).astype(np.float32)
        return distances, neighbors

    bf = types.ModuleType("cuvs.neighbors.brute_force")
    bf.build, bf.search = build, search
    flt = types.ModuleType("cuvs.neighbors.filters")
    flt.from_bitmap = lambda bits: types.SimpleNamespace(bits=np.array(bits, copy=True))
    common = types.ModuleType("cuvs.common")
    common.Resources = lambda stream=None: types.SimpleNamespace(sync=lambda: None)
    neighbors = types.ModuleType("cuvs.neighbors")
    neighbors.brute_force, neighbors.filters = bf, flt
    root = types.ModuleType("cuvs")
    root.neighbors, root.common, root.__version__ = neighbors, common, "fake"
    return {"cuvs": root, "cuvs.common": common, "cuvs.neighbors": neighbors,
            "cuvs.neighbors.brute_force": bf, "cuvs.neighbors.filters": flt}


@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_cuvs_contender_batches_bitmaps_and_scores(monkeypatch, metric):
    monkeypatch.setitem(sys.modules, "cupy", _numpy_cupy())
    for name, mod in _fake_cuvs().items():
        monkeypatch.setitem(sys.modules, name, mod)
    users, items = workloads.generate("skewed", 70, 300, 8, seed=6)
    ex = exclusions.generate(users, items, 12, k=20, seed=2)
    rows = np.arange(70)
    c = contenders.CuvsContender("gpu", metric, batch_users=16)  # 70 users: five batches, the last one short
    c.prepare(items)
    for excl in (None, ex):
        truth = oracle.exact_topk(users, items, 20, rows, metric=metric, exclude=excl)
        idx, sc = c.search(users, 20, exclude=excl)
        chk = oracle.check(truth, items, idx, sc)
        assert chk.exact and chk.max_score_error < 1e-5, (metric, excl is not None, chk)
    idx, sc = c.search(users, 400)  # k > n_items: padded as the others pad
    assert idx.shape == (70, 400) and (idx[:, 300:] == -1).all() and np.isneginf(sc[:, 300:]).all()
    few = exclusions.from_lists([np.arange(295)] * 70, 300)  # 5 allowed items, k = 20
    idx, sc = c.search(users, 20, exclude=few)
    assert (idx[:, 5:] == -1).all() and np.isneginf(sc[:, 5:]).all() and (idx[:, :5] >= 295).all()
    c.release()


# --- layouts ---------------------------------------------------------------------------------------------------------


def test_layouts_write_what_they_say(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    vecs = np.random.default_rng(0).standard_normal((150_000, 4)).astype(np.float32)
    for name, lay in layouts.LAYOUTS.items():
        path = tmp_path / f"{name}.parquet"
        layouts.write(vecs, path, name)
        meta = pq.ParquetFile(path).metadata
        col = pq.read_table(path).column("embedding")
        if lay.row_group_rows:
            assert meta.num_row_groups == -(-150_000 // lay.row_group_rows)
        assert (pa.types.is_fixed_size_list(col.type) if lay.list_type == "fixed" else pa.types.is_list(col.type))
        assert meta.row_group(0).column(1).compression.lower() == lay.compression
        back = np.stack(col.to_numpy(zero_copy_only=False)).astype(np.float32)
        np.testing.assert_array_equal(back[::5000], vecs[::5000])
    with pytest.raises(InputError):
        layouts.get("csv")


def test_e2e_rows_per_layout_with_exclusions(tmp_path):
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, ["bench", "-w", "tiny-x50", "--device", "cpu", "--contenders", "recall",
                                         "--repeat", "1", "--sample-users", "200", "--e2e", "--layout", "pyarrow",
                                         "--layout", "warehouse", "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "results.json").read_text())
    e2e = [r for r in doc["results"] if r["mode"] == "e2e"]
    assert [r["layout"] for r in e2e] == ["pyarrow", "warehouse"]
    resident = next(r for r in doc["results"] if r["contender"] == "recall" and r["mode"] == "kernel")
    for r in e2e:
        if r["status"] == "skipped":
            assert r["reason"]
            continue
        assert r["status"] == "ok" and r["check"]["exact"], r
        assert r["vs_resident"] == pytest.approx(r["median_s"] / resident["median_s"])
    assert "recall (e2e warehouse)" in (out / "results.md").read_text()
