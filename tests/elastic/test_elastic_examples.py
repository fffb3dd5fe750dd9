"""The elastic examples run under elastic horovodrun and learn (a worker joins mid-run).

The second worker is added only once the first has trained all ``--epochs`` epochs alone (the
slowest a new worker can come, forced, whatever the machine's speed): ``--finish-with-workers 2``
keeps the example training until an epoch ends with it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.elastic.conftest import REPO, driver_log, run_elastic, write_hosts

pytestmark = pytest.mark.integration

EPOCHS = 3


@pytest.mark.parametrize("script,args", [
    ("pytorch_digits_elastic.py", ["--batch-sleep", "0.02"]),
    ("keras_digits_elastic.py", []),
])
def test_example_trains_and_takes_in_a_new_worker(tmp_path: Path, script: str,
                                                  args: list[str]) -> None:
    worker = REPO / "examples" / "elastic" / script
    last_alone = f"[0]<stdout>:epoch {EPOCHS - 1}: 1 workers"
    added: list[str] = []

    def on_stdout(line: str) -> None:
        if not added and line.startswith(last_alone):
            added.append(line)
            write_hosts(tmp_path / "hosts", "localhost:1\n127.0.0.1:1\n")

    res, _ = run_elastic(tmp_path, "localhost:1\n", ["-np", "1", "--min-np", "1", "--max-np", "2"],
                         {}, timeout=300, worker=worker,
                         worker_args=["--epochs", str(EPOCHS), "--finish-with-workers", "2", *args],
                         on_stdout=on_stdout)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    assert added, f"the first worker never ended epoch {EPOCHS - 1} alone:\n{out[-5000:]}"
    m = re.search(r"done: test accuracy ([0-9.]+) on (\d) workers", res.stdout)
    assert m, out[-5000:]
    assert float(m.group(1)) > 0.6, m.group(0)  # chance: 0.1
    assert m.group(2) == "2", "the second worker did not join: " + driver_log(res)
    # it trained with the first: an epoch after the last one alone ended on two workers
    assert re.search(r"epoch \d+: 2 workers", res.stdout.split(added[0], 1)[1]), res.stdout[-3000:]
