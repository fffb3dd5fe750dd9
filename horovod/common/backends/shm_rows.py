"""Rows exchanged through shared memory between the ranks of one host, polled by the caller.

The Gloo plane's negotiation is one exchange of equal byte rows per round (``exchange_rows``,
``engine/carry.py``). Over Gloo's point-to-point transfer every row that arrives wakes the
receiver's transport thread, which then wakes the waiting caller: on a busy 2-core host about
0.3 ms per round, most of what a tiny cached step costs above the MPI plane, whose ranks poll
shared memory in the calling thread (docs/performance.md, "The fixed cost of a step on Gloo").

Here, when every rank of the world runs on this host (they could all open one file in
``/dev/shm``), each rank writes its row into its own slot of one shared mapping and then bumps
its round counter, then wakes whoever sleeps on that counter (a futex on the shared page, one
system call); every rank reads the others' rows once their counters reach the round. No transport
thread is involved: the caller polls, giving the core away between polls (``sched_yield``), for
at most ``SPIN_S``, then sleeps on the late peer's counter (``FUTEX_WAIT``) until that peer's
write wakes it: one thread woken, the caller itself, where Gloo's transfer wakes its transport
thread and then the caller. A rank whose peers are late (a long forward pass) holds no core.
Where the futex call is not available the caller sleeps between polls instead, the interval
doubling from ``SLEEP_MIN_S`` up to ``SLEEP_MAX_S``.

Two slots per rank, used in turn by the round's parity, make the writes safe without locks: a
rank writes round r+2 into the slot of round r only after it read every rank's row of round r+1,
and a rank writes round r+1 only after it read every row of round r. The counters are 8-byte
aligned stores, each on its own cache line; a row is written before its counter, and read after
it, which x86's store and load order keeps (other architectures would need fences: there the
exchange stays Gloo's; ``usable()``).

A peer that dies holds no lock any more: each rank holds a POSIX record lock on its own byte of
the mapping while it lives, and a waiting rank that finds it can take a late peer's lock knows
that peer is gone and fails at once, as Gloo's closed socket would. A peer alive but stuck fails
after the Gloo timeout, naming the ranks that did not come.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import platform
import secrets
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from horovod.common.exceptions import HorovodInternalError

__all__ = ["ShmRows", "usable", "SPIN_S"]

_LINE = 64  # one counter per cache line
_MAGIC = 0x48564452  # "HVDR"
SPIN_S = 50e-6  # polls without sleeping (yielding the core between polls) for this long
SLEEP_MIN_S, SLEEP_MAX_S = 20e-6, 1e-3  # then sleeps between polls (no futex), the interval doubling
_CHECK_S = 0.005  # while sleeping: how often the late peers' locks are tested (the futex's timeout)
SHM_DIR = "/dev/shm"
_SYS_FUTEX = ctypes.c_long(202)  # x86-64
# shared (not FUTEX_PRIVATE_FLAG): the word is in a shared mapping
_FUTEX_WAIT, _FUTEX_WAKE = ctypes.c_int(0), ctypes.c_int(1)
_ALL, _ZERO = ctypes.c_int(0x7FFFFFFF), ctypes.c_uint32(0)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex() -> Any:
    """libc's ``syscall`` (the GIL is released around it), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


def usable() -> bool:
    """Whether this host can exchange rows through shared memory here (Linux on x86-64, whose
    memory order the protocol relies on, with ``/dev/shm``)."""
    return (platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")
            and os.path.isdir(SHM_DIR))


def create(size: int, capacity: int) -> tuple[str, str] | None:
    """Rank 0: make the mapping's file for ``size`` ranks of rows up to ``capacity`` bytes; its
    (path, token), or None where it cannot be made. The file is removed once every rank has it
    open (``ShmRows.unlink``), or by ``discard`` when the ranks fall back."""
    if not usable():
        return None
    token = secrets.token_hex(8)
    path = os.path.join(SHM_DIR, f"horovod-rows-{os.getpid()}-{token}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.ftruncate(fd, _total(size, capacity))
        header = np.zeros(4, np.uint64)
        header[0], header[1], header[2] = _MAGIC, size, capacity
        header[3] = int(token, 16)
        os.pwrite(fd, header.tobytes(), 0)
    except OSError:
        os.close(fd)
        discard(path)
        return None
    os.close(fd)
    return path, token


def discard(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _total(size: int, capacity: int) -> int:
    head = _LINE * (size + 1)
    return head + 2 * size * capacity


class ShmRows:
    """One rank's end of the shared rows of ``size`` ranks (see the module docstring).

    Raises ``OSError`` or ``ValueError`` when the mapping at ``path`` cannot be opened or is not
    the one rank 0 made (``token``): the caller falls back to Gloo's exchange."""

    def __init__(self, path: str, token: str, rank: int, size: int, capacity: int, timeout_s: float) -> None:
        self.rank, self.size, self.capacity = rank, size, capacity
        self.timeout_s = timeout_s
        self.round = 0
        self.closed = False
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != _total(size, capacity):
                raise ValueError(f"{path}: not a rows mapping of {size} ranks x {capacity} bytes")
            mm = mmap.mmap(fd, _total(size, capacity))
            # This rank's life, visible to its peers: its lock on its own byte of the file.
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._mm = fd, mm
        buf = np.frombuffer(mm, np.uint8)
        header = buf[:32].view(np.uint64)
        if int(header[0]) != _MAGIC or int(header[1]) != size or int(header[2]) != capacity \
                or int(header[3]) != int(token, 16):
            self.close()
            raise ValueError(f"{path}: another job's mapping")
        # counter of rank i at byte _LINE * (i + 1)
        self._seq = np.ndarray((size,), np.int64, buf, _LINE, (_LINE,))
        head = _LINE * (size + 1)
        self._slots = buf[head:head + 2 * size * capacity].reshape(2, size, capacity)
        self._peers = [j for j in range(size) if j != rank]
        # Each counter's address (its low 32 bits are the futex word, little-endian).
        base = buf.ctypes.data
        self._addr = [ctypes.c_void_p(base + _LINE * (i + 1)) for i in range(size)]
        self._syscall = _futex()
        self._wait_for = _Timespec(0, int(_CHECK_S * 1e9))

    def exchange(self, row: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Every rank's ``row`` (bytes, at most ``capacity``, the same length on every rank), as
        rows of a (size, len) array (``out`` when given)."""
        n = row.size
        r = self.round + 1
        slot = self._slots[r & 1]
        slot[self.rank, :n] = row
        self._seq[self.rank] = r  # after the row: a peer that sees r finds the row
        self.round = r
        if self._syscall is not None:  # wake the peers asleep on this counter
            self._syscall(_SYS_FUTEX, self._addr[self.rank], _FUTEX_WAKE, _ALL, None, None, _ZERO)
        seq = self._seq
        late = [j for j in self._peers if seq[j] < r]
        if late:
            self._wait(late, r)
        if out is None:
            return slot[:, :n].copy()
        out[...] = slot[:, :n]
        return out

    def _wait(self, late: list[int], r: int) -> None:
        seq = self._seq
        yield_ = os.sched_yield
        clock = time.perf_counter
        start = clock()
        spin_until = start + SPIN_S
        while True:
            yield_()
            late = [j for j in late if seq[j] < r]
            if not late:
                return
            if clock() >= spin_until:
                break
        pause, check = SLEEP_MIN_S, clock()
        deadline = start + self.timeout_s
        futex = self._syscall
        while late:
            if futex is not None:  # asleep until the first late peer writes (or _CHECK_S)
                j = late[0]
                seen = int(seq[j])
                if seen < r:
                    futex(_SYS_FUTEX, self._addr[j], _FUTEX_WAIT, ctypes.c_uint32(seen & 0xFFFFFFFF),
                          ctypes.byref(self._wait_for), None, _ZERO)
            else:
                time.sleep(pause)
                pause = min(pause * 2, SLEEP_MAX_S)
            late = [j for j in late if seq[j] < r]
            now = clock()
            if not late:
                return
            if self.closed:
                raise HorovodInternalError(
                    f"Gloo negotiation on rank {self.rank}: the engine shut down while waiting for "
                    f"ranks {late}'s rows of round {r}.", rank=self.rank, op="negotiation")
            if now - check >= _CHECK_S:
                check = now
                gone = [j for j in late if not self._alive(j)]
                if gone:
                    raise HorovodInternalError(
                        f"Gloo negotiation on rank {self.rank}: ranks {gone} left (exited or shut "
                        f"down) without sending their rows of round {r} (shared-memory rows). A peer "
                        "process died; check the other ranks' output.", rank=self.rank, op="negotiation")
            if now >= deadline:
                raise HorovodInternalError(
                    f"Gloo negotiation on rank {self.rank}: ranks {late} sent no rows of round {r} "
                    f"within {self.timeout_s:g} s (HOROVOD_GLOO_TIMEOUT_SECONDS). A peer is stuck "
                    "or far behind; check the other ranks' output.", rank=self.rank, op="negotiation")

    def _alive(self, j: int) -> bool:
        """Whether rank ``j`` still holds its lock (a process's record locks end with it)."""
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, j, os.SEEK_SET)
        except OSError:
            return True  # held: alive
        with contextlib.suppress(OSError):
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, j, os.SEEK_SET)
        return False

    def unlink(self) -> None:
        discard(self.path)

    def close(self) -> None:
        """Unmap and release (any thread still waiting fails on ``closed``)."""
        self.closed = True
        views: list[Any] = [self.__dict__.pop(k, None) for k in ("_seq", "_slots")]
        views.clear()
        mm: Callable[[], None] | None = getattr(getattr(self, "_mm", None), "close", None)
        if mm is not None:
            with contextlib.suppress(BufferError, ValueError):
                mm()
        fd = self.__dict__.pop("_fd", None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
