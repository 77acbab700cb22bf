"""``--item-memory``: the Parquet jobs read a catalogue beyond it into host memory and stream it; their output files
are the resident jobs' files, byte for byte (exclusions, filters, several interests, re-scoring, batch)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from parquet_data import int_data, write_embeddings
from recall.cli.app import app
from recall.engine import streamed
from recall.jobs import JobOptions, rescore_files, score_files
from recall.jobs.batch import run_batch

runner = CliRunner()
N_USERS, N_ITEMS, DIM, K = 83, 140, 5, 12
SMALL = 2 * 20 * 4 * DIM  # two segments of 20 rows on the CPU


@pytest.fixture
def files(tmp_path: Path) -> dict:
    users, items = int_data(N_USERS, N_ITEMS, DIM, seed=7)
    user_ids, item_ids = 10 + np.arange(N_USERS), 900 + np.arange(N_ITEMS)[::-1]
    rng = np.random.default_rng(7)
    pairs_u = np.repeat(user_ids[:40], 6)
    pairs_i = rng.choice(item_ids, size=pairs_u.size)
    pq.write_table(pa.table({"user_id": pairs_u, "item_id": pairs_i}), tmp_path / "exclude.parquet")
    pq.write_table(pa.table({"item_id": item_ids[::3]}), tmp_path / "allow.parquet")
    (tmp_path / "users").mkdir()
    write_embeddings(tmp_path / "users" / "part-0.parquet", user_ids[:50], users[:50], row_group_size=16)
    write_embeddings(tmp_path / "users" / "part-1.parquet", user_ids[50:], users[50:], row_group_size=16)
    return {"users": write_embeddings(tmp_path / "users.parquet", user_ids, users, row_group_size=16),
            "items": write_embeddings(tmp_path / "items.parquet", item_ids, items, row_group_size=32),
            "exclude": tmp_path / "exclude.parquet", "allow": tmp_path / "allow.parquet", "dir": tmp_path,
            "shards": tmp_path / "users"}


def _same(a: Path, b: Path) -> None:
    ta, tb = pq.read_table(a), pq.read_table(b)
    assert ta.equals(tb)
    assert ta.num_rows > 0


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_score_streamed_equals_resident(files: dict, metric: str, monkeypatch: pytest.MonkeyPatch) -> None:
    d = files["dir"]
    calls = []
    run = streamed.run
    monkeypatch.setattr(streamed, "run", lambda *a, **kw: calls.append(1) or run(*a, **kw))
    for name, options in (("resident", None), ("streamed", JobOptions(item_memory=SMALL, early="on"))):
        score_files(files["users"], files["items"], d / f"{name}.parquet", K, metric=metric, device="cpu",
                    exclude_path=files["exclude"], allow_path=files["allow"], batch_size=30, options=options)
    _same(d / "resident.parquet", d / "streamed.parquet")
    assert calls  # the second job streamed its items
    summary = score_files(files["users"], files["items"], d / "plain.parquet", K, device="cpu", batch_size=30,
                          options=JobOptions(item_memory=SMALL, early="on"))
    assert summary.early_users == 0  # streamed items: no searches while they load


def test_interests_and_rescore_streamed(files: dict) -> None:
    d = files["dir"]
    for name, options in (("resident", None), ("streamed", JobOptions(item_memory=SMALL))):
        score_files(files["users"], files["items"], d / f"i-{name}.parquet", K, device="cpu", aggregate="sum",
                    options=options)
        score_files(files["users"], files["items"], d / f"c-{name}.parquet", 40, device="cpu", options=options)
        cands = pq.read_table(d / f"c-{name}.parquet")
        flat = pa.table({"user_id": pa.array(np.repeat(cands.column("user_id").to_numpy(), 40)),
                         "item_id": cands.column("item_ids").combine_chunks().flatten()})
        pq.write_table(flat, d / f"pairs-{name}.parquet")
        rescore_files(files["users"], files["items"], d / f"pairs-{name}.parquet", d / f"r-{name}.parquet", K,
                      device="cpu", options=options)
    for kind in ("i", "c", "r"):
        _same(d / f"{kind}-resident.parquet", d / f"{kind}-streamed.parquet")


def test_cli_score_rescore_and_batch(files: dict) -> None:
    d = files["dir"]
    base = ["score", "--users", str(files["users"]), "--items", str(files["items"]), "--k", str(K), "--device", "cpu",
            "--exclude", str(files["exclude"])]
    assert runner.invoke(app, [*base, "--out", str(d / "a.parquet")]).exit_code == 0
    result = runner.invoke(app, [*base, "--out", str(d / "b.parquet"), "--item-memory", str(SMALL)])
    assert result.exit_code == 0, result.output
    _same(d / "a.parquet", d / "b.parquet")
    bad = runner.invoke(app, [*base, "--out", str(d / "c.parquet"), "--item-memory", "3"])
    assert bad.exit_code == 2 and "cannot hold two item rows" in bad.output and not (d / "c.parquet").exists()
    for name, extra in (("plain", []), ("streamed", ["--item-memory", str(SMALL)])):
        result = runner.invoke(app, ["batch", "--users", str(files["shards"]), "--items", str(files["items"]),
                                     "--k", str(K), "--out", str(d / f"batch-{name}"), "--device", "cpu", "-q",
                                     *extra])
        assert result.exit_code == 0, result.output
    for part in ("part-0.parquet", "part-1.parquet"):
        _same(d / "batch-plain" / part, d / "batch-streamed" / part)


def test_batch_api_streamed(files: dict) -> None:
    d = files["dir"]
    run_batch(files["shards"], files["items"], d / "x", K, device="cpu", exclude=files["exclude"])
    run_batch(files["shards"], files["items"], d / "y", K, device="cpu", exclude=files["exclude"],
              options=JobOptions(item_memory=SMALL))
    for part in ("part-0.parquet", "part-1.parquet"):
        _same(d / "x" / part, d / "y" / part)
