"""Parquet file layouts for the end-to-end rows (``recall bench --e2e --layout NAME``): embeddings written the way
the tools that export them write them, since the reader's cost depends on it (row groups, list type, codec).

================  ======================================================================================================
layout            what it stands for
================  ======================================================================================================
``pyarrow``       one ``pq.write_table`` call: ``fixed_size_list<float32>[dim]``, pyarrow's default row groups (up to
                  1Mi rows), snappy. What a Python user writes; the default.
``warehouse``     ``list<float>`` (a variable-length list, element field "element", as Spark and DuckDB write
                  ``array<float>`` / ``FLOAT[]``), row groups of 131,072 rows, zstd.
``rowgroups-64k`` ``fixed_size_list<float32>``, row groups of 65,536 rows, snappy: many small row groups, as a writer
                  flushing often leaves them.
``list-double``   ``list<double>`` (DuckDB's ``DOUBLE[]``, pandas' float64 lists), row groups of 122,880 rows (DuckDB's
                  default), zstd: the reader converts every value to float32.
================  ======================================================================================================

Ids are int64 row numbers in every layout, so the candidates file maps straight back onto the oracle's rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recall import InputError


@dataclass(frozen=True)
class Layout:
    """How one embeddings file is written.

    Attributes
    ----------
    name : str
    list_type : {"fixed", "list"}
        ``fixed_size_list<value>[dim]`` or a variable-length ``list<value>``.
    value : {"float32", "float64"}
    row_group_rows : int or None
        Rows per row group; None: pyarrow's default (one ``write_table``).
    compression : str
    why : str
    """

    name: str
    list_type: str
    value: str
    row_group_rows: int | None
    compression: str
    why: str


LAYOUTS: dict[str, Layout] = {x.name: x for x in (
    Layout("pyarrow", "fixed", "float32", None, "snappy", "pyarrow write_table defaults (today's)"),
    Layout("warehouse", "list", "float32", 131_072, "zstd", "Spark / DuckDB export: list<float>, 128k-row groups"),
    Layout("rowgroups-64k", "fixed", "float32", 65_536, "snappy", "many small row groups"),
    Layout("list-double", "list", "float64", 122_880, "zstd", "DuckDB DOUBLE[]: float64 values"),
)}
"""Every layout, by name."""
DEFAULT = "pyarrow"


def get(name: str) -> Layout:
    """The named layout.

    Raises
    ------
    InputError
        On an unknown name.
    """
    try:
        return LAYOUTS[name]
    except KeyError:
        raise InputError(f"unknown layout {name!r}: expected one of {', '.join(LAYOUTS)}") from None


def _vectors(vecs: np.ndarray, layout: Layout):
    import pyarrow as pa

    n, dim = vecs.shape
    value_type = pa.float32() if layout.value == "float32" else pa.float64()
    flat = pa.array(np.ascontiguousarray(vecs, dtype=np.float32 if layout.value == "float32" else np.float64)
                    .ravel(), type=value_type)
    if layout.list_type == "fixed":
        return pa.FixedSizeListArray.from_arrays(flat, dim)
    # Spark names the list element "element"; offsets are int32, fine within one written chunk.
    offsets = pa.array(np.arange(0, n * dim + 1, dim, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, flat, type=pa.list_(pa.field("element", value_type)))


def write(vecs: np.ndarray, path: Path, layout: Layout | str = DEFAULT) -> None:
    """Write ``vecs`` as an embeddings Parquet file (``id`` int64 row numbers, ``embedding``) in ``layout``.

    Parameters
    ----------
    vecs : array of float32, shape (n, dim), on the host
    path : Path
    layout : Layout or str
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    layout = get(layout) if isinstance(layout, str) else layout
    n = int(vecs.shape[0])

    def table(a: int, b: int):
        return pa.table({"id": pa.array(np.arange(a, b, dtype=np.int64)), "embedding": _vectors(vecs[a:b], layout)})

    if layout.row_group_rows is None:
        pq.write_table(table(0, n), path, compression=layout.compression)
        return
    step = layout.row_group_rows
    first = table(0, min(step, n))
    with pq.ParquetWriter(path, first.schema, compression=layout.compression) as writer:
        writer.write_table(first, row_group_size=step)
        for a in range(step, n, step):  # one chunk per row group: list offsets stay int32 whatever n * dim is
            writer.write_table(table(a, min(a + step, n)), row_group_size=step)


def write_exclusions(indptr: np.ndarray, items: np.ndarray, path: Path) -> None:
    """Write per-user exclusions as ``score_files`` reads them: ``user_id`` int64, ``item_ids`` list<int64>, one row
    per user with at least one exclusion (ids are row numbers, as in :func:`write`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    counts = np.diff(indptr)
    users = np.flatnonzero(counts > 0).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts[users])]).astype(np.int64)
    lists = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.asarray(items, dtype=np.int64)))
    pq.write_table(pa.table({"user_id": pa.array(users), "item_ids": lists.cast(pa.list_(pa.int64()))}), path)
