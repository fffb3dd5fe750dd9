"""The elastic examples run under elastic horovodrun and learn (a worker joins mid-run)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.elastic.conftest import REPO, driver_log, run_elastic

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("script,args", [
    ("pytorch_digits_elastic.py", ["--epochs", "3", "--batch-sleep", "0.02"]),
    ("keras_digits_elastic.py", ["--epochs", "3"]),
])
def test_example_trains_and_takes_in_a_new_worker(tmp_path: Path, script: str,
                                                  args: list[str]) -> None:
    worker = REPO / "examples" / "elastic" / script
    res, _ = run_elastic(tmp_path, "localhost:1\n", ["-np", "1", "--min-np", "1", "--max-np", "2"],
                         {}, timeout=300, worker=worker, worker_args=args,
                         on_log={"round 0:": "localhost:1\n127.0.0.1:1\n"})
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    m = re.search(r"done: test accuracy ([0-9.]+) on (\d) workers", res.stdout)
    assert m, out[-5000:]
    assert float(m.group(1)) > 0.6, m.group(0)  # chance: 0.1
    assert m.group(2) == "2", "the second worker did not join: " + driver_log(res)
