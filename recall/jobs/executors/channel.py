"""The link between the parent and one worker process: a duplex pipe whose ``send`` never blocks.

Not ``multiprocessing.Queue``: a queue is guarded by named POSIX semaphores, which the ``resource_tracker`` process
tracks; when a job is stopped by a signal, a semaphore it had not yet given back is reported on stderr by the
tracker after the job's own last line ("There appear to be N leaked semaphore objects"), and a worker killed while
holding a queue's lock leaves it held for the other workers. A pipe of its own per worker holds neither: its two
ends are plain file descriptors, closed by the kernel with the process, so the other end reads end-of-file when a
worker dies, however it dies.
"""
from __future__ import annotations

import queue
import threading
from multiprocessing.connection import Connection
from typing import Any

_CLOSE = object()


class Channel:
    """One end of a pipe: ``send`` hands the message to a writer thread (as a queue's feeder does, so a large list
    never holds the sender up while the other side is busy), ``recv`` waits for the next one.

    Parameters
    ----------
    conn : multiprocessing.connection.Connection
        This side's end of a ``Pipe(duplex=True)``.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="recall-channel", daemon=True)
        self._writer.start()

    def send(self, obj: Any) -> None:
        """Queue ``obj`` to be written (pickled) to the other end; messages arrive in the order sent. After the
        other end has closed, messages are dropped: the reader is gone."""
        self._out.put(obj)

    def recv(self, timeout: float | None = None) -> Any:
        """The next message.

        Raises
        ------
        queue.Empty
            Nothing arrived within ``timeout`` seconds.
        EOFError
            The other end is closed (its process exited or died) and every message it sent has been read.
        """
        try:
            if timeout is not None and not self.conn.poll(timeout):
                raise queue.Empty
            return self.conn.recv()
        except ConnectionResetError:  # a killed peer's socket end: the same as its end of file
            raise EOFError("the other end of the channel was reset") from None

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, waiting up to ``timeout`` seconds (None: until written), then close this end. A
        writer still held up by a reader that stopped reading keeps the end open until this process exits (it is
        a daemon thread): closing a descriptor under a thread writing to it could let a file opened next receive
        the bytes."""
        self._out.put(_CLOSE)
        self._writer.join(timeout)
        if not self._writer.is_alive():
            self.conn.close()

    def _write(self) -> None:
        while True:
            obj = self._out.get()
            if obj is _CLOSE:
                return
            try:
                self.conn.send(obj)
            except OSError:  # the other end is closed: nobody will read the rest
                return
