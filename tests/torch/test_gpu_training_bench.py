"""benchmarks/gpu_training.py runs end to end on the CPU (``--cpu-smoke``: tiny models, Gloo, the
device plane's CPU twin) at np=2, so that the GPU machine's check does not find a broken script.
It launches two ranks under mpirun (the slow tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_training_cpu_smoke_reports_every_model_precision_and_mode(tmp_path):
    out = tmp_path / "lines.jsonl"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_training.py"), "--cpu-smoke",
                           "--np", "2", "--steps", "1", "--warmup", "1", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    rows = {(r["model"], r["precision"], r["mode"]): r for r in lines if not r.get("summary")}
    summaries = {(r["model"], r["precision"]): r for r in lines if r.get("summary")}
    for model, unit in (("resnet50", "images_per_s"), ("transformer", "tokens_per_s")):
        for precision in ("fp32", "amp"):
            for mode in ("hvd", "ddp", "local"):
                r = rows[(model, precision, mode)]
                assert r["np"] == 2 and r["step_ms"] > 0 and r[unit] > 0, r
                assert r["forward_ms"] >= 0 and r["backward_ms"] >= 0 and r["optimizer_ms"] >= 0, r
            assert summaries[(model, precision)]["hvd_over_ddp"] > 0
