"""The launcher's rendezvous service: a small key-value store over HTTP, authenticated per job.

Protocol (also spoken by the minimal client in ``horovod/common/backends/gloo.py``; a unit test
checks that both sign alike):

* Every request carries ``X-Horovod-Auth: <unix time>:<nonce>:<mac>`` where ``mac`` is the
  HMAC-SHA256, keyed with the job secret, of ``METHOD\\nPATH\\nTIME\\nNONCE\\nsha256(body)``. The
  server answers 403 with an empty body to a missing, stale (more than 5 minutes off), replayed or
  wrong signature, so a stray connection can neither join nor read.
* Every answer carries ``X-Horovod-Signature``: the HMAC of ``resp\\nMAC\\nSTATUS\\nsha256(body)``
  (``MAC`` is the request's), so a worker knows the answer came from its own launcher.
* ``PUT /kv/<scope>/<key>`` stores the body; ``GET`` returns it (404 while absent); ``DELETE``
  removes it. ``GET /slot/<rank>`` returns the JSON of the rank's slot (host, local and cross
  ranks and sizes).
"""

from horovod.runner.rendezvous.auth import RendezvousError, make_secret
from horovod.runner.rendezvous.client import RendezvousClient
from horovod.runner.rendezvous.server import RendezvousServer

__all__ = ["RendezvousClient", "RendezvousError", "RendezvousServer", "make_secret"]
