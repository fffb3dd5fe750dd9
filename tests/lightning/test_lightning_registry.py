"""Registration of "horovod" in each Lightning package's registry, and which package
``HorovodStrategy()`` builds for (one fresh interpreter: the point is what gets imported when)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None or importlib.util.find_spec("pytorch_lightning") is None,
    reason="needs both Lightning 2 distributions (pip install 'horovod-py[lightning]')")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import json, sys
import horovod.lightning as hl
out = {"at_import": hl.registered_packages(), "lightning_imported": "lightning.pytorch" in sys.modules}
import pytorch_lightning as PL                       # imported after horovod.lightning (isort order)
out["after_pl"] = hl.registered_packages()
out["pl_registry"] = "horovod" in PL.strategies.StrategyRegistry
s = hl.HorovodStrategy()                             # only pytorch_lightning is imported: its class
out["pl_instance"] = isinstance(s, PL.strategies.ParallelStrategy) and isinstance(s, hl.HorovodStrategy)
t = PL.Trainer(strategy="horovod", accelerator="cpu", logger=False, enable_progress_bar=False)
out["pl_trainer"] = [type(t.strategy).__name__, t.world_size, t.global_rank]
try:
    PL.Trainer(accelerator="horovod")                # Lightning 1.x's spelling
except ValueError as e:
    out["pl_accelerator"] = str(e)
out["pl_accel_listed"] = "horovod" in PL.accelerators.AcceleratorRegistry.available_accelerators()
import lightning.pytorch as L
out["after_both"] = sorted(hl.registered_packages())
out["l_registry"] = "horovod" in L.strategies.StrategyRegistry
try:
    L.Trainer(accelerator="horovod", logger=False)
except ValueError as e:
    out["l_accelerator"] = str(e)
try:
    L.Trainer(accelerator="nosuch")                  # Lightning's own message, "horovod" not usable
except ValueError as e:
    out["l_unknown"] = str(e)
s2 = hl.HorovodStrategy()                            # both imported: lightning.pytorch
s3 = hl.HorovodStrategy(package="pytorch_lightning")
out["default_both"] = isinstance(s2, L.strategies.ParallelStrategy) and not isinstance(s2, PL.strategies.Strategy)
out["explicit_pl"] = isinstance(s3, PL.strategies.ParallelStrategy)
out["subclass"] = issubclass(hl.strategy_class("lightning.pytorch"), hl.HorovodStrategy)
try:
    hl.strategy_class("lightning.fabric")
except ValueError as e:
    out["bad_package"] = str(e)
from horovod.lightning.strategy import _hvd_op
import horovod.torch as hvd
import torch.distributed as dist
out["ops"] = [_hvd_op("mean") == hvd.Average, _hvd_op("SUM") == hvd.Sum, _hvd_op(dist.ReduceOp.SUM) == hvd.Sum,
              _hvd_op(dist.ReduceOp.MAX) == hvd.Max, _hvd_op(None) == hvd.Average]
try:
    _hvd_op("median")
except ValueError as e:
    out["bad_op"] = str(e)
print("RESULT " + json.dumps(out))
"""


def test_registration_and_package_choice():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180, env=env)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stdout[-2000:] + res.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["at_import"] == [] and out["lightning_imported"] is False, "horovod.lightning must not import Lightning"
    assert out["after_pl"] == ["pytorch_lightning"] and out["pl_registry"]
    assert out["pl_instance"]
    assert out["pl_trainer"] == ["HorovodStrategy", 1, 0]
    assert out["after_both"] == ["lightning.pytorch", "pytorch_lightning"] and out["l_registry"]
    assert out["default_both"] and out["explicit_pl"] and out["subclass"]
    assert "unknown Lightning package 'lightning.fabric'" in out["bad_package"]
    assert out["ops"] == [True] * 5
    # accelerator="horovod" cannot choose a strategy in Lightning 2: it says which spelling does
    for key in ("pl_accelerator", "l_accelerator"):
        assert "strategy='horovod'" in out[key] and "Lightning 1.x" in out[key], out.get(key)
    assert out["pl_accel_listed"]
    assert "invalid accelerator name" in out["l_unknown"]
    assert "unsupported reduce_op 'median'" in out["bad_op"]
