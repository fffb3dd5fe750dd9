"""A training loop in which one rank fails at step 3; how and where is chosen by arguments.

    fail_at_step.py HOW WHERE RANK

HOW:   exit3   sys.exit(3)
       raise   an uncaught RuntimeError("rank R fails on purpose")
       sigkill the process kills itself with SIGKILL
WHERE: busy    the failing rank fails between steps while the others compute (not in a collective)
       outside the failing rank fails between steps while the others wait for it in an allreduce
       inside  the failing rank is waiting in an allreduce (the others compute) when it fails
               (from a signal handler, or a thread for sigkill)
       slowexit the failing rank raises, then on its way out shuts Horovod down (the others get
               HorovodShutdownError and end first) and hangs for 20 s: the report must still
               name it, not the ranks that ended first
Prints ``FAILING <rank> <time>`` just before failing. Ranks that do not fail print ``DONE``.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time

import numpy as np

import horovod.numpy as hvd


def fail(how: str, rank: int) -> None:
    print(f"FAILING {rank} {time.time():.3f}", flush=True)
    if how == "exit3":
        sys.exit(3)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"rank {rank} fails on purpose")


def main(how: str, where: str, bad: int) -> None:
    hvd.init()
    rank = hvd.rank()
    if where == "slowexit" and rank == bad:
        def slow_exit() -> None:  # registered after hvd.init(): runs before Horovod's exit step
            hvd.shutdown()
            time.sleep(20)
        atexit.register(slow_exit)
    for step in range(6):
        if step == 3 and rank == bad:
            if where in ("busy", "slowexit"):
                fail(how, rank)
            elif where == "outside":
                time.sleep(1.0)  # the others are in the allreduce by now
                fail(how, rank)
            elif where == "inside":
                if how == "sigkill":
                    threading.Timer(1.0, fail, args=(how, rank)).start()
                else:
                    signal.signal(signal.SIGALRM, lambda *_: fail(how, rank))
                    signal.alarm(1)
        elif step == 3 and where in ("busy", "inside"):
            time.sleep(60)  # computing, not in a collective (the whole job, if RANK is no rank)
        hvd.allreduce(np.ones(4), name=f"grad{step}")
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
