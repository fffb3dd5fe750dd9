"""Client of the rendezvous service, used by ``run_task`` workers and tests."""

from __future__ import annotations

import hmac
import http.client
import json
import os
import secrets
import time
from typing import Any
from urllib.parse import quote

from horovod.runner.rendezvous.auth import (
    AUTH_HEADER,
    SIG_HEADER,
    RendezvousError,
    sign_request,
    sign_response,
)

__all__ = ["RendezvousClient"]


class RendezvousClient:
    """Talk to the launcher's rendezvous service at ``addr:port`` with the job ``secret``."""

    def __init__(self, addr: str, port: int, secret: str, timeout: float = 30.0) -> None:
        self.addr, self.port, self.secret, self.timeout = addr, int(port), secret, timeout

    @classmethod
    def from_env(cls, environ: Any = None) -> RendezvousClient:
        """Build a client from ``HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT`` and ``HOROVOD_SECRET_KEY``.

        Raises:
            RendezvousError: a variable is missing (the process was not started by horovodrun).
        """
        environ = os.environ if environ is None else environ
        try:
            return cls(environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
                       int(environ["HOROVOD_GLOO_RENDEZVOUS_PORT"]), environ["HOROVOD_SECRET_KEY"])
        except KeyError as exc:
            raise RendezvousError(f"{exc.args[0]} is not set: this process was not started by "
                                  "horovodrun or horovod.run().") from exc

    def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        """Send one signed request; return (status, body) after checking the answer's signature.

        Raises:
            RendezvousError: connection failure, refusal (403) or a bad answer signature.
        """
        ts, nonce = f"{time.time():.6f}", secrets.token_hex(16)
        mac = sign_request(self.secret, method, path, ts, nonce, body)
        conn = http.client.HTTPConnection(self.addr, self.port, timeout=self.timeout)
        try:
            conn.request(method, path, body=body, headers={AUTH_HEADER: f"{ts}:{nonce}:{mac}"})
            resp = conn.getresponse()
            data = resp.read()
        except OSError as exc:
            raise RendezvousError(f"Cannot reach the rendezvous service at {self.addr}:{self.port}: "
                                  f"{exc}. Check that this host can reach the launcher's address "
                                  "(see --network-interfaces).", addr=self.addr, port=self.port) from exc
        finally:
            conn.close()
        if resp.status == 403:
            raise RendezvousError(f"The rendezvous service at {self.addr}:{self.port} refused this "
                                  "worker: its job secret does not match.", addr=self.addr)
        sig = resp.getheader(SIG_HEADER, "")
        if not hmac.compare_digest(sig, sign_response(self.secret, mac, resp.status, data)):
            raise RendezvousError(f"The answer from {self.addr}:{self.port} is not signed by this "
                                  "job's launcher.", addr=self.addr)
        return resp.status, data

    @staticmethod
    def _path(scope: str, key: str) -> str:
        return f"/kv/{quote(scope, safe='')}/{quote(key, safe='')}"

    def put(self, scope: str, key: str, value: bytes) -> None:
        status, _ = self.request("PUT", self._path(scope, key), value)
        if status != 200:
            raise RendezvousError(f"PUT {scope}/{key} failed with HTTP {status}.")

    def get(self, scope: str, key: str) -> bytes | None:
        status, data = self.request("GET", self._path(scope, key))
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
        delay = 0.01
        while True:
            value = self.get(scope, key)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise RendezvousError(f"Timed out after {timeout:g} s waiting for {scope}/{key} at "
                                      f"the rendezvous service.", scope=scope, key=key)
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def slot(self, rank: int) -> dict[str, Any]:
        status, data = self.request("GET", f"/slot/{rank}")
        if status != 200:
            raise RendezvousError(f"The launcher has no slot for rank {rank}.", rank=rank)
        return dict(json.loads(data))
