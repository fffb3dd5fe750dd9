"""``examples/ray/``: the PyTorch recipe launched by ``RayExecutor`` on the shared Ray cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pytorch_digits_example_learns_with_identical_weights(free_cluster, tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "ray", "pytorch_digits_ray.py"),
         "--address", free_cluster.cluster.address, "--num-workers", "2", "--epochs", "3",
         "--checkpoint", str(tmp_path / "ckpt.pt")],
        capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = re.findall(r"RESULT rank=(\d) size=(\d) local_rank=(\d) accuracy=([\d.]+) weights=(\w+)",
                         proc.stdout)
    assert [r[0] for r in results] == ["0", "1"], proc.stdout
    assert all(r[1] == "2" for r in results)
    assert len({r[4] for r in results}) == 1, results  # identical weights on both ranks
    assert float(results[0][3]) > 0.7, results  # it learned (chance is 0.1)
    assert (tmp_path / "ckpt.pt").exists()  # rank 0 wrote its checkpoint
