"""Passing a signal on to a worker process that may still be starting.

``horovodrun`` passes SIGUSR1 (stacks on demand) and SIGINT/SIGTERM on to the processes it
started: mpirun, or each rank's shim (``runner/_shim.py``), locally or over ssh. A local process
that has not yet installed its handler would be killed by the signal's default action, so such a
process is skipped (``still_starting``), with a line on stderr, for the static supervisor
(``runner/launch/supervisor.py``) and the elastic one (``runner/elastic/workers.py``) alike. A remote
process gets the signal as a line on its life line, which its shim reads once it runs.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from horovod.runner.launch.commands import Command

__all__ = ["catches", "still_starting"]


def still_starting(cmd: Command, pid: int, signum: int) -> bool:
    """Whether the local process ``pid`` (started by ``cmd``) has no handler for ``signum``
    yet (mpirun or the shim still starting: the signal's default action would kill it); says so
    on stderr. A remote process is never still starting here (its signal goes as a line)."""
    if cmd.remote or catches(pid, signum):
        return False
    sys.stderr.write(f"horovodrun: {' '.join(cmd.argv[:1])} (pid {pid}) is still "
                     "starting; not passed on (send it again in a moment)\n")
    return True


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (``/proc/PID/status``; True where
    that cannot be read)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return True
