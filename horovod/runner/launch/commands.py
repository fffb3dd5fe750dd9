"""What every launcher produces: ``Command`` objects, one per process the launcher starts."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["Command", "Launcher", "shim_argv", "SHIM_PATH"]

# The worker shim is run by file path, so that it needs nothing importable on the remote side
# (and loads nothing but the standard library).
SHIM_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_shim.py")


def shim_argv(command: list[str], *, python: str | None = None, watch_stdin: bool = False,
              stdin_env: bool = False, mpirun: bool = False) -> list[str]:
    """The argv that runs ``command`` under the worker shim (exit report, process-tree cleanup;
    ``mpirun``: started by mpirun, whose environment tells the shim its expected parent)."""
    argv = [python or sys.executable, "-S", "-u", SHIM_PATH]
    if mpirun:
        argv.append("--mpirun")
    if watch_stdin:
        argv.append("--watch-stdin")
    if stdin_env:
        argv.append("--stdin-env")
    return argv + ["--"] + list(command)


@dataclass
class Command:
    """One process to start on this machine (a worker, an ssh client, or mpirun).

    Attributes:
        argv: the program and its arguments.
        env: the full environment of the process (``None``: the launcher's own).
        ranks: the ranks whose output and exit this process carries.
        host: where those ranks run (for messages).
        stdin_data: written to the process's stdin at start.
        lifeline: keep stdin open while the job runs; closing it stops the worker's process tree
            (how remote workers are stopped when ssh cannot deliver a signal).
        remote: the process is an ssh client: to stop it, the launcher writes the signal on the
            life line and closes it (the remote shim reports the worker's end, which killing the
            ssh client would lose); SIGKILL follows only after the grace period.
        tagged: ``"openmpi"`` or ``"mpich"`` when output lines carry mpirun's per-rank tags.
        shown_env: the variables worth showing with ``--verbose`` (the rest is forwarded env).
    """

    argv: list[str]
    env: dict[str, str] | None
    ranks: tuple[int, ...]
    host: str
    stdin_data: bytes | None = None
    lifeline: bool = False
    remote: bool = False
    tagged: str | None = None
    shown_env: dict[str, str] = field(default_factory=dict)

    def text(self) -> str:
        """The command as a shell line (the job's variables shown in front of it)."""
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.shown_env.items()))
        return (prefix + " " if prefix else "") + shlex.join(self.argv)


class Launcher(Protocol):
    """Turns a plan into commands; ``is_available`` says why not when it cannot."""

    name: str

    def is_available(self) -> tuple[bool, str]:
        """(True, "") or (False, the reason and how to fix it)."""

    def commands(self, plan: object) -> list[Command]:
        """The processes to start for ``plan``."""
