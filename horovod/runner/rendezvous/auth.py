"""HMAC signing of rendezvous requests and answers: the protocol lives in
``horovod.common.rendezvous`` (one module for the launcher and the workers); re-exported here."""

from __future__ import annotations

from horovod.common.rendezvous import (
    AUTH_HEADER,
    MAX_SKEW_SECONDS,
    SIG_HEADER,
    RendezvousError,
    make_secret,
    sign_request,
    sign_response,
)

__all__ = ["RendezvousError", "make_secret", "sign_request", "sign_response", "AUTH_HEADER",
           "SIG_HEADER", "MAX_SKEW_SECONDS"]
