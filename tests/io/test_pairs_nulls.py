"""A pairs file with nulls names the first row holding a null in either column (user_id where a row has both)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recall import InputError
from recall.io import read_pairs


@pytest.mark.parametrize("cols, needle", [
    ({"user_id": [1, None], "item_id": [None, 100001]}, r"row 0 has a null item_id"),
    ({"user_id": [1, 2, None], "item_id": [2, None, 3]}, r"row 1 has a null item_id"),
    ({"user_id": [1, None, 2], "item_id": [2, 3, None]}, r"row 1 has a null user_id"),
    ({"user_id": [1, None], "item_id": [2, None]}, r"row 1 has a null user_id"),
    ({"user_id": [1, 2], "item_ids": [None, [2]]}, r"row 0 has a null item_ids"),
    ({"user_id": [1, None], "item_ids": [None, [2]]}, r"row 0 has a null item_ids"),
    ({"user_id": [None, 2], "item_ids": [None, [2]]}, r"row 0 has a null user_id"),
])
def test_first_row_with_a_null_is_named(tmp_path: Path, cols: dict, needle: str) -> None:
    types = {"user_id": pa.int64(), "item_id": pa.int64(), "item_ids": pa.list_(pa.int64())}
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({name: pa.array(values, types[name]) for name, values in cols.items()}), path)
    with pytest.raises(InputError, match=rf"x\.parquet: {needle}$"):
        read_pairs(path, np.array([1, 2]), np.array([2, 3, 100001]))


def test_rows_are_counted_over_the_whole_file(tmp_path: Path) -> None:
    # Row groups of 3: the first null item_id is in the second group, before its null user_id.
    path = tmp_path / "x.parquet"
    users = [1, 2, 1, 2, 1, None, 2]
    items = [2, 3, 2, 3, None, 2, 3]
    pq.write_table(pa.table({"user_id": pa.array(users, pa.int64()), "item_id": pa.array(items, pa.int64())}), path,
                   row_group_size=3)
    with pytest.raises(InputError, match=r"row 4 has a null item_id$"):
        read_pairs(path, np.array([1, 2]), np.array([2, 3]))
