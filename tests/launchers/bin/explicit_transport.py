"""hvd.init() with whatever transport the environment names, under whatever launcher started it.

Prints ``JOINED rank <r> size <n> sum <s> transport <gloo|mpi|local>`` (an allreduce of rank+1)
for each of ``argv[1]`` (default 1) init/shutdown cycles, or
``REFUSED <launcher's rank> <error type>: <message>`` and exits 3.
"""

import os
import sys

import torch

import horovod.torch as hvd
from horovod.common.exceptions import HorovodError

launcher_rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("RANK") or "?"
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1):
    try:
        hvd.init()
    except HorovodError as exc:
        print(f"REFUSED {launcher_rank} {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    s = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
    transport = "gloo" if hvd.gloo_enabled() else "mpi" if hvd.mpi_enabled() else "local"
    print(f"JOINED rank {hvd.rank()} size {hvd.size()} sum {s:g} transport {transport}", flush=True)
    hvd.shutdown()
