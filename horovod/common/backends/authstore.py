"""An authenticated key-value store for connection set-up, usable as a ``torch.distributed.Store``.

torch's ``TCPStore`` accepts anybody who can reach its port (and listens on every interface):
whoever can write its keys can redirect the ranks' Gloo/NCCL connections or stop the job. This
store is what Horovod's Gloo backend, its torch device plane and its elastic rounds use instead
whenever Horovod opens the store itself:

* The server (``StoreServer``) listens on one address only: the interface the job uses.
* A connection starts with a challenge-response: the server sends a random nonce, the client
  answers with its own nonce and ``HMAC-SHA256(key, "c" | server nonce | client nonce)``, the server
  proves itself with ``HMAC(key, "s" | ...)``. ``key`` is derived from the job's secret
  (``HOROVOD_SECRET_KEY``, never sent). A peer that fails gets an explicit refusal and is logged
  once per address at warning level (a bounded number of addresses; the rest in at most one line
  a minute).
* Strangers cannot starve members: one thread runs every handshake with a selector; at most
  ``max_pending`` handshakes are open (``max_pending_per_address`` per address), the oldest being
  closed with a "busy" answer when a new connection arrives at a cap; one deadline covers the
  whole handshake; ``accept`` failures (no file descriptors left) close the oldest handshake and
  the loop goes on. A member whose handshake was closed as busy tries again until its timeout.
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
import selectors
import socket
import struct
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from horovod.common.refusals import RefusalLog

__all__ = ["StoreServer", "StoreClient", "StoreError", "derive_key", "torch_store", "open_store",
           "connect_store", "torch_store_type", "random_key"]

log = logging.getLogger("horovod")

_HELLO = b"HVDSTOR1"
_NONCE = 32
_MAC = 32
_HANDSHAKE_SECONDS = 10.0
_MAX_FRAME = 64 * 1024 * 1024
_MAX_WAIT = 7 * 86400.0
# What the server sends instead of its proof (32 bytes, like a MAC): the client's key does not
# match, or the server closed the handshake because it is overloaded (the client tries again).
_REFUSED = b"HVDSTOR1 refused: wrong key.....".ljust(_MAC, b".")
_BUSY = b"HVDSTOR1 busy: try again........".ljust(_MAC, b".")

# Operation codes (one byte) of a request frame; fields follow as length-prefixed byte strings.
SET, GET, ADD, CSET, WAIT, CHECK, DELETE, NUMKEYS, APPEND, MGET, MSET = range(1, 12)
_OK, _TIMEOUT, _ERROR = 0, 1, 2


class StoreError(RuntimeError):
    """The store refused us, timed out, or its answer was not authentic."""


class _Busy(Exception):
    """The server closed a handshake without a verdict on the key (overloaded): try again."""


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
class _Pending:
    """A connection in its handshake: the server's nonce sent, the client's answer arriving."""

    __slots__ = ("sock", "peer", "port", "deadline", "nonce", "buf")

    def __init__(self, sock: socket.socket, addr: Any, deadline: float) -> None:
        self.sock, self.peer, self.port = sock, str(addr[0]), addr[1]
        self.deadline = deadline
        self.nonce = secrets.token_bytes(_NONCE)
        self.buf = b""


class StoreServer:
    """The store's data and its listening socket.

    One thread accepts connections and runs every handshake with a selector (no thread per
    stranger); a connection that authenticates gets a thread of its own. Strangers are bounded:
    at most ``max_pending`` connections in their handshake, ``max_pending_per_address`` from one
    address; at a cap the *oldest* handshake of that address (or of all) is closed with a
    ``BUSY`` answer, so a member's fresh connection always gets its turn. One deadline
    (``handshake_seconds``) covers the whole handshake, however slowly the bytes arrive. Errors
    of ``accept`` (out of file descriptors: ``EMFILE``, ``ENFILE``; anything else) close the
    oldest handshake, pause accepting briefly and go on.
    """

    def __init__(self, host: str, key: bytes, port: int = 0, *, max_pending: int = 512,
                 max_pending_per_address: int = 128,
                 handshake_seconds: float = _HANDSHAKE_SECONDS) -> None:
        self.key = key
        self.max_pending, self.max_per_address = int(max_pending), int(max_pending_per_address)
        self.handshake_seconds = float(handshake_seconds)
        self._data: dict[bytes, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._sock = socket.create_server((host, port), family=_family(host), backlog=128)
        self._sock.setblocking(False)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.log = RefusalLog(log, f"store {host}:{self.port}")
        self._pending: dict[socket.socket, _Pending] = {}  # in accept order (oldest first)
        self._per_peer: dict[str, dict[socket.socket, _Pending]] = {}
        self.evicted = self.accept_errors = self.admitted = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._thread = threading.Thread(target=self._loop, name="horovod-store-accept", daemon=True)
        self._thread.start()

    @property
    def refusals(self) -> int:
        """Connections refused: wrong key, garbage, or no answer within the handshake deadline."""
        return self.log.refused

    @property
    def pending(self) -> int:
        """Connections now in their handshake."""
        return len(self._pending)

    def close(self) -> None:
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._cond:
            for c in list(self._conns):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._cond.notify_all()

    # ------------------------------------------------------------------ the handshake thread
    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, False)
        listening, resume = True, 0.0
        try:
            while not self._closed:
                try:
                    now = time.monotonic()
                    if not listening and now >= resume:
                        sel.register(self._sock, selectors.EVENT_READ, None)
                        listening = True
                    wait = 0.25 if not self._pending else max(
                        0.0, min(0.25, next(iter(self._pending.values())).deadline - now))
                    if not listening:
                        wait = max(0.0, min(wait, resume - now))
                    for skey, _ in sel.select(wait):
                        if skey.data is None:
                            if not self._accept_some(sel):
                                sel.unregister(self._sock)
                                listening, resume = False, time.monotonic() + 0.05
                        elif skey.data is False:
                            self._wake_r.recv(64)
                        else:
                            self._advance(sel, skey.data)
                    self._expire(sel)
                except Exception as exc:  # noqa: BLE001 - the store must outlive any one fault
                    self.log.event("loop", f"error in the accept loop ({type(exc).__name__}: "
                                           f"{exc}); going on")
                    time.sleep(0.05)
        finally:
            for p in list(self._pending.values()):
                self._drop(sel, p, None)
            sel.close()
            self._sock.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept_some(self, sel: selectors.BaseSelector) -> bool:
        """Accept what is queued (a bounded batch); False to pause accepting after an error."""
        for _ in range(64):
            try:
                conn, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ...: free a slot, go on
                self.accept_errors += 1
                self.log.event("accept", f"accept() failed ({exc}); closing the oldest handshake "
                                         "(pausing 50 ms when there is none)")
                if self._pending:
                    self._evict(sel, next(iter(self._pending.values())))
                    return True  # a descriptor is free again: the next select accepts
                return False
            try:
                self._admit(sel, conn, addr)
            except OSError:
                conn.close()
        return True

    def _admit(self, sel: selectors.BaseSelector, conn: socket.socket, addr: Any) -> None:
        p = _Pending(conn, addr, time.monotonic() + self.handshake_seconds)
        mine = self._per_peer.setdefault(p.peer, {})
        if len(mine) >= self.max_per_address:
            self._evict(sel, next(iter(mine.values())))
        elif len(self._pending) >= self.max_pending:
            self._evict(sel, next(iter(self._pending.values())))
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.send(_HELLO + p.nonce)  # 40 bytes: a fresh socket's buffer takes them whole
        self._pending[conn] = p
        self._per_peer.setdefault(p.peer, {})[conn] = p
        sel.register(conn, selectors.EVENT_READ, p)

    def _forget(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        """The handshake of ``p`` is over (done or dropped): stop tracking and watching it."""
        self._pending.pop(p.sock, None)
        mine = self._per_peer.get(p.peer)
        if mine is not None:
            mine.pop(p.sock, None)
            if not mine:
                del self._per_peer[p.peer]
        try:
            sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass

    def _drop(self, sel: selectors.BaseSelector, p: _Pending, answer: bytes | None) -> None:
        self._forget(sel, p)
        if answer is not None:
            try:
                p.sock.send(answer)
            except OSError:
                pass
        p.sock.close()

    def _evict(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        self.evicted += 1
        self._drop(sel, p, _BUSY)
        self.log.event("busy", "too many connections in their handshake; closed the oldest")

    # A refusal is counted before its connection is closed, so a peer that sees the close sees
    # the count too.
    def _expire(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        while self._pending:
            p = next(iter(self._pending.values()))
            if p.deadline > now:
                return
            self.log.refuse(p.peer, f"no valid handshake within {self.handshake_seconds:g} s", p.port)
            self._drop(sel, p, _BUSY)

    def _advance(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        want = len(_HELLO) + _NONCE + _MAC
        try:
            chunk = p.sock.recv(want - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.log.refuse(p.peer, f"no valid handshake: {exc}", p.port)
            self._drop(sel, p, None)
            return
        if not chunk:
            self.log.refuse(p.peer, "closed during the handshake", p.port)
            self._drop(sel, p, None)
            return
        p.buf += chunk
        if len(p.buf) < want:
            return
        head = p.buf
        nonce_c, mac = head[len(_HELLO):len(_HELLO) + _NONCE], head[len(_HELLO) + _NONCE:]
        if head[:len(_HELLO)] != _HELLO or not hmac.compare_digest(
                mac, _mac(self.key, b"c", p.nonce, nonce_c)):
            self.log.refuse(p.peer, "not signed with this job's secret", p.port)
            self._drop(sel, p, _REFUSED)
            return
        self._forget(sel, p)
        conn = p.sock
        try:
            if conn.send(_mac(self.key, b"s", nonce_c, p.nonce)) != _MAC:
                raise ConnectionError("short send")
            conn.setblocking(True)
            session = _mac(self.key, b"session", p.nonce, nonce_c)
            chan = _Channel(conn, session, b"s2c", b"c2s")
            with self._cond:
                self._conns.add(conn)
            self.admitted += 1
            threading.Thread(target=self._serve, args=(chan, p.peer), name="horovod-store-conn",
                             daemon=True).start()
        except (OSError, ConnectionError, RuntimeError):
            with self._cond:
                self._conns.discard(conn)
            conn.close()

    # ------------------------------------------------------------------ members
    def _serve(self, chan: _Channel, peer: str) -> None:
        conn = chan.sock
        try:
            while not self._closed:
                try:
                    body = chan.recv()
                except ConnectionError as exc:
                    if str(exc) not in ("connection closed",):
                        self.log.refuse(peer, str(exc))
                    return
                try:
                    answer = self._handle(body)
                except (IndexError, ValueError, struct.error) as exc:
                    answer = _pack(_ERROR, [f"malformed request: {exc}"[:200].encode()])
                chan.send(answer)
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
                if not 0.0 <= timeout <= _MAX_WAIT:  # NaN fails too
                    return _pack(_ERROR, [f"bad wait of {f[0][:20]!r} s".encode()])
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
        busy = 0
        while True:
            # The server may not listen yet (rank 0 is still starting), or be busy with strangers
            # (it closes the oldest handshakes when too many are open): try again until the
            # deadline. Only an explicit refusal ends the attempts at once.
            try:
                sock, nonce_s, nonce_c = self._handshake(key, deadline)
                break
            except _Busy as exc:
                busy += 1
                if time.monotonic() > deadline:
                    raise StoreError(
                        f"the store at {host}:{port} was too busy to finish the handshake "
                        f"({busy} attempts in {timeout if connect_timeout is None else connect_timeout:g} s: "
                        f"{exc}); many connections from elsewhere may be flooding it. Check who "
                        "else connects to this port (the store's log names refused addresses).") from exc
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise StoreError(f"cannot connect to the store at {host}:{port}: {exc}") from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
        sock.settimeout(None)
        self._sock = sock
        self._chan = _Channel(sock, _mac(key, b"session", nonce_s, nonce_c), b"c2s", b"s2c")

    def _handshake(self, key: bytes, deadline: float) -> tuple[socket.socket, bytes, bytes]:
        host, port = self.host, self.port
        wait = max(1.0, min(10.0, self.timeout, deadline - time.monotonic()))
        sock = socket.create_connection((host, port), timeout=wait)
        try:
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
                # Closed or reset before the proof: the server dropped this handshake (busy),
                # not a verdict on the key (a wrong key gets an explicit refusal).
                raise _Busy(str(exc) or type(exc).__name__) from exc
            if proof == _BUSY:
                raise _Busy("the server closed the handshake: busy")
            if proof == _REFUSED:
                raise StoreError(f"the store at {host}:{port} refused this process: its key does "
                                 "not match (wrong HOROVOD_SECRET_KEY, or a process of another job)")
            if not hmac.compare_digest(proof, _mac(key, b"s", nonce_c, nonce_s)):
                raise StoreError(f"the store at {host}:{port} is not this job's (bad proof)")
        except BaseException:
            sock.close()
            raise
        return sock, nonce_s, nonce_c

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


def connect_any(host: str, ports: Sequence[int], key: bytes, timeout: float) -> tuple[Any, int]:
    """A torch store connected to the server at ``host`` on whichever of ``ports`` answers with
    ``key`` (the candidates of ``horovod.common.slurm_ports``), and its port. The candidates are
    tried in turn, again and again until ``timeout``: nothing listening, a stranger, or a store of
    another key moves on to the next."""
    if len(ports) == 1:
        return connect_store(host, ports[0], key, timeout), ports[0]
    deadline = time.monotonic() + timeout
    delay = 0.01
    last: dict[int, str] = {}
    while True:
        for port in ports:
            try:
                return torch_store(StoreClient(host, port, key, timeout, connect_timeout=0)), port
            except StoreError as exc:
                last[port] = str(exc)
        if time.monotonic() > deadline:
            raise StoreError(f"no store of this job answered at {host} on any of ports "
                             f"{', '.join(map(str, ports))} within {timeout:g} s (last answers: "
                             + "; ".join(f"{p}: {e}" for p, e in last.items()) + ")")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


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
