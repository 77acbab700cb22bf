"""The batch job's inputs: user shards found, inspected and fingerprinted before any work starts."""
from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from ...core.errors import InputError
from ...io import inspect_embeddings
from ...io.atomic import sha256_file


@dataclass(frozen=True)
class Shard:
    """An input shard as found by :func:`discover_shards` and inspected by the parent."""

    name: str
    path: str
    rows: int
    size: int
    footer_sha256: str
    id_type: str

    def fingerprint(self) -> dict:
        return {"rows": self.rows, "size": self.size, "footer_sha256": self.footer_sha256}


def _hidden(name: str) -> bool:
    # Hadoop/Spark convention: _SUCCESS, _metadata, _common_metadata, .crc files are not data.
    return name.startswith((".", "_"))


def discover_shards(users: str | os.PathLike) -> list[Path]:
    """The user shards named by ``users``: a directory (its ``*.parquet`` files, not recursive), a glob pattern
    (``**`` recurses), or one file. Names starting with ``.`` or ``_`` are skipped. Sorted by path.

    Raises
    ------
    InputError
        Nothing found, or two shards with the same file name (their outputs would collide).
    """
    spec = os.fspath(users)
    p = Path(spec)
    if p.is_dir():
        files = sorted(q for q in p.iterdir() if q.is_file() and q.suffix == ".parquet" and not _hidden(q.name))
        if not files:
            raise InputError(f"{spec}: no *.parquet files in this directory")
    elif any(c in spec for c in "*?["):
        files = sorted(Path(m) for m in glob.glob(spec, recursive=True)
                       if Path(m).is_file() and not _hidden(Path(m).name))
        if not files:
            raise InputError(f"{spec}: no files match this pattern")
    elif p.is_file():
        files = [p]
    else:
        raise InputError(f"{spec}: no such file or directory")
    seen: dict[str, Path] = {}
    for f in files:
        if f.name in seen:
            raise InputError(f"{f}: has the same file name as {seen[f.name]}; outputs are named after their input, "
                             f"so shard names must be unique")
        seen[f.name] = f
    return files


def footer_sha256(path: str, size: int) -> str:
    """sha256 of a Parquet file's footer (metadata + length + magic): row counts, row-group offsets, sizes and
    statistics. Reading it costs two small reads, not the file."""
    with open(path, "rb") as f:
        if size < 12:
            raise InputError(f"{path}: not a Parquet file, or truncated ({size} bytes)")
        f.seek(size - 8)
        tail = f.read(8)
        n = int.from_bytes(tail[:4], "little")
        if tail[4:] != b"PAR1" or n > size - 12:
            raise InputError(f"{path}: not a Parquet file, or truncated (no footer)")
        f.seek(size - 8 - n)
        return hashlib.sha256(f.read(n) + tail).hexdigest()


def fingerprint_full(path: str) -> dict:
    """Size and sha256 of a whole file."""
    st = os.stat(path)
    return {"size": st.st_size, "sha256": sha256_file(path)}


def inspect_shards(files: list[Path], id_col: str, vec_col: str, dim: int | None, items_path: str) -> list[Shard]:
    """Every shard's schema checked (dimension against the items', one id type for all) and fingerprinted."""
    shards = []
    for f in files:
        path = str(f)
        info = inspect_embeddings(path, id_col, vec_col)
        if dim is not None and info.dim is not None and info.dim != dim:
            raise InputError(f"{path}: vectors have dimension {info.dim}, but the items ({items_path}) have "
                             f"dimension {dim}")
        size = os.path.getsize(path)
        id_type = "string" if info.id_type == pa.string() else "int64"
        shards.append(Shard(f.name, path, info.n_rows, size, footer_sha256(path, size), id_type))
    kinds = {s.id_type for s in shards}
    if len(kinds) > 1:
        first = shards[0]
        odd = next(s for s in shards if s.id_type != first.id_type)
        raise InputError(f"{odd.path}: user ids are {odd.id_type}, but in {first.path} they are {first.id_type}; "
                         f"every shard must use the same id type")
    return shards
