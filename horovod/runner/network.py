"""Small network helpers: which host names are this machine, and which address others can reach."""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
import sys
from http.server import ThreadingHTTPServer
from typing import Any

from horovod.common import exceptions as errors
from horovod.common.rendezvous import route_address as _route

__all__ = ["is_local_host", "local_addresses", "route_address", "interface_address",
           "resolve", "free_port", "QuietHTTPServer"]

_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "127.0.0.1", "::1", "ip6-localhost"}


@functools.lru_cache(maxsize=1)
def local_addresses() -> frozenset[str]:
    """Every IPv4/IPv6 address of this machine's interfaces (of this network namespace)."""
    addrs = {"127.0.0.1", "::1"}
    try:
        import psutil

        for entries in psutil.net_if_addrs().values():
            for e in entries:
                if e.family in (socket.AF_INET, socket.AF_INET6):
                    addrs.add(e.address.split("%", 1)[0])
    except Exception:  # noqa: BLE001 - psutil missing or unreadable: fall back to name lookup
        try:
            addrs.update(socket.gethostbyname_ex(socket.gethostname())[2])
        except OSError:
            pass
    return frozenset(addrs)


@functools.lru_cache(maxsize=64)
def resolve(host: str) -> str | None:
    """The first IPv4 address of ``host``, or None when it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine (loopback, its host name, or one of its addresses)."""
    if host in _LOOPBACK_NAMES or host == socket.gethostname():
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    addr = resolve(host)
    if addr is None:
        return False
    return addr in local_addresses() or ipaddress.ip_address(addr).is_loopback


def route_address(remote: str) -> str:
    """The local address this machine uses to reach ``remote`` (no packet is sent)."""
    return _route(resolve(remote) or remote)


def interface_address(nic: str) -> str:
    """The IPv4 address of network interface ``nic``.

    Raises:
        ConfigError: no such interface, or it has no IPv4 address.
    """
    import psutil

    table = psutil.net_if_addrs()
    if nic not in table:
        raise errors.ConfigError(f"Network interface {nic!r} does not exist here; available: "
                          f"{', '.join(sorted(table))}.", nic=nic)
    for e in table[nic]:
        if e.family == socket.AF_INET:
            return str(e.address)
    raise errors.ConfigError(f"Network interface {nic!r} has no IPv4 address.", nic=nic)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class QuietHTTPServer(ThreadingHTTPServer):
    """The launcher's HTTP servers (rendezvous, monitor): a client gone mid-answer (a departing
    worker, a browser tab closed, a connection cut for being past its deadline) is expected and
    costs one debug line; anything else is a fault of ours and is logged with its traceback."""

    service_name = "http"

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        log = logging.getLogger(type(self).__module__)
        if isinstance(exc, OSError):
            log.debug("%s: %s closed its connection before the answer (%s)", self.service_name,
                      client_address[0], type(exc).__name__)
        else:
            log.warning("%s: a request from %s failed", self.service_name, client_address[0], exc_info=True)
