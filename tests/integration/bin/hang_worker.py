"""A training loop that hangs on purpose, for tests/integration/test_hangs.py.

    hang_worker.py MODE FIFO

Three steps of allreduce 'grad.w' on every rank, then step 3:

stuck       rank 2's ``load_batch`` blocks reading FIFO (nobody ever writes it) while the others
            wait in allreduce 'grad.w'; the stall shutdown ends the job
desync      rank 2 reduces 'grad.b' while the others reduce 'grad.a'; the stall shutdown ends it
usr1        rank 2's ``load_batch`` blocks reading FIFO until the test writes to it (after it has
            seen every rank's stacks); the others wait in allreduce 'grad.w'; the job then ends
            normally
sigstop     rank 2 stops itself (SIGSTOP) while the others wait in allreduce 'grad.w'; the
            test sends SIGCONT once rank 0 has reported it stopped, and the job ends normally
all_stacks  as usr1, but rank 0 (before its own step 3) collects every rank's stacks with
            ``horovod.common.stacks.all_stacks()``, prints them, and writes the FIFO itself

Prints ``STUCK <time>`` when rank 2 starts waiting, ``READY`` (rank 0) once every rank has
done three steps, ``DONE <rank> <value>`` at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import numpy as np

import horovod.numpy as hvd


def load_batch(step: int, mode: str, fifo: str) -> np.ndarray:
    if hvd.rank() == 2 and step == 3 and mode == "sigstop":
        print(f"STOPPING {os.getpid()}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # until the test sends SIGCONT
    if hvd.rank() == 2 and step == 3 and mode in ("stuck", "usr1", "all_stacks"):
        print(f"STUCK {time.time():.3f}", flush=True)
        with open(fifo, "rb") as fh:  # blocks until a writer comes (in "stuck": never)
            fh.read(1)
    return np.full(4, hvd.rank() + 1, np.float32)


def main() -> None:
    mode, fifo = sys.argv[1], sys.argv[2]
    hvd.init()
    for _ in range(3):
        hvd.allreduce(np.ones(4, np.float32), name="grad.w")
    hvd.barrier()
    if hvd.rank() == 0:
        print("READY", flush=True)
    if mode == "all_stacks" and hvd.rank() == 0:
        from horovod.common.stacks import all_stacks

        deadline = time.monotonic() + 60
        while True:  # until rank 2 is in load_batch and rank 1 waits in its allreduce
            stacks = all_stacks(timeout=20)
            if "load_batch" in stacks[2] and re.search(r"(submitted|negotiated) +allreduce 'allreduce.grad.w'",
                                                       stacks[1]):
                break
            assert time.monotonic() < deadline, stacks
            time.sleep(0.2)
        print("ALL_STACKS " + json.dumps({str(k): v for k, v in stacks.items()}), flush=True)
        with open(fifo, "wb") as fh:
            fh.write(b"x")
    x = load_batch(3, mode, fifo)
    name = "grad.w"
    if mode == "desync":
        name = "grad.b" if hvd.rank() == 2 else "grad.a"
    out = hvd.allreduce(x, name=name, op=hvd.Sum)
    print(f"DONE {hvd.rank()} {float(out[0])}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
