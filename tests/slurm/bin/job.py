"""A Horovod job for the srun tests: ``python job.py MODE [ARG]``, started by srun or horovodrun.

``values``: allreduce, allgather and broadcast on the torch binding; prints one line per rank
``JOB {json}`` with the ranks, the Slurm variables and the results (checked by the test).
``fail R``: rank R raises after init while the others run an allreduce.
``wait PATH``: prints ``READY {json}`` (rank 0: the step's ids, and the store's address and the
store's and key service's ports task 0 bound), waits until PATH exists, then does ``values`` (the
test probes the running job meanwhile).
"""

import json
import os
import sys
import time

import torch

import horovod.torch as hvd
from horovod.common import protocol
from horovod.common.context import get_context

mode = sys.argv[1]
hvd.init()
r, n = hvd.rank(), hvd.size()
if mode == "fail" and r == int(sys.argv[2]):
    raise ValueError(f"task {r} fails on purpose")
if mode == "wait":
    if r == 0:
        launch = get_context().launch
        print("READY " + json.dumps({"job": os.environ.get("SLURM_JOB_ID"), "step": os.environ.get("SLURM_STEP_ID"),
                                     "addr": launch.master_addr, "port": launch.master_port,
                                     "key_port": launch.key_port}), flush=True)
    while not os.path.exists(sys.argv[2]):  # the test creates it once it has probed the job
        time.sleep(0.05)
s = hvd.allreduce(torch.arange(4, dtype=torch.float64) + r, op=hvd.Sum)
g = hvd.allgather(torch.full((r + 1,), float(r)))
b = hvd.broadcast(torch.tensor([float(r)]), root_rank=n - 1)
# The secret the device plane keys its stores with (None: it would send a random key instead).
plane_keyed = protocol.job_secret(get_context().backend) is not None
print("JOB " + json.dumps({
    "rank": r, "size": n, "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
    "cross_size": hvd.cross_size(), "procid": os.environ.get("SLURM_PROCID"),
    "localid": os.environ.get("SLURM_LOCALID"), "launcher": get_context().launch.launcher,
    "plane_keyed": plane_keyed, "sum": s.tolist(), "gather": g.tolist(), "bcast": b.item()}), flush=True)
hvd.shutdown()
