"""Engine pacing at size 1 (plain python): background rounds and the MPI wait policy."""

from __future__ import annotations

import os
import subprocess
import sys

_CODE = r"""
import sys, time
import numpy as np
import horovod.numpy as hvd
from horovod.common.context import get_context
hvd.init()
eng = get_context().engine
rounds = []
orig = eng._round
def counted(new, shutdown):
    rounds.append(time.perf_counter())
    return orig(new, shutdown)
eng._round = counted
time.sleep(0.1)
rounds.clear()
handles = []
mode = sys.argv[1]
for i in range(10):
    before = len(rounds)
    handles.append(hvd.allreduce_async(np.ones(4), name=f"t{i}"))
    if mode == "each":  # nobody waits: the engine thread must start a round of its own
        t0 = time.monotonic()
        while len(rounds) == before and time.monotonic() - t0 < 60:
            time.sleep(0.001)
window = len(rounds)
for h in handles:
    hvd.synchronize(h)
print(window)
"""


def _background_rounds(cycle_ms: str, mode: str) -> int:
    env = {**os.environ, "HOROVOD_CYCLE_TIME": cycle_ms, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", _CODE, mode], capture_output=True, text=True, env=env,
                         timeout=180)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().splitlines()[-1])


def test_background_rounds_run_without_a_caller_and_wait_for_the_cycle():
    # Outcomes, not durations (they hold on a loaded machine): with nobody waiting, each
    # submission is taken by a round the engine thread starts itself (within a generous 60 s);
    # 10 submissions back to back with a 10 s cycle: the first starts a round, the rest wait for
    # the next cycle (at most one more round before anyone waits).
    assert _background_rounds("1", "each") >= 10
    assert _background_rounds("10000", "burst") <= 2


def test_mpi_backend_makes_open_mpi_yield_while_waiting_unless_the_user_chose():
    code = ("import os, horovod.numpy as hvd; hvd.init(); "
            "print(os.environ.get('OMPI_MCA_mpi_yield_when_idle'))")
    for preset, want in [(None, "1"), ("0", "0")]:
        env = {k: v for k, v in os.environ.items() if k != "OMPI_MCA_mpi_yield_when_idle"}
        if preset is not None:
            env["OMPI_MCA_mpi_yield_when_idle"] = preset
        env["PYTHONPATH"] = os.getcwd()
        env["HOROVOD_CONTROLLER"] = "mpi"  # a singleton MPI job
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == want


def test_a_caller_waiting_drives_at_once_whatever_the_cycle():
    # A blocking op must not wait for the background cycle.
    # 20 blocking ops with a 10 s cycle: together they take less than one cycle (each would wait
    # for the next cycle otherwise, 200 s in all), a bound that holds at load 10.
    code = ("import time, numpy as np, horovod.numpy as hvd; hvd.init(); hvd.allreduce(np.ones(2), name='w'); "
            "t = time.perf_counter(); [hvd.allreduce(np.ones(2), name=f'b{i}') for i in range(20)]; "
            "print(time.perf_counter() - t)")
    env = {**os.environ, "HOROVOD_CYCLE_TIME": "10000", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) < 10.0



_EMPTY = r"""
import time
import numpy as np
import horovod.numpy as hvd
from horovod.common.context import get_context
hvd.init()
eng = get_context().engine
empty = []
orig = eng._round
def counted(new, shutdown):
    if not new and not eng.rounds.pending and not shutdown:
        empty.append(time.perf_counter())
    return orig(new, shutdown)
eng._round = counted
x = np.ones(4)
hvd.synchronize(hvd.allreduce_async(x, name="t"))
empty.clear()
t0 = time.perf_counter()
for i in range(30):
    hvd.synchronize(hvd.allreduce_async(x, name="t"))  # wakes the engine thread; the caller drives
    time.sleep(0.01)
print(len(empty), time.perf_counter() - t0)
"""


def test_no_empty_round_after_a_step_its_caller_drove():
    # A submission wakes the engine thread; the caller that then waits drives the round itself.
    # The engine thread, finding nothing left to do, must not run an empty round of its own a
    # cycle later (on a real job every peer pairs it with one of theirs: a whole exchange for
    # nothing, in the next step's way). Empty rounds come from the idle tick only: at most one
    # per 50 ms of the run (+2), where each of the 30 steps used to add one.
    env = {**os.environ, "HOROVOD_CYCLE_TIME": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", _EMPTY], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr
    empty, seconds = out.stdout.split()
    assert int(empty) <= float(seconds) / 0.05 + 2, (empty, seconds)
