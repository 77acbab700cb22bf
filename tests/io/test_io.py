"""recall.io: embedding and exclusion readers (every accepted layout, every rejected input) and the atomic writer."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from parquet_data import LAYOUTS, vector_array, write_embeddings
from recall import Engine, InputError
from recall.io import (
    COMPRESSIONS,
    CandidateWriter,
    Embeddings,
    candidates_schema,
    embedding_dim,
    inspect_embeddings,
    iter_embedding_batches,
    read_embedding_rows,
    read_embeddings,
    read_ids,
    read_item_set,
    read_pairs,
)
from recall.io import parquet_footer, writer as writer_module


def _vecs(n: int, dim: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


# ---- reading embeddings ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_read_embeddings_every_layout(tmp_path: Path, layout: str) -> None:
    vecs = _vecs(53, 6)
    path = write_embeddings(tmp_path / "e.parquet", np.arange(53) * 3 + 7, vecs, layout, row_group_size=10)
    emb = read_embeddings(path)
    assert isinstance(emb, Embeddings)
    assert emb.ids.dtype == np.int64 and emb.ids.tolist() == (np.arange(53) * 3 + 7).tolist()
    assert emb.vectors.dtype == np.float32 and emb.vectors.shape == (53, 6) and emb.vectors.flags.c_contiguous
    np.testing.assert_array_equal(emb.vectors, vecs)  # float64 columns hold float32 values exactly here


class _Target:
    """A stand-in for a device backend: the matrix is allocated by ``empty_out`` and filled only through
    ``store_rows``, batch by batch, as a GPU job fills device memory."""

    def __init__(self) -> None:
        self.uploads = 0

    def empty_out(self, shape: tuple, dtype, host: bool) -> np.ndarray:
        assert not host
        return np.full(shape, np.nan, dtype)

    def store_rows(self, dest: np.ndarray, start: int, rows: np.ndarray) -> None:
        assert rows.dtype == np.float32 and rows.flags.c_contiguous
        dest[start:start + rows.shape[0]] = rows
        self.uploads += 1


@pytest.mark.parametrize("layout", ["fixed32", "list64"])
def test_read_embeddings_into_a_device_matrix_batch_by_batch(tmp_path: Path, layout: str, monkeypatch) -> None:
    monkeypatch.setattr("recall.io.embeddings.READ_BATCH_ROWS", 16)
    vecs = _vecs(53, 6)
    path = write_embeddings(tmp_path / "e.parquet", np.arange(53), vecs, layout, row_group_size=10)
    target = _Target()
    emb = read_embeddings(path, target=target)
    assert target.uploads >= 4
    np.testing.assert_array_equal(emb.vectors, read_embeddings(path).vectors)
    bad = vecs.copy()
    bad[37, 2] = np.nan
    write_embeddings(tmp_path / "bad.parquet", np.arange(53), bad, layout, row_group_size=10)
    with pytest.raises(InputError, match="row 37"):
        read_embeddings(tmp_path / "bad.parquet", target=_Target())


@pytest.mark.parametrize("id_type", [pa.int32(), pa.uint16(), pa.int64(), pa.uint64()])
def test_integer_ids_become_int64(tmp_path: Path, id_type: pa.DataType) -> None:
    path = write_embeddings(tmp_path / "e.parquet", None, _vecs(4, 3), id_array=pa.array([5, 1, 9, 2], id_type))
    emb = read_embeddings(path)
    assert emb.ids.dtype == np.int64 and emb.ids.tolist() == [5, 1, 9, 2]


def test_string_ids(tmp_path: Path) -> None:
    ids = [f"user-{i:03d}" for i in range(25)]
    path = write_embeddings(tmp_path / "e.parquet", ids, _vecs(25, 4), "list32", row_group_size=7)
    emb = read_embeddings(path)
    assert emb.ids.dtype == object and emb.ids.tolist() == ids
    assert inspect_embeddings(path).id_type == pa.string()


def test_custom_column_names(tmp_path: Path) -> None:
    path = write_embeddings(tmp_path / "e.parquet", [1, 2], _vecs(2, 3), id_col="item", vec_col="vec")
    emb = read_embeddings(path, id_col="item", vec_col="vec")
    assert emb.ids.tolist() == [1, 2]


def test_extra_columns_are_not_read(tmp_path: Path) -> None:
    table = pa.table({"id": [1, 2], "embedding": vector_array(_vecs(2, 3)), "note": ["a", None]})
    pq.write_table(table, tmp_path / "e.parquet")
    assert read_embeddings(tmp_path / "e.parquet").ids.tolist() == [1, 2]


def test_empty_file(tmp_path: Path) -> None:
    path = write_embeddings(tmp_path / "e.parquet", pa.array([], pa.int64()), np.zeros((0, 5), np.float32))
    emb = read_embeddings(path)
    assert emb.vectors.shape == (0, 5) and emb.ids.dtype == np.int64
    with pytest.raises(InputError, match=r"e\.parquet: the file has no rows"):
        read_embeddings(path, allow_empty=False)


@pytest.mark.parametrize("batch_size", [1, 7, 10, 64])
def test_batches_cross_row_groups(tmp_path: Path, batch_size: int) -> None:
    vecs = _vecs(45, 4)
    path = write_embeddings(tmp_path / "e.parquet", np.arange(45) + 100, vecs, "list64", row_group_size=10)
    batches = list(iter_embedding_batches(path, batch_size))
    assert all(0 < len(b) <= batch_size for b in batches)
    assert [b.row_start for b in batches] == np.cumsum([0] + [len(b) for b in batches[:-1]]).tolist()
    np.testing.assert_array_equal(np.concatenate([b.vectors for b in batches]), vecs)
    assert np.concatenate([b.ids for b in batches]).tolist() == list(range(100, 145))


def test_read_ids(tmp_path: Path) -> None:
    path = write_embeddings(tmp_path / "e.parquet", ["b", "a", "c"], _vecs(3, 2))
    assert read_ids(path).tolist() == ["b", "a", "c"]


# ---- bad embedding files: one InputError naming file, row and id ------------------------------------------------

def _bad_file(tmp_path: Path, case: str) -> tuple[Path, str]:
    """A broken embedding file and a regex its error message must match."""
    path = tmp_path / f"{case}.parquet"
    good = _vecs(30, 4)
    ids = np.arange(30) + 1000
    if case == "missing":
        return path, r"missing\.parquet: no such file"
    if case == "directory":
        path.mkdir()
        return path, r"directory\.parquet: is a directory"
    if case == "not_parquet":
        path.write_text("id,embedding\n1,[1 2 3]\n")
        return path, r"not_parquet\.parquet: not a Parquet file, or truncated"
    if case == "zero_bytes":
        path.write_bytes(b"")
        return path, r"zero_bytes\.parquet: not a Parquet file, or truncated"
    if case == "truncated":
        write_embeddings(path, ids, good)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        return path, r"truncated\.parquet: not a Parquet file, or truncated"
    if case == "missing_id_column":
        write_embeddings(path, ids, good, id_col="user")
        return path, r"no id column 'id'; the columns are 'user', 'embedding'"
    if case == "missing_vec_column":
        write_embeddings(path, ids, good, vec_col="vec")
        return path, r"no vector column 'embedding'; the columns are 'id', 'vec'"
    if case == "float_ids":
        write_embeddings(path, ids.astype(float), good)
        return path, r"id column 'id' has type double, expected integers or strings"
    if case == "int_vectors":
        write_embeddings(path, ids, None, vec_array=pa.array(np.ones((30, 4), np.int32).tolist()))
        return path, r"vector column 'embedding' has type list<\w+: int64>, expected fixed_size_list"
    if case == "null_vector":
        arr = vector_array(good, "list32").to_pylist()
        arr[17] = None
        write_embeddings(path, ids, None, vec_array=pa.array(arr, pa.list_(pa.float32())), row_group_size=8)
        return path, r"null_vector\.parquet: row 17 \(id 1017\) has a null vector"
    if case == "null_in_vector":
        arr = good.tolist()
        arr[21][2] = None
        write_embeddings(path, ids, None, vec_array=pa.array(arr, pa.list_(pa.float32())), row_group_size=8)
        return path, r"row 21 \(id 1021\) has a null value inside its vector"
    if case == "null_id":
        id_list = ids.tolist()
        id_list[9] = None
        write_embeddings(path, None, good, id_array=pa.array(id_list, pa.int64()), row_group_size=8)
        return path, r"null_id\.parquet: row 9 has a null id"
    if case == "ragged":
        arr = good.tolist()
        arr[26] = arr[26][:3]
        write_embeddings(path, ids, None, vec_array=pa.array(arr, pa.list_(pa.float32())), row_group_size=8)
        return path, r"ragged\.parquet: row 26 \(id 1026\) has (3 values|dimension 3), expected 4"
    if case == "empty_vector":
        write_embeddings(path, ids, None, vec_array=pa.array([[]] * 30, pa.list_(pa.float32())))
        return path, r"row 0 \(id 1000\) has an empty vector"
    if case in ("nan", "inf", "neg_inf"):
        bad = good.copy()
        bad[12, 1] = {"nan": np.nan, "inf": np.inf, "neg_inf": -np.inf}[case]
        write_embeddings(path, ids, bad, row_group_size=8)
        return path, rf"{case}\.parquet: row 12 \(id 1012\) has a NaN or infinite value"
    if case == "float64_overflow":
        bad = good.astype(np.float64)
        bad[5, 0] = 1e300
        write_embeddings(path, ids, bad, "list64")
        return path, r"row 5 \(id 1005\) has a value beyond the float32 range"
    if case == "duplicate_int_ids":
        dup = ids.copy()
        dup[23] = dup[4]
        write_embeddings(path, dup, good, row_group_size=8)
        return path, r"duplicate_int_ids\.parquet: duplicate id 1004 at rows 4 and 23"
    if case == "duplicate_str_ids":
        dup = [f"u{i}" for i in range(30)]
        dup[28] = "u3"
        write_embeddings(path, dup, good, row_group_size=8)
        return path, r"duplicate id 'u3' at rows 3 and 28"
    if case == "uint64_overflow":
        write_embeddings(path, None, good[:2], id_array=pa.array([1, 2**64 - 1], pa.uint64()))
        return path, r"row 1 has id 18446744073709551615, beyond the int64 range"
    raise AssertionError(case)


BAD_CASES = [
    "missing", "directory", "not_parquet", "zero_bytes", "truncated", "missing_id_column", "missing_vec_column",
    "float_ids", "int_vectors", "null_vector", "null_in_vector", "null_id", "ragged", "empty_vector", "nan", "inf",
    "neg_inf", "float64_overflow", "duplicate_int_ids", "duplicate_str_ids", "uint64_overflow",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_embeddings_read(tmp_path: Path, case: str) -> None:
    path, pattern = _bad_file(tmp_path, case)
    with pytest.raises(InputError, match=pattern) as info:
        read_embeddings(path)
    assert "\n" not in str(info.value)
    assert str(path) in str(info.value) or case == "missing"


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_embeddings_streamed(tmp_path: Path, case: str) -> None:
    """The streaming reader reports the same error, with the same global row number, whatever the batch size."""
    path, pattern = _bad_file(tmp_path, case)
    with pytest.raises(InputError, match=pattern):
        for _ in iter_embedding_batches(path, batch_size=5):
            pass


def test_corrupt_data_pages(tmp_path: Path) -> None:
    """A valid footer over damaged pages: the error is raised while reading, still naming the file."""
    path = tmp_path / "corrupt.parquet"
    pq.write_table(pa.table({"id": np.arange(1000), "embedding": vector_array(_vecs(1000, 8))}), path,
                   compression="snappy")
    data = bytearray(path.read_bytes())
    data[100:2000] = bytes(b ^ 0xFF for b in data[100:2000])
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"corrupt\.parquet: (row group 0 \(rows 0-999\) is damaged|not a Parquet "
                                         r"file)"):
        read_embeddings(path)


def test_ragged_across_batches_names_global_row(tmp_path: Path) -> None:
    arr = _vecs(40, 4).tolist()
    arr[33] = arr[33] + [0.5]
    path = write_embeddings(tmp_path / "r.parquet", np.arange(40), None,
                            vec_array=pa.array(arr, pa.list_(pa.float32())), row_group_size=16)
    with pytest.raises(InputError, match=r"row 33 \(id 33\) has 5 values, expected 4"):
        read_embeddings(path)
    with pytest.raises(InputError, match=r"row 33 \(id 33\) has 5 values, expected 4"):
        list(iter_embedding_batches(path, 10))


def test_later_batch_with_other_dimension(tmp_path: Path) -> None:
    """A batch whose rows all agree with each other but not with row 0 of the file."""
    arr = _vecs(20, 4).tolist()
    arr[10:] = [row + [1.0] for row in arr[10:]]
    path = write_embeddings(tmp_path / "d.parquet", np.arange(20), None,
                            vec_array=pa.array(arr, pa.list_(pa.float32())), row_group_size=10)
    with pytest.raises(InputError, match=r"row 10 \(id 10\) has dimension 5, expected 4"):
        list(iter_embedding_batches(path, 10))
    with pytest.raises(InputError, match=r"row 10 \(id 10\) has (dimension 5|5 values), expected 4"):
        read_embeddings(path)


@pytest.mark.parametrize("layout", ["fixed32", "list64"])
def test_read_embedding_rows_is_a_slice_of_the_whole_read(tmp_path: Path, layout: str) -> None:
    """One item shard's read (``recall batch --item-shards``): any row range, across and inside row groups, equal to
    the rows of a whole read; ``keep`` returns only some rows' vectors but every id; ``on_batch`` sees every row."""
    vecs = _vecs(230, 5)
    path = write_embeddings(tmp_path / "e.parquet", np.arange(230) * 2, vecs, layout, row_group_size=37)
    whole = read_embeddings(path)
    assert embedding_dim(path) == 5
    for start, stop in [(0, 230), (0, 0), (37, 74), (36, 38), (100, 101), (229, 230), (5, 200)]:
        ids, got = read_embedding_rows(path, start, stop, dim=5)
        np.testing.assert_array_equal(ids, whole.ids[start:stop])
        np.testing.assert_array_equal(got, whole.vectors[start:stop])
        keep = np.arange(0, stop - start, 4)
        seen: list[int] = []
        ids, got = read_embedding_rows(path, start, stop, dim=5, keep=keep,
                                       on_batch=lambda i, v, row: seen.extend(range(row, row + len(i))))
        np.testing.assert_array_equal(ids, whole.ids[start:stop])
        np.testing.assert_array_equal(got, whole.vectors[start:stop][keep])
        assert seen == list(range(start, stop))
    with pytest.raises(InputError, match=r"rows 200:231 are not within its 230 rows"):
        read_embedding_rows(path, 200, 231)


def test_read_embedding_rows_names_rows_of_the_whole_file(tmp_path: Path) -> None:
    arr = _vecs(60, 4).tolist()
    arr[47] = arr[47] + [0.5]  # one vector longer than row 0's
    arr[52][1] = float("nan")
    path = write_embeddings(tmp_path / "r.parquet", np.arange(60) + 100, None,
                            vec_array=pa.array(arr, pa.list_(pa.float32())), row_group_size=16)
    assert embedding_dim(path) == 4
    with pytest.raises(InputError, match=r"row 47 \(id 147\) has dimension 5, expected 4 \(the dimension of row 0"):
        read_embedding_rows(path, 47, 60, dim=4)
    with pytest.raises(InputError, match=r"row 52 \(id 152\) has a NaN or infinite value"):
        read_embedding_rows(path, 48, 60, dim=4)
    ids, got = read_embedding_rows(path, 10, 40, dim=4)  # a good range of a bad file
    assert ids.tolist() == list(range(110, 140)) and got.shape == (30, 4)


def test_stream_expected_dimension(tmp_path: Path) -> None:
    fixed = write_embeddings(tmp_path / "f.parquet", [1, 2], _vecs(2, 3))
    listed = write_embeddings(tmp_path / "l.parquet", [1, 2], _vecs(2, 3), "list32")
    with pytest.raises(InputError, match=r"f\.parquet: vectors have dimension 3, expected 8 \(items\)"):
        iter_embedding_batches(fixed, 4, dim=8, dim_source="items")
    with pytest.raises(InputError, match=r"l\.parquet: row 0 \(id 1\) has dimension 3, expected 8 \(items\)"):
        list(iter_embedding_batches(listed, 4, dim=8, dim_source="items"))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_stream_bad_batch_size(tmp_path: Path, bad) -> None:
    path = write_embeddings(tmp_path / "e.parquet", [1], _vecs(1, 2))
    with pytest.raises(InputError, match="batch_size"):
        iter_embedding_batches(path, bad)


# ---- exclusions -------------------------------------------------------------------------------------------------

def _write(path: Path, **cols) -> Path:
    pq.write_table(pa.table(cols), path)
    return path


def test_exclusion_pairs_with_unknown_ids(tmp_path: Path) -> None:
    user_ids = np.array([10, 20, 30], np.int64)
    item_ids = np.array([7, 8, 9, 6], np.int64)
    path = _write(tmp_path / "x.parquet",
                  user_id=pa.array([30, 10, 10, 99, 20, 10], pa.int32()),
                  item_id=pa.array([6, 9, 7, 7, 55, 9], pa.int64()))
    pairs = read_pairs(path, user_ids, item_ids)
    indptr, rows = pairs.csr()
    # user 99 and item 55 are unknown; (10, 9) twice counts as one exclusion.
    assert pairs.n_unknown == 2
    assert indptr.tolist() == [0, 2, 2, 3]
    assert rows.tolist() == [0, 2, 3]


def test_exclusion_list_form_string_ids(tmp_path: Path) -> None:
    user_ids = np.array(["a", "b", "c"], object)
    item_ids = np.array(["x", "y", "z"], object)
    path = _write(tmp_path / "x.parquet", user_id=["c", "a", "nobody"],
                  item_ids=pa.array([["z", "x"], ["y", "unknown"], ["x"]], pa.list_(pa.string())))
    pairs = read_pairs(path, user_ids, item_ids)
    assert (pairs.n_pairs, pairs.n_unknown) == (5, 2)
    indptr, rows = pairs.csr()
    assert indptr.tolist() == [0, 1, 1, 3] and rows.tolist() == [1, 0, 2]


@pytest.mark.parametrize("form", ["pairs", "lists"])
def test_pairs_mapped_a_group_of_batches_at_a_time_equal_one_lookup(tmp_path: Path, monkeypatch, form) -> None:
    import recall.io.pairs as pairs_mod

    rng = np.random.default_rng(8)
    user_ids, item_ids = np.arange(60) * 3 + 7, np.arange(90) * 5 + 1
    users = rng.integers(0, 200, 700)  # some unknown (not a multiple of 3 plus 7)
    if form == "pairs":
        path = _write(tmp_path / "x.parquet", user_id=users, item_id=rng.integers(0, 500, 700))
    else:
        lists = [rng.integers(0, 500, rng.integers(0, 4)).tolist() for _ in users]  # some empty lists
        path = _write(tmp_path / "x.parquet", user_id=users, item_ids=pa.array(lists, pa.list_(pa.int64())))
    whole = read_pairs(path, user_ids, item_ids)
    monkeypatch.setattr(pairs_mod, "READ_BATCH_ROWS", 16)
    monkeypatch.setattr(pairs_mod, "LOOKUP_GROUP_VALUES", 1)  # a lookup every 4 x 90 values: several groups
    grouped = read_pairs(path, user_ids, item_ids)
    for a, b in zip(whole.csr(), grouped.csr()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(whole.named, grouped.named)
    assert (whole.n_pairs, whole.n_unknown) == (grouped.n_pairs, grouped.n_unknown) and whole.n_unknown > 0


def test_exclusion_blocks_match_full_csr(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    user_ids, item_ids = np.arange(50) + 1000, np.arange(40) + 5000
    path = _write(tmp_path / "x.parquet", user_id=rng.integers(1000, 1050, 300), item_id=rng.integers(5000, 5040, 300))
    pairs = read_pairs(path, user_ids, item_ids)
    full_ptr, full_rows = pairs.csr()
    for start, stop in [(0, 7), (7, 23), (23, 50), (10, 10)]:
        ptr, rows = pairs.block(start, stop)
        assert ptr.tolist() == (full_ptr[start:stop + 1] - full_ptr[start]).tolist()
        assert rows.tolist() == full_rows[full_ptr[start]:full_ptr[stop]].tolist()


def test_exclusions_feed_the_engine(tmp_path: Path) -> None:
    items = _vecs(20, 4, seed=1)
    users = _vecs(3, 4, seed=2)
    item_ids = np.arange(20) * 10
    engine = Engine(items, ids=item_ids, device="cpu")
    best = engine.search(users, 3)
    path = _write(tmp_path / "x.parquet", user_id=[0, 0, 2], item_id=[int(best.ids[0, 0]), int(best.ids[0, 1]),
                                                                       int(best.ids[2, 0])])
    pairs = read_pairs(path, np.arange(3), item_ids)
    res = engine.search(users, 3, exclude=pairs.csr())
    assert pairs.n_unknown == 0
    assert not set(best.ids[0, :2].tolist()) & set(res.ids[0].tolist())
    assert best.ids[2, 0] not in res.ids[2] and res.ids[1].tolist() == best.ids[1].tolist()
    assert (res.indices >= 0).all()  # still k items each


@pytest.mark.parametrize("cols,pattern", [
    ({"user": [1], "item": [2]}, r"exclusion columns are 'user', 'item'; expected 'user_id' with 'item_id'"),
    ({"user_id": [1]}, r"exclusion columns are 'user_id'; expected"),
    ({"user_id": [1], "item_id": [2], "item_ids": [[2]]}, r"expected 'user_id' with 'item_id'"),
    ({"user_id": [1], "item_ids": [2]}, r"column 'item_ids' has type int64, expected a list"),
    ({"user_id": ["1"], "item_id": [2]}, r"column 'user_id' has type string, but the users' ids are integers"),
    ({"user_id": [1], "item_id": [2.0]}, r"column 'item_id' has type double, but the items' ids are integers"),
    ({"user_id": [1, None], "item_id": [2, 3]}, r"row 1 has a null user_id"),
    ({"user_id": [1, 2], "item_ids": [[2], None]}, r"row 1 has a null item_ids"),
    ({"user_id": [1, 2], "item_ids": [[2], [3, None]]}, r"row 1 has a null inside its item_ids list"),
])
def test_bad_exclusions(tmp_path: Path, cols: dict, pattern: str) -> None:
    path = _write(tmp_path / "x.parquet", **cols)
    with pytest.raises(InputError, match=pattern) as info:
        read_pairs(path, np.array([1, 2]), np.array([2, 3]))
    assert str(path) in str(info.value)


def test_exclusions_not_parquet(tmp_path: Path) -> None:
    path = tmp_path / "x.parquet"
    path.write_text("user_id,item_id\n1,2\n")
    with pytest.raises(InputError, match=r"x\.parquet: not a Parquet file"):
        read_pairs(path, np.array([1]), np.array([2]))


# ---- writer -----------------------------------------------------------------------------------------------------

def _result_table(n: int, start: int = 0) -> pa.Table:
    engine = Engine(_vecs(12, 3, seed=5), ids=np.arange(12) + 500, device="cpu")
    return engine.search(_vecs(n, 3, seed=start), 4).to_arrow(np.arange(start, start + n))


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_writer_writes_schema_and_rows(tmp_path: Path) -> None:
    out = tmp_path / "out.parquet"
    with CandidateWriter(out) as writer:
        writer.write(_result_table(5, 0))
        assert not out.exists()  # only the temporary file exists until the end
        writer.write(_result_table(3, 5))
    table = pq.read_table(out)
    assert table.schema.equals(candidates_schema(pa.int64(), pa.int64()))
    assert table.column("user_id").to_pylist() == list(range(8))
    assert all(len(x) == 4 for x in table.column("item_ids").to_pylist())
    assert _leftovers(tmp_path) == ["out.parquet"]


def test_writer_string_ids_and_empty(tmp_path: Path) -> None:
    out = tmp_path / "out.parquet"
    with CandidateWriter(out, pa.string(), pa.string()):
        pass
    table = pq.read_table(out)
    assert table.num_rows == 0 and table.schema.equals(candidates_schema(pa.string(), pa.string()))


def test_writer_exception_mid_write_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out.parquet"
    with pytest.raises(RuntimeError, match="boom"):
        with CandidateWriter(out) as writer:
            writer.write(_result_table(5))
            raise RuntimeError("boom")
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("step", ["flock", "magic", "pool"])
def test_writer_stopped_while_opening_leaves_nothing(tmp_path: Path, monkeypatch, step: str) -> None:
    # A signal raised (``raising_signals``) after the temporary file exists but before ``__enter__`` returns: no
    # ``__exit__`` runs, so the opening itself removes it; the previous file stays.
    import fcntl

    out = tmp_path / "out.parquet"
    out.write_bytes(b"previous")

    def stop(*args, **kwargs):
        assert writer_module.atomic.temporary_path(out.absolute()).exists()  # the file it must remove
        raise KeyboardInterrupt

    if step == "flock":
        monkeypatch.setattr(fcntl, "flock", stop)
    elif step == "magic":
        monkeypatch.setattr(CandidateWriter, "_write", stop)
    else:
        monkeypatch.setattr(writer_module, "ThreadPoolExecutor", stop)
    with pytest.raises(KeyboardInterrupt):
        with CandidateWriter(out):
            pass
    assert out.read_bytes() == b"previous" and _leftovers(tmp_path) == ["out.parquet"]


def test_writer_keeps_previous_file_on_failure(tmp_path: Path) -> None:
    out = tmp_path / "out.parquet"
    out.write_bytes(b"previous")
    with pytest.raises(KeyboardInterrupt):
        with CandidateWriter(out) as writer:
            writer.write(_result_table(5))
            raise KeyboardInterrupt
    assert out.read_bytes() == b"previous" and _leftovers(tmp_path) == ["out.parquet"]


def test_writer_rejects_table_of_wrong_type(tmp_path: Path) -> None:
    out = tmp_path / "out.parquet"
    with pytest.raises(InputError, match="does not fit the schema"):
        with CandidateWriter(out, pa.int64(), pa.int64()) as writer:
            writer.write(pa.table({"user_id": ["a"], "item_ids": [["b"]], "scores": pa.array([[1.0]],
                                                                                             pa.list_(pa.float32()))}))
    assert _leftovers(tmp_path) == []


def _candidates(n: int, k: int, start: int, seed: int) -> pa.Table:
    """A candidates table of n users with k pairs each (some rows shorter, as after padding is dropped)."""
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(n) < 0.2, rng.integers(0, k + 1, n), k)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    items = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 10**6, offsets[-1])))
    scores = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.standard_normal(offsets[-1]), pa.float32()))
    return pa.table({"user_id": np.arange(start, start + n), "item_ids": items, "scores": scores})


def _batches() -> list[pa.Table]:
    sizes = [300, 1, 0, 2500, 40, 700, 5]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return [_candidates(n, 9, int(s), seed=i) for i, (n, s) in enumerate(zip(sizes, starts))]


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_writer_file_is_what_one_pyarrow_writer_writes(tmp_path: Path, compression: str) -> None:
    """Row groups encoded on three threads and laid end to end: the same bytes as one encoder, in order."""
    tables = _batches()
    with CandidateWriter(tmp_path / "out.parquet", compression=compression, threads=3) as writer:
        for table in tables:
            writer.write(table)
    assert writer.rows_written == sum(t.num_rows for t in tables)
    # The options the writer promises: no dictionary, statistics for user_id only, zstd at level 1, page checksums.
    with pq.ParquetWriter(tmp_path / "one.parquet", candidates_schema(), compression=compression,
                          compression_level=1 if compression == "zstd" else None, use_dictionary=False,
                          write_statistics=["user_id"], write_page_checksum=True) as one:
        for table in tables:
            if table.num_rows:  # an empty table adds no row group
                one.write_table(table)
    assert (tmp_path / "out.parquet").read_bytes() == (tmp_path / "one.parquet").read_bytes()
    meta = pq.ParquetFile(tmp_path / "out.parquet").metadata
    assert meta.num_row_groups == 6 and meta.num_rows == 3546
    assert meta.row_group(0).column(1).compression == ("UNCOMPRESSED" if compression == "none" else
                                                       compression.upper())
    assert meta.row_group(1).column(0).statistics.min == 300 and meta.row_group(1).column(1).statistics is None
    assert pq.read_table(tmp_path / "out.parquet").equals(pa.concat_tables(tables))


def test_writer_search_results_read_back(tmp_path: Path) -> None:
    """Engine results, padded rows included (k > items, exclusions), written in batches: read back as they went in."""
    engine = Engine(_vecs(12, 3, seed=5), ids=np.arange(12) * 7 + 500, device="cpu")
    users = _vecs(50, 3, seed=6)
    exclude = {3: range(12), 4: [0, 1, 2]}
    result = engine.search(users, 15, exclude=exclude)
    with CandidateWriter(tmp_path / "out.parquet", threads=2) as writer:
        for start in range(0, 50, 8):
            sel = slice(start, start + 8)
            writer.write(type(result)(result.indices[sel], result.scores[sel], result.ids[sel])
                         .to_arrow(np.arange(50)[sel] + 1000))
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.equals(result.to_arrow(np.arange(50) + 1000))
    lengths = [len(x) for x in table.column("item_ids").to_pylist()]
    assert lengths[3] == 0 and lengths[4] == 9 and set(lengths[5:]) == {12}


def test_footer_decodes_and_encodes_to_the_same_bytes(tmp_path: Path) -> None:
    """The compact-protocol codec on footers with statistics, dictionaries, string ids and page indexes."""
    tables = [_candidates(500, 4, 0, seed=1),
              pa.table({"user_id": [f"u{i}" for i in range(200)], "x": np.arange(200.0)})]
    for table in tables:
        for options in ({}, {"write_page_index": True}, {"use_dictionary": False, "write_statistics": False}):
            path = tmp_path / "f.parquet"
            pq.write_table(table, path, row_group_size=120, **options)
            raw = path.read_bytes()
            data, meta = parquet_footer.split_file(raw)
            assert len(data) > 0 and parquet_footer.num_rows(meta) == table.num_rows
            assert len(parquet_footer.row_groups(meta)) == -(-table.num_rows // 120)
            assert parquet_footer.footer(meta, parquet_footer.row_groups(meta), table.num_rows) == \
                raw[4 + len(data):]
    with pytest.raises(ValueError, match="not a Parquet file"):
        parquet_footer.split_file(b"PAR1 nope")
    pq.write_table(tables[0], path, write_page_index=True)
    _, meta = parquet_footer.split_file(path.read_bytes())
    with pytest.raises(ValueError, match="page index"):  # its page positions would need moving too
        parquet_footer.move_row_group(parquet_footer.row_groups(meta)[0], 100, 0)


@pytest.mark.parametrize("kwargs,pattern", [
    ({"compression": "gzip"}, r"unknown compression 'gzip': expected one of none, snappy, lz4, zstd"),
    ({"threads": 0}, r"threads must be an integer >= 1, got 0"),
    ({"threads": True}, r"threads must be an integer >= 1, got True"),
])
def test_writer_bad_options(tmp_path: Path, kwargs: dict, pattern: str) -> None:
    with pytest.raises(InputError, match=pattern):
        CandidateWriter(tmp_path / "out.parquet", **kwargs)
    assert _leftovers(tmp_path) == []


def test_writer_encoding_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error on an encoding thread reaches the caller (from a later write or the commit); nothing is published
    and the threads are gone."""
    import threading

    calls = []
    original = writer_module._encode

    def failing_encode(table, schema, options):
        calls.append(1)
        if len(calls) == 3:  # the empty file of open(), then the first table, then this one
            raise OSError("disk full")
        return original(table, schema, options)

    monkeypatch.setattr(writer_module, "_encode", failing_encode)
    out = tmp_path / "out.parquet"
    with pytest.raises(OSError, match="disk full"):
        with CandidateWriter(out, threads=2) as writer:
            for start in range(0, 40, 5):
                writer.write(_result_table(5, start))
    assert _leftovers(tmp_path) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("recall-parquet")]


def test_writer_flushes_to_disk_as_it_grows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced = []
    monkeypatch.setattr(writer_module, "_SYNC_BYTES", 1000)
    monkeypatch.setattr(writer_module.os, "fdatasync", lambda fd: synced.append(fd))
    with CandidateWriter(tmp_path / "out.parquet", threads=2) as writer:
        for start in range(0, 400, 100):
            writer.write(_candidates(100, 9, start, seed=start))
    assert len(synced) == 4
    assert pq.read_table(tmp_path / "out.parquet").num_rows == 400


def test_writer_splits_large_tables_over_its_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "_SPLIT_ROWS", 10)
    tables = [_candidates(103, 9, 0, seed=1), _candidates(25, 9, 103, seed=2), _candidates(9, 9, 128, seed=3)]
    with CandidateWriter(tmp_path / "out.parquet", threads=4) as writer:
        for table in tables:
            writer.write(table)
    meta = pq.ParquetFile(tmp_path / "out.parquet").metadata
    # 103 rows in 4 row groups of 26, 26, 26, 25; 25 rows in 2 of 13 and 12; 9 rows whole.
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [26, 26, 26, 25, 13, 12, 9]
    assert pq.read_table(tmp_path / "out.parquet").equals(pa.concat_tables(tables))


def test_writer_appends_encoded_tables_before_commit(tmp_path: Path) -> None:
    # A table whose encoding is done goes into the file at the next write, not when every thread is busy: otherwise
    # the last tables of a job (and their flush to disk) would all wait for commit().
    out = tmp_path / "out.parquet"
    with CandidateWriter(out, threads=8) as writer:
        for start in range(0, 500, 100):
            writer.write(_candidates(100, 9, start, seed=start))
            if writer.tmp_path.stat().st_size > len(parquet_footer.MAGIC):
                break
            time.sleep(0.2)
        assert writer.tmp_path.stat().st_size > len(parquet_footer.MAGIC), "nothing appended before commit"
        assert start < 400  # long before 8 tables are pending
    assert pq.read_table(out).num_rows == start + 100


def test_writer_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        with CandidateWriter(tmp_path / "no" / "out.parquet"):
            pass
    with pytest.raises(InputError, match="is a directory"):
        with CandidateWriter(tmp_path):
            pass


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root can write anywhere")
def test_writer_unwritable_directory(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(InputError, match="not writable"):
            with CandidateWriter(ro / "out.parquet"):
                pass
    finally:
        ro.chmod(0o700)


# ---- damaged pages, content hashes, leftovers of dead processes, output paths (issue 19) ---------------------------

def _flip_inside_a_data_page(path: Path, row_group: int, column: int = 1, n: int = 16) -> None:
    """Flip ``n`` bytes in the middle of the first data page of a column chunk (past its header: the values)."""
    chunk = pq.ParquetFile(path).metadata.row_group(row_group).column(column)
    start = chunk.data_page_offset
    end = start + chunk.total_compressed_size - (chunk.data_page_offset - (chunk.dictionary_page_offset or start))
    pos = (start + end) // 2
    data = bytearray(path.read_bytes())
    data[pos:pos + n] = bytes(b ^ 0xFF for b in data[pos:pos + n])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("layout", ["fixed32", "list32", "list64"])
def test_a_page_failing_its_checksum_is_an_error_naming_the_row_group(tmp_path: Path, layout: str) -> None:
    """Issue 19.2: 16 flipped bytes inside a data page of the second row group of a file written with page checksums
    decode into other (finite) vectors; the checksum is verified, so they are refused, naming the row group."""
    path = tmp_path / "u.parquet"
    pq.write_table(pa.table({"id": np.arange(300), "embedding": vector_array(_vecs(300, 8), layout)}), path,
                   row_group_size=100, compression="none", use_dictionary=False, write_page_checksum=True)
    _flip_inside_a_data_page(path, 1)
    assert pq.ParquetFile(path).read().num_rows == 300  # unverified, the damage goes unnoticed
    pattern = rf"{path}: row group 1 \(rows 100-199\) is damaged: a page checksum does not match"
    with pytest.raises(InputError, match=pattern):
        read_embeddings(path)
    with pytest.raises(InputError, match=pattern):
        list(iter_embedding_batches(path, 64))
    assert read_ids(path).size == 300  # the id column is intact


def test_outputs_carry_page_checksums(tmp_path: Path) -> None:
    """Every candidates file is written with page checksums, so a reader can tell a damaged one (recall's own pairs
    reader does: a damaged candidates file given to ``recall rescore`` is refused)."""
    out = tmp_path / "c.parquet"
    with CandidateWriter(out, compression="none") as writer:
        writer.write(_candidates(100, 9, 0, seed=1))
        writer.write(_candidates(100, 9, 100, seed=2))
    _flip_inside_a_data_page(out, 1, column=1)
    assert pq.read_table(out).num_rows == 200
    with pytest.raises(OSError, match="CRC checksum verification failed"):
        pq.read_table(out, page_checksum_verification=True)
    with pytest.raises(InputError, match=rf"{out}: row group 1 \(rows 100-199\) is damaged"):
        read_pairs(out, np.arange(200), np.arange(10_000), what="candidate")


def test_a_page_that_does_not_decode_names_the_row_group(tmp_path: Path) -> None:
    path = tmp_path / "u.parquet"
    pq.write_table(pa.table({"id": np.arange(300), "embedding": vector_array(_vecs(300, 8))}), path,
                   row_group_size=100, compression="snappy")
    chunk = pq.ParquetFile(path).metadata.row_group(2).column(1)
    data = bytearray(path.read_bytes())
    lo = chunk.data_page_offset + 20
    data[lo:lo + 400] = bytes(b ^ 0xFF for b in data[lo:lo + 400])
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match=rf"{path}: row group 2 \(rows 200-299\) is damaged"):
        read_embeddings(path)


def test_content_hash_sees_one_changed_byte(tmp_path: Path) -> None:
    import xxhash

    from recall.io.atomic import content_hash

    a, b = tmp_path / "a", tmp_path / "b"
    blob = np.random.default_rng(0).bytes(3 << 20)  # several read chunks
    a.write_bytes(blob)
    b.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    assert content_hash(a) == xxhash.xxh3_128(blob).hexdigest() != content_hash(b)
    with pytest.raises(OSError) as err:
        content_hash(tmp_path / "missing")
    assert err.value.filename == str(tmp_path / "missing")


def _dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_are_only_those_of_dead_unlocked_writers(tmp_path: Path) -> None:
    import fcntl
    import subprocess

    from recall.io.atomic import remove_stale_temporaries, stale_temporaries

    dead = _dead_pid()
    live = subprocess.Popen(["sleep", "30"])
    try:
        names = {"dead": f".out.parquet.tmp-{dead}", "other": f".x.json.tmp-{dead}",
                 "live": f".out.parquet.tmp-{live.pid}", "mine": f".out.parquet.tmp-{os.getpid()}",
                 "locked": f".y.parquet.tmp-{dead + 1 if dead + 1 != live.pid else dead + 2}",
                 "unrelated": "out.parquet.tmp-1"}
        for name in names.values():
            (tmp_path / name).write_bytes(b"x" * 10)
        # A writer on another host: its pid means nothing here, but it holds the flock.
        fd = os.open(tmp_path / names["locked"], os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            assert {p.name for p in stale_temporaries(tmp_path)} == {names["dead"], names["other"]}
            assert sorted(remove_stale_temporaries(tmp_path)) == sorted([(names["dead"], 10), (names["other"], 10)])
        finally:
            os.close(fd)
        assert {p.name for p in tmp_path.iterdir()} == {names[k] for k in ("live", "mine", "locked", "unrelated")}
    finally:
        live.kill()
        live.wait()


def test_writer_locks_its_temporary_file(tmp_path: Path) -> None:
    from recall.io.atomic import _locked

    with CandidateWriter(tmp_path / "out.parquet") as writer:
        writer.write(_candidates(10, 3, 0, seed=0))
        assert _locked(str(writer.tmp_path))
    assert _leftovers(tmp_path) == ["out.parquet"]


@pytest.mark.parametrize("case", ["trailing_slash", "dash", "empty", "symlink_loop", "dangling_link"])
def test_output_paths_that_name_no_file_are_refused(tmp_path: Path, case: str) -> None:
    """Issue 19.8: ``--out newdir/`` created a file named newdir, ``--out -`` a file named -."""
    from recall.io import check_output_path

    if case == "trailing_slash":
        path, pattern = f"{tmp_path}/newdir/", r"newdir/: names a directory \(it ends with '/'\)"
    elif case == "dash":
        path, pattern = "-", r"'-': expected the path of the output Parquet file \(writing to stdout is not"
    elif case == "empty":
        path, pattern = "", r"'': expected the path of the output Parquet file"
    elif case == "symlink_loop":
        (tmp_path / "a").symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(tmp_path / "a")
        path, pattern = str(tmp_path / "a"), r"a: cannot be used as the output: Too many levels of symbolic links"
    else:
        (tmp_path / "a").symlink_to(tmp_path / "nowhere" / "x.parquet")
        path, pattern = str(tmp_path / "a"), r"a: is a symbolic link to .*nowhere/x\.parquet, which does not exist"
    with pytest.raises(InputError, match=pattern):
        check_output_path(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in tmp_path.iterdir()
                                                               if p.is_symlink())


@pytest.mark.parametrize("case", ["loop", "dangling"])
def test_inputs_behind_bad_symbolic_links(tmp_path: Path, case: str) -> None:
    """Issue 19.7: a loop of links read as "no such file"."""
    if case == "loop":
        (tmp_path / "a.parquet").symlink_to(tmp_path / "b.parquet")
        (tmp_path / "b.parquet").symlink_to(tmp_path / "a.parquet")
        pattern = r"a\.parquet: cannot open the embeddings file: Too many levels of symbolic links"
    else:
        (tmp_path / "a.parquet").symlink_to(tmp_path / "gone.parquet")
        pattern = r"a\.parquet: is a symbolic link to .*gone\.parquet, which does not exist"
    with pytest.raises(InputError, match=pattern):
        read_embeddings(tmp_path / "a.parquet")


def test_disk_full_names_the_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19.7: ``[Errno 28] No space left on device`` without a path. The error keeps its errno and type and
    names the output; nothing is left behind and the previous file stays."""
    import errno

    out = tmp_path / "out.parquet"
    out.write_bytes(b"yesterday")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer_module.os, "fsync", full)
    with pytest.raises(OSError) as err:
        with CandidateWriter(out) as writer:
            writer.write(_candidates(10, 3, 0, seed=0))
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(out)
    assert err.value.strerror.startswith("cannot write: No space left on device")
    assert out.read_bytes() == b"yesterday" and _leftovers(tmp_path) == ["out.parquet"]


def test_write_bytes_names_the_path_of_an_os_error(tmp_path: Path) -> None:
    from recall.io.atomic import write_bytes

    (tmp_path / "d").mkdir()
    with pytest.raises(OSError) as err:
        write_bytes(tmp_path / "d", b"x")  # a directory: the rename fails
    assert err.value.filename == str(tmp_path / "d") and _leftovers(tmp_path) == ["d"]


@pytest.mark.parametrize("ids", [
    np.arange(1000, 1400)[::-1],                                  # dense: looked up in a table by id
    np.array([-7, -3, 0, 5, 9, 2 ** 40]),                         # sparse: Arrow's hash
    np.array([np.iinfo(np.int64).min + 3, np.iinfo(np.int64).max - 1, 0]),
    np.arange(-50, 50, 3),
])
def test_lookup_dense_and_hashed_agree(ids: np.ndarray) -> None:
    from recall.io.parquet import lookup

    ids = ids.astype(np.int64)
    rng = np.random.default_rng(0)
    probe = np.concatenate([rng.choice(ids, 50), [np.iinfo(np.int64).max, np.iinfo(np.int64).min, -1, 10 ** 6],
                            ids.min() - np.arange(1, 4), ids.max() + np.arange(1, 4)]).astype(np.int64)
    want = np.array([int(np.flatnonzero(ids == v)[0]) if (ids == v).any() else -1 for v in probe])
    chunked = pa.chunked_array([pa.array(probe[:20]), pa.array(probe[20:])])
    np.testing.assert_array_equal(lookup(chunked, ids), want)
    np.testing.assert_array_equal(lookup(pa.array(probe), ids), want)
    assert lookup(pa.chunked_array([], pa.int64()), ids).size == 0


@pytest.mark.parametrize("table, needle", [
    ({"user_id": pa.array([], pa.string()), "item_id": pa.array([], pa.string())}, "column 'user_id' has type string"),
    ({"user_id": pa.array([], pa.int64()), "item_id": pa.array([], pa.string())}, "column 'item_id' has type string"),
    ({"user_id": pa.array([], pa.int64()), "item_ids": pa.array([], pa.list_(pa.string()))},
     "column 'item_ids' has type string"),
])
def test_a_pairs_file_without_rows_still_has_its_id_types_checked(tmp_path: Path, table: dict, needle: str) -> None:
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.table(table), path)
    with pytest.raises(InputError, match=needle):
        read_pairs(path, np.array([1, 2]), np.array([3, 4]))


def test_an_item_filter_file_without_rows_still_has_its_id_type_checked(tmp_path: Path) -> None:
    path = tmp_path / "deny.parquet"
    pq.write_table(pa.table({"item_id": pa.array([], pa.string())}), path)
    with pytest.raises(InputError, match="column 'item_id' has type string, but the items' ids are integers"):
        read_item_set(path, np.array([1, 2]), "deny")
    assert read_item_set(path, np.array(["a"], object), "deny").n_ids == 0
