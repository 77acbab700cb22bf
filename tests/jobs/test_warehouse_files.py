"""Parquet as warehouses write it (the interop audit, 2026-12-05): string ids holding bytes that are not UTF-8 (Hive,
Impala and Spark do not check them), an items file whose first row group is empty (a streaming writer's first
batch), a Spark dataset's ``_temporary/`` folder of failed task attempts under a ``**`` pattern."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from parquet_data import vector_array, write_embeddings
from test_batch import DIM, _run, _write_job
from typer.testing import CliRunner

from recall.cli.app import app
from recall.core.errors import InputError
from recall.io import embedding_dim
from recall.io.parquet import first_invalid_utf8, ids_from_arrow
from recall.jobs.batch import SUCCESS

runner = CliRunner()


def _latin1(ids: list[str], bad: dict[int, bytes]) -> pa.Array:
    """A string column whose rows ``bad`` hold bytes that are not UTF-8."""
    raw = [bad.get(i, s.encode()) for i, s in enumerate(ids)]
    return pa.array(raw, pa.binary()).view(pa.string())


def test_ids_that_are_not_utf8_are_named_by_row():
    ids = [f"u{i}" for i in range(40)]
    col = _latin1(ids, {17: b"caf\xe9", 30: b"\xff"})
    assert first_invalid_utf8(col) == 17 and first_invalid_utf8(pa.array(ids)) is None
    assert first_invalid_utf8(col.slice(18)) == 12  # an array's own positions, offset or not
    with pytest.raises(InputError, match=r"f\.parquet: row 117 has an id that is not valid UTF-8 \(b'caf\\xe9'\)"):
        ids_from_arrow("f.parquet", col, 100)
    assert list(ids_from_arrow("f.parquet", pa.array(ids), 0)) == ids


@pytest.mark.parametrize("which", ["users", "items"])
def test_score_refuses_an_id_that_is_not_utf8_naming_file_and_row(tmp_path: Path, which: str):
    rng = np.random.default_rng(0)
    n = {"users": 30, "items": 50}
    paths = {}
    for name in ("users", "items"):
        ids = [f"{name[0]}{i}" for i in range(n[name])]
        arr = _latin1(ids, {7: b"caf\xe9"}) if name == which else pa.array(ids)
        paths[name] = write_embeddings(tmp_path / f"{name}.parquet", None, rng.standard_normal((n[name], 8)),
                                       id_array=arr)
    out = tmp_path / "out.parquet"
    result = runner.invoke(app, ["score", "--users", str(paths["users"]), "--items", str(paths["items"]), "--k", "5",
                                 "--out", str(out), "--device", "cpu", "-q"])
    assert result.exit_code == 2, result.output
    assert f"{paths[which]}: row 7 has an id that is not valid UTF-8" in result.output
    assert "Traceback" not in result.output and not out.exists()


def test_batch_names_a_shard_whose_id_is_not_utf8_and_keeps_the_others(tmp_path: Path):
    job = _write_job(tmp_path, string_ids=True)
    path, start, n = job["shards"][1]
    table = pq.read_table(path)
    ids = [str(x) for x in table.column("id").to_pylist()]
    pq.write_table(table.set_column(0, "id", _latin1(ids, {3: b"caf\xe9"})), path)
    # Exclusions naming a user by such bytes name no user: ignored as any unknown id (the job does not fail).
    excl = tmp_path / "excl.parquet"
    pq.write_table(pa.table({"user_id": _latin1(["x", str(job["user_ids"][0])], {0: b"\xe9"}),
                             "item_id": pa.array([str(job["item_ids"][0])] * 2)}), excl)
    out = tmp_path / "out"
    with pytest.raises(InputError, match=rf"{path}: row 3 has an id that is not valid UTF-8") as err:
        _run(job, out, exclude=excl)
    assert f"1 of {len(job['shards'])} shards is bad" in str(err.value)
    metrics = json.loads((out / "_metrics.json").read_text())
    assert [b["shard"] for b in metrics["job"]["bad_shards"]] == [path.name] and not (out / SUCCESS).exists()
    assert sorted(p.name for p in out.glob("*.parquet")) == sorted(p.name for p, _, _ in job["shards"]
                                                                   if p != path)


def _empty_first_row_group(path: Path, ids: np.ndarray, vecs: np.ndarray) -> None:
    table = pa.table({"id": pa.array(ids), "embedding": vector_array(vecs, "list32")})
    with pq.ParquetWriter(path, table.schema) as writer:
        writer.write_table(table.slice(0, 0))
        writer.write_table(table, row_group_size=25)


def test_an_items_file_whose_first_row_group_is_empty_shards_like_any(tmp_path: Path):
    job = _write_job(tmp_path)
    _empty_first_row_group(job["items"], job["item_ids"], job["item_vecs"])
    meta = pq.ParquetFile(job["items"]).metadata
    assert meta.row_group(0).num_rows == 0 and meta.num_row_groups > 2
    assert embedding_dim(job["items"]) == DIM
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    _run(job, whole)
    summary = _run(job, sharded, item_shards=2)
    assert summary.shards_scored == len(job["shards"])
    for p, _, _ in job["shards"]:
        assert pq.read_table(sharded / p.name).equals(pq.read_table(whole / p.name))


def test_a_pattern_skips_the_hidden_folders_it_reaches_into(tmp_path: Path):
    job = _write_job(tmp_path)
    dataset = tmp_path / "users.parquet"
    dataset.mkdir()
    for p, _, _ in job["shards"]:
        shutil.copy(p, dataset / p.name)
    (dataset / "_SUCCESS").write_bytes(b"")
    attempt = dataset / "_temporary" / "0" / "_temporary" / "attempt_1"
    attempt.mkdir(parents=True)
    shutil.copy(job["shards"][0][0], attempt / "part-900.parquet")  # a failed attempt's copy of users
    hidden = dataset / ".hive-staging_1"
    hidden.mkdir()
    shutil.copy(job["shards"][0][0], hidden / "part-901.parquet")
    out = tmp_path / "out"
    summary = _run({**job, "users": str(dataset / "**" / "*.parquet")}, out)
    assert summary.shards_total == len(job["shards"]) and (out / SUCCESS).exists()
    assert sorted(p.name for p in out.glob("*.parquet")) == sorted(p.name for p, _, _ in job["shards"])
    # A literal part of the pattern may itself be so named: only what the pattern matched is looked at.
    under = tmp_path / "_exports" / "users"
    shutil.copytree(dataset, under)
    assert _run({**job, "users": str(under / "**" / "*.parquet")}, tmp_path / "out2").shards_total == len(
        job["shards"])


def test_binary_id_columns_are_read_as_text(tmp_path: Path):
    # Impala and older Hive write STRING columns as BYTE_ARRAY without the UTF-8 annotation: Arrow reads binary.
    rng = np.random.default_rng(4)
    users, items = rng.standard_normal((30, 8)), rng.standard_normal((50, 8))
    uids, iids = [f"u{i}" for i in range(30)], [f"item-{i}" for i in range(50)]
    b = {}
    for name, ids, vecs in (("users", uids, users), ("items", iids, items)):
        b[name] = write_embeddings(tmp_path / f"{name}-b.parquet", None, vecs,
                                   id_array=pa.array([s.encode() for s in ids], pa.binary()))
        write_embeddings(tmp_path / f"{name}-s.parquet", ids, vecs)
    pq.write_table(pa.table({"user_id": pa.array([b"u0", b"u0", b"u3"], pa.large_binary()),
                             "item_id": pa.array([b"item-1", b"item-2", b"item-9"], pa.binary())}),
                   tmp_path / "excl-b.parquet")
    pq.write_table(pa.table({"user_id": ["u0", "u0", "u3"], "item_id": ["item-1", "item-2", "item-9"]}),
                   tmp_path / "excl-s.parquet")
    pq.write_table(pa.table({"item_id": pa.array([f"item-{i}".encode() for i in range(0, 50, 2)], pa.binary())}),
                   tmp_path / "allow-b.parquet")
    pq.write_table(pa.table({"item_id": [f"item-{i}" for i in range(0, 50, 2)]}), tmp_path / "allow-s.parquet")
    outs = {}
    for kind in ("b", "s"):
        out = tmp_path / f"out-{kind}.parquet"
        result = runner.invoke(app, ["score", "--users", str(tmp_path / f"users-{kind}.parquet"), "--items",
                                     str(tmp_path / f"items-{kind}.parquet"), "--k", "5", "--out", str(out),
                                     "--exclude", str(tmp_path / f"excl-{kind}.parquet"), "--allow",
                                     str(tmp_path / f"allow-{kind}.parquet"), "--device", "cpu", "-q"])
        assert result.exit_code == 0, result.output
        outs[kind] = pq.read_table(out)
    assert outs["b"].equals(outs["s"]) and outs["b"].schema.field("user_id").type == pa.string()
    # A binary value that is not UTF-8 is refused as a string one is.
    bad = write_embeddings(tmp_path / "bad.parquet", None, users,
                           id_array=pa.array([s.encode() for s in uids[:11]] + [b"\xe9"] + [s.encode() for s in
                                                                                           uids[12:]], pa.binary()))
    result = runner.invoke(app, ["score", "--users", str(bad), "--items", str(b["items"]), "--k", "5", "--out",
                                 str(tmp_path / "o.parquet"), "--device", "cpu", "-q"])
    assert result.exit_code == 2 and f"{bad}: row 11 has an id that is not valid UTF-8" in result.output


@pytest.mark.parametrize("pattern, hidden", [
    ("d/**/*.parquet", {"d/_temporary/0/a.parquet": True, "d/x/a.parquet": False, "d/a.parquet": False,
                        "d/x/_a.parquet": True, "d/.staging/a.parquet": True}),
    ("d/_exports*/*.parquet", {"d/_exports1/a.parquet": False, "d/_exports1/_a.parquet": True}),
    ("_d/*/x.parquet", {"_d/p/x.parquet": False, "_d/_p/x.parquet": True}),
    ("**/_x/*.parquet", {"a/_x/b.parquet": False, "_a/_x/b.parquet": True, "_x/b.parquet": False}),
])
def test_hidden_names_a_pattern_did_not_ask_for(pattern, hidden):
    from recall.jobs.batch.shards import _hidden_match

    for match, want in hidden.items():
        assert _hidden_match(pattern, match) is want, (pattern, match)
