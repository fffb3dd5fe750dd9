"""Elastic horovodrun end to end on this machine: real worker processes, real faults.

Hosts are names of this machine ("localhost", "127.0.0.1"), listed by a discovery script that
prints a file the test (or the training itself, at a given step) rewrites. The worker
(``bin/elastic_worker.py``) trains a model whose weights after N steps do not depend on the
number of workers, so after every fault the test checks that training reached its step count,
that every surviving rank holds exactly the weights (and momentum) of N uninterrupted steps (no
committed step lost, none applied twice), and what the driver's log says.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.elastic.conftest import check_training, driver_log, run_elastic

pytestmark = pytest.mark.integration

def test_sigkilled_worker_with_its_host_removed(tmp_path: Path) -> None:
    steps = 40
    res, _ = run_elastic(
        tmp_path, "localhost:2\n127.0.0.1:1\n", ["-np", "3", "--min-np", "2"],
        {"STEPS": str(steps), "KILL": "127.0.0.1[0]@12",
         "HOSTS_AT": json.dumps({"12": "localhost:2\n"})})
    check_training(res, steps, size=2)
    log = driver_log(res)
    assert "worker 127.0.0.1[0] (rank 2) failed (killed by signal 9 (SIGKILL)); blacklisting host " \
           "127.0.0.1" in log, log
    assert re.search(r"round 1: training resumes with 2 workers on localhost:2; gone: "
                     r"127\.0\.0\.1\[0\].*state synced from rank 0", log), log


def test_raising_worker_job_continues_on_remaining_host(tmp_path: Path) -> None:
    steps = 30
    res, _ = run_elastic(tmp_path, "localhost:1\n127.0.0.1:2\n", ["-np", "3", "--min-np", "1"],
                         {"STEPS": str(steps), "RAISE": "localhost[0]@10"})
    finals = check_training(res, steps, size=2)
    assert {f["me"] for f in finals} == {"127.0.0.1[0]", "127.0.0.1[1]"}
    log = driver_log(res)
    assert "worker localhost[0] (rank 0) failed (exit code 1); blacklisting host localhost for " \
           "good" in log, log
    # the raising rank's traceback reaches the user, its internal failure record does not
    assert "[0]<stderr>:" in res.stderr and "__HOROVOD_RANK_ERROR__" not in res.stderr + res.stdout, (
        res.stderr[-3000:])


def test_host_added_mid_training_joins_with_the_state(tmp_path: Path) -> None:
    # The new worker's optimizer has no momentum yet: it must receive rank 0's (upstream #2652).
    steps = 24
    res, _ = run_elastic(
        tmp_path, "localhost:2\n", ["-np", "2", "--min-np", "2", "--max-np", "3"],
        {"STEPS": str(steps), "HOSTS_AT": json.dumps({"5": "localhost:2\n127.0.0.1:1\n"}),
         "WAIT_FOR_SIZE": "3@12"})
    finals = check_training(res, steps, size=3)
    assert "127.0.0.1[0]" in {f["me"] for f in finals}
    log = driver_log(res)
    assert "host 127.0.0.1 appeared in discovery with 1 slot(s)" in log
    assert "new slot(s) 127.0.0.1[0]: telling the workers to take them in" in log
    assert re.search(r"round 1: training resumes with 3 workers on localhost:2, 127\.0\.0\.1:1; "
                     r"new: 127\.0\.0\.1\[0\].*state synced from rank 0", log), log


def test_graceful_shrink_below_min_np_then_new_host_no_deadlock(tmp_path: Path) -> None:
    # Upstream #3494: after a graceful removal the survivors skipped the state sync while the
    # new workers joining the same round waited in it: deadlock. Here the driver tells every
    # member of the round whether to sync.
    steps = 24
    res, _ = run_elastic(
        tmp_path, "localhost:2\n127.0.0.1:1\n", ["-np", "3", "--min-np", "3"],
        {"STEPS": str(steps), "HOSTS_AT": json.dumps({"6": "localhost:2\n"})},
        on_log={"waiting for hosts: 2 slot(s) available": "localhost:2\n127.0.0.2:1\n"})
    finals = check_training(res, steps, size=3)
    assert {f["me"] for f in finals} == {"localhost[0]", "localhost[1]", "127.0.0.2[0]"}
    log = driver_log(res)
    assert "127.0.0.1[0] will leave" in log, log
    assert "waiting for hosts: 2 slot(s) available (localhost:2), --min-np is 3" in log, log
    assert re.search(r"round 1: training resumes with 3 workers on localhost:2, 127\.0\.0\.2:1; "
                     r"new: 127\.0\.0\.2\[0\]; gone: 127\.0\.0\.1\[0\].*state synced from rank 0",
                     log), log


def test_all_workers_failing_ends_the_job_with_a_message(tmp_path: Path) -> None:
    res, _ = run_elastic(tmp_path, "localhost:1\n127.0.0.1:1\n", ["-np", "2", "--min-np", "1"],
                         {"STEPS": "30", "RAISE": "*@5"})
    assert res.returncode != 0
    log = driver_log(res)
    assert "failed (exit code 1); blacklisting host localhost" in log, log
    assert "failed (exit code 1); blacklisting host 127.0.0.1" in log, log
    assert "elastic job failed" in res.stderr and (
        "no worker holds the committed training state" in log or "all 2 workers failed" in log), log
    # the report names one of them with the error its program recorded
    assert re.search(r"root cause: worker (localhost|127\.0\.0\.1)\[0\] \(rank \d\) exit code 1: "
                     r"RuntimeError: worker \S+ raises at step 5", res.stderr), res.stderr[-3000:]


def test_too_few_hosts_for_longer_than_the_timeout(tmp_path: Path) -> None:
    res, _ = run_elastic(tmp_path, "localhost:1\n127.0.0.1:1\n",
                         ["-np", "2", "--min-np", "2", "--elastic-timeout", "4"],
                         {"STEPS": "40", "KILL": "127.0.0.1[0]@5"})
    assert res.returncode != 0
    log = driver_log(res)
    assert "waiting for hosts: 1 slot(s) available (localhost:1), --min-np is 2" in log, log
    assert "too few hosts: only 1 slot(s) available for longer than --elastic-timeout 4 s" in log
    # the killed worker is the root cause, not the survivor the driver stopped
    assert "root cause: worker 127.0.0.1[0] (rank 1) killed by signal 9 (SIGKILL)" in res.stderr, \
        res.stderr[-3000:]


def test_reset_limit_stops_the_job(tmp_path: Path) -> None:
    res, _ = run_elastic(
        tmp_path, "localhost:1\n127.0.0.1:1\n127.0.0.2:1\n",
        ["-np", "3", "--min-np", "1", "--reset-limit", "1"],
        {"STEPS": "40", "KILL": "127.0.0.2[0]@5", "RAISE": "127.0.0.1[0]@12"})
    assert res.returncode != 0
    log = driver_log(res)
    assert "round 1: training resumes with 2 workers" in log, log
    assert "this would be reset number 2, more than --reset-limit 1" in log, log
    # a worker's own error comes before a worker killed earlier (failures.root_cause, as for
    # static jobs); the peers' errors (a member left) are no root cause
    assert re.search(r"root cause: worker 127\.0\.0\.1\[0\] \(rank \d\) exit code 1: RuntimeError: "
                     r"worker 127\.0\.0\.1\[0\] raises at step 12", res.stderr), res.stderr[-3000:]
