"""Durable files: written under a temporary name, fsynced, renamed into place; locks; content hashes.

Every file recall writes (candidates, the batch manifest and metrics, the tune cache) goes through
:func:`temporary_path` and :func:`replace`, so a reader never sees a torn file and a kill leaves either the old file
or the new one at the path (plus, after kill -9, a ``.{name}.tmp-{pid}`` file that the next run into that directory
removes: :func:`stale_temporaries`).

Every ``OSError`` raised from here names the path it is about (``exc.filename``), so that a message such as "No space
left on device" always says where.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..core.errors import InputError

_HASH_CHUNK = 8 << 20
#: Reads of :func:`content_hash`: small enough to stay in the CPU's caches between the read and the hash (measured:
#: 19 GB/s at 1 MiB, 13 GB/s at 16 MiB, from the page cache).
_CONTENT_CHUNK = 1 << 20
#: The content hash of input files (:func:`content_hash`), as named in manifests.
CONTENT_HASH = "xxh3_128"
#: The temporary files of :func:`temporary_path`: ``.{name}.tmp-{pid}``.
TMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")


def temporary_path(path: Path) -> Path:
    """Where the new content of ``path`` is written before the rename: ``.{name}.tmp-{pid}`` beside it (a rename
    within one file system is atomic on POSIX)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def fsync_dir(path: os.PathLike | str) -> None:
    """Flush a directory's entries (a rename into it) to disk; a no-op where the platform cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def with_path(exc: OSError, path: os.PathLike | str, doing: str | None = None, note: str | None = None) -> OSError:
    """``exc`` as an OSError of the same type and errno that names ``path`` (its ``filename``), what was being done
    and, optionally, a note on what it left.

    ``str()`` of the result reads ``[Errno 28] cannot write: No space left on device: '/out/x.parquet'``; the CLI
    prints ``{filename}: {strerror}``.
    """
    if exc.filename is not None and doing is None and note is None:
        return exc
    reason = exc.strerror or str(exc)
    text = f"{doing}: {reason}" if doing else reason
    new = type(exc)(exc.errno, f"{text}; {note}" if note else text, os.fspath(path))
    new.__cause__ = exc
    return new


#: Errors creating an output (its directory, its temporary file) that say the path given cannot take it:
#: permissions, a read-only file system, a missing, non-directory or existing component, a name too long, a loop of
#: links. The caller's to change: InputError, exit 2. Any other (no space, quota, I/O) is the system's: an OSError
#: naming the path, exit 1.
PATH_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EISDIR,
                         errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP})


def make_output_dir(path: Path, label: str) -> None:
    """Create the output directory ``path`` (and its parents) and check that it can be written.

    Raises
    ------
    InputError
        Naming ``label`` (e.g. ``--out DIR``), when it cannot be created (PATH_ERRNOS: a file in the way, no
        permission...) or written to.
    OSError
        Naming ``path``, when the system failed to create it (no space, quota, I/O).
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if exc.errno in PATH_ERRNOS:
            raise InputError(f"{label}: cannot create the output directory: {exc.strerror or exc}") from None
        raise with_path(exc, path, "cannot create the output directory") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"{label}: the output directory is not writable")


def replace(tmp: Path, path: Path) -> None:
    """Rename the finished ``tmp`` onto ``path`` and make the rename durable."""
    try:
        os.replace(tmp, path)
    except OSError as exc:
        raise with_path(exc, path, f"cannot rename {Path(tmp).name} into place") from exc
    fsync_dir(path.parent)


def remove(path: Path) -> None:
    """Remove ``path`` if it exists."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: the path holds the old or the new bytes, never a part."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise with_path(exc, path, "cannot write") from exc
        replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented, key-sorted JSON, written atomically."""
    write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a whole file, read in 8 MiB chunks (hashlib releases the GIL, so threads hash in parallel)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
    except OSError as exc:
        raise with_path(exc, path, "cannot read") from exc
    return h.hexdigest()


def content_hash(path: str | os.PathLike) -> str:
    """Hex xxh3-128 of a whole file's bytes (:data:`CONTENT_HASH`): what an input's fingerprint is made of.

    Not cryptographic: it tells a regenerated file from the one an output was computed from (any changed byte changes
    it, with a 2^-128 chance of a miss), at ~17 GB/s from the page cache on one core, 8x sha256's speed, so every
    shard of a job can be hashed at every start. xxhash releases the GIL, so threads hash files in parallel.
    """
    import xxhash

    h = xxhash.xxh3_128()
    buf = bytearray(_CONTENT_CHUNK)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
    except OSError as exc:
        raise with_path(exc, path, "cannot read") from exc
    return h.hexdigest()


def _alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (another user's counts: it cannot be signalled)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _locked(path: str) -> bool:
    """Whether a process holds an ``flock`` on ``path`` (a :class:`recall.io.CandidateWriter` holds one on its
    temporary file while it writes, on any host that shares the file system)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True  # vanished or unreadable: not ours to remove
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # a file system without flock: the pid alone decides
    finally:
        os.close(fd)
    return False


def stale_temporaries(directory: str | os.PathLike, names: Any = None) -> Iterator[Path]:
    """The ``.{name}.tmp-{pid}`` files in ``directory`` left by processes that died (kill -9, OOM, a reboot): their
    pid is not alive on this host and nobody holds a lock on them. Files of live processes are never listed, so
    two runs writing into one directory leave each other alone. ``names(name) -> bool``, optional: which ``{name}``
    parts to consider (default: all)."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        m = TMP_NAME.match(entry.name)
        if m is None or int(m["pid"]) == os.getpid() or (names is not None and not names(m["name"])):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
        except OSError:
            continue
        if not _alive(int(m["pid"])) and not _locked(entry.path):
            yield Path(entry.path)


def remove_stale_temporaries(directory: str | os.PathLike, names: Any = None) -> list[tuple[str, int]]:
    """Remove :func:`stale_temporaries` from ``directory``; returns (name, bytes) of each file removed."""
    removed = []
    for path in stale_temporaries(directory, names):
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            continue
        removed.append((path.name, size))
    return removed


def describe_removed(removed: list[tuple[str, int]], directory: str | os.PathLike) -> str:
    """One notice for the files :func:`remove_stale_temporaries` removed."""
    total = sum(size for _, size in removed)
    names = ", ".join(name for name, _ in removed[:3]) + (f" and {len(removed) - 3} more" if len(removed) > 3 else "")
    return (f"{directory}: removed {len(removed)} temporary file{'s' if len(removed) != 1 else ''} left by "
            f"earlier runs that were killed ({names}; {total / 1e6:,.1f} MB)")


class FileLock:
    """An exclusive ``flock`` on ``path`` (created if missing), released when the object is closed or the process
    dies, even by kill -9. The holder's pid is written into the file, for the message of whoever finds it taken.

    Parameters
    ----------
    path : Path
    blocking : bool
        Wait for the lock (True), or raise ``BlockingIOError`` at once when another process holds it.
    """

    def __init__(self, path: Path, blocking: bool = True) -> None:
        self.path, self.blocking = Path(path), blocking
        self.fd: int | None = None

    def holder(self) -> str:
        """The pid recorded by the process that holds (or last held) the lock, as text."""
        try:
            return self.path.read_text(errors="replace").strip() or "unknown"
        except OSError:
            return "unknown"

    def __enter__(self) -> "FileLock":
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise with_path(exc, self.path, "cannot create the lock file") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if self.blocking else fcntl.LOCK_NB))
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock; the file stays (removing it would race with a waiting process)
            self.fd = None
