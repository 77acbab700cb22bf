"""recall.tune: the tiling cache (keys, round trip, corrupt / stale / malformed files, atomic and concurrent writes),
the engine's hook (tune="auto" takes a matching entry, "off" ignores it, "force" tunes once), and ``recall tune``.

Every test points ``XDG_CACHE_HOME`` at its own tmp_path, so nothing here reads or writes the user's cache.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import oracle
from conftest import emulated
from parquet_data import int_data, write_embeddings
from recall import Engine, EngineOptions, InputError
from recall.backends.cupy import backend as cupy_backend
from recall.backends.numpy import NumpyBackend
from recall.core.tiling import plan_tiles
from recall.engine import engine as engine_module
from recall.engine import tuning
from recall.cli.app import app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("RECALL_GPU_TILES", raising=False)
    tuning.reset_state()
    yield tmp_path / "xdg"
    tuning.reset_state()


@pytest.fixture
def plan_spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """The ``preferred`` tuple of every ``plan_tiles`` call the engine makes."""
    seen: list[tuple[int, int, int]] = []
    real = plan_tiles

    def spy(n_users, n_items, dim, k, budget, preferred, *rest, **kw):
        seen.append(tuple(preferred))
        return real(n_users, n_items, dim, k, budget, preferred, *rest, **kw)

    monkeypatch.setattr(engine_module, "plan_tiles", spy)
    return seen


def _key(engine: Engine, n_users: int, k: int) -> dict:
    return tuning.make_key(engine.backend, engine.metric, engine.dim, min(k, engine.n_items), n_users,
                           engine.n_items)


# -- keys and paths ---------------------------------------------------------------------------------------------------

def test_cache_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert tuning.cache_path() == tmp_path / "xdg" / "recall" / "tune.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec says: ignore a relative path
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning.cache_path() == tmp_path / "home" / ".cache" / "recall" / "tune.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tuning.cache_path() == tmp_path / "home" / ".cache" / "recall" / "tune.json"


def test_buckets() -> None:
    assert [tuning.bucket(n) for n in (1, 2, 3, 100, 128, 129, 1000)] == [1, 2, 4, 128, 128, 256, 1024]
    assert tuning.bucket(10 ** 6, tuning.USERS_BUCKET_CAP) == tuning.USERS_BUCKET_CAP
    assert tuning.bucket(0) == 1


@pytest.mark.parametrize("mode", ["fast", "", None, 1, "AUTO"])
def test_invalid_tune_mode(mode: object) -> None:
    with pytest.raises(InputError, match="tune must be one of 'auto', 'force', 'off'"):
        Engine(np.ones((4, 2), np.float32), device="cpu", tune=mode)


# -- the cache file ---------------------------------------------------------------------------------------------------

def test_round_trip(cache_home: Path) -> None:
    engine = Engine(np.ones((100, 8), np.float32), device="cpu")
    key = _key(engine, 50, 10)
    assert tuning.lookup(key) is None
    path = tuning.store(key, (32, 512, 2), {"seconds": 0.5})
    assert path == cache_home / "recall" / "tune.json"
    assert tuning.lookup(key) == (32, 512, 2)
    data = json.loads(path.read_text())
    assert data["schema"] == tuning.SCHEMA_VERSION
    entry = data["entries"][tuning.key_string(key)]
    assert entry["tiles"] == [32, 512, 2] and entry["seconds"] == 0.5 and entry["key"] == key
    # A second key is added beside the first; re-storing the first replaces it.
    other = {**key, "dim": 16}
    tuning.store(other, (8, 256, 1))
    tuning.store(key, (64, 1024, 1))
    assert tuning.lookup(key) == (64, 1024, 1) and tuning.lookup(other) == (8, 256, 1)
    assert tuning.cache_info() == {"path": str(path), "status": "ok", "entries": 2}
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_key_mismatch_and_buckets() -> None:
    engine = Engine(np.ones((1000, 8), np.float32), device="cpu")
    key = _key(engine, 50_000, 100)
    tuning.store(key, (32, 512, 2))
    # Same buckets: k 100 and 120 round to 128; 50,000 and 2,000,000 users are both past the cap.
    assert tuning.lookup(_key(engine, 2_000_000, 120)) == (32, 512, 2)
    for changed in ({"dim": 16}, {"k_bucket": 256}, {"users_bucket": 1024}, {"items_bucket": 2048},
                    {"metric": "cosine"}, {"dtype": "float16"}, {"device": "another cpu"}, {"driver": "numpy 0.1"},
                    {"runtime": "another blas"}, {"backend": "gpu"}):
        assert tuning.lookup({**key, **changed}) is None, changed


@pytest.mark.parametrize("content, why", [
    ("{not json", "not valid JSON"),
    ("", "not valid JSON"),
    ("[1, 2, 3]", "no 'entries' object"),
    ('{"schema": 1, "entries": 7}', "no 'entries' object"),
])
def test_corrupt_file_is_ignored_with_one_warning(cache_home: Path, content: str, why: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    path = cache_home / "recall" / "tune.json"
    path.parent.mkdir(parents=True)
    path.write_text(content)
    key = _key(Engine(np.ones((10, 4), np.float32), device="cpu"), 5, 3)
    with caplog.at_level(logging.WARNING, logger="recall"):
        assert tuning.lookup(key) is None
        assert tuning.lookup(key) is None
    warnings = [r.getMessage() for r in caplog.records if "tune cache" in r.getMessage()]
    assert len(warnings) == 1 and why in warnings[0] and str(path) in warnings[0]
    assert tuning.cache_info()["status"].startswith("corrupt")
    # The next store replaces the bad file with a good one.
    tuning.store(key, (4, 256, 1))
    assert tuning.lookup(key) == (4, 256, 1)
    assert json.loads(path.read_text())["schema"] == tuning.SCHEMA_VERSION


def test_stale_schema_is_ignored_with_one_warning(cache_home: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine(np.ones((10, 4), np.float32), device="cpu")
    key = _key(engine, 5, 3)
    path = cache_home / "recall" / "tune.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema": tuning.SCHEMA_VERSION + 1,
                                "entries": {tuning.key_string(key): {"tiles": [4, 256, 1]}}}))
    with caplog.at_level(logging.WARNING, logger="recall"):
        assert tuning.lookup(key) is None
        engine.search(np.ones((5, 4), np.float32), 3)
        engine.search(np.ones((5, 4), np.float32), 3)
    warnings = [r.getMessage() for r in caplog.records if "tune cache" in r.getMessage()]
    assert len(warnings) == 1 and f"schema version {tuning.SCHEMA_VERSION + 1}" in warnings[0]
    assert tuning.cache_info()["status"].startswith("stale")


@pytest.mark.parametrize("tiles", [[0, 256, 1], [4, 256], "4,256,1", [4.0, 256, 1], [True, 256, 1], None])
def test_malformed_entry_is_ignored(cache_home: Path, tiles: object, caplog: pytest.LogCaptureFixture) -> None:
    key = _key(Engine(np.ones((10, 4), np.float32), device="cpu"), 5, 3)
    path = cache_home / "recall" / "tune.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema": tuning.SCHEMA_VERSION, "entries": {tuning.key_string(key): {"tiles": tiles}}}))
    with caplog.at_level(logging.WARNING, logger="recall"):
        assert tuning.lookup(key) is None
        assert tuning.lookup(key) is None
    assert sum("malformed entry" in r.getMessage() for r in caplog.records) == 1


def test_write_is_atomic(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = _key(Engine(np.ones((10, 4), np.float32), device="cpu"), 5, 3)
    path = tuning.store(key, (4, 256, 1))
    before = path.read_bytes()
    renames = []
    real_replace = os.replace

    def failing_replace(src, dst):
        renames.append((Path(src), Path(dst)))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        tuning.store({**key, "dim": 99}, (8, 512, 1))
    # Written to a temporary file beside the cache and renamed over it; on failure the old file is intact and the
    # temporary file is gone.
    assert renames and renames[0][0].parent == path.parent and renames[0][1] == path
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["tune.json", "tune.json.lock"]
    monkeypatch.setattr(os, "replace", real_replace)
    tuning.store({**key, "dim": 99}, (8, 512, 1))
    assert tuning.lookup({**key, "dim": 99}) == (8, 512, 1)


_WRITER = """
import sys
from recall.engine import tuning as tune
base = {"backend": "cpu", "device": "d", "driver": "x", "runtime": "y", "metric": "ip", "dtype": "float32",
        "k_bucket": 8, "users_bucket": 8, "items_bucket": 8}
for i in range(int(sys.argv[2])):
    tune.store({**base, "dim": int(sys.argv[1]) * 1000 + i}, (1, 2, 3))
"""


def test_concurrent_writers_never_tear_the_file(cache_home: Path) -> None:
    path_env = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path_env, "XDG_CACHE_HOME": str(cache_home)}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(w), "15"], env=env) for w in range(3)]
    path = cache_home / "recall" / "tune.json"
    while any(p.poll() is None for p in procs):
        if path.exists():  # a reader at any moment sees a whole file
            assert json.loads(path.read_text())["schema"] == tuning.SCHEMA_VERSION
    assert all(p.returncode == 0 for p in procs)
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 45  # the lock file serialises read-modify-write: no writer's entries are lost


# -- the engine's hook ------------------------------------------------------------------------------------------------

def test_engine_uses_the_cached_tiling(device: str, plan_spy: list, make_ties) -> None:
    users, items = make_ties(300, 2000, 16, seed=3)  # exact scores: any tiling must give the same answer
    engine = Engine(items, device=device)
    heuristic = tuple(engine.backend.preferred_tiles(16, 10, "float32", 300, 2000, engine.options))
    want = engine.search(users, 10)
    assert plan_spy[-1] == heuristic  # no cache yet
    tuned = (32, 512, 2)
    tuning.store(_key(engine, 300, 10), tuned)
    got = engine.search(users, 10)
    assert plan_spy[-1] == tuned
    np.testing.assert_array_equal(oracle.as_numpy(got.indices), oracle.as_numpy(want.indices))
    # A new engine (another process would do the same) finds it too; a search of another shape does not.
    assert Engine(items, device=device).search(users, 10) is not None and plan_spy[-1] == tuned
    engine.search(users, 200)
    assert plan_spy[-1] == tuple(engine.backend.preferred_tiles(16, 200, "float32", 300, 2000, engine.options))


def test_tune_off_ignores_the_cache(device: str, plan_spy: list, make_normal) -> None:
    users, items = make_normal(300, 2000, 16, seed=4)
    engine = Engine(items, device=device, tune="off")
    tuning.store(_key(engine, 300, 10), (32, 512, 2))
    engine.search(users, 10)
    assert plan_spy[-1] == tuple(engine.backend.preferred_tiles(16, 10, "float32", 300, 2000, engine.options))


def test_budget_still_caps_a_cached_tiling(plan_spy: list, make_normal) -> None:
    users, items = make_normal(200, 3000, 8, seed=5)
    engine = Engine(items, device="cpu", memory_budget=64 << 10)
    tuning.store(_key(engine, 200, 5), (4096, 65536, 8))
    got = engine.search(users, 5)
    plan = plan_tiles(200, 3000, 8, 5, 64 << 10, (4096, 65536, 8), engine.backend.state_bytes(5),
                              engine.backend.workers)
    assert plan_spy[-1] == (4096, 65536, 8)
    assert plan.workspace_bytes(8, 5, engine.backend.state_bytes(5)) <= 64 << 10
    want, _ = oracle.topk(users, items, 5)
    np.testing.assert_array_equal(got.indices, want)


def test_tune_force_tunes_once_then_caches(cache_home: Path, plan_spy: list, monkeypatch: pytest.MonkeyPatch,
                                           make_normal) -> None:
    users, items = make_normal(400, 3000, 8, seed=6)
    calls = []
    real = tuning.tune_engine

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(tuning, "tune_engine", counting)
    engine = Engine(items, device="cpu", tune="force")
    got = engine.search(users, 7)
    engine.search(users, 7)
    Engine(items, device="cpu", tune="force").search(users, 7)  # same key in this process: tuned already
    assert len(calls) == 1 and calls[0]["save"] is False and calls[0]["n_users"] == 400 and calls[0]["prepared"]
    want, _ = oracle.topk(users, items, 7)
    np.testing.assert_array_equal(got.indices, want)
    key = _key(engine, 400, 7)
    tiles = tuning.lookup(key)
    assert tiles is not None
    entry = json.loads((cache_home / "recall" / "tune.json").read_text())["entries"][tuning.key_string(key)]
    assert entry["heuristic"] == list(engine.backend.preferred_tiles(8, 7, "float32", 400, 3000, engine.options))
    assert entry["candidates"] >= 1
    # A later engine in "auto" mode uses what "force" stored.
    Engine(items, device="cpu").search(users, 7)
    assert plan_spy[-1] == tiles


def test_tune_force_with_fast_precision_reads_the_cache(monkeypatch: pytest.MonkeyPatch, make_normal,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    users, items = make_normal(60, 900, 8, seed=9)
    monkeypatch.setattr(tuning, "tune_engine", lambda *a, **kw: pytest.fail("fast precision must not tune inline"))
    engine = Engine(items, device="cpu", tune="force", precision="fast", options=emulated())
    with caplog.at_level(logging.WARNING, logger="recall"):
        got = engine.search(users, 5)
        engine.search(users, 5)
    assert sum("exact-precision engines only" in r.getMessage() for r in caplog.records) == 1
    want, _ = oracle.topk(users, items, 5)
    np.testing.assert_array_equal(got.indices, want)


def test_tune_force_tunes_a_cpu_fast_engine_s_exact_search(monkeypatch: pytest.MonkeyPatch, make_normal,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    # Fast precision on the CPU searches in exact precision (no emulation asked for): its float32 pass is the whole
    # search, tuned as an exact engine's is.
    users, items = make_normal(60, 900, 8, seed=9)
    tuned = []
    monkeypatch.setattr(tuning, "_force", lambda engine, users, k, key: tuned.append(key) or (32, 512, 1))
    engine = Engine(items, device="cpu", tune="force", precision="fast")
    with caplog.at_level(logging.WARNING, logger="recall"):
        got = engine.search(users, 5)
    assert len(tuned) == 1 and not any("exact-precision engines only" in r.getMessage() for r in caplog.records)
    assert engine.stats["precision"] == "exact" and "fast_declined" in engine.stats
    want, _ = oracle.topk(users, items, 5)
    np.testing.assert_array_equal(got.indices, want)


def test_tune_engine_dedupes_candidates_and_keeps_the_heuristic_within_noise(monkeypatch: pytest.MonkeyPatch,
                                                                             make_normal) -> None:
    users, items = make_normal(10, 5000, 4, seed=7)
    engine = Engine(items, device="cpu", tune="off")
    monkeypatch.setattr(tuning, "NOISE", 1.0)  # nothing can be 100% faster: the heuristic must be kept
    result = tuning.tune_engine(engine, users, 3, repeat=1, save=False)
    grid = NumpyBackend().tune_candidates(result.heuristic)
    plans = [(t.plan, t.workers) for t in result.trials]
    assert 1 < len(plans) == len(set(plans)) < len(grid)  # 10 users: every user block collapses to 10
    assert result.trials[0].heuristic and result.trials[0].tiles == result.heuristic
    fastest = min(result.trials, key=lambda t: t.seconds)
    assert result.best == result.heuristic and result.saved_to is None
    assert bool(result.notes) == (not fastest.heuristic)
    assert result.cold_seconds > 0 and result.tuning_seconds >= sum(t.seconds for t in result.trials)
    assert result.shape == {"users": 10, "timed_users": 10, "items": 5000, "dim": 4, "k": 3}
    assert json.loads(json.dumps(result.to_dict(), default=str))["best_seconds"] == result.best_seconds


def test_tune_engine_keys_the_fast_precision_pass(cache_home: Path, make_normal) -> None:
    users, items = make_normal(50, 800, 8, seed=8)
    engine = Engine(items, device="cpu", tune="off", precision="fast", options=emulated())
    result = tuning.tune_engine(engine, users, 5, repeat=1)
    # Fast mode's first tiled pass scores float16 inputs for more than k candidates: that is the pass tuned.
    assert result.key["dtype"] == "float16" and result.shape["k"] > 5
    assert tuning.lookup(result.key) == result.best


def test_engine_options_tiles_beat_the_cache(plan_spy: list, make_normal) -> None:
    users, items = make_normal(100, 1000, 8, seed=3)
    engine = Engine(items, device="cpu")
    tuning.store(_key(engine, 100, 10), (64, 512, 1))
    engine.search(users, 10)
    assert plan_spy[-1] == (64, 512, 1)
    Engine(items, device="cpu", options=EngineOptions(tiles=(32, 256, 2))).search(users, 10)
    assert plan_spy[-1] == (32, 256, 2)


def test_candidate_grids_stay_in_their_bands() -> None:
    gpu = cupy_backend.tune_candidates((2048, 8192, 4))
    cpu = NumpyBackend().tune_candidates((128, 2048, 1))
    assert gpu[0] == (2048, 8192, 4) and cpu[0] == (128, 2048, 1)
    assert len(set(gpu)) == len(gpu) <= 16 and len(set(cpu)) == len(cpu) <= 12
    assert all(32 << 20 <= 4 * u * w * t <= 512 << 20 for u, w, t in gpu)
    assert (1024, 4096, 2) in gpu  # the former, L2-sized default stays a candidate
    assert all(256 << 10 <= 4 * u * w * t <= 4 << 20 for u, w, t in cpu)


# -- recall tune ------------------------------------------------------------------------------------------------------

def test_cli_tune_on_the_cpu(cache_home: Path) -> None:
    result = runner.invoke(app, ["tune", "--users", "300", "--items", "4000", "--dim", "8", "--k", "10",
                                 "--device", "cpu", "--repeat", "1", "-q"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "recall tune: 300 users x 4,000 items x 8, k=10, metric ip" in out
    assert "(heuristic)" in out and "*best" in out and "best:" in out and "tuning cost:" in out
    assert f"cached in {cache_home / 'recall' / 'tune.json'}" in out
    entries = json.loads((cache_home / "recall" / "tune.json").read_text())["entries"]
    assert len(entries) == 1
    (entry,) = entries.values()
    assert entry["shape"]["users"] == 300 and entry["key"]["k_bucket"] == 16 and entry["key"]["backend"] == "cpu"


def test_cli_tune_json_files_and_no_save(cache_home: Path, tmp_path: Path) -> None:
    users, items = int_data(120, 900, 6, seed=2)
    uf = write_embeddings(tmp_path / "u.parquet", np.arange(120), users)
    itf = write_embeddings(tmp_path / "i.parquet", np.arange(900), items)
    result = runner.invoke(app, ["tune", "--users-file", str(uf), "--items-file", str(itf), "--k", "4",
                                 "--device", "cpu", "--repeat", "1", "--metric", "l2", "--budget", "1M", "--json",
                                 "--no-save", "-q"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["shape"] == {"users": 120, "items": 900, "dim": 6, "k": 4} and doc["metric"] == "l2"
    assert doc["memory_budget"] == 1 << 20 and "read from" in doc["data"]
    for field in ("heuristic", "best", "trials", "tuning_seconds", "cold_seconds", "heuristic_seconds",
                  "best_seconds", "key", "key_string"):
        assert field in doc["result"]
    assert doc["result"]["key"]["dim"] > 6  # l2 scores an augmented vector: the key names the scored dimension
    assert doc["speedup"] >= 1.0 and doc["total_seconds"] > 0
    assert not (cache_home / "recall" / "tune.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--items", "100", "--dim", "4", "--k", "3"], "give exactly one of --users N and --users-file PATH"),
    (["--users", "10", "--users-file", "x.parquet", "--items", "100", "--dim", "4", "--k", "3"],
     "give exactly one of --users"),
    (["--users", "10", "--items", "100", "--k", "3"], "--dim is needed"),
    (["--users", "0", "--items", "100", "--dim", "4", "--k", "3"], "--users must be >= 1"),
    (["--users", "10", "--items", "100", "--dim", "4", "--k", "0"], "--k must be >= 1"),
    (["--users", "10", "--items", "100", "--dim", "4", "--k", "3", "--repeat", "0"], "--repeat must be >= 1"),
    (["--users", "10", "--items", "100", "--dim", "4", "--k", "3", "--budget", "lots"], "--budget must be"),
    (["--users", "10", "--items", "100", "--dim", "4", "--k", "3", "--budget", "16"], "memory budget"),
    (["--users-file", "missing.parquet", "--items", "100", "--k", "3"], "missing.parquet"),
])
def test_cli_tune_bad_arguments(args: list, message: str) -> None:
    result = runner.invoke(app, ["tune", "--device", "cpu", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("args, message", [
    (["--users", "0", "--items", "100", "--dim", "4"], "error: --users must be >= 1, got 0"),
    (["--users", "5", "--items", "100", "--dim", "0"], "error: --dim must be >= 1, got 0"),
    (["--users", "5", "--items", "100", "--dim", "4", "--seed", "-1"], "error: --seed must be >= 0, got -1"),
])
def test_cli_tune_refuses_arguments_before_the_device_and_the_cache(args: list, message: str,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    # The third audit (2026-12-05): refused arguments said the device's notice first and made the cache's folder.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    result = runner.invoke(app, ["tune", "--k", "3", *args])
    assert result.exit_code == 2 and result.stderr.strip() == message, result.stderr
    assert not (tmp_path / "cache").exists()


@pytest.mark.gpu
def test_tune_engine_on_the_gpu(cache_home: Path, plan_spy: list) -> None:
    import cupy

    # Integer vectors: scores are exact, so every tiling must return the same (tie-ruled) answer.
    users, items = (cupy.asarray(a) for a in int_data(4096, 50_000, 32, seed=4, low=-2, high=2))
    engine = Engine(items, device="gpu", tune="off")
    result = tuning.tune_engine(engine, users, 50, repeat=1)
    assert result.key["backend"] == "gpu" and result.key["device"] and result.key["runtime"].startswith("cuda")
    assert len(result.trials) >= 2 and all(t.seconds > 0 for t in result.trials)
    auto = Engine(items, device="gpu")
    got = auto.search(users, 50)
    assert plan_spy[-1] == result.best
    want = engine.search(users, 50)
    assert bool((got.indices == want.indices).all())
