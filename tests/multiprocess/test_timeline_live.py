"""A running job's timeline holds its collectives a fraction of a second after they complete."""

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
            while time.monotonic() - t0 < 2.0:
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
                    break
                time.sleep(0.005)
            delays.append(time.monotonic() - t0)
        hvd.barrier()  # nobody shuts down (which would flush) before rank 0 has looked
    return delays


@pytest.mark.parametrize("np_", [2, 3])
def test_timeline_events_are_in_the_file_while_the_job_runs(tmp_path, np_):
    path = str(tmp_path / "timeline.json")
    res = run_ranks(_read_while_running, np=np_, timeout=120, args=(path,),
                    env={"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    delays = res[0]
    assert max(delays) < 0.15, (
        "an allreduce's events reached the timeline file after "
        + ", ".join(f"{d:.3f}" for d in delays) + " s (5 allreduces back to back)")
