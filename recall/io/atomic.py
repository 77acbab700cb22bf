"""Durable files: written under a temporary name, fsynced, renamed into place; locks; content hashes.

Every file recall writes (candidates, the batch manifest and metrics, the tune cache) goes through
:func:`temporary_path` and :func:`replace`, so a reader never sees a torn file and a kill leaves either the old file
or the new one at the path (plus, after kill -9, a ``.{name}.tmp-{pid}`` file that the next run removes).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

_HASH_CHUNK = 8 << 20
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


def replace(tmp: Path, path: Path) -> None:
    """Rename the finished ``tmp`` onto ``path`` and make the rename durable."""
    os.replace(tmp, path)
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
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
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
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


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

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
