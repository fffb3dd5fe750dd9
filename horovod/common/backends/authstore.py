"""An authenticated key-value store for connection set-up, usable as a ``torch.distributed.Store``.

torch's ``TCPStore`` accepts anybody who can reach its port (and listens on every interface):
whoever can write its keys can redirect the ranks' Gloo/NCCL connections or stop the job. This
store is what Horovod's Gloo backend, its torch device plane and its elastic rounds use instead
whenever Horovod opens the store itself:

* The server (``StoreServer``) listens on one address only: the interface the job uses.
* A connection starts with a challenge-response: the server sends a random nonce, the client
  answers with its own nonce and ``HMAC-SHA256(key, "c" | server nonce | client nonce)``, the server
  proves itself with ``HMAC(key, "s" | ...)``. ``key`` is derived from the job's secret
  (``HOROVOD_SECRET_KEY``, never sent). A peer that fails is refused (connection closed), logged
  once per address at warning level, and never holds up the job: each connection has its own
  thread and a handshake deadline.
* After it, every request and answer is a frame ``length | body | HMAC(session key, direction |
  sequence number | body)``: a frame that is altered, replayed or out of order ends the connection.

The protocol part is standard library only; ``torch_store()`` wraps a client as a
``torch.distributed.Store`` (importing torch only then), so ``ProcessGroupGloo``/``ProcessGroupNCCL``
and ``PrefixStore`` use it like any store.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

__all__ = ["StoreServer", "StoreClient", "StoreError", "derive_key", "torch_store", "open_store",
           "connect_store", "torch_store_type", "random_key"]

log = logging.getLogger("horovod")

_HELLO = b"HVDSTOR1"
_NONCE = 32
_MAC = 32
_HANDSHAKE_SECONDS = 10.0
_MAX_FRAME = 64 * 1024 * 1024

# Operation codes (one byte) of a request frame; fields follow as length-prefixed byte strings.
SET, GET, ADD, CSET, WAIT, CHECK, DELETE, NUMKEYS, APPEND, MGET, MSET = range(1, 12)
_OK, _TIMEOUT, _ERROR = 0, 1, 2


class StoreError(RuntimeError):
    """The store refused us, timed out, or its answer was not authentic."""


def derive_key(secret: str | bytes, purpose: str = "store") -> bytes:
    """The store's HMAC key: the job secret (hex text or bytes) bound to ``purpose``."""
    if isinstance(secret, str):
        try:
            raw = bytes.fromhex(secret)
        except ValueError:
            raw = secret.encode()
    else:
        raw = secret
    return hmac.new(raw, b"horovod-" + purpose.encode(), hashlib.sha256).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"|".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def _pack(op: int, fields: Sequence[bytes]) -> bytes:
    return bytes([op]) + b"".join(struct.pack("!I", len(f)) + f for f in fields)


def _unpack(body: bytes) -> tuple[int, list[bytes]]:
    op, pos, fields = body[0], 1, []
    while pos < len(body):
        (n,) = struct.unpack_from("!I", body, pos)
        fields.append(body[pos + 4:pos + 4 + n])
        pos += 4 + n
    return op, fields


class _Channel:
    """Framed, MAC'd messages over one authenticated connection."""

    def __init__(self, sock: socket.socket, session: bytes, send_dir: bytes, recv_dir: bytes) -> None:
        self.sock, self.session = sock, session
        self.send_dir, self.recv_dir = send_dir, recv_dir
        self.sent = self.received = 0

    def send(self, body: bytes) -> None:
        mac = _mac(self.session, self.send_dir, str(self.sent).encode(), body)
        self.sent += 1
        self.sock.sendall(struct.pack("!I", len(body)) + body + mac)

    def recv(self) -> bytes:
        (n,) = struct.unpack("!I", _recv_exact(self.sock, 4))
        if n > _MAX_FRAME:
            raise ConnectionError(f"frame of {n} bytes")
        body = _recv_exact(self.sock, n)
        mac = _recv_exact(self.sock, _MAC)
        want = _mac(self.session, self.recv_dir, str(self.received).encode(), body)
        if not hmac.compare_digest(mac, want):
            raise ConnectionError("bad frame signature")
        self.received += 1
        return body


# ------------------------------------------------------------------------------------ server
class StoreServer:
    """The store's data and its listening socket (one thread per authenticated connection)."""

    def __init__(self, host: str, key: bytes, port: int = 0) -> None:
        self.key = key
        self._data: dict[bytes, bytes] = {}
        self._cond = threading.Condition()
        self._refused: set[str] = set()
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._sock = socket.create_server((host, port), family=_family(host), backlog=128)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.refusals = 0
        threading.Thread(target=self._accept, name="horovod-store-accept", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._cond:
            for c in list(self._conns):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._cond.notify_all()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, addr), name="horovod-store-conn",
                             daemon=True).start()

    def _refuse(self, addr: Any, why: str) -> None:
        self.refusals += 1
        peer = str(addr[0])
        if peer not in self._refused:
            self._refused.add(peer)
            log.warning("store %s:%d refused a connection from %s:%s (%s); further refusals of "
                        "this address are not logged", self.host, self.port, peer, addr[1], why)

    def _handshake(self, conn: socket.socket, addr: Any) -> _Channel | None:
        conn.settimeout(_HANDSHAKE_SECONDS)
        nonce_s = secrets.token_bytes(_NONCE)
        try:
            conn.sendall(_HELLO + nonce_s)
            head = _recv_exact(conn, len(_HELLO) + _NONCE + _MAC)
        except (OSError, ConnectionError) as exc:
            self._refuse(addr, f"no valid handshake: {exc or 'timeout'}")
            return None
        nonce_c, mac = head[len(_HELLO):len(_HELLO) + _NONCE], head[len(_HELLO) + _NONCE:]
        if head[:len(_HELLO)] != _HELLO or not hmac.compare_digest(
                mac, _mac(self.key, b"c", nonce_s, nonce_c)):
            self._refuse(addr, "not signed with this job's secret")
            return None
        conn.sendall(_mac(self.key, b"s", nonce_c, nonce_s))
        conn.settimeout(None)
        session = _mac(self.key, b"session", nonce_s, nonce_c)
        return _Channel(conn, session, b"s2c", b"c2s")

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        with self._cond:
            self._conns.add(conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            chan = self._handshake(conn, addr)
            if chan is None:
                return
            while not self._closed:
                try:
                    body = chan.recv()
                except ConnectionError as exc:
                    if str(exc) not in ("connection closed",):
                        self._refuse(addr, str(exc))
                    return
                chan.send(self._handle(body))
        except OSError:
            return
        finally:
            with self._cond:
                self._conns.discard(conn)
            conn.close()

    def _handle(self, body: bytes) -> bytes:
        op, f = _unpack(body)
        d: dict[bytes, bytes] = self._data
        cond = self._cond
        with cond:
            if op == SET:
                d[f[0]] = f[1]
                cond.notify_all()
                return _pack(_OK, [])
            if op == APPEND:
                d[f[0]] = d.get(f[0], b"") + f[1]
                cond.notify_all()
                return _pack(_OK, [])
            if op == MSET:
                for k, v in zip(f[0::2], f[1::2]):
                    d[k] = v
                cond.notify_all()
                return _pack(_OK, [])
            if op == ADD:
                k = f[0]
                value = int(d.get(k, b"0")) + int(f[1])
                d[k] = str(value).encode()
                cond.notify_all()
                return _pack(_OK, [str(value).encode()])
            if op == CSET:
                k = f[0]
                cur = d.get(k)
                if (cur is None and f[1] == b"") or cur == f[1]:
                    d[k] = f[2]
                    cond.notify_all()
                    return _pack(_OK, [f[2]])
                return _pack(_OK, [cur if cur is not None else f[1]])
            if op == CHECK:
                return _pack(_OK, [b"1" if all(k in d for k in f) else b"0"])
            if op == DELETE:
                found = d.pop(f[0], None) is not None
                return _pack(_OK, [b"1" if found else b"0"])
            if op == NUMKEYS:
                return _pack(_OK, [str(len(d)).encode()])
            if op in (GET, WAIT, MGET):
                timeout = float(f[0])
                keys = f[1:]
                deadline = time.monotonic() + timeout
                while not all(k in d for k in keys):
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed:
                        missing = [k for k in keys if k not in d]
                        return _pack(_TIMEOUT, [b", ".join(missing)])
                    cond.wait(min(left, 1.0))
                return _pack(_OK, [d[k] for k in keys] if op != WAIT else [])
        return _pack(_ERROR, [f"unknown operation {op}".encode()])


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# ------------------------------------------------------------------------------------ client
class StoreClient:
    """One authenticated connection to a ``StoreServer``; calls are serialised by a lock."""

    def __init__(self, host: str, port: int, key: bytes, timeout: float = 30.0,
                 connect_timeout: float | None = None) -> None:
        self.host, self.port, self.timeout = host, int(port), float(timeout)
        self._lock = threading.Lock()
        deadline = time.monotonic() + (timeout if connect_timeout is None else connect_timeout)
        delay = 0.01
        while True:  # the server may not listen yet (rank 0 is still starting)
            try:
                sock = socket.create_connection((host, self.port), timeout=max(1.0, min(10.0, timeout)))
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise StoreError(f"cannot connect to the store at {host}:{port}: {exc}") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            head = _recv_exact(sock, len(_HELLO) + _NONCE)
            if head[:len(_HELLO)] != _HELLO:
                raise StoreError(f"{host}:{port} is not a Horovod store")
            nonce_s = head[len(_HELLO):]
            nonce_c = secrets.token_bytes(_NONCE)
            sock.sendall(_HELLO + nonce_c + _mac(key, b"c", nonce_s, nonce_c))
            proof = _recv_exact(sock, _MAC)
        except (OSError, ConnectionError) as exc:
            sock.close()
            raise StoreError(f"the store at {host}:{port} refused this process (is it from "
                             f"another job? wrong HOROVOD_SECRET_KEY): {exc}") from exc
        if not hmac.compare_digest(proof, _mac(key, b"s", nonce_c, nonce_s)):
            sock.close()
            raise StoreError(f"the store at {host}:{port} is not this job's (bad proof)")
        sock.settimeout(None)
        self._sock = sock
        self._chan = _Channel(sock, _mac(key, b"session", nonce_s, nonce_c), b"c2s", b"s2c")

    def call(self, op: int, fields: Sequence[bytes]) -> list[bytes]:
        with self._lock:
            try:
                self._chan.send(_pack(op, fields))
                status, out = _unpack(self._chan.recv())
            except (OSError, ConnectionError) as exc:
                raise StoreError(f"lost the store at {self.host}:{self.port}: {exc}") from exc
        if status == _TIMEOUT:
            raise StoreError(f"timed out waiting for key(s) {out[0].decode()} in the store at "
                             f"{self.host}:{self.port}")
        if status != _OK:
            raise StoreError(out[0].decode() if out else "store error")
        return out

    def close(self) -> None:
        # shutdown() first: it wakes a call blocked in recv() on another thread (close() alone
        # does not), which then fails with StoreError.
        for end in (lambda: self._sock.shutdown(socket.SHUT_RDWR), self._sock.close):
            try:
                end()
            except OSError:
                pass


# ------------------------------------------------------------------------------ torch adaptor
_TorchStore: Any = None


def _torch_store_class() -> Any:
    global _TorchStore
    if _TorchStore is not None:
        return _TorchStore
    import datetime

    import torch.distributed as dist

    def _b(value: Any) -> bytes:
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    class AuthenticatedStore(dist.Store):  # type: ignore[misc]
        """``torch.distributed.Store`` over a ``StoreClient`` (see the module docstring)."""

        def __init__(self, client: StoreClient, server: StoreServer | None) -> None:
            super().__init__()
            self.client, self.server = client, server
            self._wait = client.timeout
            if server is not None:
                weakref.finalize(self, server.close)
            weakref.finalize(self, client.close)

        def set_timeout(self, timeout: datetime.timedelta) -> None:
            self._wait = timeout.total_seconds()

        def set(self, key: str, value: Any) -> None:
            self.client.call(SET, [key.encode(), _b(value)])

        def append(self, key: str, value: Any) -> None:
            self.client.call(APPEND, [key.encode(), _b(value)])

        def get(self, key: str) -> bytes:
            return self.client.call(GET, [str(self._wait).encode(), key.encode()])[0]

        def multi_get(self, keys: list[str]) -> list[bytes]:
            return self.client.call(MGET, [str(self._wait).encode()] + [k.encode() for k in keys])

        def multi_set(self, keys: list[str], values: list[Any]) -> None:
            fields: list[bytes] = []
            for k, v in zip(keys, values):
                fields += [k.encode(), _b(v)]
            self.client.call(MSET, fields)

        def add(self, key: str, amount: int) -> int:
            return int(self.client.call(ADD, [key.encode(), str(int(amount)).encode()])[0])

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            return self.client.call(CSET, [key.encode(), _b(expected), _b(desired)])[0]

        def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
            wait = self._wait if timeout is None else timeout.total_seconds()
            self.client.call(WAIT, [str(wait).encode()] + [k.encode() for k in keys])

        def check(self, keys: list[str]) -> bool:
            return self.client.call(CHECK, [k.encode() for k in keys])[0] == b"1"

        def delete_key(self, key: str) -> bool:
            return self.client.call(DELETE, [key.encode()])[0] == b"1"

        def num_keys(self) -> int:
            return int(self.client.call(NUMKEYS, [])[0])

        def close(self) -> None:
            self.client.close()
            if self.server is not None:
                self.server.close()

    _TorchStore = AuthenticatedStore
    return _TorchStore


def torch_store_type() -> Any:
    """The ``torch.distributed.Store`` class of this module (imports torch)."""
    return _torch_store_class()


def torch_store(client: StoreClient, server: StoreServer | None = None) -> Any:
    """A ``torch.distributed.Store`` on ``client`` (keeping ``server`` alive while it lives)."""
    return _torch_store_class()(client, server)


def open_store(host: str, key: bytes, timeout: float, port: int = 0) -> Any:
    """Start a server on ``host`` (``port`` 0: a free one) and return a torch store connected to it.

    The store's ``server.port`` is the port to publish to the other members.
    """
    server = StoreServer(host, key, port)
    try:
        client = StoreClient(host, server.port, key, timeout)
    except Exception:
        server.close()
        raise
    return torch_store(client, server)


def connect_store(host: str, port: int, key: bytes, timeout: float) -> Any:
    """A torch store connected to the server at ``host:port`` (retrying until ``timeout``)."""
    return torch_store(StoreClient(host, port, key, timeout))


def random_key() -> bytes:
    """A fresh store key, for stores whose members share no job secret but a trusted channel."""
    return os.urandom(32)


def open_for_members(host: str, timeout: float, secret: str | None) -> tuple[Any, bytes]:
    """Open a store for members that will get its ``ticket`` over the job's own transport.

    The key is derived from the job secret when there is one (``HOROVOD_SECRET_KEY``), else it is a
    fresh random key carried in the ticket (jobs started by MPI or torch launchers share no
    secret, but their CPU transport already joins exactly the job's members).
    """
    key = derive_key(secret, "members") if secret else random_key()
    store = open_store(host, key, timeout)
    ticket = f"{host}:{store.server.port}" + ("" if secret else f":{key.hex()}")
    return store, ticket.encode()


def join_members(ticket: bytes, timeout: float, secret: str | None) -> Any:
    """Connect to the store of ``open_for_members`` from its ticket."""
    parts = ticket.decode().split(":")
    if secret:
        host, port = ":".join(parts[:-1]), parts[-1]
        key = derive_key(secret, "members")
    else:
        host, port, key = ":".join(parts[:-2]), parts[-2], bytes.fromhex(parts[-1])
    return connect_store(host, int(port), key, timeout)
