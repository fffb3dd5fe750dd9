"""An abandoned round's connection attempt ends with the round, not at Gloo's timeout.

A worker of an elastic round whose peer died waits in Gloo's process-group creation, on the
round's store. When the driver abandons the round, the worker moves on at once (tested in
tests/unit/runner/test_elastic_driver.py); this file checks that the thread still building the
abandoned round also ends at once (the round's store is closed under it), instead of waiting in
Gloo's C++ code until its timeout. A thread still there when the interpreter finalizes can abort
the process ("terminate called without an active exception"), which turned a finished elastic
job into a failed one (seen in tests/elastic/test_elastic_faults.py on a loaded machine).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from horovod.common.elastic import worker as elastic_worker

SCRIPT = Path(__file__).resolve().parent / "bin" / "abandoned_round_exit.py"
REPO = Path(__file__).resolve().parents[2]


def test_the_abandoned_build_ends_with_the_round_and_the_process_exits_cleanly() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True,
                         timeout=240)
    wall = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "ABANDONED" in res.stdout and "b[0] (rank 1) died" in res.stdout, out
    # The script joins the build for 10 s; Gloo's own timeout there is 100 s, which a build left
    # waiting in Gloo would add to the run (the bound leaves room for a loaded machine's start-up).
    assert "ORPHAN_ALIVE False" in res.stdout, out
    assert wall < 90, (wall, out)


def test_cancel_runs_each_hook_once_and_late_hooks_at_once() -> None:
    cancel = elastic_worker.Cancel()
    calls: list[str] = []
    cancel.on_cancel(lambda: calls.append("a"))
    cancel.on_cancel(lambda: (_ for _ in ()).throw(OSError("already closed")))  # best effort
    assert calls == [] and not cancel.cancelled
    cancel.cancel()
    cancel.cancel()
    assert calls == ["a"] and cancel.cancelled
    cancel.on_cancel(lambda: calls.append("late"))  # a store made after the round was given up
    assert calls == ["a", "late"]


def test_form_round_cancels_the_build_when_the_driver_gives_the_round_up() -> None:
    from horovod.common.exceptions import HorovodInternalError
    from horovod.common.protocol import ABANDONED_KEY, RankIdentity, RoundInfo
    from horovod.common.rendezvous import RendezvousClient
    from horovod.runner.rendezvous.server import RendezvousServer
    from horovod.runner.secret import make_secret

    info = RoundInfo(7, RankIdentity(hostname="h", rank=1, local_rank=0, cross_rank=1, size=2,
                     local_size=1, cross_size=2), skip_sync=False, notice=0)
    secret = make_secret()
    cancel = elastic_worker.Cancel()
    woken = threading.Event()

    def build() -> str:  # waits on "the store" until its wait is cut short
        cancel.on_cancel(woken.set)
        server.put("elastic.7", ABANDONED_KEY, b"b[0] died")
        if not woken.wait(60):
            return "timed out"
        raise HorovodInternalError("the store was closed")

    with RendezvousServer(secret) as server:
        client = RendezvousClient("127.0.0.1", server.port, secret)
        t0 = time.monotonic()
        with pytest.raises(HorovodInternalError, match="round 7 was abandoned"):
            elastic_worker.form_round(build, client, info, cancel=cancel)
        # woken by the abandon notice, not by its own 60 s timeout (a bound that holds at load 10)
        assert woken.wait(30) and time.monotonic() - t0 < 30
    thread = next(t for t in elastic_worker._orphans if t.name == "horovod-elastic-round-7")
    thread.join(5)
    assert not thread.is_alive()
