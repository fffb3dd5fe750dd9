"""A binding's elastic warm-up runs in hvd.init(), before the worker first asks the driver for a round,
once; importing the binding only registers it (``horovod.torch.elastic``: ``torch._dynamo``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from horovod.common.elastic import worker as elastic_worker
from horovod.common.protocol import RankIdentity, RoundInfo

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


class _Driver:
    """Answers every ``ready`` with the next round; records what had run when it was asked."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.rounds = 0

    def call(self, name: str, request: Any, timeout: float = 0.0) -> dict[str, Any]:
        self.events.append(f"ready {self.rounds}")
        self.rounds += 1
        return RoundInfo(self.rounds, RankIdentity("h", 0, 0, 0, 1, 1, 1), False, 0).to_wire()


def test_warm_ups_run_once_before_the_first_ready_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic_worker, "_current", None)
    monkeypatch.setattr(elastic_worker, "_warm_ups", {})
    # no heartbeat thread in the test process: its calls are not the ready requests counted here
    monkeypatch.setattr(elastic_worker.heartbeat, "start_heartbeat", lambda *args, **kwargs: None)
    events: list[str] = []
    elastic_worker.warm_up_before_joining("a", lambda: events.append("warm a"))
    elastic_worker.warm_up_before_joining("a", lambda: events.append("warm a again"))  # one per name

    def broken() -> None:
        events.append("warm b")
        raise RuntimeError("no such module")

    elastic_worker.warm_up_before_joining("b", broken)
    driver = _Driver(events)
    environ: dict[str, str] = {}
    elastic_worker.join_round(driver, environ)  # type: ignore[arg-type]
    elastic_worker.join_round(driver, environ)  # type: ignore[arg-type]
    # a failing warm-up costs nothing but the warm-up; the second round runs none
    assert events == ["warm a", "warm b", "ready 0", "ready 1"]


def test_importing_horovod_torch_in_an_elastic_worker_loads_no_dynamo() -> None:
    pytest.importorskip("torch")
    code = ("import sys, json, torch; import horovod.torch\n"
            "from horovod.common.elastic import worker\n"
            "print(json.dumps({'dynamo': 'torch._dynamo' in sys.modules, 'warm_ups': sorted(worker._warm_ups)}))")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOROVOD_ELASTIC": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"dynamo": False, "warm_ups": ["torch._dynamo"]}, result
