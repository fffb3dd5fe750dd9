"""The same LightningModule under ``strategy="horovod"`` (horovodrun, np=2) and Lightning's own
``strategy="ddp"`` (torchrun, np=2, Gloo on CPU): the final weights of every configuration agree.

One launch per strategy runs all configurations of tests/lightning/parity_job.py in turn; the
tests below compare the files the two launches wrote (each rank's weights and a summary)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None
                                 or importlib.util.find_spec("sklearn") is None,
                                 reason="needs lightning and scikit-learn (pip install 'horovod-py[test]')")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "lightning", "parity_job.py")
CONFIGS = ("plain", "accumulate", "clip", "bf16_mixed", "adam_steplr", "manual_two_opt", "early_stopping")
TOL = 1e-4



@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("parity"))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    launches = {
        "horovod": [sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable, JOB,
                    "--strategy", "horovod", "--out", out],
        "ddp": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", JOB,
                "--strategy", "ddp", "--out", out],
    }
    for name, cmd in launches.items():
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
        assert res.returncode == 0, f"the {name} launch failed:\n" + (res.stdout + res.stderr)[-6000:]
    return out


def _weights(out: str, strategy: str, config: str) -> list:
    import torch

    return [torch.load(os.path.join(out, f"{strategy}-{config}-r{rank}.pt")) for rank in range(2)]


def _summary(out: str, strategy: str, rank: int) -> dict:
    with open(os.path.join(out, f"{strategy}-r{rank}.json")) as f:
        return json.load(f)


def _max_diff(a, b) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("config", CONFIGS)
def test_weights_match_ddp(runs, config):
    hvd_w, ddp_w = _weights(runs, "horovod", config), _weights(runs, "ddp", config)
    for rank in range(2):
        diff = _max_diff(hvd_w[rank], ddp_w[rank])
        print(f"PARITY {config} rank {rank}: max |horovod - ddp| = {diff:.3g}")
        assert diff <= TOL, f"{config}: rank {rank}'s weights differ from DDP's by {diff:.3g} (> {TOL})"
    assert _max_diff(hvd_w[0], hvd_w[1]) == 0.0, f"{config}: the Horovod ranks disagree"


def test_trained_and_configs_differ(runs):
    """The configurations really change training (else matching DDP would prove little)."""
    first = {c: _weights(runs, "horovod", c)[0] for c in CONFIGS}
    for i, a in enumerate(CONFIGS):
        for b in CONFIGS[i + 1:]:
            if {a, b} == {"plain", "early_stopping"}:
                continue  # both stop after 2 epochs of the same SGD; early stopping checked below
            assert _max_diff(first[a], first[b]) > 1e-4, f"{a} and {b} trained alike"


def test_test_predict_and_early_stopping_match(runs):
    for rank in range(2):
        h, d = _summary(runs, "horovod", rank), _summary(runs, "ddp", rank)
        assert h["test"] == pytest.approx(d["test"], abs=1e-6), (h["test"], d["test"])
        assert h["test"]["test_acc"] > 0.5
        assert h["predict"] == d["predict"], f"rank {rank}: trainer.predict differs from DDP's"
        assert len(h["predict"]) == 384 // 2  # this rank's shard
        assert h["early_stopping_epoch"] == d["early_stopping_epoch"] == 2  # stopped before max_epochs=6
        assert h["adam_lr"] == d["adam_lr"] == pytest.approx(0.01 * 0.5 ** 3)


def test_checkpoint_resume_restores_everything(runs):
    """Adam's moments, StepLR's state and the epoch come back from the checkpoint: the resumed run
    ends where the uninterrupted one (and DDP's) did."""
    resumed, continuous = _weights(runs, "horovod", "adam_steplr_resumed"), _weights(runs, "horovod", "adam_steplr")
    ddp = _weights(runs, "ddp", "adam_steplr")
    for rank in range(2):
        assert _max_diff(resumed[rank], continuous[rank]) <= 1e-6
        assert _max_diff(resumed[rank], ddp[rank]) <= TOL
        s = _summary(runs, "horovod", rank)
        assert s["resumed"]["epoch"] == s["continuous"]["epoch"] == 3
        assert s["resumed"]["step"] == s["continuous"]["step"]
        assert s["resumed"]["lr"] == pytest.approx(0.01 * 0.5 ** 3)
        assert set(s["resumed"]["adam_steps"]) == {s["continuous"]["step"]}, s["resumed"]


def test_manual_optimization_with_plain_backward(runs):
    """loss.backward() in place of self.manual_backward: the step still averages every optimizer's
    gradients first."""
    plain, ddp = _weights(runs, "horovod", "manual_two_opt_loss_backward"), _weights(runs, "ddp", "manual_two_opt")
    for rank in range(2):
        assert _max_diff(plain[rank], ddp[rank]) <= TOL
