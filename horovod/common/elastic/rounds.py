"""An elastic worker meets its job round by round: the elastic round's rendezvous handler and the
join loop that builds the transport of each round.

``hvd.init()`` of an elastic worker (``HOROVOD_ELASTIC=1``) asks the elastic driver for its place
in the next round (``horovod.common.elastic.worker.join_round``) and meets the round's other
members under that round's scope of the launcher's rendezvous service (:class:`RoundHandler`, the
way ``horovod.common.rendezvous_handlers.HorovodHandler`` meets a static job's ranks). A round that
fails to form (a member died while it formed, and the driver abandoned it) is left for the next
one, so a failure elsewhere never crashes this worker.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from horovod.common import protocol
from horovod.common.backends.gloo import gloo_checks
from horovod.common.config import EngineConfig
from horovod.common.elastic import worker as elastic_worker
from horovod.common.exceptions import HorovodInternalError
from horovod.common.rendezvous import RendezvousClient
from horovod.common.rendezvous_handlers import StoreRendezvous, horovod_store, single_store

if TYPE_CHECKING:
    from horovod.common.backends.gloo import GlooBackend

__all__ = ["RoundHandler", "create_gloo"]

log = logging.getLogger("horovod")


class RoundHandler:
    """The members of one elastic round (``info``) meet under the round's scope; ``cancel`` (the
    driver abandoned the round) closes the store, which ends this member's waits on it."""

    def __init__(self, config: EngineConfig, environ: Mapping[str, str], info: protocol.RoundInfo,
                 cancel: elastic_worker.Cancel) -> None:
        self.config, self.environ, self.info, self.cancel = config, environ, info, cancel

    def next_rendezvous(self) -> StoreRendezvous:
        slot = self.info.slot
        if slot.size == 1:
            return single_store(self.environ, slot.rank)
        return horovod_store(self.config, self.environ, protocol.round_scope(self.info.round),
                             slot.rank, slot.size, on_store=lambda store: self.cancel.on_cancel(store.close))


def _build(config: EngineConfig, handler: RoundHandler) -> GlooBackend:
    from horovod.common.backends.gloo import GlooBackend

    return GlooBackend(config, handler.next_rendezvous())


def create_gloo(config: EngineConfig, environ: Mapping[str, str], comm: Any = None) -> GlooBackend:
    """Join the driver's next round and build its Gloo transport (retrying with the next round).

    Raises:
        WorkerRemovedError, JobStoppedError: the driver left this worker out, or ended the job.
        HorovodInternalError: the driver cannot be reached.
        ValueError, BackendUnavailableError: see ``gloo_checks``.
    """
    from horovod.common.backends.gloo import GlooBackend

    gloo_checks(comm)

    client = RendezvousClient.from_env(environ)
    while True:
        info = elastic_worker.join_round(client, environ)  # type: ignore[arg-type]
        try:
            # Waits on the round's members (store, Gloo device, process group) end within a
            # fraction of a second when the driver abandons the round (a member died or left).
            cancel = elastic_worker.Cancel()
            return elastic_worker.form_round(
                functools.partial(_build, config, RoundHandler(config, environ, info, cancel)),
                client, info, close=GlooBackend.close, cancel=cancel)
        except HorovodInternalError as exc:
            log.warning("elastic: round %d did not form (%s); asking the driver for the next one",
                        info.round, exc)
            elastic_worker.set_ready_reason("retry")
