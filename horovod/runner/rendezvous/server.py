"""The rendezvous HTTP server that runs inside the launcher for Gloo jobs, ``horovod.run`` and
elastic jobs (protocol: ``horovod.common.rendezvous``)."""

from __future__ import annotations

import hmac
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

from horovod.common.rendezvous import (
    AUTH_HEADER,
    MAX_SKEW_SECONDS,
    SIG_HEADER,
    sign_request,
    sign_response,
)

__all__ = ["RendezvousServer"]

log = logging.getLogger(__name__)

_MAX_BODY = 1 << 30


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("rendezvous %s: " + format, self.client_address[0], *args)

    def _answer(self, status: int, body: bytes = b"", request_mac: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        if request_mac is not None:
            self.send_header(SIG_HEADER, sign_response(self.server.secret, request_mac, status, body))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _authenticate(self, body: bytes) -> str | None:
        auth = self.headers.get(AUTH_HEADER, "")
        parts = auth.split(":")
        if len(parts) == 3:
            ts, nonce, mac = parts
            try:
                fresh = abs(time.time() - float(ts)) <= MAX_SKEW_SECONDS
            except ValueError:
                fresh = False
            want = sign_request(self.server.secret, self.command, self.path, ts, nonce, body)
            if fresh and hmac.compare_digest(want, mac) and self.server.fresh_nonce(nonce):
                return mac
        self.server.rejected += 1
        log.warning("rendezvous: rejected an unauthenticated %s %s from %s", self.command,
                    self.path[:64], self.client_address[0])
        return None

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length < 0 or length > _MAX_BODY:
            self._answer(413)
            return
        body = self.rfile.read(length) if length else b""
        mac = self._authenticate(body)
        if mac is None:
            self.close_connection = True
            self._answer(403)
            return
        parts = [unquote(p) for p in self.path.split("/") if p]
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
        elif len(parts) == 2 and parts[0] == "slot" and self.command == "GET":
            info = self.server.slots.get(parts[1])
            self._answer(404 if info is None else 200, json.dumps(info).encode() if info else b"",
                         mac)
        else:
            self._answer(404, b"", mac)

    do_GET = do_PUT = do_DELETE = do_POST = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], secret: str) -> None:
        super().__init__(addr, _Handler)
        self.secret = secret
        self.store: dict[tuple[str, str], bytes] = {}
        self.slots: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.rejected = 0
        # POST /elastic/<call>: (call, body) -> (status, answer), set by the elastic driver.
        self.elastic_handler: Callable[[str, bytes], tuple[int, bytes]] | None = None
        self._nonces: dict[str, float] = {}

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client gone mid-answer (a departing worker, one killed while it long-polls) is expected:
        # one line, no traceback. Anything else is a fault of ours and keeps its traceback.
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError):
            log.debug("rendezvous: %s closed its connection before the answer (%s)", client_address[0],
                      type(exc).__name__)
        else:
            log.warning("rendezvous: a request from %s failed", client_address[0], exc_info=True)

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

    Use as a context manager, or call ``stop()``.
    """

    def __init__(self, secret: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = _Server((host, port), secret)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="hvd-rendezvous", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def rejected(self) -> int:
        """How many requests were refused (bad or missing signature)."""
        return self._server.rejected

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

    def set_slots(self, slots: dict[int, dict[str, Any]]) -> None:
        self._server.slots = {str(r): info for r, info in slots.items()}

    def set_elastic_handler(self, handler: Callable[[str, bytes], tuple[int, bytes]] | None) -> None:
        """Answer ``POST /elastic/<call>`` with ``handler(call, body) -> (status, body)``."""
        self._server.elastic_handler = handler

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> RendezvousServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
