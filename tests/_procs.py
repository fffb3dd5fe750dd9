"""Other processes as ``/proc`` shows them, and a lock file: what the machine-changing fixtures
(``tests/_fakehosts.py``, ``tests/_slurm.py``) use to tell their own leftovers from live owners."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_file`` (made if missing): one process at a time."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as fd:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def proc_start(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, ``/proc/<pid>/stat``): with the PID, it
    names one process, never a later one that reuses the PID; None if there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """The process exists and is neither a zombie nor dead."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def cmdline(pid: int) -> list[str]:
    """The process's arguments; [] if it is gone (or a kernel thread)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []
