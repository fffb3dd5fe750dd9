"""The launcher's monitor service: ``horovodrun --monitor-port PORT [--monitor-address ADDR]``.

Endpoints:

* ``POST /api/report``: a rank's counters (``horovod.common.reporter``), signed with the job secret
  exactly like a rendezvous request (``horovod.common.rendezvous``: ``X-Horovod-Auth``, a fresh
  nonce, an HMAC over method, path, time, nonce and body; the answer is signed back). Anything
  else is refused with 403.
* ``GET /metrics``: Prometheus text exposition (``exposition.py``).
* ``GET /api/job``: the same as JSON (``JobState.job``).
* ``GET /api/stacks``: where every rank last said it was: its main thread's stack and its flight
  record, with the age of that report (``JobState.stacks``).
* ``GET /``: a self-contained page that polls ``/api/job`` (``page.py``; no external assets).

Reads are open on a loopback address (the default, ``127.0.0.1``). On any other address they
need the read token the service prints with its URL (``?token=...`` or
``Authorization: Bearer ...``), so that only whoever can see the launcher's output can read the
job's state; reports always need the job secret.

The service runs in the launcher, off every rank's path: one daemon thread per connection, at
most ``MAX_CONNECTIONS`` at once (more are closed at once), a socket timeout on every read and
write, and a deadline on every answer, so a client that reads slowly, or never, holds one thread
for a bounded time and never holds up a rank (a rank's reporter retries on its next tick).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import secrets
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from horovod.common import protocol
from horovod.common.exceptions import LaunchError
from horovod.common.rendezvous import AUTH_HEADER, MAX_SKEW_SECONDS, SIG_HEADER, sign_request, sign_response
from horovod.runner.monitor import exposition, page
from horovod.runner.monitor.state import JobState
from horovod.runner.network import QuietHTTPServer

__all__ = ["MonitorService", "MAX_CONNECTIONS", "MAX_REPORT_BYTES", "answer_report"]

log = logging.getLogger("horovod.runner")

MAX_CONNECTIONS = 64
MAX_REPORT_BYTES = 1 << 20
SOCKET_TIMEOUT = 5.0
ANSWER_DEADLINE = 15.0
_CHUNK = 64 * 1024


class _MonitorHTTPServer(QuietHTTPServer):
    service_name = "monitor"
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, addr: tuple[str, int], service: MonitorService) -> None:
        self.service = service
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(addr, _MonitorHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many clients at once: drop this one
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _MonitorHandler(BaseHTTPRequestHandler):
    server: _MonitorHTTPServer
    timeout = SOCKET_TIMEOUT
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("monitor: " + format, *args)

    def _answer(self, status: int, body: bytes, ctype: str = "application/json",
                request_mac: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if request_mac is not None:
            self.send_header(SIG_HEADER, sign_response(self.server.service.secret, request_mac,
                                                       status, body))
        self.end_headers()
        deadline = time.monotonic() + ANSWER_DEADLINE
        view = memoryview(body)
        for at in range(0, len(body), _CHUNK):
            if time.monotonic() > deadline:
                raise TimeoutError("monitor client reads too slowly")
            self.wfile.write(view[at:at + _CHUNK])

    # ------------------------------------------------------------------ reads
    def _read_allowed(self) -> bool:
        svc = self.server.service
        if svc.read_token is None:
            return True
        query = parse_qs(urlsplit(self.path).query)
        given = (query.get("token") or [""])[0]
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            given = auth[7:].strip()
        return hmac.compare_digest(given, svc.read_token)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        route = urlsplit(self.path).path
        if not self._read_allowed():
            self._answer(403, b"read token required (see the URL horovodrun printed)\n", "text/plain")
            return
        svc = self.server.service
        if route == "/metrics":
            self._answer(200, exposition.render(svc.state.job()).encode(), exposition.CONTENT_TYPE)
        elif route == "/api/job":
            self._answer(200, json.dumps(svc.state.job()).encode())
        elif route == "/api/stacks":
            self._answer(200, json.dumps(svc.state.stacks()).encode())
        elif route in ("/", "/index.html"):
            self._answer(200, page.HTML.encode(), "text/html; charset=utf-8")
        else:
            self._answer(404, b"not found: try /, /metrics, /api/job or /api/stacks\n", "text/plain")

    # ------------------------------------------------------------------ reports
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_REPORT_BYTES:
            self._answer(413, b"")
            return
        body = self.rfile.read(length)
        mac = self.server.service.authenticate(self.command, self.path,
                                               self.headers.get(AUTH_HEADER, ""), body)
        if mac is None:
            self._answer(403, b"")
            return
        if urlsplit(self.path).path != protocol.REPORT_PATH:
            self._answer(404, b"", request_mac=mac)
            return
        status, answer = answer_report(self.server.service.state, body)
        self._answer(status, answer, "application/json" if status == 200 else "text/plain",
                     request_mac=mac)


def answer_report(state: JobState, body: bytes) -> tuple[int, bytes]:
    """Take one signed rank report (a JSON body) into ``state``: (HTTP status, answer body).

    The one place a report is accepted, whether it came to this service or to a job's rendezvous
    service (``horovod.runner.monitor.cluster``: Spark and Ray jobs)."""
    if len(body) > MAX_REPORT_BYTES:
        return 413, b"report too large"
    try:
        state.ingest(protocol.MonitorReport.from_wire(json.loads(body)))
    except (ValueError, KeyError, TypeError) as exc:
        return 400, str(exc).encode()
    return 200, b"{}"


def _loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


class MonitorService:
    """Bind at once (so a port in use fails before any rank starts), serve from a daemon thread.

    Args:
        secret: the job secret (reports must be signed with it).
        port: TCP port; 0 picks a free one.
        address: where to listen (``127.0.0.1`` by default; another address needs the read token).
        state: the ``JobState`` to show and update.

    Raises:
        LaunchError: the address cannot be bound (port in use, address not on this host).
    """

    def __init__(self, secret: str, port: int, address: str = "127.0.0.1",
                 state: JobState | None = None) -> None:
        self.secret = secret
        self.state = state if state is not None else JobState()
        self.read_token = None if _loopback(address) else secrets.token_urlsafe(24)
        self._nonces: dict[str, float] = {}
        self._nonce_lock = threading.Lock()
        try:
            self._server = _MonitorHTTPServer((address, port), self)
        except OSError as exc:
            why = ("the port is in use by another process (another job's monitor, or another "
                   "service); choose another --monitor-port, or 0 for any free port"
                   if exc.errno in (98, 48, 10048) else
                   "check that --monitor-address is an address of this host")
            raise LaunchError(f"Cannot start the monitor on {address}:{port}: {exc.strerror or exc}; "
                              f"{why}. No rank was started.", address=address, port=port) from exc
        self.address = address
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="horovod-monitor", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = self.address
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        elif ":" in host:
            host = f"[{host}]"
        base = f"http://{host}:{self.port}/"
        return base + (f"?token={self.read_token}" if self.read_token else "")

    def authenticate(self, method: str, path: str, header: str, body: bytes) -> str | None:
        """The request's mac when signed with the job secret (fresh, never seen), else None."""
        parts = header.split(":")
        if len(parts) != 3:
            return None
        ts, nonce, mac = parts
        try:
            fresh = abs(time.time() - float(ts)) <= MAX_SKEW_SECONDS
        except ValueError:
            return None
        want = sign_request(self.secret, method, path, ts, nonce, body)
        if not (fresh and hmac.compare_digest(want, mac)):
            return None
        now = time.time()
        with self._nonce_lock:
            if nonce in self._nonces:
                return None
            if len(self._nonces) > 100_000:
                self._nonces = {n: t for n, t in self._nonces.items() if now - t <= 2 * MAX_SKEW_SECONDS}
            self._nonces[nonce] = now
        return mac

    def stop(self, wait: float = 5.0) -> None:
        """Stop serving and close the port, within about ``wait`` seconds even if the serving
        thread is stuck in a request: the launcher ends after its Ctrl-C whatever a client does
        (``socketserver``'s shutdown() alone waits for the serving loop without a limit)."""
        stopper = threading.Thread(target=self._server.shutdown, name="horovod-monitor-stop", daemon=True)
        stopper.start()
        stopper.join(wait)
        if stopper.is_alive():
            log.warning("monitor: the serving thread did not stop within %g s; closing its port", wait)
        self._server.server_close()
        self._thread.join(2.0)
