"""The batch job's exclusions: read and mapped to item rows once per job, by the parent, and shared with every worker.

The parent maps the exclusion file with the item file's id column (:meth:`ExclusionIndex.read`: pairs keyed by the
file's own distinct user ids, so no list of every user of the job is needed; on a thread of its own, only once
the job has shards to score, :class:`ExclusionRead`) and saves the index in the output
directory as the job's temporary files (``.exclusions-<part>.tmp-<pid>``: what a killed run leaves there is removed
by the next one), and lets it go. Every worker, in its process or another, or on another host of a Ray cluster
(which writes into the same directory), maps those files read-only (:meth:`ExclusionFiles.open`): the pages are read
as shards need them, and the workers of one host share them in the page cache. Each shard takes only its users'
slice (:meth:`ExclusionIndex.for_shard`), and an item-shard worker only the pairs in its rows
(:meth:`ExclusionIndex.in_rows`).
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ...core.exclusions import Exclusions
from ...io import IdPairs, read_ids, read_pairs
from ...io.atomic import temporary_path
from ...io.pairs import distinct_users, rows_of

_PARTS = ("keys", "indptr", "rows", "named")


@dataclass
class ExclusionIndex:
    """Exclusion pairs as CSR over the file's distinct user ids (``keys``: int64, or object for string ids), item
    rows of the whole catalogue."""

    keys: np.ndarray
    pairs: IdPairs

    @classmethod
    def read(cls, path: str, user_ids_are_strings: bool, item_ids: np.ndarray) -> "ExclusionIndex":
        """Read and validate the file (:func:`recall.io.read_pairs`), mapping item ids to rows of ``item_ids``."""
        keys = distinct_users(path, user_ids_are_strings)
        return cls(keys, read_pairs(path, keys, item_ids, what="exclusion"))

    def for_shard(self, user_ids: np.ndarray) -> IdPairs:
        """The pairs of this shard's users, as CSR over the shard's rows."""
        return self.pairs.take(rows_of(self.keys, user_ids))

    @staticmethod
    def in_rows(pairs: IdPairs, start: int, stop: int) -> IdPairs:
        """The pairs of ``pairs`` whose item row is in ``start:stop``, as rows of that range (``row - start``)."""
        window = Exclusions(pairs.indptr, pairs.item_rows).window(start, stop)
        return IdPairs(window.indptr, window.items, pairs.named, int(window.items.size), 0)

    def save(self, out_dir: Path) -> "ExclusionFiles":
        """Write the index into ``out_dir`` as this process's temporary files, for the workers to map."""
        paths = {part: str(temporary_path(out_dir / f"exclusions-{part}")) for part in _PARTS}
        strings = self.keys.dtype == object
        files = ExclusionFiles(paths, strings, self.pairs.n_pairs, self.pairs.n_unknown)
        try:
            if strings:
                with pa.OSFile(paths["keys"], "wb") as sink:
                    with pa.ipc.new_file(sink, pa.schema([("user_id", pa.string())])) as writer:
                        writer.write_batch(pa.record_batch([pa.array(self.keys, pa.string())], names=["user_id"]))
            else:
                _save(paths["keys"], self.keys.astype(np.int64, copy=False))
            _save(paths["indptr"], self.pairs.indptr)
            _save(paths["rows"], self.pairs.item_rows)
            _save(paths["named"], self.pairs.named)
        except BaseException:  # a full disk, or a signal raised in the middle: none of them left behind
            files.remove()
            raise
        return files


class ExclusionRead:
    """The exclusion file read and mapped on a thread of its own once :meth:`start` is called: only when the job has
    shards to score and its workers are placed, so that a run with nothing to do, or refused, never reads a file of
    billions of pairs (nor waits for that read before it exits on a signal). :meth:`save` waits for it; :meth:`close`
    (always) waits for the thread and removes the files :meth:`save` wrote, whatever happened."""

    def __init__(self, path: str, user_ids_are_strings: bool, items_path: str, id_col: str, vec_col: str) -> None:
        self._read = lambda: ExclusionIndex.read(path, user_ids_are_strings, read_ids(items_path, id_col, vec_col))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="recall-exclusions")
        self._future: Future | None = None
        self._files: ExclusionFiles | None = None

    def start(self) -> None:
        """Start reading (once)."""
        if self._future is None:
            self._future = self._pool.submit(self._read)

    def save(self, out_dir: Path) -> "ExclusionFiles":
        """The index (or the error reading it raised), saved into ``out_dir``; the parent lets it go."""
        self.start()
        self._files = self._future.result().save(out_dir)
        self._future = None
        return self._files

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._files is not None:
            self._files.remove()


def _save(path: str, arr: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object: np.save would add ".npy" to a name
        np.save(f, np.ascontiguousarray(arr))


@dataclass(frozen=True)
class ExclusionFiles:
    """Where the parent saved the job's :class:`ExclusionIndex`, and its counts: what crosses a process or Ray
    boundary."""

    paths: dict[str, str]
    strings: bool
    n_pairs: int
    n_unknown: int

    def open(self) -> ExclusionIndex:
        """The index, its files mapped read-only (string user ids are read into memory)."""
        if self.strings:
            with pa.memory_map(self.paths["keys"]) as source:
                keys = pa.ipc.open_file(source).read_all().column("user_id").to_numpy(zero_copy_only=False)
            keys = keys.astype(object)
        else:
            keys = np.load(self.paths["keys"], mmap_mode="r")
        indptr, rows, named = (np.load(self.paths[part], mmap_mode="r") for part in ("indptr", "rows", "named"))
        return ExclusionIndex(keys, IdPairs(indptr, rows, named, self.n_pairs, self.n_unknown))

    def remove(self) -> None:
        for path in self.paths.values():
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
