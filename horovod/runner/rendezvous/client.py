"""Client of the rendezvous service (defined with the protocol in ``horovod.common.rendezvous``)."""

from __future__ import annotations

from horovod.common.rendezvous import RendezvousClient

__all__ = ["RendezvousClient"]
