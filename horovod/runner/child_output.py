"""Read a child process's output pipes to the last byte it wrote, without ever waiting on an orphan.

A reader thread per pipe reads until end of file. An orphan that inherited the pipe (a data
loader worker that survived its rank, a daemon started by the training script) keeps its write
end open, so end of file may never come; the launcher therefore tells the readers when it has
reaped the child (``ChildOutput.ended``). Everything the child wrote is then in the pipe's buffer
(a write to a pipe returns only once its bytes are in the buffer, so the child cannot exit before
that), the exit report of the worker shim included, however slow the machine is. Each reader then
takes exactly what the pipe holds at that moment (``FIONREAD``) without blocking, and stops.
Joining the readers afterwards has no deadline and needs none: nothing they do waits on another
process.
"""

from __future__ import annotations

import array
import fcntl
import os
import select
import termios
import threading
from collections.abc import Callable

from horovod.runner.output import LineSplitter

__all__ = ["ChildOutput", "LineHandler"]

# What a reader passes on: complete lines as (text, terminator); the last one, without its
# terminator, when the stream ends.
LineHandler = Callable[[list[tuple[str, str]]], None]

_CHUNK = 65536
# Bytes read after the end beyond what the pipe held at the end, where FIONREAD cannot tell: at
# least a full default pipe buffer, and a bound on what a writing orphan can make a reader take.
_UNKNOWN_BUFFERED = 1 << 20


def _buffered(fd: int) -> int:
    """How many bytes the pipe ``fd`` holds now, or ``_UNKNOWN_BUFFERED`` where it cannot tell."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    except OSError:
        return _UNKNOWN_BUFFERED
    return buf[0]


class ChildOutput:
    """The output pipes of one child process, each read on its own (daemon) thread.

    Args:
        name: for the threads' names.
        pipes: ``(stream, fd, handler)``; each ``fd`` is owned (and closed) by its reader, and each
            ``handler`` is called on that reader's thread only.
    """

    def __init__(self, name: str, pipes: list[tuple[str, int, LineHandler]]) -> None:
        self._wake_r, self._wake_w = os.pipe()
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._read, args=(fd, handler), daemon=True,
                             name=f"hvd-read-{name}-{stream}")
            for stream, fd, handler in pipes]
        for t in self._threads:
            t.start()

    @property
    def ending(self) -> threading.Event:
        """Set once ``ended()`` was called (the readers are taking what is left)."""
        return self._ended

    def ended(self) -> None:
        """The child has been reaped: each reader takes what its pipe holds now, then stops.
        Idempotent; call it only after ``wait()`` on the child returned."""
        with self._lock:
            if self._ended.is_set() or self._closed:
                return
            self._ended.set()
            os.write(self._wake_w, b"x")  # never read: it stays readable for every reader

    def join(self) -> None:
        """Wait until every reader has passed on its last line (after ``ended()``: bounded by the
        bytes left in the pipes, never by another process), then release the wake-up pipe."""
        for t in self._threads:
            t.join()
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _read(self, fd: int, handle: LineHandler) -> None:
        splitter = LineSplitter()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while True:
                ready = {f for f, _ in poller.poll()}
                if self._wake_r in ready:
                    self._drain(fd, splitter, handle)
                    return
                data = os.read(fd, _CHUNK)
                if not data:
                    return
                handle(splitter.feed(data))
        except OSError:
            pass
        finally:
            handle(splitter.flush())
            os.close(fd)

    @staticmethod
    def _drain(fd: int, splitter: LineSplitter, handle: LineHandler) -> None:
        """Take what the pipe holds now (all the reaped child wrote), never waiting for more."""
        left = _buffered(fd)
        os.set_blocking(fd, False)
        while left > 0:
            try:
                data = os.read(fd, min(_CHUNK, left))
            except BlockingIOError:
                return
            if not data:
                return
            left -= len(data)
            handle(splitter.feed(data))
