"""What a Ray worker reports (``BaseHorovodWorker.execute_reported``) and how the driver names
failed ranks from it (``horovod.ray.waiting``), without a Ray cluster."""

from __future__ import annotations

import pickle
import sys

import pytest

from horovod.common.exceptions import HorovodInternalError
from horovod.common.protocol import Died, Exited, Raised, Returned
from horovod.ray.waiting import failure_error
from horovod.ray.worker import BaseHorovodWorker

pytestmark = pytest.mark.unit


class _Unpicklable(Exception):
    def __reduce__(self):  # type: ignore[no-untyped-def]
        raise TypeError("no")


def _boom(_: object) -> None:
    raise ValueError("bad batch")


def _unpicklable(_: object) -> None:
    raise _Unpicklable("held a lock")


@pytest.mark.parametrize("func, check", [
    (lambda ex: ex + 1, lambda o: o == Returned(42)),
    (lambda ex: sys.exit(), lambda o: o == Exited(0)),
    (lambda ex: sys.exit(3), lambda o: o == Exited(3)),
    (lambda ex: sys.exit("why"), lambda o: o == Exited(1)),
    (_boom, lambda o: isinstance(o, Raised) and isinstance(o.error, ValueError)
     and "bad batch" in o.traceback),
    (_unpicklable, lambda o: isinstance(o, Raised) and type(o.error) is RuntimeError
     and "_Unpicklable: held a lock" in str(o.error)),
])
def test_execute_reported_returns_a_picklable_protocol_outcome(func, check, capsys) -> None:  # type: ignore[no-untyped-def]
    worker = object.__new__(BaseHorovodWorker)  # no __init__: it sets this process's rank variables
    worker.executable = 41
    out = worker.execute_reported(func)
    assert check(out), out
    back = pickle.loads(pickle.dumps(out))  # what crosses Ray's object store
    assert type(back) is type(out)


def test_failure_error_puts_the_dead_actor_first_and_names_every_rank() -> None:
    failures = {0: Raised(HorovodInternalError("peer left"), "tb0"),
                1: Died(RuntimeError("The actor died unexpectedly\nmore")),
                2: Raised(HorovodInternalError("peer left"), "tb2")}
    err = failure_error("RayExecutor.run(f)", failures, [3], lambda r: f"rank {r}",
                        times={0: 2.0, 1: 1.0, 2: 2.0})
    text = str(err)
    assert text.startswith("RayExecutor.run(f): rank 1 died: The actor died unexpectedly (its "
                           "actor's process ended"), text
    assert "also rank 0: HorovodInternalError: peer left" in text
    assert "also rank 2: HorovodInternalError: peer left" in text
    assert "rank 3 did not finish" in text and "Traceback of rank" not in text
    assert err.rank == 1 and err.ranks == [1, 0, 2] and err.stuck_ranks == [3]  # type: ignore[attr-defined]
    # a rank that raised its own error is the root cause, with its traceback
    failures[2] = Raised(ValueError("bad batch"), "Traceback: line 7")
    err = failure_error("RayExecutor.run(f)", failures, [], lambda r: f"rank {r}")
    assert str(err).startswith("RayExecutor.run(f): rank 2 raised ValueError: bad batch")
    assert str(err).endswith("Traceback of rank 2:\nTraceback: line 7")
    assert isinstance(err.exception, ValueError)  # type: ignore[attr-defined]
