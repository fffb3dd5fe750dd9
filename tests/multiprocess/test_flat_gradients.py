"""``DistributedOptimizer``'s flat gradients (``HOROVOD_FLAT_GRADIENTS``, default on; issue 48).

The CPU gradients of each dtype are views of one flat buffer, reduced in buckets (one grouped
in-place allreduce each, one span on the wire). Checked on real ranks, on Gloo and MPI:

* training with flat gradients gives the same gradients and weights as every gradient its own
  tensor (``HOROVOD_FLAT_GRADIENTS=0``), at np=2 and np=3, with ``zero_grad`` both setting the
  gradients to None and zeroing them, a parameter that gets no gradient on one rank only, a float64
  parameter (its own buffer), a sparse embedding gradient (reduced densified in its bucket) and
  ``backward_passes_per_step=2``;
* after each step every float32 gradient is a view of the same buffer and each bucket was one
  grouped request;
* ranks may differ in ``HOROVOD_OVERLAP_GRADIENTS`` (one starts each bucket as it completes, the
  other holds them to the end of the pass): the requests are the same, so are the values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests._shared_launch import JOINT_TIMEOUT, in_turn, joint_launch, under_settings

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _train(flat_by_rank: list[str], overlap_by_rank: list[str], passes: int = 1) -> dict:
    import os

    rank = int(os.environ.get("HOROVOD_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
    os.environ["HOROVOD_FLAT_GRADIENTS"] = flat_by_rank[rank % len(flat_by_rank)]
    os.environ["HOROVOD_OVERLAP_GRADIENTS"] = overlap_by_rank[rank % len(overlap_by_rank)]

    import numpy as np
    import torch

    import horovod.torch as hvd
    from horovod.torch import _dense_reducer

    hvd.init()
    grouped: list[int] = []
    # the original, not an earlier run's counter (in_turn: several runs in one process)
    real = getattr(_dense_reducer.grouped_allreduce_async_, "__wrapped__", _dense_reducer.grouped_allreduce_async_)

    def counted(tensors, *a, **k):
        grouped.append(len(tensors))
        return real(tensors, *a, **k)

    counted.__wrapped__ = real  # type: ignore[attr-defined]
    _dense_reducer.grouped_allreduce_async_ = counted
    torch.manual_seed(0)
    embed = torch.nn.Embedding(10, 4, sparse=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    double = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    sometimes = torch.nn.Parameter(torch.ones(2))  # in rank 0's loss only
    scale = torch.nn.Parameter(torch.ones(2))
    params = ([("embed", embed.weight)] + list(model.named_parameters())
              + [("double", double), ("sometimes", sometimes), ("scale", scale)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.05),
                                   named_parameters=params, backward_passes_per_step=passes)
    hvd.broadcast_parameters(dict(params), 0)
    gen = torch.Generator().manual_seed(10 + hvd.rank())
    grads, shared, per_step = [], [], []
    for step in range(5):
        opt.zero_grad(set_to_none=step % 2 == 0)
        before = len(grouped)
        for _ in range(passes):
            ids = torch.randint(0, 10, (4,), generator=gen)
            out = model(embed(ids)).pow(2).mean() + scale.pow(2).sum() * (1 + hvd.rank())
            out = out + (double.pow(2).sum() * 2).float()
            if hvd.rank() == 0:
                out = out + sometimes.pow(3).sum()
            out.backward()
        opt.step()
        per_step.append(grouped[before:])
        grads.append([p.grad.to_dense().double().numpy().copy().ravel().tolist() for _, p in params])
        dense32 = [p for n, p in params if p.dtype == torch.float32 and n != "embed"]
        shared.append(len({p.grad.untyped_storage().data_ptr() for p in dense32}))
    weights = np.concatenate([p.detach().double().numpy().ravel() for _, p in params])
    return {"grads": grads, "params": weights.tolist(), "shared": shared, "grouped": per_step,
            "flat": bool(opt.reducer._views)}


def _check(runs: dict[str, list[dict]]) -> None:
    ref = runs["separate"][0]
    for label, results in runs.items():
        for rank, r in enumerate(results):
            for step, (got, want) in enumerate(zip(r["grads"], ref["grads"])):
                for i, (g, w) in enumerate(zip(got, want)):
                    assert g == pytest.approx(w, rel=1e-6, abs=1e-7), \
                        f"{label}, rank {rank}, step {step}: gradient {i} differs from separate tensors"
            assert r["params"] == pytest.approx(ref["params"], rel=1e-6, abs=1e-7), \
                f"{label}, rank {rank}: weights differ from separate tensors"


def _spied() -> list[tuple[Any, str]]:
    from horovod.torch import _dense_reducer

    return [(_dense_reducer, "grouped_allreduce_async_")]


def _runs(calls: list[tuple[Any, ...]]) -> Callable[[], Any]:
    """Late bodies of the shared torch launches (tests/_shared_launch.py): each run from a fresh
    ``hvd.init()``, the settings ``_train`` sets and its counter put back afterwards."""
    settings = dict.fromkeys(("HOROVOD_FLAT_GRADIENTS", "HOROVOD_OVERLAP_GRADIENTS"))
    return under_settings(in_turn(_train, calls), settings, _spied)


_GLOO = {n: joint_launch("torch", n, {"separate_flat": _runs([(["0"], ["0"]), (["1"], ["0"])])}, timeout=400,
                         gloo=True, late=True) for n in (2, 3)}
_MPIRUN = joint_launch("torch", 2, {"accumulate_mixed": _runs([(["0"], ["0"], 2), (["1"], ["1", "0"], 2)])},
                       timeout=400, late=True)


@pytest.mark.parametrize("np_", [2, 3])
def test_flat_gradients_train_as_separate_tensors_on_gloo(np_: int) -> None:
    # both runs in one launch, each from a fresh hvd.init()
    runs = dict(zip(("separate", "flat"), zip(*_GLOO[np_].results("separate_flat"))))
    _check(runs)
    for r in runs["flat"]:
        assert r["flat"]
        # One float32 buffer for every dense float32 gradient, after every step (set_to_none or not).
        assert r["shared"] == [1] * 5, r["shared"]
        # Each step: one float32 bucket (embedding, 4 linear tensors, sometimes, scale) and one float64.
        assert [len(s) for s in r["grouped"]] == [2] * 5, r["grouped"]
        assert sorted(r["grouped"][0]) == [1, 7], r["grouped"]
    for r in runs["separate"]:
        assert not r["flat"] and r["grouped"] == [[]] * 5
        assert r["shared"][0] > 1


def test_flat_gradients_on_mpi_with_accumulation_and_mixed_overlap() -> None:
    runs = dict(zip(("separate", "flat, overlap differs"), zip(*_MPIRUN.results("accumulate_mixed"))))
    _check(runs)
    for r in runs["flat, overlap differs"]:
        assert r["flat"] and r["shared"] == [1] * 5, r["shared"]
        assert [len(s) for s in r["grouped"]] == [2] * 5, r["grouped"]
