"""The ports an ``srun`` step's tasks meet on: task 0's store and its MUNGE key service.

The tasks of a step share no channel before they meet, so every task derives the same short list
of candidate ports from the job and step ids (:func:`step_ports`). Task 0 binds the first one it
can and holds it (:func:`bind_first`): a candidate another process holds (``EADDRINUSE``) is
skipped. The other tasks try the candidates in turn until one answers as the step's own (the
store's and the key service's authentication tell it from a stranger's).

The candidates lie in ports 20000-32767, below Linux's default ephemeral range (32768-60999,
``/proc/sys/net/ipv4/ip_local_port_range``), from which the kernel hands out the local ports of
outgoing connections: a derived port there could be taken by any connection between its choice
and its bind. Where a node's ephemeral range covers some candidates anyway, task 0 tries the
others first. ``MASTER_PORT`` names the store's port (and ``MASTER_PORT + 1`` the key service's)
instead: one candidate, no fallback, the user chose it. Standard library only.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

__all__ = ["CANDIDATES", "EPHEMERAL_RANGE_FILE", "PORT_WINDOW", "bind_first", "ephemeral_range",
           "step_ports"]

PORT_WINDOW = (20000, 32768)  # [first, end): below Linux's default ephemeral range
CANDIDATES = 8
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_PAIRS = (PORT_WINDOW[1] - PORT_WINDOW[0]) // 2  # the store on the even port, the key service +1
_STRIDE = 797  # a prime: the candidates of one step spread over the window

T = TypeVar("T")


def _int(environ: Mapping[str, str], name: str) -> int | None:
    try:
        return int(environ[name])
    except (KeyError, ValueError):
        return None


def step_ports(environ: Mapping[str, str], service: str = "store") -> list[int]:
    """The candidate ports of ``service`` (``"store"`` or ``"key"``), the same on every task."""
    offset = {"store": 0, "key": 1}[service]
    master = _int(environ, "MASTER_PORT")
    if master:
        return [master + offset]
    job = _int(environ, "SLURM_JOB_ID") or 0
    step = _int(environ, "SLURM_STEP_ID") or 0
    first = (7 * job + step) % _PAIRS
    return [PORT_WINDOW[0] + 2 * ((first + i * _STRIDE) % _PAIRS) + offset for i in range(CANDIDATES)]


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int] | None:
    """This node's range of local ports for outgoing connections (inclusive), None if unknown."""
    try:
        with open(path, encoding="ascii") as fh:
            low, high = (int(v) for v in fh.read().split()[:2])
    except (OSError, ValueError):
        return None
    return low, high


def bind_first(ports: Sequence[int], bind: Callable[[int], T],
               ephemeral: tuple[int, int] | None = None) -> T:
    """``bind(port)`` for the first candidate that is free, those outside ``ephemeral`` (default:
    this node's range) first; the result holds the port. Raises the last ``OSError`` when every
    candidate is taken (or the first error that is not ``EADDRINUSE``)."""
    rng = ephemeral_range() if ephemeral is None else ephemeral
    order = sorted(ports, key=lambda p: rng is not None and rng[0] <= p <= rng[1])  # stable
    last: OSError | None = None
    for port in order:
        try:
            return bind(port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            last = exc
    assert last is not None, "no candidate ports"
    raise last

