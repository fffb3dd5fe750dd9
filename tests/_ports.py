"""A TCP port for a server that another process of a test will start: ``reserved_port()``.

Picking a free port with ``bind(("", 0))`` and closing the socket leaves the port free for anyone
until the server binds it, seconds later on a loaded machine: another process's ``bind(0)`` or
outgoing connection can take it in between, and the server then fails with "address already in
use" (or a client reaches the wrong process). ``reserved_port()`` keeps the port bound, with
``SO_REUSEADDR`` and without listening, while the test runs: the kernel hands it to no ``bind(0)``
nor outgoing connection of any process, refuses a plain ``bind`` to it, and still lets a server
that binds it with ``SO_REUSEADDR`` have it (torch's ``TCPStore``, gRPC's servers, Python's
``socketserver`` servers all do). Until a server listens there, connecting to it is refused.

``held_step_ports(taken, free)``: an srun step whose first store candidate ports (in task 0's
order, ``bind_order``; ``horovod.common.slurm_ports``) are held for real by listening sockets
(``hold_port``), so that task 0 falls back to the next ones every time.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

from horovod.common import slurm_ports


@contextlib.contextmanager
def reserved_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A free TCP port on ``host``, held for a server with ``SO_REUSEADDR`` until the block ends."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind((host, 0))
        yield int(holder.getsockname()[1])


def hold_port(port: int) -> socket.socket | None:
    """A socket listening on ``port`` of every address, as another service would hold it; None when
    another process holds it already (taken all the same)."""
    sock = socket.socket()
    try:
        sock.bind(("", port))
        sock.listen(1)
    except OSError:
        sock.close()
        return None
    return sock


def held_step_ports(taken: int, free: int = 0, first_job: int = 4242,
                    ) -> tuple[dict[str, str], list[int], list[socket.socket]]:
    """A step (``SLURM_JOB_ID``/``SLURM_STEP_ID``) whose store candidates, in task 0's order, start
    with ``taken`` ports held for real by sockets listening on every address (returned: close them)
    followed by ``free`` ports that were free just now: the step's own derived candidates, no
    others (the job id moves on from ``first_job`` past candidates in use here)."""
    for job in range(first_job, first_job + 200):
        step = {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "1"}
        order = bind_order(slurm_ports.step_ports(step))
        held = [hold_port(port) for port in order[:taken + free]]
        mine = [sock for sock in held if sock is not None]
        if len(mine) == len(held):
            for sock in mine[taken:]:
                sock.close()
            return step, order, mine[:taken]
        for sock in mine:  # a candidate in use here: the next job
            sock.close()
    raise AssertionError(f"no step of jobs {first_job}-{first_job + 199} has its first candidate ports free here")


def bind_order(ports: list[int]) -> list[int]:
    """``ports`` in the order task 0 tries them here (``slurm_ports.bind_first``: those outside
    this node's ephemeral range first)."""
    rng = slurm_ports.ephemeral_range()
    return sorted(ports, key=lambda p: rng is not None and rng[0] <= p <= rng[1])
