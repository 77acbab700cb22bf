"""Catalogues beyond memory, audited against the resident engine and job (recall/engine/streamed.py): a streamed
search's scores are the resident search's bits however its user groups and segments fall, and an l2 item whose
norm overflows float32 is named by file, row and id when the items stream, as when they are resident."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from parquet_data import write_embeddings

from recall import Engine, InputError
from recall.backends import resolve
from recall.core import metrics
from recall.engine import streamed
from recall.jobs import JobOptions, score_files
from recall.jobs.batch import run_batch


def _item_memory(dim: int, rows: int, metric: str = "ip") -> int:
    """An item_memory whose segments hold ``rows`` rows on the CPU."""
    return 2 * rows * streamed.row_bytes(resolve("cpu"), metrics.scored_width(metric, dim))


def _float_data(n_users: int, n_items: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n_users, dim)).astype(np.float32),
            rng.standard_normal((n_items, dim)).astype(np.float32))


@pytest.mark.parametrize("budget, k, n_users, group", [(4 << 20, 100, 350, 349), (1 << 20, 700, 397, 12)])
def test_user_groups_give_the_resident_bits(budget: int, k: int, n_users: int, group: int) -> None:
    """User groups below streamed.ALIGN are not aligned by group_users: 349 users against the resident search's
    blocks of 128, or 12 against blocks of 16. The last user used to be searched alone (a matrix-vector product)
    where the resident search scores it in a block of several, and its scores differed in the last bits."""
    users, items = _float_data(n_users, 3000, 16, seed=1)
    assert streamed.group_users(budget, k, n_users) == group
    resident = Engine(items, device="cpu", memory_budget=budget)
    streaming = Engine(items, device="cpu", memory_budget=budget, item_memory=_item_memory(16, 1024))
    want, got = resident.search(users, k), streaming.search(users, k)
    assert streaming.stats["streamed"] and streaming.stats["user_groups"] >= 2
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.scores, want.scores)


def test_score_job_streamed_under_a_small_budget_writes_the_resident_bytes(tmp_path: Path) -> None:
    """The same through ``score_files`` (``--memory-budget 4MiB --batch-size 350 --item-memory ...``): the output
    file is the resident job's, byte for byte."""
    users, items = _float_data(700, 3000, 16, seed=2)
    write_embeddings(tmp_path / "users.parquet", np.arange(700), users, row_group_size=100)
    write_embeddings(tmp_path / "items.parquet", np.arange(3000) + 10_000, items, row_group_size=500)
    for name, options in (("resident", None), ("streamed", JobOptions(item_memory=_item_memory(16, 1024)))):
        score_files(tmp_path / "users.parquet", tmp_path / "items.parquet", tmp_path / f"{name}.parquet", 100,
                    device="cpu", batch_size=350, memory_budget=4 << 20, options=options)
    assert pq.read_table(tmp_path / "streamed.parquet").equals(pq.read_table(tmp_path / "resident.parquet"))
    assert (tmp_path / "streamed.parquet").read_bytes() == (tmp_path / "resident.parquet").read_bytes()


@pytest.mark.parametrize("n_users, k", [(1000, 5), (300, 2101)])
def test_short_segments_give_the_resident_bits(n_users: int, k: int) -> None:
    """Segments of 1,050 rows (fewer than streamed.ALIGN) over 2,101 items used to be 1,050, 1,050 and 1 rows: the
    last item was scored on its own (a matrix-vector product) where the resident search scores it in a tile of
    several, and its scores differed in the last bits. Item 2100 is in most users' top k here."""
    users, items = _float_data(n_users, 2101, 16, seed=1)
    users[:, 0] = np.abs(users[:, 0]) + 1
    items[2100, 0] += 12.0
    resident = Engine(items, device="cpu")
    streaming = Engine(items, device="cpu", item_memory=_item_memory(16, 1050))
    want, got = resident.search(users, k), streaming.search(users, k)
    assert streaming.stats["item_segments"] >= 3 and (want.indices == 2100).any(axis=1).mean() > 0.9
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.scores, want.scores)


def test_streamed_l2_item_that_overflows_is_named_by_row() -> None:
    rng = np.random.default_rng(3)
    items = rng.integers(-3, 4, (40, 6)).astype(np.float32)
    items[33] = 3e19
    for item_memory in (None, _item_memory(6, 5, "l2")):
        with pytest.raises(InputError, match=r"^item_vecs: row 33 has norm 7\.35e\+19: metric 'l2'"):
            Engine(items, metric="l2", device="cpu", item_memory=item_memory, l2_centre=None)


def test_streamed_jobs_name_the_file_row_and_id_of_an_l2_item_that_overflows(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    items = rng.integers(-3, 4, (150, 5)).astype(np.float32)
    items[110] = 3e19
    item_ids = np.arange(150) * 3 + 7
    path = write_embeddings(tmp_path / "items.parquet", item_ids, items, row_group_size=40)
    (tmp_path / "users").mkdir()
    users = write_embeddings(tmp_path / "users" / "a.parquet", np.arange(9),
                             rng.integers(-3, 4, (9, 5)).astype(np.float32))
    needle = rf"^{path}: row 110 \(id {item_ids[110]}\) has norm .* metric 'l2'"
    options = JobOptions(item_memory=_item_memory(5, 20, "l2"))
    with pytest.raises(InputError, match=needle):
        score_files(users, path, tmp_path / "out.parquet", 5, metric="l2", device="cpu", options=options)
    assert not (tmp_path / "out.parquet").exists()
    with pytest.raises(InputError, match=needle):
        run_batch(tmp_path / "users", path, tmp_path / "batch", 5, metric="l2", device="cpu", options=options)
    assert not list((tmp_path / "batch").glob("*.parquet"))
