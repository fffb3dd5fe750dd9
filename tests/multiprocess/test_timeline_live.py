"""A running job's timeline holds its collectives while the job runs, without a shutdown flushing it
(each allreduce's events are in the file before any rank may go on; the wait is generous, so the
test holds on a loaded machine; how soon they appear is a measurement, not asserted here)."""

from __future__ import annotations

import json

import pytest

from horovod.testing import run_ranks

pytestmark = pytest.mark.multiprocess


def _read_while_running(path):
    import time

    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    delays = []
    for step in range(5):  # back to back, as a training loop does
        name = f"live_sum_{step}"
        hvd.allreduce(np.arange(3.0), name=name)
        if hvd.rank() == 0:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 60.0:
                with open(path) as fh:
                    text = fh.read()
                try:
                    events = json.loads(text)  # a JSON array whenever a write is not racing
                except ValueError:
                    time.sleep(0.005)
                    continue
                names = {e.get("name") for e in events} | {
                    e.get("args", {}).get("name") for e in events if e.get("ph") == "M"}
                if {f"allreduce.{name}", "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START"} <= names:
                    delays.append(time.monotonic() - t0)
                    break
                time.sleep(0.005)
            else:
                delays.append(None)  # never there while the job ran
        hvd.barrier()  # nobody shuts down (which would flush) before rank 0 has looked
    return delays


@pytest.mark.parametrize("np_", [2, 3])
def test_timeline_events_are_in_the_file_while_the_job_runs(tmp_path, np_):
    path = str(tmp_path / "timeline.json")
    res = run_ranks(_read_while_running, np=np_, timeout=120, args=(path,),
                    env={"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    delays = res[0]
    assert len(delays) == 5 and None not in delays, (
        "an allreduce's events never reached the timeline file while the job ran: " + repr(delays))
