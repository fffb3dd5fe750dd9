"""HMAC signing of rendezvous requests and answers (see the package docstring)."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from horovod.common.exceptions import HorovodError

__all__ = ["RendezvousError", "make_secret", "sign_request", "sign_response", "AUTH_HEADER",
           "SIG_HEADER", "MAX_SKEW_SECONDS"]

AUTH_HEADER = "X-Horovod-Auth"
SIG_HEADER = "X-Horovod-Signature"
MAX_SKEW_SECONDS = 300.0


class RendezvousError(HorovodError, RuntimeError):
    """The rendezvous service cannot be reached, refused us, or answered with a bad signature."""


def make_secret() -> str:
    """A fresh per-job secret (hex text, 256 bits)."""
    return secrets.token_hex(32)


def _mac(secret: str, *parts: str) -> str:
    return hmac.new(bytes.fromhex(secret), "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def sign_request(secret: str, method: str, path: str, timestamp: str, nonce: str,
                 body: bytes) -> str:
    return _mac(secret, method.upper(), path, timestamp, nonce, hashlib.sha256(body).hexdigest())


def sign_response(secret: str, request_mac: str, status: int, body: bytes) -> str:
    return _mac(secret, "resp", request_mac, str(status), hashlib.sha256(body).hexdigest())
