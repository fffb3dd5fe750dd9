"""The rendezvous HTTP server that runs inside the launcher for Gloo jobs, ``horovod.run`` and
elastic jobs (protocol: ``horovod.common.rendezvous``).

What a stranger on the network can make it do is bounded:

* The signed header is checked before any body is read (403 and the connection closed
  otherwise), so an unsigned body is never buffered. Signed bodies are limited too:
  ``MAX_BODY`` (64 MiB), except the results ``horovod.run()`` workers send back
  (``LARGE_BODY_SCOPES``, 1 GiB).
* At most ``max_unauthenticated`` connections (``max_per_address`` from one address) may be
  between their accept and a valid signature; at a cap the oldest of them is closed, so a
  member's fresh request still gets through. Each has ``header_seconds`` in all to send a signed
  header, however slowly its bytes arrive. Past ``max_connections`` in all, a connection gets
  503 at once (members try again). Out of file descriptors, it closes the oldest
  unauthenticated connection, pauses 50 ms and goes on.
* Every socket has a timeout; a malformed request (bad or non-ASCII signature, bad, negative or
  huge ``Content-Length``, chunked bodies, unknown methods) gets a 4xx and no traceback; refused
  peers are logged once per address, the rest in at most one line a minute.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import unquote

from horovod.common import protocol
from horovod.common.refusals import RefusalLog
from horovod.common.rendezvous import (
    AUTH_HEADER,
    DIGEST_HEADER,
    EMPTY_DIGEST,
    MAX_SKEW_SECONDS,
    SIG_HEADER,
    sign_header,
    sign_response,
)
from horovod.runner.network import QuietHTTPServer

__all__ = ["RendezvousServer", "MAX_BODY", "LARGE_BODY", "LARGE_BODY_SCOPES"]

log = logging.getLogger(__name__)

MAX_BODY = 64 << 20
LARGE_BODY = 1 << 30
# Scopes whose PUT bodies may be LARGE_BODY: a horovod.run() function's return value per rank.
LARGE_BODY_SCOPES = frozenset({protocol.RESULT_SCOPE})
_AUTH = re.compile(r"([0-9]{1,12}(?:\.[0-9]{1,9})?):([0-9A-Za-z_-]{1,64}):([0-9a-f]{64})")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_LENGTH = re.compile(r"[0-9]{1,12}")
_BUSY_ANSWER = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n"
                b"Retry-After: 1\r\n\r\n")


def body_limit(method: str, parts: list[str]) -> int:
    """The largest body a signed ``method`` request on ``parts`` (the decoded path) may carry."""
    if method == "PUT" and len(parts) == 3 and parts[0] == "kv" and parts[1] in LARGE_BODY_SCOPES:
        return LARGE_BODY
    return MAX_BODY


class _RendezvousHandler(BaseHTTPRequestHandler):
    server: _RendezvousHTTPServer
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # so that even a garbage request line gets a status line
    timeout = 30  # every blocking read and write of a connection

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("rendezvous %s: " + format, self.client_address[0], *args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own refusals of a malformed request line or headers: a 4xx, never a 5xx
        # (501 unknown method, 505 bad version), and no body to speak of.
        if code >= 500:
            code = 405 if code == 501 else 400
        self.server.log.refuse(self.client_address[0], f"malformed request ({code})",
                               self.client_address[1])
        self.close_connection = True
        self._answer(code)

    def _answer(self, status: int, body: bytes = b"", request_mac: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        if request_mac is not None:
            self.send_header(SIG_HEADER, sign_response(self.server.secret, request_mac, status, body))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _refuse(self, status: int, why: str) -> None:
        self.server.log.refuse(self.client_address[0], why, self.client_address[1])
        self.close_connection = True
        self._answer(status)

    def _header_mac(self, parts: list[str]) -> tuple[str, int, str] | None:
        """Check the signed header; return (mac, length, digest), or None after refusing."""
        if self.headers.get("Transfer-Encoding") is not None:
            self._refuse(411, "chunked body (a Content-Length is required)")
            return None
        lengths = self.headers.get_all("Content-Length") or ["0"]
        raw_len = lengths[0].strip()
        if len(lengths) > 1 or not _LENGTH.fullmatch(raw_len):
            self._refuse(400, "bad Content-Length")
            return None
        length = int(raw_len)
        if length > body_limit(self.command, parts):
            self._refuse(413, f"a body of {length} bytes")
            return None
        auth = self.headers.get(AUTH_HEADER)
        if auth is None:
            self._refuse(403, f"an unsigned {self.command} {self.path[:64]!r}")
            return None
        m = _AUTH.fullmatch(auth)
        digest = self.headers.get(DIGEST_HEADER, EMPTY_DIGEST if length == 0 else "")
        if m is None or not _DIGEST.fullmatch(digest):
            self._refuse(400, f"a malformed {AUTH_HEADER} or {DIGEST_HEADER} header")
            return None
        ts, nonce, mac = m.groups()
        fresh = abs(time.time() - float(ts)) <= MAX_SKEW_SECONDS
        want = sign_header(self.server.secret, self.command, self.path, ts, nonce, length, digest)
        if not (fresh and hmac.compare_digest(want, mac)):
            self._refuse(403, f"a bad or stale signature on {self.command} {self.path[:64]!r}")
            return None
        if not self.server.fresh_nonce(nonce):
            self._refuse(403, "a replayed request")
            return None
        return mac, length, digest

    def _handle(self) -> None:
        self.close_connection = True  # one request per connection (the client's way too)
        try:
            parts = [unquote(p, errors="strict") for p in self.path.split("?")[0].split("/") if p]
        except UnicodeDecodeError:
            parts = []
        checked = self._header_mac(parts)
        if checked is None:
            return
        mac, length, digest = checked
        self.server.authenticated(self.connection)
        body = self.rfile.read(length) if length else b""
        if len(body) != length or not hmac.compare_digest(hashlib.sha256(body).hexdigest(), digest):
            self._refuse(400, "a body that is not the signed one")
            return
        self._dispatch(parts, body, mac)

    def _dispatch(self, parts: list[str], body: bytes, mac: str) -> None:
        store = self.server.store
        if len(parts) == 3 and parts[0] == "kv":
            key = (parts[1], parts[2])
            if self.command == "PUT":
                with self.server.lock:
                    store[key] = body
                    self.server.changed.notify_all()
                self._answer(200, b"", mac)
            elif self.command == "GET":
                with self.server.lock:
                    value = store.get(key)
                self._answer(404 if value is None else 200, value or b"", mac)
            elif self.command == "DELETE":
                with self.server.lock:
                    store.pop(key, None)
                self._answer(200, b"", mac)
            else:
                self._answer(405, b"", mac)
        elif len(parts) == 2 and parts[0] == "elastic" and self.command == "POST":
            handler = self.server.elastic_handler
            if handler is None:
                self._answer(404, b"", mac)
                return
            try:
                status, answer = handler(parts[1], body)
            except Exception as exc:  # noqa: BLE001 - a bad request must not kill the service
                log.exception("rendezvous: elastic call %s failed", parts[1])
                status, answer = 500, str(exc).encode()
            self._answer(status, answer, mac)
        elif "/" + "/".join(parts) == protocol.REPORT_PATH and self.command == "POST":
            report = self.server.report_handler
            status, answer = report(body) if report is not None else (404, b"")
            self._answer(status, answer, mac)
        else:
            self._answer(404, b"", mac)

    do_GET = do_PUT = do_DELETE = do_POST = _handle


class _RendezvousHTTPServer(QuietHTTPServer):
    service_name = "rendezvous"
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], secret: str, *, max_connections: int = 1024,
                 max_unauthenticated: int = 128, max_per_address: int = 32,
                 header_seconds: float = 10.0) -> None:
        super().__init__(addr, _RendezvousHandler)
        self.secret = secret
        self.store: dict[tuple[str, str], bytes] = {}
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.log = RefusalLog(log, f"rendezvous {addr[0]}:{self.server_address[1]}")
        # POST /elastic/<call>: (call, body) -> (status, answer), set by the elastic driver.
        self.elastic_handler: Callable[[str, bytes], tuple[int, bytes]] | None = None
        # POST /api/report: body -> (status, answer), set when a monitor takes the ranks' reports
        # over this service (horovod.runner.monitor.cluster: Spark and Ray jobs).
        self.report_handler: Callable[[bytes], tuple[int, bytes]] | None = None
        self._nonces: dict[str, float] = {}
        self.max_connections, self.max_unauthenticated = max_connections, max_unauthenticated
        self.max_per_address, self.header_seconds = max_per_address, header_seconds
        self._conn_lock = threading.Lock()
        self._live = 0
        # Connections not yet past a valid signature, oldest first: socket -> (peer, deadline).
        self._unauth: dict[socket.socket, tuple[str, float]] = {}
        self._per_peer: dict[str, int] = {}
        self._tracked: set[socket.socket] = set()
        self.evicted = self.busy = self.accept_errors = 0

    @property
    def unauthenticated(self) -> int:
        return len(self._unauth)

    # ---------------------------------------------------------------- connection accounting
    def process_request(self, request: Any, client_address: Any) -> None:
        peer = str(client_address[0])
        with self._conn_lock:
            over = self._live >= self.max_connections
            if not over:
                self._live += 1
                self._tracked.add(request)
                victims = self._make_room(peer)
                self._unauth[request] = (peer, time.monotonic() + self.header_seconds)
                self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        if over:
            self.busy += 1
            self.log.event("busy", f"{self.max_connections} connections open; answered 503")
            try:
                request.setblocking(False)
                request.send(_BUSY_ANSWER)
            except OSError:
                pass
            request.close()
            return
        for v in victims:
            self._cut(v)
        if victims:
            self.log.event("evict", "too many connections without a valid signature; closed the "
                                    "oldest")
        try:
            super().process_request(request, client_address)
        except Exception:  # noqa: BLE001 - e.g. no thread could be started: refuse, go on
            self.shutdown_request(request)
            self.log.event("thread", "could not start a thread for a connection")

    def get_request(self) -> tuple[Any, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            # Out of descriptors (EMFILE, ENFILE) or another accept failure: socketserver skips
            # the connection and goes on; free a descriptor (the oldest unauthenticated
            # connection) and pause, rather than spin on a listening socket that stays readable.
            with self._conn_lock:
                victim = next(iter(self._unauth), None)
                if victim is not None:
                    self._drop_unauth(victim)
                    self.evicted += 1
            if victim is not None:
                self._cut(victim)
            self.accept_errors += 1
            self.log.event("accept", f"accept() failed ({exc}); closed the oldest unauthenticated "
                                     "connection and paused 50 ms")
            time.sleep(0.05)
            raise

    def _make_room(self, peer: str) -> list[socket.socket]:
        """Under ``_conn_lock``: take out the oldest unauthenticated connections over a cap."""
        victims = []
        if self._per_peer.get(peer, 0) >= self.max_per_address:
            for sock, (who, _) in self._unauth.items():
                if who == peer:
                    victims.append(sock)
                    break
        elif len(self._unauth) >= self.max_unauthenticated:
            victims.append(next(iter(self._unauth)))
        for v in victims:
            self._drop_unauth(v)
        self.evicted += len(victims)
        return victims

    def _drop_unauth(self, sock: socket.socket) -> None:
        entry = self._unauth.pop(sock, None)
        if entry is not None:
            left = self._per_peer.get(entry[0], 1) - 1
            if left > 0:
                self._per_peer[entry[0]] = left
            else:
                self._per_peer.pop(entry[0], None)

    @staticmethod
    def _cut(sock: socket.socket) -> None:
        # Its thread's blocked read returns at once; the thread closes the socket.
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def authenticated(self, sock: socket.socket) -> None:
        with self._conn_lock:
            self._drop_unauth(sock)

    def shutdown_request(self, request: Any) -> None:
        # Every accepted connection ends here (socketserver calls it after the handler, whatever
        # happened): the accounting, then a bounded lingering close for refused ones.
        with self._conn_lock:
            tracked = request in self._tracked
            unread = request in self._unauth
            if tracked:
                self._tracked.discard(request)
                self._drop_unauth(request)
                self._live -= 1
        if unread:
            self._linger(request)
        super().shutdown_request(request)

    @staticmethod
    def _linger(sock: socket.socket) -> None:
        """Read (a little of) what a refused peer still sends before closing, so that it gets
        our 4xx rather than a reset; at most 64 KiB and one second."""
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(0.2)
            deadline, got = time.monotonic() + 1.0, 0
            while got < 65536 and time.monotonic() < deadline:
                chunk = sock.recv(16384)
                if not chunk:
                    break
                got += len(chunk)
        except OSError:
            pass

    def service_actions(self) -> None:
        """Called by ``serve_forever`` between accepts: close handshakes past their deadline."""
        now = time.monotonic()
        expired = []
        with self._conn_lock:
            for sock, (peer, deadline) in self._unauth.items():
                if deadline > now:
                    break
                expired.append((sock, peer))
            for sock, _ in expired:
                self._drop_unauth(sock)
        for sock, peer in expired:
            self._cut(sock)
            self.log.refuse(peer, f"no signed request within {self.header_seconds:g} s")

    def fresh_nonce(self, nonce: str) -> bool:
        """Accept each nonce once (within the skew window), so a captured request cannot replay."""
        now = time.time()
        with self.lock:
            if nonce in self._nonces:
                return False
            if len(self._nonces) > 100_000:
                self._nonces = {n: t for n, t in self._nonces.items()
                                if now - t <= 2 * MAX_SKEW_SECONDS}
            self._nonces[nonce] = now
            return True


class RendezvousServer:
    """Start the service on ``host`` (port 0: any free port) in a background thread.

    Use as a context manager, or call ``stop()``. The keyword arguments set the limits on
    strangers described in the module docstring.
    """

    def __init__(self, secret: str, host: str = "127.0.0.1", port: int = 0, **limits: Any) -> None:
        self._server = _RendezvousHTTPServer((host, port), secret, **limits)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="hvd-rendezvous", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def rejected(self) -> int:
        """How many requests were refused (bad or missing signature, malformed, too slow)."""
        return self._server.log.refused

    def put(self, scope: str, key: str, value: bytes) -> None:
        with self._server.lock:
            self._server.store[(scope, key)] = value

    def get(self, scope: str, key: str) -> bytes | None:
        with self._server.lock:
            return self._server.store.get((scope, key))

    def pop(self, scope: str, key: str) -> bytes | None:
        """Remove ``scope/key`` and return its value (None when absent)."""
        with self._server.lock:
            return self._server.store.pop((scope, key), None)

    def set_elastic_handler(self, handler: Callable[[str, bytes], tuple[int, bytes]] | None) -> None:
        """Answer ``POST /elastic/<call>`` with ``handler(call, body) -> (status, body)``."""
        self._server.elastic_handler = handler

    def set_report_handler(self, handler: Callable[[bytes], tuple[int, bytes]] | None) -> None:
        """Answer ``POST /api/report`` (a rank's monitor report) with ``handler(body)``."""
        self._server.report_handler = handler

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> RendezvousServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
