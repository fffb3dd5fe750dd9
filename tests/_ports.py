"""A TCP port for a server that another process of a test will start: ``reserved_port()``.

Picking a free port with ``bind(("", 0))`` and closing the socket leaves the port free for anyone
until the server binds it, seconds later on a loaded machine: another process's ``bind(0)`` or
outgoing connection can take it in between, and the server then fails with "address already in
use" (or a client reaches the wrong process). ``reserved_port()`` keeps the port bound, with
``SO_REUSEADDR`` and without listening, while the test runs: the kernel hands it to no ``bind(0)``
nor outgoing connection of any process, refuses a plain ``bind`` to it, and still lets a server
that binds it with ``SO_REUSEADDR`` have it (torch's ``TCPStore``, gRPC's servers, Python's
``socketserver`` servers all do). Until a server listens there, connecting to it is refused.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def reserved_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A free TCP port on ``host``, held for a server with ``SO_REUSEADDR`` until the block ends."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind((host, 0))
        yield int(holder.getsockname()[1])
