"""Elastic Keras (``model.fit`` with the elastic callbacks) end to end on this machine."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.elastic.conftest import driver_log, run_elastic, tagged

pytestmark = pytest.mark.integration

KERAS_WORKER = Path(__file__).resolve().parent / "bin" / "elastic_keras_worker.py"
sys.path.insert(0, str(KERAS_WORKER.parent))


def test_keras_fit_takes_in_a_new_host_with_unbuilt_optimizer(tmp_path: Path) -> None:
    # Upstream #2652: the new worker's optimizer has no slot variables yet; its state sync must
    # not wait in broadcasts the trained workers never make.
    from elastic_keras_worker import reference

    spe, epochs = 6, 4
    res, _ = run_elastic(
        tmp_path, "localhost:1\n", ["-np", "1", "--min-np", "1", "--max-np", "2"],
        {"STEPS_PER_EPOCH": str(spe), "EPOCHS": str(epochs),
         "HOSTS_AT": json.dumps({"4": "localhost:1\n127.0.0.1:1\n"}), "WAIT_FOR_SIZE": "2@8"},
        timeout=240, worker=KERAS_WORKER)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    finals = tagged(res.stdout, "FINAL")
    assert sorted(f["me"] for f in finals) == ["127.0.0.1[0]", "localhost[0]"], out[-4000:]
    # each rank trained on its own batch: the weights are the reference's only if every committed
    # step averaged the gradients of all the ranks of its time (``sizes``), once
    sizes = finals[0]["sizes"]
    assert len(sizes) == spe * epochs and set(sizes) == {1, 2}, sizes
    want = reference(sizes)
    for f in finals:
        assert f["size"] == 2 and f["epoch"] == epochs and f["iterations"] == spe * epochs, f
        assert f["sizes"] == sizes and f["w"] == finals[0]["w"], (f, finals[0])
        for got, exp in zip(f["w"], want):
            assert got == pytest.approx(exp, abs=1e-5), (
                f"{f['me']}: weights after steps at sizes {sizes} differ from the reference")
    log = driver_log(res)
    assert re.search(r"round 1: training resumes with 2 workers .*new: 127\.0\.0\.1\[0\].*"
                     r"state synced from rank 0", log), log
