"""Every error path leaves all ranks in step (np=2 and np=3, real ranks under mpirun).

A call whose arguments are bad on ONE rank only (splits, root, dtype, op) must fail on every rank
of the set, name the bad rank, and leave the engine and the auto-generated names in step: after
each failure the ranks run an unnamed allreduce together, which would hang (names out of step) or
fail if they were not. Unnamed operations of a process set are numbered per set, so ranks that
run operations on a set that other ranks are not part of still agree on later unnamed names.
"""

from __future__ import annotations

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch, own_init

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]

NPS = [2, 3]


def _rank_dependent_errors():
    import torch

    import horovod.torch as hvd
    from horovod.common.exceptions import CollectiveMismatchError

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad_rank = n - 1
    me_bad = r == bad_rank
    bad = []

    def in_step(label):
        got = hvd.allreduce(torch.ones(3), op=hvd.Sum)  # unnamed: names must still agree
        if not torch.equal(got, torch.full((3,), float(n))):
            bad.append(f"rank {r}: allreduce after {label} -> {got}")

    def expect(label, local_type, fn):
        try:
            fn()
        except CollectiveMismatchError as exc:
            if me_bad:
                bad.append(f"rank {r}: {label}: the bad rank got {exc!r} instead of its own error")
            elif exc.field != "argument" or bad_rank not in exc.ranks or f"rank {bad_rank}" not in str(exc):
                bad.append(f"rank {r}: {label}: error does not name rank {bad_rank}: {exc}")
        except local_type as exc:
            if not me_bad:
                bad.append(f"rank {r}: {label}: a valid rank raised {exc!r}")
        except Exception as exc:  # noqa: BLE001
            bad.append(f"rank {r}: {label}: raised {type(exc).__name__}: {exc}")
        else:
            bad.append(f"rank {r}: {label}: did not raise")
        in_step(label)

    rows = torch.arange(2.0 * n)
    expect("alltoall splits of the wrong length", ValueError,
           lambda: hvd.alltoall(rows, splits=[1] * (n + 1) if me_bad else [2] * n))
    int_splits = torch.full((n,), 2, dtype=torch.int32)
    expect("alltoall float splits", ValueError,
           lambda: hvd.alltoall(rows, splits=int_splits.float() if me_bad else int_splits))
    expect("alltoall indivisible rows", ValueError,
           lambda: hvd.alltoall(torch.ones(2 * n + 1) if me_bad else torch.ones(2 * n)))
    expect("broadcast root outside the set", ValueError,
           lambda: hvd.broadcast(torch.ones(2), root_rank=n + 3 if me_bad else 0))
    expect("broadcast_ root outside the set", ValueError,
           lambda: hvd.broadcast_(torch.ones(2), root_rank=-1 if me_bad else 0))
    expect("allreduce unsupported dtype", ValueError,
           lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64 if me_bad else torch.float32)))
    expect("allgather scalar", ValueError,
           lambda: hvd.allgather(torch.tensor(1.0) if me_bad else torch.ones(1)))
    expect("reducescatter op=Max", NotImplementedError,
           lambda: hvd.reducescatter(torch.ones(n), op=hvd.Max if me_bad else hvd.Sum))
    expect("grouped_allreduce given a tensor", TypeError,
           lambda: hvd.grouped_allreduce(torch.ones(2) if me_bad else [torch.ones(2)]))
    expect("allreduce op and average", ValueError,
           lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum, average=False if me_bad else None))

    # async: the bad rank raises from the call, the others from synchronize
    def bad_async():
        h = hvd.allreduce_async(torch.ones(2, dtype=torch.complex64) if me_bad else torch.ones(2))
        hvd.synchronize(h)
    expect("allreduce_async unsupported dtype", ValueError, bad_async)

    # a named operation already in the response cache, then bad on one rank, then good again
    for _ in range(2):
        hvd.allreduce(torch.ones(2), name="cached")
    expect("cached name, bad on one rank", ValueError,
           lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64) if me_bad else torch.ones(2), name="cached"))
    got = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="cached")
    if not torch.equal(got, torch.full((2,), float(n))):
        bad.append(f"rank {r}: the name 'cached' after its failure -> {got}")

    # bad on every rank: each rank raises its own error; the upstream type for reducescatter
    # with an op it does not implement is a RuntimeError
    try:
        hvd.reducescatter(torch.ones(n), op=hvd.Adasum)
        bad.append(f"rank {r}: reducescatter(op=Adasum) did not raise")
    except RuntimeError:
        pass
    in_step("reducescatter Adasum on every rank")
    return bad


def _unnamed_numbering_per_set():
    import torch

    import horovod.torch as hvd

    hvd.init(process_sets="dynamic")
    r, n = hvd.rank(), hvd.size()
    part = hvd.add_process_set(list(range(n - 1)))  # every rank but the last
    bad = []
    for step in range(3):
        if r < n - 1:  # unnamed operations on a set the last rank is not part of
            got = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=part)
            if not torch.equal(got, torch.full((2,), float(n - 1))):
                bad.append(f"rank {r}: step {step}: allreduce on the subset -> {got}")
            hvd.allgather(torch.ones(1), name=f"named.{step}", process_set=part)
        got = hvd.allreduce(torch.ones(2) * (r + 1), op=hvd.Sum)  # unnamed, global
        if not torch.equal(got, torch.full((2,), float(n * (n + 1) // 2))):
            bad.append(f"rank {r}: step {step}: global allreduce -> {got}")
        got = hvd.broadcast(torch.ones(2) * r, root_rank=n - 1)
        if not torch.equal(got, torch.full((2,), float(n - 1))):
            bad.append(f"rank {r}: step {step}: global broadcast -> {got}")
    return bad


@pytest.mark.parametrize("np_", NPS)
def test_rank_dependent_bad_arguments_fail_everywhere_and_ranks_stay_in_step(np_):
    fails = _LAUNCH[np_].results("rank_dependent")
    assert not any(fails), "\n".join(f for per_rank in fails for f in per_rank)


@pytest.mark.parametrize("np_", NPS)
def test_unnamed_operations_are_numbered_per_process_set(np_):
    fails = _LAUNCH[np_].results("numbering_per_set")
    assert not any(fails), "\n".join(f for per_rank in fails for f in per_rank)


# Both bodies are parts of the launch per world size shared with the other torch modules' plain-init
# bodies, among the last (errors on purpose; tests/_shared_launch.py); the one with dynamic process
# sets between shutdowns of its own (own_init).
_LAUNCH = {n: joint_launch("torch", n, {"rank_dependent": _rank_dependent_errors,
                                        "numbering_per_set": own_init(_unnamed_numbering_per_set)},
                           timeout=210, late=True)
           for n in NPS}
