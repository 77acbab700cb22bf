"""Item filter files (``--allow`` / ``--deny``) in every Parquet job: score, multi-interest score, rescore and batch;
never a filtered item in the output, unknown ids counted, bad files refused with the file and row named."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from parquet_data import int_data, oracle_topk, write_embeddings
from recall import InputError
from recall.cli.app import app
from recall.io import read_item_set
from recall.jobs import rescore_files, score_files
from recall.jobs.batch import MANIFEST, run_batch

runner = CliRunner()


def _files(tmp_path: Path, n_users: int = 30, n_items: int = 40, dim: int = 4):
    users, items = int_data(n_users, n_items, dim, seed=3)
    user_ids, item_ids = 100 + np.arange(n_users), 7000 + np.arange(n_items)[::-1]
    up = write_embeddings(tmp_path / "users.parquet", user_ids, users, row_group_size=7)
    ip = write_embeddings(tmp_path / "items.parquet", item_ids, items, row_group_size=11)
    return up, ip, users, items, user_ids, item_ids


def _ids_file(path: Path, ids) -> Path:
    pq.write_table(pa.table({"item_id": pa.array(ids, pa.int64()), "note": pa.array(["x"] * len(ids))}), path)
    return path


def _users_and_out(tmp_path: Path, up: Path, command: str) -> tuple[Path, Path]:
    """The --users and --out of ``command``: the users file and an output file for score, a shard directory holding
    it and an output directory for batch."""
    if command != "batch":
        return up, tmp_path / "o.parquet"
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.parquet").write_bytes(up.read_bytes())
    return tmp_path / "shards", tmp_path / "out"


def _check(out: Path, users, items, user_ids, item_ids, k, banned_rows) -> None:
    table = pq.read_table(out)
    assert table.column("user_id").to_pylist() == list(user_ids)
    banned = np.zeros((len(users), len(items)), bool)
    banned[:, banned_rows] = True
    rows, scores = oracle_topk(users, items, k, banned=banned)
    got = table.column("item_ids").to_pylist()
    for u in range(len(users)):
        assert got[u] == [item_ids[r] for r in rows[u]], f"user row {u}"
    np.testing.assert_array_equal(np.concatenate([np.asarray(s) for s in table.column("scores").to_pylist()]),
                                  np.concatenate(scores).astype(np.float32))


def test_score_with_allow_and_deny_files(tmp_path: Path) -> None:
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    allowed = np.arange(0, 40, 2)  # rows
    denied = np.array([0, 4, 8])
    allow = _ids_file(tmp_path / "allow.parquet", [*item_ids[allowed], 123456])  # one unknown id
    deny = _ids_file(tmp_path / "deny.parquet", item_ids[denied])
    summary = score_files(up, ip, tmp_path / "out.parquet", 6, device="cpu", allow_path=allow, deny_path=deny,
                          batch_size=7)
    banned = np.setdiff1d(np.arange(40), np.setdiff1d(allowed, denied))
    _check(tmp_path / "out.parquet", users, items, user_ids, item_ids, 6, banned)
    assert summary.filter_ids == 24 and summary.unknown_filter_ids == 1
    assert any("1 of 24 item filter ids are not in the items file" in w for w in summary.warnings())


def test_filters_combine_with_exclusions_and_allow_fewer_than_k(tmp_path: Path) -> None:
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    allow = _ids_file(tmp_path / "allow.parquet", item_ids[[3, 5, 7]])
    excl = tmp_path / "excl.parquet"
    pq.write_table(pa.table({"user_id": pa.array([user_ids[0]], pa.int64()),
                             "item_id": pa.array([item_ids[5]], pa.int64())}), excl)
    score_files(up, ip, tmp_path / "out.parquet", 5, device="cpu", allow_path=allow, exclude_path=excl)
    table = pq.read_table(tmp_path / "out.parquet")
    lists = table.column("item_ids").to_pylist()
    assert all(set(x) <= set(item_ids[[3, 5, 7]]) and len(x) == 3 for x in lists[1:])
    assert item_ids[5] not in lists[0] and len(lists[0]) == 2


def test_interests_and_rescore_jobs_honour_filters(tmp_path: Path) -> None:
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    deny = _ids_file(tmp_path / "deny.parquet", item_ids[:20])
    score_files(up, ip, tmp_path / "i.parquet", 4, device="cpu", aggregate="max", deny_path=deny)
    got = np.concatenate(pq.read_table(tmp_path / "i.parquet").column("item_ids").to_pylist())
    assert not np.isin(got, item_ids[:20]).any()
    cands = tmp_path / "c.parquet"
    pq.write_table(pa.table({"user_id": pa.array(user_ids, pa.int64()),
                             "item_ids": pa.array([list(item_ids[:30]) for _ in user_ids], pa.list_(pa.int64()))}),
                   cands)
    summary = rescore_files(up, ip, cands, tmp_path / "r.parquet", 4, device="cpu", deny_path=deny)
    got = pq.read_table(tmp_path / "r.parquet").column("item_ids").to_pylist()
    assert summary.users == 30 and all(len(x) == 4 and not set(x) & set(item_ids[:20]) for x in got)


def test_batch_with_filters_and_a_changed_filter_file_is_another_job(tmp_path: Path) -> None:
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.parquet").write_bytes(up.read_bytes())
    allow = _ids_file(tmp_path / "allow.parquet", item_ids[10:])
    out = tmp_path / "out"
    run_batch(tmp_path / "shards", ip, out, 5, device="cpu", allow=allow)
    _check(out / "a.parquet", users, items, user_ids, item_ids, 5, np.arange(10))
    assert "allow" in __import__("json").loads((out / MANIFEST).read_text())["job"]
    _ids_file(allow, item_ids[12:])
    with pytest.raises(InputError, match="allow file content changed"):
        run_batch(tmp_path / "shards", ip, out, 5, device="cpu", allow=allow)


def test_cli_score_allow_deny(tmp_path: Path) -> None:
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    deny = _ids_file(tmp_path / "deny.parquet", [*item_ids[:5], 999999])
    result = runner.invoke(app, ["score", "--users", str(up), "--items", str(ip), "--k", "3", "--out",
                                 str(tmp_path / "o.parquet"), "--device", "cpu", "--deny", str(deny), "-q"])
    assert result.exit_code == 0, result.output
    assert "warning: 1 of 6 item filter ids are not in the items file" in result.stderr
    _check(tmp_path / "o.parquet", users, items, user_ids, item_ids, 3, np.arange(5))


@pytest.mark.parametrize("table,pattern", [
    ({"item": [1]}, r"allow file columns are 'item'; expected an 'item_id' column"),
    ({"item_id": [1, None]}, r"row 1 has a null item_id"),
    ({"item_id": ["a"]}, r"column 'item_id' has type string, but the items' ids are integers"),
])
def test_bad_filter_files_name_file_and_row(tmp_path: Path, table: dict, pattern: str) -> None:
    path = tmp_path / "allow.parquet"
    pq.write_table(pa.table(table), path)
    with pytest.raises(InputError, match=pattern) as info:
        read_item_set(path, np.array([1, 2]), "allow")
    assert str(path) in str(info.value)
    up, ip, *_ = _files(tmp_path)
    result = runner.invoke(app, ["score", "--users", str(up), "--items", str(ip), "--k", "3", "--out",
                                 str(tmp_path / "o.parquet"), "--device", "cpu", "--allow", str(path)])
    assert result.exit_code == 2 and not (tmp_path / "o.parquet").exists()


def test_batch_warns_about_unknown_filter_ids(tmp_path: Path) -> None:
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.parquet").write_bytes(up.read_bytes())
    allow = _ids_file(tmp_path / "allow.parquet", [*item_ids[10:], 555555, 666666])
    out = tmp_path / "out"
    result = runner.invoke(app, ["batch", "--users", str(tmp_path / "shards"), "--items", str(ip), "--k", "4",
                                 "--out", str(out), "--device", "cpu", "--allow", str(allow), "-q"])
    assert result.exit_code == 0, result.output
    assert "warning: 2 of 32 item filter ids are not in the items file; they were ignored" in result.stderr
    _check(out / "a.parquet", users, items, user_ids, item_ids, 4, np.arange(10))


@pytest.mark.parametrize("ids", [[], [555555, 666666]], ids=["empty", "all-unknown"])
@pytest.mark.parametrize("command", ["score", "batch"])
def test_an_allow_file_that_matches_no_item_is_refused(tmp_path: Path, ids, command) -> None:
    """Every user would get no candidates: exit 2, the file named, nothing written."""
    up, ip, *_ = _files(tmp_path)
    allow = _ids_file(tmp_path / "allow.parquet", ids)
    users, out = _users_and_out(tmp_path, up, command)
    result = runner.invoke(app, [command, "--users", str(users), "--items", str(ip), "--k", "3", "--out", str(out),
                                 "--device", "cpu", "--allow", str(allow)])
    assert result.exit_code == 2, result.output
    assert f"{allow}: the allow file names no item of the items file" in result.stderr
    assert not out.exists() or not any(p.suffix == ".parquet" or p.name == "_SUCCESS" for p in out.iterdir())


@pytest.mark.parametrize("with_allow", [False, True], ids=["deny-all", "allow-minus-deny"])
@pytest.mark.parametrize("command", ["score", "batch", "batch-item-shards"])
def test_a_deny_file_that_leaves_no_item_is_refused(tmp_path: Path, with_allow: bool, command: str) -> None:
    """The same mistake as an allow file that matches nothing, reached through the deny file: exit 2, both files
    named, nothing written."""
    up, ip, *_, item_ids = _files(tmp_path)
    extra = []
    if with_allow:
        allow = _ids_file(tmp_path / "allow.parquet", item_ids[:3])
        deny = _ids_file(tmp_path / "deny.parquet", [*item_ids[:3], 555555])
        extra = ["--allow", str(allow)]
        needle = f"{deny}: the deny file names every item the allow file {allow} passes (3)"
    else:
        deny = _ids_file(tmp_path / "deny.parquet", item_ids)
        needle = f"{deny}: the deny file names every item of the items file (40)"
    cmd = "batch" if command.startswith("batch") else command
    users, out = _users_and_out(tmp_path, up, cmd)
    if command == "batch-item-shards":
        extra += ["--item-shards", "2"]
    result = runner.invoke(app, [cmd, "--users", str(users), "--items", str(ip), "--k", "3", "--out", str(out),
                                 "--device", "cpu", "--deny", str(deny), *extra])
    assert result.exit_code == 2, result.output
    assert needle in " ".join(result.stderr.split())
    assert not out.exists() or [p.name for p in out.iterdir()] == [".recall-batch.lock"]


@pytest.mark.parametrize("command", ["score", "batch"])
def test_an_exclusions_file_without_pairs_is_a_warning(tmp_path: Path, command: str) -> None:
    """A nightly export that failed quietly would serve every user what it has seen: the job runs (there may be
    nothing to exclude) and says so in one warning line."""
    up, ip, users, items, user_ids, item_ids = _files(tmp_path)
    excl = tmp_path / "excl.parquet"
    pq.write_table(pa.table({"user_id": pa.array([], pa.int64()), "item_id": pa.array([], pa.int64())}), excl)
    users_arg, out = _users_and_out(tmp_path, up, command)
    result = runner.invoke(app, [command, "--users", str(users_arg), "--items", str(ip), "--k", "3", "--out", str(out),
                                 "--device", "cpu", "--exclude", str(excl), "-q"])
    assert result.exit_code == 0, result.output
    assert f"warning: {excl}: the exclusions file has no pairs; no item was excluded for any user" in result.stderr
    _check(out / "a.parquet" if command == "batch" else out, users, items, user_ids, item_ids, 3, [])
