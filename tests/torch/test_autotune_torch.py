"""Autotune on real ranks, started by horovodrun's flags: it changes the engine's knobs identically on
every rank, writes upstream's CSV, ends on its best sample, and training stays exactly right while
the knobs change under it (same weights as one process on the whole batch)."""

from __future__ import annotations

import csv
import sys

import pytest

from horovod.testing import run_ranks

pytestmark = pytest.mark.multiprocess


def _train():
    import copy

    import torch

    import horovod.torch as hvd
    from horovod.common.context import get_context

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                              torch.nn.Linear(32, 2))
    model = copy.deepcopy(ref)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    knobs, bad = [], []
    engine = get_context().engine
    for step in range(40):
        x, y = torch.randn(4 * n, 8, generator=g), torch.randn(4 * n, 2, generator=g)
        opt.zero_grad()
        ((model(x[4 * r:4 * r + 4]) - y[4 * r:4 * r + 4]) ** 2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        sum(((ref(x[4 * k:4 * k + 4]) - y[4 * k:4 * k + 4]) ** 2).mean() for k in range(n)).div(n).backward()
        ref_opt.step()
        knobs.append(tuple(sorted(engine.tunables.as_dict().items())))
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if not torch.allclose(p, q, atol=1e-5):
                bad.append(f"step {step}: {name} differs by {(p - q).abs().max().item():.3g}")
                break
    return {"knobs": knobs, "bad": bad, "active": engine._autotune.active, "applied": engine._autotune.applied,
            "history": engine._autotune.history if r == 0 else None}


@pytest.mark.parametrize("controller", ["--mpi", "--gloo"])
def test_autotune_tunes_identically_everywhere_and_training_stays_exact(tmp_path, controller):
    log = tmp_path / "autotune.csv"
    launcher = [sys.executable, "-m", "horovod.runner", controller, "-np", "2", "--autotune",
                "--autotune-log-file", str(log), "--autotune-warmup-samples", "1",
                "--autotune-steps-per-sample", "2", "--autotune-bayes-opt-max-samples", "6"]
    results = run_ranks(_train, np=2, timeout=180, launcher=launcher)
    for res in results:
        assert res["bad"] == []
        assert not res["active"], "tuning did not finish within 40 steps"
    # Every rank applied the same parameters after the same number of operations.
    assert results[0]["applied"] == results[1]["applied"], "ranks applied different knobs"
    assert results[0]["knobs"][-1] == results[1]["knobs"][-1]
    assert len(set(results[0]["knobs"])) > 1, "autotune never changed a knob"
    history = results[0]["history"]
    assert [h["phase"] for h in history].count("sample") == 6 and history[-1]["phase"] == "best"
    final = dict(results[0]["knobs"][-1])
    for k in ("fusion_threshold", "chunk_bytes", "cycle_time_ms", "cache_enabled"):
        assert final[k] == history[-1][k]
    rows = list(csv.reader(open(log)))
    assert rows[0][:7] == ["hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce", "cache_enabled",
                           "cycle_time_ms", "tensor_fusion_threshold", "score"]
    assert len(rows) == 1 + 6 + 1
    assert rows[-1][:7] in [row[:7] for row in rows[1:-1]], "the best row is not one of the samples"
