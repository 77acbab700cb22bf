"""``recall batch --item-shards N`` (recall/jobs/batch/item_shards.py, recall/jobs/executors/item_shards.py, the Ray
item-shard executor): the catalogue cut into row ranges on the search's tile grid, every range scored by its own
worker, the lists merged exactly. Every sharded output is compared byte for byte with the unsharded job's.

Most cases run the ranges in this process (``inline_item_shard_executor``: the same ranges, merge and bytes, no
process start-up); worker processes, a kill -9 and its resume, and Ray run once each.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from parquet_data import write_embeddings
from processes import alive, metrics, tracker_registrations
from test_batch import (
    REPO,
    SIZES,
    TESTS,
    K,
    _kill_mid_run,
    _manifest_done,
    _outputs,
    _sigterm_mid_shard,
    _wait_for,
    _write_job,
)
from typer.testing import CliRunner

from recall.cli.app import app
from recall.core.errors import InputError
from recall.core.options import EngineOptions
from recall.jobs.batch import MANIFEST, SUCCESS, run_batch
from recall.jobs.batch.item_shards import split_catalogue
from recall.jobs.executors import item_shards as item_shard_executors
from recall.jobs.options import JobOptions

runner = CliRunner()
#: A 16-item tile (the CPU's own is 512): the tiny catalogues here then split into real ranges, some smaller than k.
SMALL_TILES = JobOptions(engine=EngineOptions(tiles=(32, 16, 1)))


@pytest.fixture
def inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item shards run in this process, merged a few users at a time (several merge blocks per batch)."""
    monkeypatch.setattr(item_shard_executors, "local_item_shard_executor",
                        item_shard_executors.inline_item_shard_executor)
    monkeypatch.setattr("recall.jobs.batch.item_shards._MERGE_ROWS", 5)






def _float_job(root: Path, n_items: int = 203, dim: int = 7, string_ids: bool = False, zero_user: bool = True
               ) -> dict:
    """Float vectors (scores are not exact small integers, so equal bytes mean the same float32 arithmetic), item
    norms skewed, exact duplicate items on both sides of range boundaries (ties), uneven shards, one empty; an
    exclusions file (with pairs of unknown items), an allow file (with an unknown id) and a deny file."""
    rng = np.random.default_rng(5)
    items = rng.standard_normal((n_items, dim)) * rng.lognormal(0, 0.6, (n_items, 1))
    for a, b in ((3, 40), (17, 18), (31, 200), (47, 48), (100, 15)):
        items[b] = items[a]  # the same vector: equal scores, the lower row first
    items = items.astype(np.float32)
    sizes = (90, 0, 37)
    users = rng.standard_normal((sum(sizes), dim)).astype(np.float32)
    if zero_user:
        users[5] = 0.0  # every score +-0.0 under ip: the merge keeps each one's sign
    item_ids = np.arange(n_items)[::-1] * 7 + 3
    user_ids = np.arange(sum(sizes)) + 1000
    if string_ids:
        item_ids = np.array([f"i{i}" for i in item_ids], dtype=object)
        user_ids = np.array([f"u{i}" for i in user_ids], dtype=object)
    (root / "users").mkdir(parents=True)
    start = 0
    for i, n in enumerate(sizes):
        ids = user_ids[start:start + n]
        write_embeddings(root / "users" / f"part-{i}.parquet", None, users[start:start + n].reshape(n, dim),
                         row_group_size=25, id_array=pa.array(ids.tolist(), pa.string() if string_ids else pa.int64()))
        start += n
    write_embeddings(root / "items.parquet", item_ids.tolist(), items, row_group_size=30,
                     id_array=pa.array(item_ids.tolist(), pa.string()) if string_ids else None)
    excl_users = rng.choice(user_ids, 300)
    excl_items = rng.choice(item_ids, 300)
    excl_items[:10] = "nope" if string_ids else 9_999_999  # unknown items: ignored, counted in one warning
    pq.write_table(pa.table({"user_id": pa.array(excl_users.tolist()), "item_id": pa.array(excl_items.tolist())}),
                   root / "exclude.parquet")
    allowed = rng.choice(n_items, 150, replace=False)
    pq.write_table(pa.table({"item_id": pa.array(item_ids[allowed].tolist() + ([9_999_999] if not string_ids
                                                                                  else ["nope"]))}),
                   root / "allow.parquet")
    pq.write_table(pa.table({"item_id": pa.array(item_ids[:60].tolist())}), root / "deny.parquet")
    return {"users": root / "users", "items": root / "items.parquet", "exclude": root / "exclude.parquet",
            "allow": root / "allow.parquet", "deny": root / "deny.parquet", "item_ids": item_ids}


def _batch(job: dict, out: Path, **kw) -> object:
    kw.setdefault("device", "cpu")
    kw.setdefault("batch_size", 32)
    return run_batch(job["users"], job["items"], out, kw.pop("k", K), **kw)


def _same(out: Path, ref: Path) -> None:
    """Byte-equal outputs, and equal tables (for a readable failure)."""
    assert sorted(_outputs(out)) == sorted(_outputs(ref))
    for name in _outputs(ref):
        assert pq.read_table(out / name).equals(pq.read_table(ref / name)), name
    assert _outputs(out) == _outputs(ref)


# ---- the ranges ------------------------------------------------------------------------------------------------------

def test_ranges_fall_on_the_tile_grid_and_cover_the_file_once():
    ranges = split_catalogue(1000, None, 3, 128)  # 8 tiles: 3, 3, 2
    assert [(r.start, r.stop, r.first, r.size) for r in ranges] == [(0, 384, 0, 384), (384, 768, 384, 384),
                                                                     (768, 1000, 768, 232)]
    # A filter: the ranges balance the passing items (on their tile grid); removed rows go with the range before.
    passing = np.flatnonzero(np.arange(1000) % 3 == 1)  # 333 items: 21 tiles of 16
    ranges = split_catalogue(1000, passing, 4, 16)
    assert ranges[0].start == 0 and ranges[-1].stop == 1000
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
    assert [r.size for r in ranges] == [96, 80, 80, 77] and all(r.first % 16 == 0 for r in ranges)
    got = np.concatenate([r.start + r.keep for r in ranges])
    np.testing.assert_array_equal(got, passing)
    # Fewer tiles than shards: the last ranges are empty, no tile is cut.
    assert [r.size for r in split_catalogue(90, None, 3, 90)] == [90, 0, 0]
    assert [r.size for r in split_catalogue(40, None, 3, 16)] == [16, 16, 8]
    # A filter that passes nothing: every range is empty; every row is still read once.
    ranges = split_catalogue(50, np.zeros(0, np.int64), 3, 16)
    assert [r.size for r in ranges] == [0, 0, 0] and (ranges[0].start, ranges[0].stop) == (0, 50)


# ---- outputs: the unsharded job's bytes ------------------------------------------------------------------------------

@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
@pytest.mark.parametrize("case", ["plain", "filtered", "k beyond a shard", "string ids"])
def test_outputs_equal_the_unsharded_jobs(inline: None, tmp_path: Path, metric: str, case: str) -> None:
    """Float data, exclusions, an allow and a deny file (with an unknown id), ties across range boundaries, a zero
    user, shards smaller than k, an empty user shard: the bytes of 3 (and 4) item shards are those of 1, and so are
    the manifest's outputs and the warnings."""
    job = _float_job(tmp_path / "job", string_ids=case == "string ids", zero_user=metric != "cosine")
    kw: dict = dict(metric=metric, options=SMALL_TILES, exclude=job["exclude"], k=12, memory_budget=1 << 28)
    if case in ("filtered", "string ids"):
        kw.update(allow=job["allow"], deny=job["deny"])
    if case == "k beyond a shard":
        kw["k"] = 90  # each shard holds about 64 items; the job's result is 90 wide
    ref = _batch(job, tmp_path / "ref", **kw)
    for n in (3, 4):
        out = tmp_path / f"n{n}"
        summary = _batch(job, out, item_shards=n, **kw)
        _same(out, tmp_path / "ref")
        assert summary.item_shards == n and summary.workers == n and summary.n_items == ref.n_items
        assert summary.warnings() == ref.warnings() and len(ref.warnings()) == (2 if "allow" in kw else 1)
        outputs = json.loads((out / MANIFEST).read_text())["outputs"]
        want = json.loads((tmp_path / "ref" / MANIFEST).read_text())["outputs"]
        assert {name: {**e, "item_shards": n} for name, e in want.items()} == outputs
        workers = metrics(out)["workers"]
        rows = sorted(tuple(w["item_rows"]) for w in workers)
        assert rows[0][0] == 0 and rows[-1][1] == 203 and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
        assert all(w["n_items"] < 203 for w in workers)  # no worker holds the catalogue


def test_a_shard_without_a_passing_item_returns_nothing_and_the_rest_is_exact(inline: None, tmp_path: Path) -> None:
    """An allow file of 3 items in one tile: one shard searches them, the others hold none (and say so). (A filter
    that passes no item at all is refused before any shard: tests/jobs/test_item_filters.py.)"""
    job = _float_job(tmp_path / "job")
    pq.write_table(pa.table({"item_id": pa.array(job["item_ids"][[5, 9, 11]].tolist())}), tmp_path / "three.parquet")
    kw = dict(allow=tmp_path / "three.parquet")
    _batch(job, tmp_path / "ref", options=SMALL_TILES, exclude=job["exclude"], **kw)
    notices: list[str] = []
    _batch(job, tmp_path / "three", options=SMALL_TILES, exclude=job["exclude"], item_shards=3,
           notice=notices.append, **kw)
    _same(tmp_path / "three", tmp_path / "ref")
    assert [w["n_items"] for w in metrics(tmp_path / "three")["workers"]] == [3, 0, 0]
    assert any("2 of the 3 item shards hold no item" in n for n in notices), notices


def test_default_tiling_on_a_catalogue_of_several_tiles(inline: None, tmp_path: Path) -> None:
    """The CPU's own tile (512 items): 5,000 float items make 10 tiles, cut 4 / 3 / 3, bytes as unsharded."""
    job = _float_job(tmp_path / "job", n_items=5000, dim=8, zero_user=False)
    for metric in ("cosine", "l2"):
        _batch(job, tmp_path / f"ref-{metric}", metric=metric, k=20)
        _batch(job, tmp_path / metric, metric=metric, k=20, item_shards=3)
        _same(tmp_path / metric, tmp_path / f"ref-{metric}")
        assert [w["n_items"] for w in metrics(tmp_path / metric)["workers"]] == [2048, 1536, 1416]


def test_bad_inputs_are_named_as_unsharded(inline: None, tmp_path: Path) -> None:
    """A bad item row in a later range names the file's row; a duplicate id across ranges; a bad user shard is set
    aside while the others are scored."""
    job = _write_job(tmp_path / "job")
    vecs = job["item_vecs"].copy()
    vecs[77, 2] = np.nan
    bad_items = write_embeddings(tmp_path / "nan-items.parquet", job["item_ids"], vecs)
    with pytest.raises(InputError, match=f"^{bad_items}: row 77 .*NaN"):
        run_batch(job["users"], bad_items, tmp_path / "a", K, device="cpu", item_shards=3, options=SMALL_TILES)
    ids = job["item_ids"].copy()
    ids[80] = ids[2]
    dup = write_embeddings(tmp_path / "dup-items.parquet", ids, job["item_vecs"])
    with pytest.raises(InputError, match="duplicate id .* at rows 2 and 80"):
        run_batch(job["users"], dup, tmp_path / "b", K, device="cpu", item_shards=3, options=SMALL_TILES)
    shard = job["shards"][0][0]
    table = pq.read_table(shard)
    flat = table.column("embedding").combine_chunks().values.to_numpy().copy()
    flat[17 * 6] = np.nan
    pq.write_table(table.set_column(1, "embedding", pa.FixedSizeListArray.from_arrays(pa.array(flat), 6)), shard)
    out = tmp_path / "c"
    with pytest.raises(InputError, match=f"^{shard}: row 17 .*1 of 5 shards is bad"):
        _batch(job, out, item_shards=3, options=SMALL_TILES)
    assert len(json.loads((out / MANIFEST).read_text())["outputs"]) == len(SIZES) - 1
    assert not (out / SUCCESS).exists()


@pytest.mark.parametrize("args, message", [
    (["--item-shards", "0"], "--item-shards must be an integer >= 1, got 0"),
    (["--item-shards", "91"], "--item-shards 91: "),
    (["--item-shards", "3", "--workers", "2"], "--workers 2 does not go with --item-shards 3"),
    (["--item-shards", "2", "--gpus", "3"], "--gpus 3 does not go with --item-shards 2"),
])
def test_bad_item_shard_options_exit_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    job = _write_job(tmp_path / "job")
    out = tmp_path / "out"
    result = runner.invoke(app, ["batch", "--users", str(job["users"]), "--items", str(job["items"]), "--k", "5",
                                 "--out", str(out), "--device", "cpu", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not out.exists()  # refused before anything is written


def test_gpus_all_goes_with_item_shards(inline: None, tmp_path: Path) -> None:
    """The nightly script passes ``--gpus all``: with item shards it means the GPUs the shards need."""
    job = _write_job(tmp_path / "job")
    result = runner.invoke(app, ["batch", "--users", str(job["users"]), "--items", str(job["items"]), "--k", "5",
                                 "--out", str(tmp_path / "out"), "--device", "cpu", "--gpus", "all",
                                 "--item-shards", "2", "-v"])
    assert result.exit_code == 0, result.output
    assert "2 cpu workers (local, items in 2 shards)" in result.stdout
    assert "batch: 5 of 5 shards scored; 442 users x 90 items" in result.stdout


# ---- worker processes, a kill -9 and its resume, Ray --------------------------------------------------------------

def test_worker_processes_equal_the_unsharded_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three spawned workers (this host has two cores: two share one), exclusions and a filter: the bytes of the
    unsharded job; each worker held only its rows, in a process of its own, gone at the end; the parent left nothing
    for the resource tracker to report."""
    job = _float_job(tmp_path / "job")
    kw = dict(metric="l2", options=SMALL_TILES, exclude=job["exclude"], allow=job["allow"], k=12)
    _batch(job, tmp_path / "ref", **kw)
    tracked = tracker_registrations(monkeypatch)
    summary = _batch(job, tmp_path / "out", item_shards=3, **kw)
    assert tracked == []
    _same(tmp_path / "out", tmp_path / "ref")
    workers = metrics(tmp_path / "out")["workers"]
    assert summary.workers == 3 and len({w["pid"] for w in workers}) == 3 and os.getpid() not in {
        w["pid"] for w in workers}
    assert sum(w["n_items"] for w in workers) == 150 and all(w["n_items"] < 150 for w in workers)
    assert not any(alive(w["pid"]) for w in workers)


def _several_tiles_job(root: Path, sizes: tuple[int, ...] = (130, 7, 0, 260, 45, 90)) -> dict:
    """Small-integer vectors and 4,500 items: nine of the CPU's own item tiles (512), three per shard of three."""
    rng = np.random.default_rng(2)
    (root / "users").mkdir(parents=True)
    for i, n in enumerate(sizes):
        write_embeddings(root / "users" / f"part-{i}.parquet", np.arange(n) + 10_000 * i,
                         rng.integers(-3, 4, (n, 6)).astype(np.float32), row_group_size=40)
    write_embeddings(root / "items.parquet", np.arange(4500) * 2, rng.integers(-3, 4, (4500, 6)).astype(np.float32))
    return {"users": root / "users", "items": root / "items.parquet"}


def test_kill_9_of_a_sharded_job_then_rerun_gives_the_same_bytes(inline: None, tmp_path: Path) -> None:
    """``kill -9`` of the parent mid-shard: its three workers die with it; the same job resumes (the finished shards
    kept, the others scored); a resume with another number of item shards is accepted, says so, and gives the same
    bytes; the manifest records each output's item shards."""
    job = _several_tiles_job(tmp_path / "job")
    ref, out = tmp_path / "ref", tmp_path / "out"
    _batch(job, ref)
    args = ["batch", "--users", str(job["users"]), "--items", str(job["items"]), "--k", str(K), "--out", str(out),
            "--device", "cpu", "--batch-size", "32", "--item-shards", "3", "--quiet"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{TESTS}"}
    _kill_mid_run(args, out, env)  # python -m pacing: the parent sleeps after each batch it writes
    workers = metrics(out)["workers"]
    assert [w["n_items"] for w in workers] == [1536, 1536, 1428] and not (out / SUCCESS).exists()
    assert _wait_for(lambda: not any(alive(w["pid"]) for w in workers), timeout=10), "orphan workers outlived the job"
    done = _manifest_done(out)
    assert 1 <= done < 6

    notices: list[str] = []
    summary = _batch(job, out, item_shards=2, notice=notices.append)  # in this process (see the fixture)
    assert summary.shards_skipped == done and summary.shards_scored == 6 - done
    _same(out, ref)
    assert (out / SUCCESS).exists() and not [p for p in out.iterdir() if ".tmp-" in p.name]
    said = [n for n in notices if "computed with" in n]
    assert len(said) == 1 and "item shards 3, this run uses" in said[0] and "item shards 2" in said[0], notices
    outputs = json.loads((out / MANIFEST).read_text())["outputs"]
    assert sorted(e["item_shards"] for e in outputs.values()) == sorted([3] * done + [2] * (6 - done))


def test_sigterm_of_a_sharded_job_stops_its_workers_cleanly(tmp_path: Path) -> None:
    """SIGTERM mid-shard: the parent stops at once (its workers' unread lists do not hold them up), records the
    failure, leaves no temporary file and no worker; the rerun resumes."""
    job = _several_tiles_job(tmp_path / "job")
    out = tmp_path / "out"
    args = ["batch", "--users", str(job["users"]), "--items", str(job["items"]), "--k", str(K), "--out", str(out),
            "--device", "cpu", "--batch-size", "32", "--item-shards", "2"]
    returncode, stderr, stopped_in = _sigterm_mid_shard(args, out)
    assert returncode == 143, stderr
    assert stderr.strip().splitlines()[-1] == "error: terminated by SIGTERM; rerun the same command to resume"
    assert "resource_tracker" not in stderr, stderr
    assert stopped_in < 8, stopped_in  # not a 10 s join timeout per worker
    assert metrics(out)["job"]["status"] == "failed" and not [p for p in out.iterdir() if ".tmp-" in p.name]
    assert not any(alive(w["pid"]) for w in metrics(out)["workers"])
    summary = _batch(job, out)
    assert summary.shards_skipped >= 1 and (out / SUCCESS).exists()


def test_ray_item_shards_equal_the_unsharded_job(tmp_path: Path) -> None:
    """``engine="ray"``, a local Ray started by the job (with CPUs enough for three one-CPU actors) and stopped at
    the end, one actor per range: the unsharded job's bytes."""
    ray = pytest.importorskip("ray")
    job = _float_job(tmp_path / "job", zero_user=False)
    kw = dict(metric="cosine", exclude=job["exclude"], allow=job["allow"], k=12, options=SMALL_TILES)
    _batch(job, tmp_path / "ref", **kw)
    summary = _batch(job, tmp_path / "out", engine="ray", item_shards=3, **kw)
    assert not ray.is_initialized()
    assert "3 cpu workers (ray, items in 3 shards)" in summary.line()
    _same(tmp_path / "out", tmp_path / "ref")
    workers = metrics(tmp_path / "out")["workers"]
    assert sorted(w["worker"] for w in workers) == ["ray-cpu0", "ray-cpu1", "ray-cpu2"]
    assert all(0 < w["n_items"] < 150 for w in workers)


def test_l2_far_from_the_origin_is_centred_as_unsharded(inline: None, tmp_path: Path) -> None:
    """Integer vectors around (3000, ..., 3000): every engine, whole or a range, takes the whole catalogue's l2
    centre (from the item file's first rows), so the ranges' lists merge into the unsharded job's bytes, and both
    are the exact distances."""
    from parquet_data import int_data, oracle_topk

    users, items = int_data(70, 150, 6, seed=9)
    users, items = users + np.float32(3000), items + np.float32(3000)
    (tmp_path / "users").mkdir()
    write_embeddings(tmp_path / "users" / "a.parquet", np.arange(70) + 100, users)
    write_embeddings(tmp_path / "items.parquet", np.arange(150) + 7000, items, row_group_size=40)
    job = {"users": tmp_path / "users", "items": tmp_path / "items.parquet"}
    _batch(job, tmp_path / "ref", metric="l2", k=6, options=SMALL_TILES)
    _batch(job, tmp_path / "sharded", metric="l2", k=6, item_shards=3, options=SMALL_TILES)
    _same(tmp_path / "sharded", tmp_path / "ref")
    table = pq.read_table(tmp_path / "ref" / "a.parquet")
    rows, scores = oracle_topk(users, items, 6, "l2")
    assert table.column("item_ids").to_pylist() == [(7000 + r).tolist() for r in rows]
    np.testing.assert_array_equal(np.array(table.column("scores").to_pylist()), np.array(scores))


def test_an_l2_item_whose_norm_overflows_is_named_as_unsharded(inline: None, tmp_path: Path) -> None:
    """Row 150 (not in the allow file: read, checked, not searched) overflows float32 under l2: the sharded job
    refuses it with the unsharded job's message (file, row, id)."""
    job = _float_job(tmp_path / "job")
    items = pq.read_table(job["items"])
    vecs = np.array(items.column("embedding").to_pylist(), np.float32)
    vecs[150] = 3e19
    write_embeddings(job["items"], items.column("id").to_pylist(), vecs, row_group_size=30)
    pq.write_table(pa.table({"item_id": pa.array(job["item_ids"][:20].tolist())}), tmp_path / "allow.parquet")
    needle = rf"items\.parquet: row 150 \(id {job['item_ids'][150]}\) has norm .* metric 'l2'"
    for shards in (1, 3):
        with pytest.raises(InputError, match=needle):
            _batch(job, tmp_path / f"out{shards}", metric="l2", item_shards=shards, options=SMALL_TILES,
                   allow=tmp_path / "allow.parquet")
