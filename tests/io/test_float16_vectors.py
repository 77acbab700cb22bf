"""float16 vector columns are read, exactly, as float32; a column of another value type is refused with a message
that lists every accepted one."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recall import InputError
from recall.io import inspect_embeddings, iter_embedding_batches, read_embeddings


def _write(path: Path, vecs: np.ndarray, value_type: pa.DataType, fixed: bool = True) -> Path:
    flat = pa.array(vecs.ravel(), value_type)
    offsets = pa.array(np.arange(0, vecs.size + 1, vecs.shape[1]), pa.int32())
    column = pa.FixedSizeListArray.from_arrays(flat, vecs.shape[1]) if fixed else pa.ListArray.from_arrays(offsets,
                                                                                                            flat)
    pq.write_table(pa.table({"id": pa.array(np.arange(len(vecs)) + 1000), "embedding": column}), path)
    return path


@pytest.mark.parametrize("fixed", [True, False])
def test_float16_vectors_are_read_exactly(tmp_path: Path, fixed: bool) -> None:
    vecs = np.random.default_rng(0).standard_normal((7, 16)).astype(np.float16)
    path = _write(tmp_path / "u16.parquet", vecs, pa.float16(), fixed)
    assert inspect_embeddings(path).dim == (16 if fixed else None)
    emb = read_embeddings(path)
    assert emb.vectors.dtype == np.float32
    np.testing.assert_array_equal(emb.vectors, vecs.astype(np.float32))
    batches = list(iter_embedding_batches(path, batch_size=3))
    np.testing.assert_array_equal(np.concatenate([b.vectors for b in batches]), vecs.astype(np.float32))


def test_other_vector_types_are_refused_naming_the_accepted_ones(tmp_path: Path) -> None:
    path = _write(tmp_path / "i32.parquet", np.ones((3, 4), np.int32), pa.int32())
    with pytest.raises(InputError, match=r"i32\.parquet: vector column 'embedding' has type "
                                         r"fixed_size_list<\w+: int32>\[4\], expected "
                                         r"fixed_size_list<float16\|float32\|float64>\[dim\] or "
                                         r"list<float16\|float32\|float64>$"):
        read_embeddings(path)
