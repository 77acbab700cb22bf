"""The batch job's output directory: its lock, its manifest, and what an earlier run left there.

``OUT_DIR/_manifest.json`` records the job (parameters, the size and content hash of every input) and, per finished
shard, its rows, size and the sha256 of its output file; it is rewritten atomically after every finished shard, by
the parent process only. A rerun keeps a shard whose output matches the manifest's size and sha256 and whose input
is unchanged, and redoes the others; a different job (parameters, item or exclusion file, the set of shards) into the
same directory is refused unless the caller overwrites.

Manifest formats: ``recall-batch/2`` (content hashes of every input, xxh3-128) is written; ``recall-batch/1`` (an
earlier recall's: shards fingerprinted by their footer, which misses some in-place rewrites) is read, and its
outputs are scored again, since nothing says they were computed from today's shards.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ...core.errors import InputError
from ...core.version import __version__
from ...io import atomic

MANIFEST = "_manifest.json"
METRICS = "_metrics.json"
SUCCESS = "_SUCCESS"
LOCK = ".recall-batch.lock"
FORMAT = "recall-batch/2"
#: Manifests of earlier versions that are understood (their outputs are redone: see the module docstring).
OLD_FORMATS = ("recall-batch/1",)
OWN_NAMES = {MANIFEST, METRICS, SUCCESS, LOCK}
#: The job parameters that must match for a directory to be resumed (the inputs' fingerprints are compared apart).
PARAMETERS = ("k", "metric", "id_col", "vec_col")


def lock(out_dir: Path) -> atomic.FileLock:
    """An exclusive lock on ``OUT_DIR/.recall-batch.lock`` for the length of the job: two jobs writing the same
    directory would corrupt each other's manifest. Entering raises InputError naming the holder when it is taken."""
    return _DirLock(out_dir / LOCK, blocking=False)


class _DirLock(atomic.FileLock):
    def __enter__(self) -> "_DirLock":
        try:
            super().__enter__()
        except BlockingIOError:
            raise InputError(f"{self.path.parent}: another recall batch (pid {self.holder()}) is writing to this "
                             f"directory; wait for it to finish or stop it") from None
        return self


def versions() -> dict:
    """The library versions an output's bytes depend on."""
    return {"recall": __version__, "pyarrow": pa.__version__, "numpy": np.__version__}


def read_manifest(path: Path, overwrite: bool) -> dict | None:
    """The manifest at ``path`` (None when there is none). An unreadable one is an InputError, unless the caller
    overwrites (then an empty manifest)."""
    if not path.exists():
        return None
    try:
        old = json.loads(path.read_text())
        if not isinstance(old, dict) or old.get("format") not in (FORMAT, *OLD_FORMATS) or \
                not isinstance(old.get("job"), dict):
            raise ValueError(f"format {old.get('format') if isinstance(old, dict) else None!r}, expected {FORMAT!r}")
        _check_sections(old)
        return old
    except (ValueError, OSError) as exc:
        if not overwrite:
            raise InputError(f"{path}: cannot be read as a recall batch manifest ({exc}); pass --overwrite to start "
                             f"this directory over") from None
        return {"job": {}, "outputs": {}}


def _check_sections(old: dict) -> None:
    """ValueError where a manifest's sections are not what a run writes (an edited or damaged file): the shards and
    the outputs as objects by name, each output with its integer size and its sha256."""
    shards, outputs = old["job"].get("shards") or {}, old.get("outputs", {})
    if not isinstance(shards, dict) or not all(isinstance(e, dict) for e in shards.values()):
        raise ValueError("its job's shards are not an object of shard fingerprints")
    if not isinstance(outputs, dict):
        raise ValueError("its outputs are not an object of output entries")
    for name, entry in outputs.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str)):
            raise ValueError(f"its output entry of {name!r} has no integer bytes and sha256")


def previous_names(old: dict | None) -> set[str]:
    """The files a manifest's job wrote or would write: its outputs and its shards' (an output is named after its
    shard; a kill between an output's rename and the manifest's update leaves it listed under the shards only)."""
    if not old:
        return set()
    return set(old.get("outputs", {})) | set(old.get("job", {}).get("shards") or {})


def describe_difference(old: dict, new: dict) -> str:
    """What differs between two manifests' ``job`` sections, in a few words."""
    diffs = []
    for key in PARAMETERS:
        if old.get(key) != new.get(key):
            diffs.append(f"{key} {old.get(key)!r} -> {new.get(key)!r}")
    for key, what in (("items", "item file"), ("exclude", "exclusions file"), ("allow", "allow file"),
                      ("deny", "deny file")):
        a, b = old.get(key), new.get(key)
        if a != b:
            if a is None or b is None:
                diffs.append(f"{what} {'added' if a is None else 'removed'}")
            else:
                diffs.append(f"{what} content changed ({describe_change(a, b)})")
    a, b = old.get("shards") or {}, new.get("shards") or {}
    added = sorted(set(b) - set(a))
    removed = sorted(set(a) - set(b))
    for label, names in (("added", added), ("removed", removed)):
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            diffs.append(f"user shards {label}: {shown}")
    extra = sorted(set(old) ^ set(new))
    if extra and not diffs:
        diffs.append(f"manifest fields differ: {', '.join(extra)}")
    return "; ".join(diffs) or "the job description differs"


def same_job(old: dict, new: dict) -> bool:
    """Whether a manifest's job is this one: the same parameters, item, exclusion and filter files and shard names
    (a shard whose content changed is the same job: that shard is scored again, see :func:`changed_shards`)."""
    return (all(old.get(key) == new.get(key) for key in PARAMETERS) and old.get("items") == new.get("items")
            and all(old.get(key) == new.get(key) for key in ("exclude", "allow", "deny"))
            and set(old.get("shards") or {}) == set(new.get("shards") or {}))


def changed_shards(old: dict, new: dict) -> dict[str, str]:
    """The shards (by name) whose fingerprint differs between two manifests' jobs, each with what changed."""
    a, b = old.get("shards") or {}, new.get("shards") or {}
    return {name: describe_change(a[name], b[name]) for name in sorted(set(a) & set(b)) if a[name] != b[name]}


def describe_change(a: dict, b: dict) -> str:
    """How two fingerprints differ: ``xxh3_128 3f2a9c01d4e7 -> 9b1c...; size 1,024 -> 1,024``."""
    key = atomic.CONTENT_HASH
    parts = [f"{key} {str(a.get(key, '?'))[:12]} -> {str(b.get(key, '?'))[:12]}"]
    for field in ("size", "rows"):
        if field in a or field in b:
            parts.append(f"{field} {_count(a.get(field))} -> {_count(b.get(field))}")
    if b.get("unreadable"):
        parts.append(f"now unreadable: {b['unreadable']}")
    return ", ".join(parts)


def withdraw(out_dir: Path, changed: dict[str, str], paths: dict[str, str], say: Callable[[str], None],
             after: Callable[[str], str]) -> set[str]:
    """Withdraw the outputs of the shards that changed since they were computed (``changed``: name -> what changed,
    :func:`describe_change`): ``_SUCCESS`` first (the directory stops being a finished dataset before any output goes:
    a failure in between must not leave it beside a manifest that lists a removed file), then each such output, said
    with the shard's path (``paths``) and ``after(name)`` (what happens next). Returns the names whose output went."""
    if not changed:
        return set()
    atomic.remove(out_dir / SUCCESS)
    gone = set()
    for name, what in sorted(changed.items()):
        if (out_dir / name).exists():
            # Its output was computed from other vectors: it goes now, so that the directory never serves it.
            atomic.remove(out_dir / name)
            gone.add(name)
            say(f"{paths[name]}: the shard changed since its output was computed ({what}); its output is removed"
                f"{after(name)}")
    return gone


def _count(value: Any) -> str:
    """A fingerprint's count for a message: ``1,024``, or ``?`` where it is not known (a shard that could not be
    read)."""
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else "?"


def verify(out_dir: Path, name: str, entry: dict) -> str | None:
    """None when ``OUT_DIR/name`` matches the manifest entry (size, then sha256), else what is wrong."""
    path = out_dir / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "the output file is missing"
    if size != entry.get("bytes"):
        return f"the output has {size:,} bytes, the manifest says {entry.get('bytes'):,}"
    if atomic.sha256_file(path) != entry.get("sha256"):
        return "the output's sha256 differs from the manifest's"
    return None


def kept_outputs(out_dir: Path, old: dict, names: set[str], say: Callable[[str], None]) -> dict[str, dict]:
    """The earlier run's outputs that are still good (verified against the manifest, in parallel); each one that is
    not is named once and removed (the directory never serves a damaged output while its shard is scored again)."""
    listed = [(n, e) for n, e in sorted(old.get("outputs", {}).items()) if n in names]
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(listed)))) as pool:
        problems = list(pool.map(lambda ne: verify(out_dir, ne[0], ne[1]), listed))
    if any(problem is not None for problem in problems):
        atomic.remove(out_dir / SUCCESS)  # first: from here on the directory is not a finished dataset
    outputs = {}
    for (name, entry), problem in zip(listed, problems):
        if problem is None:
            outputs[name] = entry
        else:
            atomic.remove(out_dir / name)
            say(f"{out_dir / name}: {problem}; removed, and the shard is scored again")
    return outputs


def foreign_files(out_dir: Path, old: dict | None, names: set[str]) -> list[str]:
    """Files in the directory that neither this job nor the manifest's job would write."""
    earlier = previous_names(old)
    return sorted(p.name for p in out_dir.iterdir()
                  if p.name not in OWN_NAMES and not atomic.TMP_NAME.match(p.name)
                  and p.name not in earlier and p.name not in names)


def start_over(out_dir: Path, old: dict | None, names: set[str], foreign: list[str], label: str,
               say: Callable[[str], None]) -> None:
    """``--overwrite``: remove the previous job's outputs, manifest, metrics and ``_SUCCESS``; name the files left."""
    # _SUCCESS goes first: from here on the directory is not a finished dataset. The old manifest goes last, so a
    # kill in between leaves a directory that the same --overwrite command starts over again.
    atomic.remove(out_dir / SUCCESS)
    for name in sorted(set(names) | previous_names(old)):
        atomic.remove(out_dir / name)
    atomic.remove(out_dir / METRICS)
    atomic.remove(out_dir / MANIFEST)
    if foreign:
        say(f"{label}: --overwrite left {len(foreign)} file(s) recall batch did not write: "
            f"{', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}")


def remove_if_unwritten(out_dir: Path) -> None:
    """Remove a directory the job created, where it holds nothing but the job's lock and temporary files (a job-wide
    input refused, or a signal, before the job's first write); anything else there and it stays. Called with the lock
    held: its file goes by name, and the lock itself when the job lets go of it."""
    try:
        names = os.listdir(out_dir)
        if any(name != LOCK and not atomic.TMP_NAME.match(name) for name in names):
            return
        for name in names:
            os.unlink(out_dir / name)
        os.rmdir(out_dir)
    except OSError:
        pass  # the directory stays: the same command, fixed, runs in it all the same


def remove_leftovers(out_dir: Path) -> list[tuple[str, int]]:
    """Temporary files of a killed run (ours, by name): we hold the lock, so nobody writes them. Returns (name,
    bytes) of each file removed."""
    removed = []
    for p in out_dir.iterdir():
        if atomic.TMP_NAME.match(p.name) and p.is_file():
            try:
                size = p.stat().st_size
            except OSError:
                size = 0
            atomic.remove(p)
            removed.append((p.name, size))
    return removed


def earlier_shard_metrics(path: Path, kept: dict[str, dict]) -> dict[str, dict]:
    """The previous ``_metrics.json`` entries of the shards a resumed run keeps, marked ``"earlier_run": true``, so
    the file still describes every shard of the job. A kept shard the file does not describe (a kill between the
    manifest's update and the metrics', a metrics file removed or damaged) gets what the manifest says of its output,
    marked ``"metrics_lost": true``."""
    try:
        shards = json.loads(path.read_text()).get("shards", {})
        if not isinstance(shards, dict):
            shards = {}
    except (OSError, ValueError, AttributeError):
        shards = {}
    out = {}
    for name, entry in kept.items():
        if isinstance(shards.get(name), dict):
            out[name] = {**shards[name], "earlier_run": True}
        else:
            out[name] = {**{key: entry.get(key) for key in ("rows", "device", "batch_size", "memory_budget")},
                         "earlier_run": True, "metrics_lost": True}
    return out


def complete_metrics(path: Path, kept: dict[str, dict], job: dict, finished_at: str) -> None:
    """A finished job's ``_metrics.json`` where a rerun has nothing to score: left as it is where it describes every
    kept shard; else those it misses added (:func:`earlier_shard_metrics`), or, where it is missing or cannot be
    read, written again from ``job`` (the job's totals) and the manifest, marked ``"metrics_rebuilt": true``."""
    try:
        metrics = json.loads(path.read_text())
        readable = isinstance(metrics, dict) and isinstance(metrics.get("job"), dict) and \
            isinstance(metrics.get("shards"), dict)
    except (OSError, ValueError):
        readable = False
    if readable and all(name in metrics["shards"] for name in kept):
        return
    if not readable:
        metrics = {"job": {**job, "status": "succeeded", "finished_at": finished_at, "metrics_rebuilt": True},
                   "workers": [], "shards": {}}
    metrics["shards"] = {**earlier_shard_metrics(path, kept), **metrics["shards"]}
    atomic.write_json(path, metrics)


def mark_succeeded(path: Path, finished_at: str) -> None:
    """``_metrics.json`` of the run a kill stopped just before its ``_SUCCESS``, marked ``succeeded`` (its error
    dropped) by the rerun that writes that ``_SUCCESS``: beside it, the file must not say the job is still running,
    or failed. Left as it is where there is none or it cannot be read."""
    try:
        metrics = json.loads(path.read_text())
        job = metrics["job"]
        if job.get("status") == "succeeded":
            return
        job.pop("error", None)
        job.update(status="succeeded", finished_at=finished_at)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    atomic.write_json(path, metrics)


def numerics(entry: dict[str, Any]) -> tuple:
    """What decides an output's last bits besides its inputs: the device, the tiling (batch size, budget) and the
    item shards it was merged from (1 when the entry does not say: an unsharded output)."""
    return entry.get("device"), entry.get("batch_size"), entry.get("memory_budget"), entry.get("item_shards") or 1


def describe_numerics(values: set[tuple]) -> str:
    return " / ".join(f"device {d}, batch size {b}, memory budget {m}" + (f", item shards {n}" if n != 1 else "")
                      for d, b, m, n in sorted(values, key=str))
