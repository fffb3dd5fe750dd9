"""Rank 0 of an elastic round whose other member never comes; the driver abandons the round.

Rank 0 opens the round's store and waits in Gloo's process-group creation for rank 1. The
"driver" (a thread here, watching the rendezvous server) writes the round's abandon key once rank 0
has published its store. ``form_round`` must raise at once, the build must end (the store it
waits on is closed), and the process must then exit 0 well before Gloo's own timeout, without
aborting in interpreter finalization. Prints ``ABANDONED <seconds>`` and ``ORPHAN_ALIVE <bool>``.
"""

from __future__ import annotations

import sys
import threading
import time

from horovod.common.backends.gloo import GlooBackend
from horovod.common.config import EngineConfig
from horovod.common.elastic import worker as elastic_worker
from horovod.common.elastic.rounds import RoundHandler
from horovod.common.exceptions import HorovodInternalError
from horovod.common.protocol import ABANDONED_KEY, STORE_KEY, RankIdentity, RoundInfo, round_scope
from horovod.common.rendezvous import RendezvousClient
from horovod.runner.rendezvous.server import RendezvousServer
from horovod.runner.secret import make_secret


def main() -> int:
    secret = make_secret()
    with RendezvousServer(secret) as server:
        env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
               "HOROVOD_GLOO_RENDEZVOUS_PORT": str(server.port), "HOROVOD_SECRET_KEY": secret,
               "HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_GLOO_TIMEOUT_SECONDS": "100"}
        config = EngineConfig.from_env(env)
        info = RoundInfo(1, RankIdentity(hostname="localhost", rank=0, local_rank=0, cross_rank=0, size=2,
                     local_size=1, cross_size=2), skip_sync=False, notice=0)

        def driver() -> None:  # the member's peer died: give the round up once rank 0 waits in it
            while server.get(round_scope(info.round), STORE_KEY) is None:
                time.sleep(0.02)
            server.put(round_scope(info.round), ABANDONED_KEY, b"worker b[0] (rank 1) died")

        threading.Thread(target=driver, daemon=True).start()
        client = RendezvousClient("127.0.0.1", server.port, secret)
        cancel = elastic_worker.Cancel()
        t0 = time.monotonic()
        try:
            elastic_worker.form_round(
                lambda: GlooBackend(config, RoundHandler(config, env, info, cancel).next_rendezvous()),
                client, info,
                close=GlooBackend.close, cancel=cancel)
        except HorovodInternalError as exc:
            print(f"ABANDONED {time.monotonic() - t0:.2f} {exc}", flush=True)
        else:
            print("FORMED (unexpected)", flush=True)
            return 1
        orphans = [t for t in threading.enumerate() if t.name == "horovod-elastic-round-1"]
        for t in orphans:
            t.join(10)
        print(f"ORPHAN_ALIVE {any(t.is_alive() for t in orphans)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
