"""The rendezvous protocol between a launcher and its workers, in one place.

The launcher (``horovodrun``, ``horovod.run()``, the elastic driver) runs a small HTTP service;
workers use it to find each other (Gloo), to fetch a function and return results
(``horovod.run``), and in elastic mode to join each new round of the job and to hear about host
changes. Both sides import this module: ``horovod.runner.rendezvous.server`` answers, the
``RendezvousClient`` below asks.

* Every request carries ``X-Horovod-Auth: <unix time>:<nonce>:<mac>`` and
  ``X-Horovod-Body-Digest: sha256(body)`` (hex; may be left out for an empty body), where ``mac``
  is the HMAC-SHA256, keyed with the job secret, of
  ``METHOD\\nPATH\\nTIME\\nNONCE\\nCONTENT-LENGTH\\nDIGEST``. The header alone proves the
  sender, so the server checks it *before* reading any body: it answers 403 with an empty body to
  a missing, stale (more than 5 minutes off), replayed or wrong signature without reading what
  follows, 400 to a malformed header, 413 to a body over its limit, and 400 to a body whose
  digest is not the signed one. A stray connection can neither join, nor read, nor make the
  service buffer anything.
* A busy service answers 503 (unsigned); the client tries again until its timeout.
* Every answer carries ``X-Horovod-Signature``: the HMAC of ``resp\\nMAC\\nSTATUS\\nsha256(body)``
  (``MAC`` is the request's), so a worker knows the answer came from its own launcher.
* ``PUT /kv/<scope>/<key>`` stores the body; ``GET`` returns it (404 while absent); ``DELETE``
  removes it.
* ``POST /elastic/<call>`` (elastic jobs only): a JSON request, a JSON answer; the calls are
  described in ``horovod.common.elastic.worker``.

Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import os
import secrets
import socket
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from horovod.common import protocol
from horovod.common.exceptions import HorovodError

__all__ = ["AUTH_HEADER", "DIGEST_HEADER", "SIG_HEADER", "MAX_SKEW_SECONDS", "EMPTY_DIGEST",
           "RendezvousError", "RendezvousClient", "make_secret", "sign_header", "sign_request",
           "sign_response", "kv_path", "route_address"]

AUTH_HEADER = "X-Horovod-Auth"
DIGEST_HEADER = "X-Horovod-Body-Digest"
SIG_HEADER = "X-Horovod-Signature"
MAX_SKEW_SECONDS = 300.0
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


class RendezvousError(HorovodError, RuntimeError):
    """The rendezvous service cannot be reached, refused us, or answered with a bad signature."""


def make_secret() -> str:
    """A fresh per-job secret (hex text, 256 bits)."""
    return secrets.token_hex(32)


def _mac(secret: str, *parts: str) -> str:
    return hmac.new(bytes.fromhex(secret), "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def sign_header(secret: str, method: str, path: str, timestamp: str, nonce: str, length: int,
                digest: str) -> str:
    """The ``mac`` of a request whose body has ``length`` bytes and SHA-256 ``digest`` (hex)."""
    return _mac(secret, method.upper(), path, timestamp, nonce, str(int(length)), digest)


def sign_request(secret: str, method: str, path: str, timestamp: str, nonce: str,
                 body: bytes) -> str:
    """The ``mac`` of a request (see the module docstring)."""
    return sign_header(secret, method, path, timestamp, nonce, len(body),
                       hashlib.sha256(body).hexdigest())


def sign_response(secret: str, request_mac: str, status: int, body: bytes) -> str:
    """The signature of an answer to the request signed ``request_mac``."""
    return _mac(secret, "resp", request_mac, str(status), hashlib.sha256(body).hexdigest())


def route_address(remote: str) -> str:
    """The local address this machine uses to reach ``remote`` (an IPv4 address; no packet is
    sent), or ``127.0.0.1`` when no route leads there."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((remote, 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def kv_path(scope: str, key: str) -> str:
    return f"/kv/{quote(scope, safe='')}/{quote(key, safe='')}"


class RendezvousClient:
    """Talk to the launcher's rendezvous service at ``addr:port`` with the job ``secret``."""

    def __init__(self, addr: str, port: int, secret: str, timeout: float = 30.0) -> None:
        self.addr, self.port, self.secret, self.timeout = addr, int(port), secret, timeout

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RendezvousClient:
        """Build a client from ``HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT`` and ``HOROVOD_SECRET_KEY``.

        Raises:
            RendezvousError: a variable is missing (the process was not started by horovodrun).
        """
        environ = os.environ if environ is None else environ
        try:
            return cls(environ[protocol.RENDEZVOUS_ADDR_ENV], int(environ[protocol.RENDEZVOUS_PORT_ENV]),
                       environ[protocol.SECRET_ENV])
        except KeyError as exc:
            raise RendezvousError(f"{exc.args[0]} is not set: this process was not started by "
                                  "horovodrun or horovod.run().") from exc

    def request(self, method: str, path: str, body: bytes = b"",
                timeout: float | None = None) -> tuple[int, bytes]:
        """Send one signed request; return (status, body) after checking the answer's signature.

        A busy service (503, or a connection it closed before answering) is asked again, with a
        fresh nonce, until ``timeout``.

        Raises:
            RendezvousError: connection failure, refusal (403) or a bad answer signature.
        """
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        digest = hashlib.sha256(body).hexdigest()
        delay = 0.01
        while True:
            ts, nonce = f"{time.time():.6f}", secrets.token_hex(16)
            mac = sign_header(self.secret, method, path, ts, nonce, len(body), digest)
            conn = http.client.HTTPConnection(self.addr, self.port, timeout=wait)
            busy = ""
            try:
                conn.request(method, path, body=body, headers={
                    AUTH_HEADER: f"{ts}:{nonce}:{mac}", DIGEST_HEADER: digest,
                    "Content-Length": str(len(body))})
                resp = conn.getresponse()
                data = resp.read()
                if resp.status == 503:
                    busy = "503 busy"
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected) as exc:
                busy = f"{type(exc).__name__}: {exc}"  # closed before answering: not processed
            except OSError as exc:
                raise RendezvousError(f"Cannot reach the rendezvous service at {self.addr}:{self.port}: "
                                      f"{exc}. Check that this host can reach the launcher's address "
                                      "(see --network-interfaces).", addr=self.addr, port=self.port) from exc
            finally:
                conn.close()
            if not busy:
                break
            if time.monotonic() + delay > deadline:
                raise RendezvousError(f"The rendezvous service at {self.addr}:{self.port} stayed "
                                      f"busy for {wait:g} s ({busy}): too many connections, maybe "
                                      "from outside the job (its log names the addresses).",
                                      addr=self.addr, port=self.port)
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        if resp.status == 403:
            raise RendezvousError(f"The rendezvous service at {self.addr}:{self.port} refused this "
                                  "worker: its job secret does not match (wrong HOROVOD_SECRET_KEY: "
                                  "this process belongs to another job).", addr=self.addr,
                                  refused=True)
        sig = resp.getheader(SIG_HEADER, "")
        if not sig.isascii() or not hmac.compare_digest(sig, sign_response(self.secret, mac, resp.status, data)):
            raise RendezvousError(f"The answer from {self.addr}:{self.port} is not signed by this "
                                  "job's launcher.", addr=self.addr)
        return resp.status, data

    def put(self, scope: str, key: str, value: bytes) -> None:
        status, _ = self.request("PUT", kv_path(scope, key), value)
        if status != 200:
            raise RendezvousError(f"PUT {scope}/{key} failed with HTTP {status}.")

    def get(self, scope: str, key: str) -> bytes | None:
        status, data = self.request("GET", kv_path(scope, key))
        if status == 404:
            return None
        if status != 200:
            raise RendezvousError(f"GET {scope}/{key} failed with HTTP {status}.")
        return data

    def wait(self, scope: str, key: str, timeout: float) -> bytes:
        """Poll until ``key`` exists.

        Raises:
            RendezvousError: it did not appear within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            value = self.get(scope, key)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise RendezvousError(f"Timed out after {timeout:g} s waiting for {scope}/{key} at "
                                      f"the rendezvous service.", scope=scope, key=key)
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def call(self, name: str, payload: Mapping[str, Any], timeout: float | None = None,
             ) -> dict[str, Any]:
        """``POST /elastic/<name>`` with a JSON body; return the JSON answer.

        Raises:
            RendezvousError: unreachable service, bad signature, or a non-200 answer.
        """
        status, data = self.request("POST", f"/elastic/{quote(name, safe='')}",
                                    json.dumps(dict(payload)).encode(), timeout=timeout)
        if status != 200:
            raise RendezvousError(f"elastic call {name!r} failed with HTTP {status}: "
                                  f"{data.decode(errors='replace')[:200]}", status=status)
        return dict(json.loads(data))
