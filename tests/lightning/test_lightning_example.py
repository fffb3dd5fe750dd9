"""examples/pytorch/pytorch_lightning_mnist.py under ``horovodrun -np 2``: it trains (upstream's
callback checks pass on every rank), rank 0 alone reports and writes the checkpoint."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                 reason="the `lightning` package is not installed")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "pytorch", "pytorch_lightning_mnist.py")


def test_lightning_mnist_example_under_horovodrun(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable, EXAMPLE,
                          "--epochs", "4", "--output-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    # upstream's callback: counts and asserts on both ranks
    assert out.count("Training ends") == 2 and out.count("A train epoch ended.") == 8, out[-3000:]
    acc = re.findall(r"Test set: Average loss: [0-9.]+, Accuracy: ([0-9.]+)%", out)
    assert len(acc) == 1, f"only rank 0 reports:\n{out[-3000:]}"
    assert float(acc[0]) > 70.0, out[-3000:]
    assert re.search(r"^\[0\]<stdout>:Checkpoints: \['epoch=3-step=\d+\.ckpt'\]$", out, re.MULTILINE), out[-3000:]
    assert os.listdir(tmp_path / "checkpoint") == [re.search(r"'(epoch=3-step=\d+\.ckpt)'", out).group(1)]
    assert (tmp_path / "logger").is_dir()
