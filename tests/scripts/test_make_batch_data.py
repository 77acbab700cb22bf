"""scripts/make_batch_data.py: the nightly-batch dataset that scripts/gpu_batch.sh scores. Its files follow the
contracts ``recall batch`` reads, its shards are uneven, it is deterministic, and ``recall batch`` on the CPU scores
it with one output row per user and no excluded item returned.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from recall.jobs.batch import SUCCESS, run_batch
from recall.io import read_embeddings

REPO = Path(__file__).resolve().parents[2]
N_USERS, N_ITEMS, DIM, SHARDS, EXCL, K = 900, 400, 8, 4, 3, 7


def _make_batch_data():
    spec = importlib.util.spec_from_file_location("make_batch_data", REPO / "scripts" / "make_batch_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generate(out: Path, seed: int = 5, excl: int = EXCL) -> Path:
    _make_batch_data().main(["--out", str(out), "--users", str(N_USERS), "--items", str(N_ITEMS), "--dim", str(DIM),
                             "--shards", str(SHARDS), "--exclusions-per-user", str(excl), "--seed", str(seed)])
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _generate(tmp_path_factory.mktemp("batch-data"))


def test_files_follow_the_contracts(data: Path) -> None:
    items = read_embeddings(data / "items.parquet")
    assert items.vectors.shape == (N_ITEMS, DIM) and items.vectors.dtype == np.float32
    assert items.ids.dtype == np.int64 and np.unique(items.ids).size == N_ITEMS
    shards = sorted((data / "users").glob("part-*.parquet"))
    assert len(shards) == SHARDS
    users = [read_embeddings(p) for p in shards]
    sizes = [len(u) for u in users]
    assert sum(sizes) == N_USERS and max(sizes) >= 2 * min(sizes)  # uneven, as a nightly job's shards are
    all_ids = np.concatenate([u.ids for u in users])
    assert np.unique(all_ids).size == N_USERS  # unique over all shards
    excl = pq.read_table(data / "exclusions.parquet")
    assert excl.schema.names == ["user_id", "item_id"] and excl.num_rows == N_USERS * EXCL
    assert set(excl.column("user_id").to_pylist()) == set(all_ids.tolist())
    assert set(excl.column("item_id").to_pylist()) <= set(items.ids.tolist())


def test_deterministic_and_rewritable(data: Path, tmp_path: Path) -> None:
    again = _generate(tmp_path / "again")
    for name in ["items.parquet", "exclusions.parquet", *(f"users/{p.name}" for p in (data / "users").iterdir())]:
        assert (again / name).read_bytes() == (data / name).read_bytes(), name
    # Rewriting a directory with fewer shards and no exclusions leaves no stale file behind.
    _make_batch_data().main(["--out", str(again), "--users", "50", "--items", "30", "--dim", "4", "--shards", "2"])
    assert len(list((again / "users").iterdir())) == 2 and not (again / "exclusions.parquet").exists()


def test_recall_batch_scores_it(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    summary = run_batch(data / "users", data / "items.parquet", out, K, exclude=data / "exclusions.parquet",
                        device="cpu")
    assert summary.shards_scored == SHARDS and summary.users_scored == N_USERS and (out / SUCCESS).exists()
    # Without the exclusions, some of the excluded items (drawn from each user's own cluster) are in the top k.
    run_batch(data / "users", data / "items.parquet", tmp_path / "plain", K, device="cpu")
    excluded = {(u, i) for u, i in zip(*pq.read_table(data / "exclusions.parquet").to_pydict().values())}
    rows, hits_with, hits_without = 0, 0, 0
    for shard in sorted((data / "users").glob("part-*.parquet")):
        result = pq.read_table(out / shard.name).to_pydict()
        assert result["user_id"] == read_embeddings(shard).ids.tolist()
        assert all(len(items) == K for items in result["item_ids"])
        rows += len(result["user_id"])
        hits_with += sum((u, i) in excluded for u, items in zip(result["user_id"], result["item_ids"]) for i in items)
        plain = pq.read_table(tmp_path / "plain" / shard.name).to_pydict()
        hits_without += sum((u, i) in excluded for u, items in zip(plain["user_id"], plain["item_ids"]) for i in items)
    assert rows == N_USERS and hits_with == 0 and hits_without > 0
