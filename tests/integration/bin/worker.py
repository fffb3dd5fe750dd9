"""A small worker for launcher tests; what it does is chosen by arguments.

    worker.py ident                 print this rank's identity (from the launcher's variables)
    worker.py allreduce             hvd.init(), allreduce, print RESULT {json} with topology
    worker.py reinit                hvd.init/allreduce/shutdown three times, print ROUND {json}
    worker.py wait-file PATH        print "waiting", wait (30 s max) for PATH, print "done"
    worker.py output                write partial lines, unicode, progress-bar carriage returns
    worker.py fail RANK CODE DIR    rank RANK exits with CODE after writing to stderr; the others
                                    start a grandchild (printing its pid), mark DIR/started.<r>
                                    and sleep; rank RANK fails once every other rank has marked
                                    (however late a loaded machine starts them)
    worker.py kill RANK DIR         like fail, but rank RANK is killed by SIGKILL
    worker.py sigint DIR            print "ready", then wait; on SIGINT/SIGTERM write its name to
                                    DIR/rank<r>, print "got <SIGNAL>" and exit 7
    worker.py env NAME...           print NAME=value for each NAME
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time


def env_rank() -> int:
    for var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def env_size() -> int:
    for var in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if var in os.environ:
            return int(os.environ[var])
    return 1


def main(argv: list[str]) -> int:
    what = argv[0]
    rank = env_rank()
    if what == "ident":
        print("IDENT " + json.dumps({"rank": rank, "host": socket.gethostname(),
                                     "env": {k: v for k, v in os.environ.items()
                                             if k.startswith("HOROVOD_") and k != "HOROVOD_SECRET_KEY"}}))
        return 0
    if what == "allreduce":
        import numpy as np

        import horovod.numpy as hvd

        hvd.init()
        total = hvd.allreduce(np.arange(4, dtype=np.float64) + hvd.rank(), op=hvd.Sum)
        print("RESULT " + json.dumps({
            "rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
            "cross_size": hvd.cross_size(), "sum": total.tolist(), "host": socket.gethostname()}),
            flush=True)
        hvd.shutdown()
        return 0
    if what == "reinit":
        import numpy as np

        import horovod.numpy as hvd

        for i in range(3):
            hvd.init()
            total = hvd.allreduce(np.full(2, float(hvd.rank() + i)), op=hvd.Sum)
            print("ROUND " + json.dumps({"rank": hvd.rank(), "round": i, "sum": total.tolist()}),
                  flush=True)
            hvd.shutdown()
        return 0
    if what == "wait-file":
        path = argv[1]
        print("waiting", flush=True)
        deadline = time.monotonic() + 30
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                print("timed out waiting: output was not forwarded live", file=sys.stderr)
                return 5
            time.sleep(0.05)
        print("done", flush=True)
        return 0
    if what == "output":
        out = sys.stdout
        out.write("part-")
        out.flush()
        time.sleep(0.1)
        out.write("one\n")
        out.write("héllo ✓ 日本\n")
        out.write("10%\r20%\r100%\n")
        out.write("no newline at end")
        out.flush()
        sys.stderr.write(f"err from {rank}\n")
        return 0
    if what in ("fail", "kill"):
        bad, marks = int(argv[1]), argv[-1]
        if rank == bad:
            others = [os.path.join(marks, f"started.{r}") for r in range(env_size()) if r != bad]
            deadline = time.monotonic() + 60
            while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
                time.sleep(0.05)
            print(f"rank {rank} is failing on purpose", file=sys.stderr, flush=True)
            if what == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            return int(argv[2])
        child = subprocess.Popen(["sleep", "300"])
        print(f"GRANDCHILD {child.pid}", flush=True)
        open(os.path.join(marks, f"started.{rank}"), "w").close()
        time.sleep(120)
        return 0
    if what == "sigint":
        report_dir = argv[1]

        def on_int(signum: int, frame: object) -> None:
            # Also to a file: mpirun stops forwarding output once it is terminating the job.
            with open(os.path.join(report_dir, f"rank{rank}"), "w") as fh:
                fh.write(signal.Signals(signum).name)
            print(f"got {signal.Signals(signum).name}", flush=True)
            os._exit(7)

        signal.signal(signal.SIGINT, on_int)
        signal.signal(signal.SIGTERM, on_int)
        print("ready", flush=True)
        time.sleep(120)
        return 0
    if what == "env":
        for name in argv[1:]:
            print(f"{name}={os.environ.get(name, '<unset>')}")
        return 0
    raise SystemExit(f"unknown action {what}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
