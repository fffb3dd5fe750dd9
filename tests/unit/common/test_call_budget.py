"""The Python calls one small blocking collective costs, counted (not timed).

A blocking allreduce of a few bytes is all fixed cost: the caller's thread checks the call,
submits it, and drives the round itself (the AND of the cache bits, the batch, the reduction, the
observers' hooks). Each Python-level call there is ~0.1 us, and they add up unnoticed: a blocking
4-byte ``horovod.numpy`` allreduce took 114 calls on 2026-11-28, 133 two days later (+10-25%
latency at np=2), 107 after that was won back. Counting calls with ``sys.setprofile`` is exact
where a timing would be noise on a loaded machine (the median of 11 blocks of 20 calls, so that
a round the engine thread happened to drive is not counted); each operation's budget below is
its count of 2026-11-28. Raising one needs a measurement of what the new calls buy
(``benchmarks/gradsync_limit.py --case latency``, ``benchmarks/step_cost.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# Python calls per blocking operation (its own lambda included): the counts of 2026-11-28
BUDGETS = {
    "numpy allreduce": 114, "numpy allreduce_": 116, "numpy grouped_allreduce_": 117,
    "torch allreduce": 141, "torch allreduce_": 92, "torch grouped_allreduce_": 93,
    "torch allreduce_async_ + synchronize": 91,
}

_CODE = r"""
import json, sys
import numpy as np
import torch
import horovod.numpy as hvd
import horovod.torch as htorch
hvd.init()
x, t = np.ones(1, np.float32), torch.ones(1)
xs, ts = [np.ones(3, np.float32) for _ in range(4)], [torch.ones(3) for _ in range(4)]
ops = {
    "numpy allreduce": lambda: hvd.allreduce(x, name="lat", op=hvd.Average),
    "numpy allreduce_": lambda: hvd.allreduce_(x, name="lat_", op=hvd.Sum),
    "numpy grouped_allreduce_": lambda: hvd.grouped_allreduce_(xs, name="g", op=hvd.Average),
    "torch allreduce": lambda: htorch.allreduce(t, name="t", op=htorch.Average),
    "torch allreduce_": lambda: htorch.allreduce_(t, name="t_", op=htorch.Sum),
    "torch grouped_allreduce_": lambda: htorch.grouped_allreduce_(ts, name="tg", op=htorch.Average),
    "torch allreduce_async_ + synchronize":
        lambda: htorch.synchronize(htorch.allreduce_async_(t, name="ta", op=htorch.Sum)),
}
calls = {}
for name, op in ops.items():
    for _ in range(50):  # the cache slot filled, the step memo warm
        op()
    count = [0]
    def prof(frame, event, arg):
        if event == "call":
            count[0] += 1
    blocks = []
    for _ in range(11):  # the median block: a round the engine thread happened to drive (the
        count[0] = 0     # caller then waits, a few calls more) is an outlier, not the count
        sys.setprofile(prof)
        for _ in range(20):
            op()
        sys.setprofile(None)
        blocks.append(count[0] / 20)
    calls[name] = sorted(blocks)[5]
print(json.dumps(calls))
"""


def test_small_blocking_collectives_stay_within_their_call_budgets() -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for var in ("HOROVOD_TIMELINE", "HOROVOD_AUTOTUNE", "HOROVOD_CACHE_CAPACITY"):
        env.pop(var, None)
    out = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    calls = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(calls) == set(BUDGETS), calls
    over = {k: (v, BUDGETS[k]) for k, v in calls.items() if v > BUDGETS[k]}
    assert not over, (f"Python calls per blocking op over budget, (calls, budget): {over}; all: {calls}. A new "
                      "layer on the per-operation path (see this module's docstring)")
