"""``DistributedOptimizer``'s gradient bundles (issue 25).

Where the engine holds the hooks' gradients until ``step()`` (``HOROVOD_OVERLAP_GRADIENTS=0``),
a backward pass's gradients are resubmitted as one bundle at its end: one engine submission and
one handle. On the wire each gradient is still its own named, cached allreduce, so:

* training with bundles equals training without them (overlap on: one submission per gradient),
  on every rank, at np=2 and np=3, with a parameter that gets no gradient (reduced as zeros in
  ``step()``, one by one) and with ``backward_passes_per_step=2``;
* ranks may differ in the choice: one bundling, the other submitting gradient by gradient;
* a gradient whose tensor no longer matches its checked request (here: another shape) makes the
  pass fall back to one submission per gradient, with the same values; the next pass bundles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests._shared_launch import JOINT_TIMEOUT, in_turn, joint_launch, under_settings

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _train(overlap_by_rank: list[str], passes: int = 1) -> dict:
    import os

    rank = int(os.environ.get("HOROVOD_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
    os.environ["HOROVOD_OVERLAP_GRADIENTS"] = overlap_by_rank[rank % len(overlap_by_rank)]
    # Bundles are the path of gradients that are separate tensors (flat gradients, the default on
    # CPU, are reduced in grouped buckets instead: tests/multiprocess/test_flat_gradients.py).
    os.environ["HOROVOD_FLAT_GRADIENTS"] = "0"

    import numpy as np
    import torch

    import horovod.torch as hvd
    from horovod.torch import _dense_reducer as hvd_optimizer  # the dense reducer resubmits the bundles

    hvd.init()
    bundles: list[int] = []
    # the original, not an earlier run's counter (in_turn: several runs in one process)
    real = getattr(hvd_optimizer._resubmit_many, "__wrapped__", hvd_optimizer._resubmit_many)

    def counted(tensors, signatures, defer=False, wake=True):
        h = real(tensors, signatures, defer, wake)
        bundles.append(0 if h is None else len(tensors))
        return h

    counted.__wrapped__ = real  # type: ignore[attr-defined]
    hvd_optimizer._resubmit_many = counted
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    unused = torch.nn.Parameter(torch.ones(2))  # never in the loss: reduced as zeros by step()
    scale = torch.nn.Parameter(torch.ones(2))  # changes shape before step 4
    params = list(model.named_parameters()) + [("unused", unused), ("scale", scale)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.05),
                                   named_parameters=params, backward_passes_per_step=passes)
    hvd.broadcast_parameters(model.state_dict(), 0)
    gen = torch.Generator().manual_seed(10 + hvd.rank())
    grads = []
    for step in range(5):
        opt.zero_grad()
        if step == 3:
            # A gradient of another shape than its checked request: no bundle this pass (every
            # gradient goes one by one, the changed one renegotiated); the next pass bundles.
            with torch.no_grad():
                scale.data = torch.ones(3)
        for _ in range(passes):
            x = torch.randn(4, 6, generator=gen)
            (model(x).pow(2).mean() + scale.pow(2).sum() * (1 + hvd.rank())).backward()
        opt.step()
        grads.append([p.grad.double().numpy().copy().ravel().tolist() for _, p in params])
    flat = np.concatenate([p.detach().double().numpy().ravel() for _, p in params])
    return {"bundles": bundles, "params": flat.tolist(), "grads": grads}


def _check(runs: dict[str, list[dict]]) -> None:
    ref = next(iter(runs.values()))[0]
    for label, results in runs.items():
        for r in results:
            assert r["grads"] == ref["grads"], f"{label}: averaged gradients differ from the reference"
            assert r["params"] == ref["params"], f"{label}: parameters differ"


def _spied() -> list[tuple[Any, str]]:
    from horovod.torch import _dense_reducer

    return [(_dense_reducer, "_resubmit_many")]


def _runs(calls: list[tuple[Any, ...]]) -> Callable[[], Any]:
    settings = dict.fromkeys(("HOROVOD_OVERLAP_GRADIENTS", "HOROVOD_FLAT_GRADIENTS"))
    return under_settings(in_turn(_train, calls), settings, _spied)


# Parts of the torch launches at np=2 and np=3 that other modules share (tests/_shared_launch.py).
_LAUNCH = {n: joint_launch("torch", n, {
    "bundles": _runs([(["0"],), (["1"],)]),
    **({"mixed": _runs([(["0", "1"], 2), (["1"], 2)])} if n == 2 else {}),
}, timeout=600 if n == 2 else 300, late=True) for n in (2, 3)}


@pytest.mark.parametrize("np_", [2, 3])
def test_bundled_gradients_train_exactly_as_one_by_one(np_: int) -> None:
    # both runs in one launch, each from a fresh hvd.init()
    runs = dict(zip(("0", "1"), zip(*_LAUNCH[np_].results("bundles"))))
    _check(runs)
    for r in runs["0"]:
        # Step 1 takes the checked path; steps 2, 3 and 5 bundle every gradient that the loss
        # reaches (5 of 6 parameters); step 4 falls back (a gradient of a new shape).
        assert r["bundles"] == [5, 5, 0, 5], r["bundles"]
    for r in runs["1"]:
        assert r["bundles"] == [], "overlapped gradients must start one by one during backward"


def test_ranks_may_differ_in_bundling_and_accumulate_passes() -> None:
    runs = dict(zip(("mixed", "one by one"), zip(*_LAUNCH[2].results("mixed"))))
    _check(runs)
    assert runs["mixed"][0]["bundles"] == [5, 5, 0, 5], runs["mixed"][0]["bundles"]
    assert runs["mixed"][1]["bundles"] == []
