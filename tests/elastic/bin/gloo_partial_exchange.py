"""One of three Gloo ranks whose third member stops half-way through a point-to-point exchange.

``python gloo_partial_exchange.py RANK PORT`` (the test starts ranks 0, 1 and 2 and SIGKILLs
rank 2 once it is stopped). Every rank builds ``GlooBackend`` on one ``TCPStore`` (Gloo timeout
60 s) and takes part in one ``exchange_rows`` (the negotiation's exchange, ``engine/carry.py``).
Then, as when a worker is stopped (SIGSTOP) by the kernel in the middle of a round:

- rank 2 exchanges its row with rank 1 only, prints ``STOPPING`` and stops itself;
- rank 1 has every row of that round (it goes on) and enters the next exchange, where it waits
  for rank 0;
- rank 0 still waits for rank 2's row; when rank 2 is killed its exchange fails. It keeps the
  error (as the engine keeps a failure for the handles it fails, and a user may keep the
  exception), closes the backend (what ``hvd.shutdown()`` does at an elastic reset) and stays
  alive for 90 s (as a survivor waiting for the next round).

Rank 1 must fail as soon as rank 0 has closed: its process group is gone, so are its connections.
Prints ``EXCHANGED``, ``CLOSED <monotonic time>``, ``FAILED <monotonic time> <error>`` (rank 1)
or ``NOT FAILED``.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from horovod.common.backends import gloo
from horovod.common.config import EngineConfig
from horovod.common.exceptions import HorovodInternalError
from horovod.common.rendezvous_handlers import StoreRendezvous

KEPT: list[BaseException] = []


def main() -> int:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=120))
    config = EngineConfig.from_env({"HOROVOD_GLOO_TIMEOUT_SECONDS": "60"})
    backend = gloo.GlooBackend(config, StoreRendezvous(store=store, rank=rank, size=3, address="127.0.0.1"))
    row = np.full(16, rank + 1, np.uint8)
    rows = backend.exchange_rows(row)
    assert [int(r[0]) for r in rows] == [1, 2, 3], rows
    if rank == 2:  # a round half done: its row reached rank 1 (and rank 1's reached it), not rank 0
        pg = backend.world_group().handle
        got = torch.empty(16, dtype=torch.uint8)
        send = pg.send([torch.from_numpy(row)], 1, gloo._ROWS_TAG)
        pg.recv([got], 1, gloo._ROWS_TAG).wait()
        send.wait()
        print("STOPPING", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(120)
        return 1
    if rank == 1:
        backend.exchange_rows(row)  # rank 2's row came before it stopped
        print("EXCHANGED", flush=True)
        try:
            backend.exchange_rows(row)  # rank 0 never comes to this one: it failed and closed
        except HorovodInternalError as exc:
            print(f"FAILED {time.monotonic():.3f} {exc}", flush=True)
        else:
            print("NOT FAILED", flush=True)
        backend.close()
        return 0
    try:
        backend.exchange_rows(row)  # waits for rank 2, which stopped before sending to rank 0
    except HorovodInternalError as exc:
        KEPT.append(exc)
    backend.close()
    print(f"CLOSED {time.monotonic():.3f} {KEPT[0] if KEPT else 'no error'}", flush=True)
    time.sleep(90)  # a survivor waiting for the next round: the test ends it
    return 0


if __name__ == "__main__":
    sys.exit(main())
