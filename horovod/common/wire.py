"""What the launcher and its workers say to each other, spelled once (standard library only).

(The messages the ranks' engines exchange during negotiation are another protocol:
``horovod/common/engine/negotiation_codec.py``.)

Both sides import this module: the worker (``horovod.common.lifecycle``), the worker shim
(``horovod/runner/_shim.py``, which runs by file path and loads this file by path too), and the
launchers that read their workers' output (``horovodrun``'s static and elastic jobs, Spark).

* **Variables**: where a process finds its rank (:data:`RANK_VARS`, in the order every reader
  checks them; :data:`RANK_SIZE_VARS` pairs each with its size variable), the identity of a
  worker's slot (:func:`slot_env`), where ``horovod.run()``'s workers find the launcher
  (:data:`RUNNER_ADDR_ENV`, :data:`RUNNER_PORT_ENV`, :data:`SECRET_ENV`), the file named by
  :data:`EXIT_RECORD_ENV` that a failing rank writes its failure record to, the fail-fast switch
  (:data:`LIFECYCLE_ENV`).
* **Markers**: two stderr lines a launcher removes from the output it shows.
  ``__HOROVOD_RANK_ERROR__ {json}`` is written by a failing Horovod rank the moment it fails
  (``{"code", "kind", "error", "time", "rank"}``: whether its error is its own or the consequence of
  a peer leaving); ``__HOROVOD_RUNNER_EXIT__ {json}`` is the shim's last line about a rank (rank,
  host, pid, exit code or signal, why the shim stopped it, the failure record).
  :func:`strip_markers` is the one function that finds and removes them.
* **Life line**: a launcher stops a remote worker by writing :func:`signal_line` on the shim's
  stdin, then closing it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ERROR_MARKER", "EXIT_MARKER", "EXIT_RECORD_ENV", "RANK_VARS", "RANK_SIZE_VARS",
           "LIFECYCLE_ENV", "RUNNER_ADDR_ENV", "RUNNER_PORT_ENV", "SECRET_ENV", "job_secret",
           "MONITOR_ADDR_ENV", "MONITOR_PORT_ENV", "MONITOR_INTERVAL_ENV", "Markers", "env_rank",
           "error_line", "exit_line", "parse_signal_line", "signal_line", "slot_env", "strip_markers"]

ERROR_MARKER = "__HOROVOD_RANK_ERROR__ "
EXIT_MARKER = "__HOROVOD_RUNNER_EXIT__ "
EXIT_RECORD_ENV = "HOROVOD_EXIT_RECORD"
# 0 in a worker's environment: no fail-fast hook (see horovod.common.lifecycle); a failed rank
# takes the normal exit path, and the launcher stops the job when the rank's process ends.
LIFECYCLE_ENV = "HOROVOD_FAIL_FAST"

# horovodrun / Open MPI / PMIx / PMI (MPICH, Intel MPI): the first one set names the rank.
RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
# (rank variable, size variable) per launcher, in the order upstream's helper checks them.
RANK_SIZE_VARS = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                  ("PMI_RANK", "PMI_SIZE"))
# Where horovod.run()'s workers (horovod.runner.run_task) find the launcher's service, and its key.
RUNNER_ADDR_ENV = "HOROVOD_RUNNER_ADDR"
RUNNER_PORT_ENV = "HOROVOD_RUNNER_PORT"
SECRET_ENV = "HOROVOD_SECRET_KEY"
# Where a rank pushes its counters (``horovodrun --monitor-port``; see horovod/common/reporter.py).
MONITOR_ADDR_ENV = "HOROVOD_MONITOR_ADDR"
MONITOR_PORT_ENV = "HOROVOD_MONITOR_PORT"
MONITOR_INTERVAL_ENV = "HOROVOD_MONITOR_INTERVAL"


def slot_env(hostname: str, rank: int, size: int, local_rank: int, local_size: int, cross_rank: int,
             cross_size: int) -> dict[str, str]:
    """The identity variables a launcher gives the worker of one slot (upstream's names)."""
    return {"HOROVOD_HOSTNAME": hostname, "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
            "HOROVOD_LOCAL_RANK": str(local_rank), "HOROVOD_LOCAL_SIZE": str(local_size),
            "HOROVOD_CROSS_RANK": str(cross_rank), "HOROVOD_CROSS_SIZE": str(cross_size)}


def job_secret(backend: Any = None, env: Mapping[str, str] | None = None) -> str | None:
    """The secret every rank of this job holds and no outsider does, or None (MPI, torchrun).

    ``HOROVOD_SECRET_KEY`` (horovodrun, horovod.run, Spark, Ray, a batch script), else the one the
    CPU transport established at init (``backend.job_secret``: an srun step's secret from MUNGE
    or a key file). Stores keyed from it need no key sent over the network.
    """
    env = os.environ if env is None else env
    return env.get(SECRET_ENV) or getattr(backend, "job_secret", None) or None


def env_rank(env: Mapping[str, str] | None = None) -> str | None:
    """The rank the launcher put in ``env`` (default ``os.environ``), as written, or None."""
    env = os.environ if env is None else env
    return next((env[v] for v in RANK_VARS if v in env), None)


def error_line(record: Mapping[str, Any]) -> str:
    """The stderr line a failing rank writes (``record`` has ``rank``, ``code``, ``kind``...)."""
    return ERROR_MARKER + json.dumps(dict(record)) + "\n"


def exit_line(info: Mapping[str, Any]) -> str:
    """The shim's last stderr line about its rank."""
    return EXIT_MARKER + json.dumps(dict(info)) + "\n"


def signal_line(signum: int) -> bytes:
    """The life-line command that asks a shim to send ``signum`` to its worker."""
    return f"signal {int(signum)}\n".encode()


def parse_signal_line(line: bytes) -> int | None:
    """The signal number of a life-line command, or None for anything else."""
    words = line.split()
    if len(words) == 2 and words[0] == b"signal" and words[1].isdigit():
        return int(words[1])
    return None


@dataclass
class Markers:
    """What :func:`strip_markers` found in one line: the text to show and the records."""

    text: str
    terminator: str
    error: dict[str, Any] | None = None  # a rank's failure record (ERROR_MARKER)
    exit: dict[str, Any] | None = None  # the shim's exit report (EXIT_MARKER)

    @property
    def empty(self) -> bool:
        """The line held only markers: show nothing."""
        return not self.text and (self.error is not None or self.exit is not None)


def _take(text: str, marker: str) -> tuple[str, dict[str, Any] | None]:
    at = text.find(marker)
    if at < 0:
        return text, None
    try:
        record = json.loads(text[at + len(marker):])
    except ValueError:
        return text, None  # not ours after all (a program printing the word): shown as is
    if not isinstance(record, dict):
        return text, None
    return text[:at], record


def strip_markers(text: str, terminator: str = "\n") -> Markers:
    """Remove the markers from one output line; what came before a marker on the line stays.

    A marker that is not followed by a JSON object is left in the text (it was not written by
    Horovod). The line's terminator becomes ``"\\n"`` when a marker ended it (the marker line
    always ends the text a rank had written on it).
    """
    text, error = _take(text, ERROR_MARKER)
    text, exit_info = _take(text, EXIT_MARKER)
    if error is not None or exit_info is not None:
        terminator = "\n"
    return Markers(text, terminator, error, exit_info)
