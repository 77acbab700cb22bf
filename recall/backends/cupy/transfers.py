"""Large host arrays to the device through a ring of pinned chunks that the host's threads (``core.host_threads``)
fill while others cross the bus, and back into page-locked arrays.

A copy from pageable memory is staged by the driver one thread at a time: 7-9 GB/s up and 2.7-3.6 GB/s down on the
GPU machine (1M users x 64 float32 up in 28-35 ms, their 10 results down in 33-45 ms), where the ring moves 26 GB/s
up (scripts/lab/host_transfers.py).
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ...core import host_threads

#: Bytes a chunk: 8 MiB filled by 4 threads kept up with the bus (scripts/lab/host_transfers.py).
CHUNK_BYTES = 8 << 20
#: Arrays of at least this many bytes go through the ring; a smaller one in one copy of the driver's.
MIN_BYTES = 16 << 20


class _Ring:
    """The pinned chunks of uploads (a chunk a host thread, at least two) and their stream, used by one upload at a
    time; an event a chunk marks its last copy on the bus."""

    def __init__(self) -> None:
        import cupy

        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.lock = threading.Lock()
        self.buffers: list = []
        self.events: list = []

    def take(self, nbytes: int) -> list:
        import cupyx

        size = max(2, host_threads.threads())
        if len(self.buffers) != size or self.buffers[0].nbytes < nbytes:
            self.stream.synchronize()  # the old chunks may still be read by the bus
            self.buffers = [cupyx.empty_pinned(max(CHUNK_BYTES, nbytes), np.uint8) for _ in range(size)]
            self.events = [None] * size
        return self.buffers


def _chunks(shape: tuple, itemsize: int) -> tuple[list, int, int]:
    """(the first row of each chunk, rows a chunk, bytes a chunk) of an array of ``shape``: rows of at most
    CHUNK_BYTES together, at least one."""
    row_bytes = itemsize * int(np.prod(shape[1:], dtype=np.int64))
    rows = max(1, CHUNK_BYTES // max(1, row_bytes))
    return list(range(0, int(shape[0]), rows)), rows, rows * row_bytes


def _view(buffer: np.ndarray, rows: int, shape: tuple, dtype: Any) -> np.ndarray:
    nbytes = rows * np.dtype(dtype).itemsize * int(np.prod(shape[1:], dtype=np.int64))
    return buffer[:nbytes].view(dtype).reshape((rows,) + tuple(shape[1:]))


class HostTransfers:
    """Uploads and downloads of one backend's large host arrays (``CupyBackend.ingest``, ``to_host``), each
    direction on a stream of its own."""

    def __init__(self) -> None:
        import cupy

        self._ring = _Ring()
        self._down = cupy.cuda.Stream(non_blocking=True)

    def upload(self, host: np.ndarray, dtype: Any) -> Any:
        """A new C-contiguous device array of ``dtype`` holding ``host`` (n, ...) (any strides; NumPy's casting),
        written after the work queued on the caller's stream and before the work queued there after this returns."""
        import cupy

        out = cupy.empty(host.shape, dtype)
        n = int(host.shape[0])
        starts, rows, chunk_bytes = _chunks(host.shape, out.itemsize)
        caller = cupy.cuda.get_current_stream()
        ring = self._ring
        with ring.lock:
            buffers = ring.take(chunk_bytes)
            stream, events, size = ring.stream, ring.events, len(buffers)
            stream.wait_event(caller.record())  # out's memory may be freed work's of the caller's stream

            def fill(i: int) -> np.ndarray:
                # On a host thread: chunk i into its buffer, once the bus has read that buffer's last chunk.
                j = i % size
                if events[j] is not None:
                    events[j].synchronize()
                start = starts[i]
                view = _view(buffers[j], min(n, start + rows) - start, host.shape, out.dtype)
                host_threads.copy_part(view, host[start:start + view.shape[0]])
                return view

            filled = {i: host_threads.submit(fill, i) for i in range(min(size, len(starts)))}
            try:
                for i, start in enumerate(starts):
                    view = filled.pop(i).result()
                    out[start:start + view.shape[0]].set(view, stream=stream)
                    events[i % size] = stream.record()
                    if i + size < len(starts):
                        filled[i + size] = host_threads.submit(fill, i + size)
            finally:
                # Interrupted (an error, ^C): the fills still running must not write into the next upload's chunks.
                for future in filled.values():
                    future.exception()
            caller.wait_event(stream.record())
        return out

    def download(self, dev: Any, after: Any) -> np.ndarray:
        """``dev`` (n, ...) in a new page-locked NumPy array, once the work queued on the stream ``after`` is done.

        Page-locked from CuPy's pinned pool, as the float32 search's host results are (``CupyBackend.empty_out``):
        one copy at the bus's rate (1M x 10 results, float32 and int64: 2.3 ms, where emptying the ring into fresh
        pageable memory took 12 ms and the driver's own copy 45 ms, scripts/lab/host_transfers.py); the pool keeps
        the memory for the next result of that size."""
        import cupy
        import cupyx

        with after:
            src = cupy.ascontiguousarray(dev)
        try:
            out = cupyx.empty_pinned(src.shape, src.dtype)
        except (cupy.cuda.memory.OutOfMemoryError, cupy.cuda.runtime.CUDARuntimeError):
            # No page-locked memory of that size to be had: the driver's own copy into pageable memory.
            after.synchronize()
            return src.get()
        self._down.wait_event(after.record())
        src.get(stream=self._down, out=out, blocking=False)
        # src (maybe a contiguous copy) is freed on ``after``'s pool and read on this stream: kept until read. An
        # event, not the stream: another thread's download queued meanwhile is not waited for.
        self._down.record().synchronize()
        return out
