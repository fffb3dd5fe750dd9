"""Gradients held until the optimizer waits (HOROVOD_OVERLAP_GRADIENTS=0) vs reduced in the background (=1).

Both must train to the same parameters on every rank; a deferred operation nobody waits for still
completes (after ``DEFER_LIMIT_S``), and one a caller waits for starts at once.
"""

from __future__ import annotations

import pytest

from tests._shared_launch import JOINT_TIMEOUT, in_turn, joint_launch, under_settings

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _train(overlap: str) -> dict:
    import os
    import time

    os.environ["HOROVOD_OVERLAP_GRADIENTS"] = overlap  # read by hvd.init()

    import numpy as np
    import torch

    import horovod.torch as hvd
    from horovod.common.context import get_context
    from horovod.common.engine.loop import DEFER_LIMIT_S

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 300), torch.nn.ReLU(), torch.nn.Linear(300, 5))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), 0)
    gen = torch.Generator().manual_seed(1 + hvd.rank())
    for _ in range(4):
        opt.zero_grad()
        x = torch.randn(8, 20, generator=gen)
        torch.nn.functional.mse_loss(model(x), torch.zeros(8, 5)).backward()
        opt.step()
    engine = get_context().engine
    params = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    # A deferred operation that nobody waits for: it completes after DEFER_LIMIT_S anyway.
    h = hvd.allreduce_async_(torch.ones(3), name="probe", op=hvd.Sum)
    req = get_context().handles[h][0].request
    hvd.synchronize(h)
    t = torch.ones(3)
    buf = [t.numpy()]
    handle = get_context().prepare(req).submit(buf, buf, defer=True)
    t0 = time.monotonic()
    while not handle.done() and time.monotonic() - t0 < DEFER_LIMIT_S + 10:
        time.sleep(0.05)
    waited = time.monotonic() - t0
    return {"params": params.tolist(), "overlap": engine.tunables.overlap, "probe_done": handle.done(),
            "probe": t.tolist(), "waited": waited}


# Both runs, each from a fresh hvd.init(), a late body of the shared torch launch at np=2
# (tests/_shared_launch.py; the setting put back afterwards).
_RUNS = under_settings(in_turn(_train, [("0",), ("1",)]), {"HOROVOD_OVERLAP_GRADIENTS": None})
_LAUNCH = joint_launch("torch", 2, {"runs": _RUNS},
                       timeout=300, late=True)


def test_deferred_and_overlapped_gradients_train_alike() -> None:
    runs = dict(zip(("0", "1"), zip(*_LAUNCH.results("runs"))))
    for overlap, results in runs.items():
        for r in results:
            assert r["overlap"] is (overlap == "1"), r
            assert r["params"] == results[0]["params"], "ranks differ"
            assert r["params"] == runs["0"][0]["params"], "deferred and overlapped gradients trained differently"
            assert r["probe_done"] and r["probe"] == [2.0, 2.0, 2.0], r
    for r in runs["0"]:
        assert r["waited"] > 1.0, f"a deferred op started without a waiter after {r['waited']:.2f} s"
