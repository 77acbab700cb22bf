"""The batch job's inputs: user shards found, inspected and fingerprinted before any work starts.

Fingerprints are content hashes (xxh3-128 of every byte, :func:`recall.io.atomic.content_hash`): a shard regenerated
in place with the same size and the same footer (an uncompressed file without statistics, one changed value) still
changes its fingerprint. Every input is hashed at every start, the shards on a few threads: ~17 GB/s from the page
cache, and the read warms the cache for the workers (measured in docs/batch.md, "The manifest and its fingerprints").
"""
from __future__ import annotations

import glob
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from ...core.errors import InputError
from ...io import inspect_embeddings
from ...io.atomic import CONTENT_HASH, content_hash

#: Threads hashing inputs at start-up (xxhash releases the GIL; beyond a few, the disk is the limit).
HASH_THREADS = 4


@dataclass(frozen=True)
class Shard:
    """An input shard as found by :func:`discover_shards` and inspected by the parent.

    ``error`` is set (and ``rows`` 0) for a shard whose footer or schema is bad: the job scores the others, then
    fails naming it.
    """

    name: str
    path: str
    rows: int
    size: int
    id_type: str
    error: str | None = None


def _hidden(name: str) -> bool:
    # Hadoop/Spark convention: _SUCCESS, _metadata, _common_metadata, .crc files are not data.
    return name.startswith((".", "_"))


def _hidden_match(pattern: str, match: str) -> bool:
    """Whether a path a glob ``pattern`` matched passes through a hidden name (``_hidden``) the pattern did not ask
    for by name: folders too, since a Spark dataset's ``_temporary/`` holds failed or speculative task attempts'
    files, copies of users the dataset's own files hold. A pattern part that itself starts with ``_`` or ``.``
    (``'data/_exports*/x.parquet'``) asks for such names; the folders a ``**`` reaches into are never asked for."""
    want, got = Path(pattern).parts, Path(match).parts
    if "**" in want:
        deep = want.index("**")
        tail = len(want) - deep - 1
        pairs = list(zip(want[:deep], got[:deep])) + list(zip(want[deep + 1:], got[len(got) - tail:]))
        spanned = got[deep:len(got) - tail]
    else:
        pairs, spanned = list(zip(want, got)), ()
    return any(_hidden(part) for part in spanned) or any(_hidden(part) and not _hidden(asked)
                                                          for asked, part in pairs)


def _is_dir(p: Path) -> bool:
    try:
        return p.is_dir()
    except OSError:
        return False


def discover_shards(users: str | os.PathLike) -> list[Path]:
    """The user shards named by ``users``: a directory (its ``*.parquet`` files, not recursive), a glob pattern
    (``**`` recurses), or one file. Names starting with ``.`` or ``_`` are skipped (under a pattern, files inside
    folders so named that the pattern reaches into too). Sorted by path.

    Raises
    ------
    InputError
        Nothing found, or two shards with the same file name (their outputs would collide).
    """
    spec = os.fspath(users)
    p = Path(spec)
    try:
        is_dir = p.is_dir()
    except OSError as exc:  # a loop of symbolic links, a name too long
        raise InputError(f"{spec}: cannot open: {exc.strerror or exc}") from exc
    if is_dir:
        # A *.parquet entry that is not a directory is a shard, even a dangling or looping link: it is reported as a
        # bad shard rather than silently left out. One that is a directory (a dataset written as a folder of files,
        # as Spark writes one) holds users the job would not read: refused, not skipped.
        entries = sorted(q for q in p.iterdir() if q.suffix == ".parquet" and not _hidden(q.name))
        _refuse_folders([q for q in entries if _is_dir(q)], f"'{os.path.join(spec, '**', '*.parquet')}'")
        files = [q for q in entries if not _is_dir(q)]
        if not files:
            raise InputError(f"{spec}: no *.parquet files in this directory")
    elif any(c in spec for c in "*?["):
        matches = sorted(Path(m) for m in glob.glob(spec, recursive=True) if not _hidden_match(spec, m))
        # A folder the pattern matches is read through the files the pattern matches in it: a '**' pattern's.
        if "**" not in spec:
            _refuse_folders([m for m in matches if _is_dir(m) and m.suffix == ".parquet"],
                            "a pattern with '**' that matches their files")
        files = [m for m in matches if not _is_dir(m)]
        if not files:
            raise InputError(f"{spec}: no files match this pattern")
    elif p.is_file():
        files = [p]
    elif p.is_symlink():
        try:
            p.stat()
        except OSError as exc:
            raise InputError(f"{spec}: is a symbolic link that cannot be followed: {exc.strerror or exc}") from None
        raise InputError(f"{spec}: is neither a file nor a directory")
    else:
        raise InputError(f"{spec}: no such file or directory")
    seen: dict[str, Path] = {}
    for f in files:
        if f.name in seen:
            raise InputError(f"{f}: has the same file name as {seen[f.name]}; outputs are named after their input, "
                             f"so shard names must be unique")
        seen[f.name] = f
    return files


def _refuse_folders(folders: list[Path], instead: str) -> None:
    """Refuse user shards that are folders named ``*.parquet``: the job reads files, not recursively."""
    if folders:
        shown = ", ".join(str(f) for f in folders[:3]) + (f" and {len(folders) - 3} more" if len(folders) > 3 else "")
        raise InputError(f"{shown}: {'is a directory' if len(folders) == 1 else 'are directories'} (a dataset "
                         f"written as a folder of files?); --users takes files, not the files inside folders: pass "
                         f"{instead} to read them")


def fingerprint(path: str, strict: bool = True) -> dict:
    """Size and content hash of a whole file: ``{"size": ..., "xxh3_128": ...}``.

    An unreadable file is an InputError when ``strict``; otherwise (a shard, already reported bad by
    :func:`inspect_shards`) its fingerprint says why instead.
    """
    try:
        return {"size": os.stat(path).st_size, CONTENT_HASH: content_hash(path)}
    except OSError as exc:
        if strict:
            raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        return {"size": None, CONTENT_HASH: None, "unreadable": exc.strerror or str(exc)}


def fingerprint_all(paths: list[str], strict: list[bool] | None = None) -> list[dict]:
    """:func:`fingerprint` of each path (``strict[i]``: default True), on :data:`HASH_THREADS` threads, in order."""
    flags = strict if strict is not None else [True] * len(paths)
    if len(paths) <= 1:
        return [fingerprint(p, f) for p, f in zip(paths, flags)]
    with ThreadPoolExecutor(min(HASH_THREADS, len(paths)), thread_name_prefix="recall-hash") as pool:
        return list(pool.map(fingerprint, paths, flags))


def inspect_shards(files: list[Path], id_col: str, vec_col: str, dim: int | None, items_path: str) -> list[Shard]:
    """Every shard's schema checked (dimension against the items', one id type for all).

    A shard that cannot be opened, is not Parquet, lacks a column or has another dimension is returned with its
    ``error`` set (the job scores the others, then reports it); shards of two id types are an InputError at once.
    """
    shards = []
    other_dims, mismatched = set(), 0  # the dimensions of the shards whose vectors are not the items', how many
    for f in files:
        path = str(f)
        try:
            info = inspect_embeddings(path, id_col, vec_col)
            if dim is not None and info.dim is not None and info.dim != dim:
                other_dims.add(info.dim)
                mismatched += 1
                raise InputError(f"{path}: vectors have dimension {info.dim}, but the items ({items_path}) have "
                                 f"dimension {dim}")
        except InputError as exc:
            shards.append(Shard(f.name, path, 0, _size(path), "", str(exc)))
            continue
        id_type = "string" if info.id_type == pa.string() else "int64"
        shards.append(Shard(f.name, path, info.n_rows, _size(path), id_type))
    if len(other_dims) == 1 and mismatched == len(shards):
        # Every shard disagrees with the items the same way: the item file is the odd one (a job-wide error, before
        # anything is written to --out, so that the same command with the right items runs).
        raise InputError(f"{items_path}: the items have dimension {dim}, but every user shard's vectors have "
                         f"dimension {other_dims.pop()} ({len(shards):,} shard{'s' if len(shards) != 1 else ''}, "
                         f"{shards[0].path} first): users and items must come from the same model; check --items")
    good = [s for s in shards if s.error is None]
    kinds = {s.id_type for s in good}
    if len(kinds) > 1:
        first = good[0]
        odd = next(s for s in good if s.id_type != first.id_type)
        raise InputError(f"{odd.path}: user ids are {odd.id_type}, but in {first.path} they are {first.id_type}; "
                         f"every shard must use the same id type")
    return shards


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
