"""A rank whose engine stops wakes every waiting caller with HorovodInternalError (issue 26).

The transport fails in the middle of a batch (as Gloo does with "Connection closed by peer"): the
entries of that very batch, those still pending and those queued must all be failed, whichever
thread waits on them (a blocking call, a handle waited on by another thread, a join).
"""

from __future__ import annotations

import os
import subprocess
import sys

_CODE = r"""
import threading
import numpy as np
import horovod.numpy as hvd
from horovod.common.context import get_context
from horovod.common.exceptions import HorovodInternalError
hvd.init()
eng = get_context().engine
real_run = eng._executor.run
def broken(batch, entries):
    if any("boom" in r.name for r in batch):
        raise RuntimeError("Gloo allreduce failed: Connection closed by peer")
    return real_run(batch, entries)
eng._executor.run = broken
hvd.allreduce(np.ones(2), name="warm")
results = {}
def waiter(tag, fn):
    try:
        fn()
        results[tag] = "returned"
    except HorovodInternalError as exc:
        results[tag] = type(exc).__name__
other = hvd.allreduce_async(np.ones(3), name="other")
threads = [threading.Thread(target=waiter, args=("other", lambda: hvd.synchronize(other)))]
threads[0].start()
waiter("boom", lambda: hvd.allreduce(np.ones(2), name="boom"))
threads[0].join(10)
waiter("after", lambda: hvd.allreduce(np.ones(2), name="after"))
print(sorted(results.items()))
"""


def test_engine_stop_in_a_batch_wakes_every_waiter():
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "HOROVOD_CYCLE_TIME": "50"}
    out = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    got = out.stdout.strip().splitlines()[-1]
    # "other" may have completed before "boom" broke the engine; it must never hang.
    assert "('boom', 'HorovodShutdownError')" in got, got
    assert "('after', 'HorovodShutdownError')" in got, got
    assert "('other', " in got, got
