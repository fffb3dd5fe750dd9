"""A Gloo job whose rank 1 starts late: it waits for ``PROBE_DIR/go`` before ``hvd.init()``, so
rank 0 sits in the store waiting for it while the test floods every port the job listens on.
Every rank prints ``LATE rank <r> size <n> sum <s> ok <bool>``.
"""

import os
import pathlib
import time

import numpy as np

import horovod.numpy as hvd

probe = pathlib.Path(os.environ["PROBE_DIR"])
if os.environ.get("HOROVOD_RANK") == "1":
    deadline = time.monotonic() + 300
    while not (probe / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
hvd.init()
s = hvd.allreduce(np.full(4, hvd.rank() + 1.0), op=hvd.Sum, name="late.sum")
want = hvd.size() * (hvd.size() + 1) / 2
print(f"LATE rank {hvd.rank()} size {hvd.size()} sum {s[0]:g} ok {bool((s == want).all())}",
      flush=True)
hvd.shutdown()
