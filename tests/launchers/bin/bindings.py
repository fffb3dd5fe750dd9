"""One binding's hvd.init() under whatever launcher started this process; prints a check line.

``python bindings.py torch|numpy|tensorflow``: allreduce of rank+1 and a broadcast from the last
rank; prints ``BINDING <name> rank <r> size <n> local <lr>/<ls> cross <cr>/<cs> sum <s> bcast <b>``.
"""

import sys

import numpy as np

which = sys.argv[1]
if which == "torch":
    import torch

    import horovod.torch as hvd

    hvd.init()
    s = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
    b = hvd.broadcast(torch.tensor([float(hvd.rank())]), root_rank=hvd.size() - 1).item()
elif which == "numpy":
    import horovod.numpy as hvd

    hvd.init()
    s = float(hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)[0])
    b = float(hvd.broadcast(np.array([float(hvd.rank())]), root_rank=hvd.size() - 1)[0])
else:
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    s = float(hvd.allreduce(tf.constant([hvd.rank() + 1.0]), op=hvd.Sum).numpy()[0])
    b = float(hvd.broadcast(tf.constant([float(hvd.rank())]), root_rank=hvd.size() - 1).numpy()[0])
print(f"BINDING {which} rank {hvd.rank()} size {hvd.size()} local {hvd.local_rank()}/{hvd.local_size()} "
      f"cross {hvd.cross_rank()}/{hvd.cross_size()} sum {s:g} bcast {b:g}", flush=True)
hvd.shutdown()
