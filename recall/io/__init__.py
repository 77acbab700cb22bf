"""Parquet in and out (placeholder until the I/O module lands)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Embeddings:
    ids: np.ndarray
    vectors: np.ndarray


def read_embeddings(path, id_col="id", vec_col="embedding"):
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    return Embeddings(t[id_col].to_numpy(), np.stack(t[vec_col].to_pylist()).astype(np.float32))
