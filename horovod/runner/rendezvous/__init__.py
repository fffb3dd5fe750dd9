"""The launcher's rendezvous service: a small key-value store over HTTP, authenticated per job.

The protocol (request signing, answer signatures, paths) and the client are defined once, in
``horovod.common.rendezvous``, which the workers (Gloo backend, ``run_task``, elastic workers) and
this server all import.
"""

from horovod.common.rendezvous import RendezvousClient, RendezvousError, make_secret
from horovod.runner.rendezvous.server import RendezvousServer

__all__ = ["RendezvousClient", "RendezvousError", "RendezvousServer", "make_secret"]
