"""Elastic training across separate hosts (network namespaces with their own address, host name
and sshd: ``tests/_fakehosts.py``). horovodrun runs inside the first host and starts the
workers of the others over ssh, as across real machines; a host "dies" when every process in it
is killed."""

from __future__ import annotations

import json
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests._fakehosts import FakeHosts
from tests.elastic.conftest import check_training, driver_log, run_elastic, write_hosts

pytestmark = [pytest.mark.integration, pytest.mark.fakehosts]

Factory = Callable[..., FakeHosts]


def test_host_killed_survivors_on_other_hosts_go_on(fakehosts_factory: Factory,
                                                    tmp_path: Path) -> None:
    # Upstream #3264: killing one host's workers made the workers on the other hosts fail too.
    fh = fakehosts_factory(3)
    h1, h2, h3 = fh.hosts
    steps = 40
    killed = threading.Event()

    def on_stdout(line: str) -> None:
        m = re.search(r"COMMIT (\{.*\})", line)
        if m and json.loads(m.group(1))["step"] >= 8 and not killed.is_set():
            killed.set()
            write_hosts(tmp_path / "hosts", f"{h1}:1\n{h2}:1\n")
            fh.kill_host_processes(h3, signal.SIGKILL)

    res, _ = run_elastic(tmp_path, f"{h1}:1\n{h2}:1\n{h3}:1\n", ["-np", "3", "--min-np", "2"],
                         {"STEPS": str(steps), "STEP_SLEEP": "0.15"}, timeout=240,
                         popen=lambda argv, **kw: fh.popen(h1, argv, **kw), on_stdout=on_stdout)
    assert killed.is_set()
    finals = check_training(res, steps, size=2)
    assert {f["me"] for f in finals} == {f"{h1}[0]", f"{h2}[0]"}
    log = driver_log(res)
    assert re.search(rf"worker {h3}\[0\] \(rank 2\) failed \(.*\); blacklisting host {h3}", log), log
    assert f"blacklisting host {h1}" not in log and f"blacklisting host {h2}" not in log, log
    assert "round 1: training resumes with 2 workers" in log, log


def test_host_added_and_worker_raising_on_another_host(fakehosts_factory: Factory,
                                                       tmp_path: Path) -> None:
    fh = fakehosts_factory(3)
    h1, h2, h3 = fh.hosts
    steps = 30
    res, _ = run_elastic(
        tmp_path, f"{h1}:1\n{h2}:1\n", ["-np", "2", "--min-np", "1", "--max-np", "3"],
        {"STEPS": str(steps), "HOSTS_AT": json.dumps({"4": f"{h1}:1\n{h2}:1\n{h3}:1\n"}),
         "WAIT_FOR_SIZE": "3@10", "RAISE": f"{h2}[0]@18"}, timeout=240,
        popen=lambda argv, **kw: fh.popen(h1, argv, **kw))
    finals = check_training(res, steps, size=2)
    assert {f["me"] for f in finals} == {f"{h1}[0]", f"{h3}[0]"}
    log = driver_log(res)
    assert f"host {h3} appeared in discovery" in log, log
    assert re.search(rf"round 1: training resumes with 3 workers .*new: {h3}\[0\]", log), log
    assert f"worker {h2}[0] (rank 1) failed (exit code 1); blacklisting host {h2}" in log, log
    assert re.search(rf"round 2: training resumes with 2 workers on {h1}:1, {h3}:1", log), log
