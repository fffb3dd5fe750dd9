"""A job that keeps running collectives until the prober says it is done (issue 24's probe tests).

Environment: PROBE_DIR (rank 0 writes ``ready`` there once the job is in the state to probe, and
the job ends after the prober writes ``done``); ELASTIC_TARGET: run elastic, and be ready only
once the job has re-formed with that many workers (the test adds a host after ``started``).
Every rank prints ``PROBED rank <r> size <n> sum <s> ok <bool>`` at the end.
"""

import os
import pathlib
import time

import torch

import horovod.torch as hvd

probe = pathlib.Path(os.environ["PROBE_DIR"])
target = int(os.environ.get("ELASTIC_TARGET", "0"))


def step() -> bool:
    """One allreduce checked on every rank; True when rank 0 saw ``done`` (broadcast: all leave together)."""
    s = hvd.allreduce(torch.full((4,), hvd.rank() + 1.0), op=hvd.Sum, name="probe.sum")
    want = hvd.size() * (hvd.size() + 1) / 2
    assert s.tolist() == [want] * 4, (s, want)
    if hvd.rank() == 0:
        if target and hvd.size() < target:
            (probe / "started").write_text("1")
        elif not (probe / "ready").exists():
            (probe / "ready").write_text("1")
    done = torch.tensor([1.0 if hvd.rank() == 0 and (probe / "done").exists() else 0.0])
    time.sleep(0.02)  # pacing only: the job idles between steps while it is probed
    return bool(hvd.broadcast(done, root_rank=0, name="probe.done").item())


hvd.init()
if target:
    state = hvd.elastic.TorchState(steps=0)

    @hvd.elastic.run
    def train(state) -> None:  # noqa: ANN001
        while True:
            finished = step()
            state.steps += 1
            state.commit()
            if finished and hvd.size() == target:
                return

    train(state)
else:
    while not step():
        pass
s = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="probe.final").item()
print(f"PROBED rank {hvd.rank()} size {hvd.size()} sum {s:g} ok {s == hvd.size()}", flush=True)
hvd.shutdown()
