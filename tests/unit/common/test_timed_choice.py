"""A rank's own timed choice per repeated batch (``choice.TimedChoice``) and the executor's use of it:
reducing memory that is not on huge pages where it lies, or copying it through the fusion buffer."""

from __future__ import annotations

import numpy as np
import pytest

from horovod.common.backends.base import Group
from horovod.common.engine.choice import TimedChoice
from horovod.common.engine.executor import UNTIMED_BYTES, Entry, Executor
from horovod.common.engine.placement import HostPlacement
from horovod.common.engine.tunables import Tunables
from horovod.common.types import ReduceOp, Request, RequestType, Response


def _ways(choice: TimedChoice, batch, cost, runs: int) -> list[bool]:
    ways = []
    for _ in range(runs):
        way = choice.pick(batch)
        choice.record(batch, way, cost[way])
        ways.append(way)
    return ways


@pytest.mark.parametrize("faster", [True, False])
def test_tries_both_ways_then_keeps_the_faster_until_the_recheck(faster: bool) -> None:
    choice = TimedChoice(False, {})
    batch = ("a", "b")
    cost = {faster: 1.0, not faster: 2.0}
    tries = 2 * TimedChoice.TRIES
    ways = _ways(choice, batch, cost, tries)
    assert ways == [False, True] * TimedChoice.TRIES  # alternating, the default first
    assert choice.chosen(batch) is faster
    assert _ways(choice, batch, cost, TimedChoice.RECHECK) == [faster] * TimedChoice.RECHECK
    # then both ways again (the machine's state changes), now with the costs swapped
    cost = {faster: 3.0, not faster: 2.0}
    assert _ways(choice, batch, cost, tries) == [False, True] * TimedChoice.TRIES
    assert choice.chosen(batch) is (not faster)


def test_a_batch_planned_afresh_runs_the_default_and_a_new_batch_is_tried_anew() -> None:
    choice = TimedChoice(True, {})
    fresh = ["a", "b"]  # a list: not a memoized step's batch
    assert _ways(choice, fresh, {True: 9.0, False: 1.0}, 12) == [True] * 12
    assert choice.chosen(fresh) is None
    one = ("a",)
    _ways(choice, one, {True: 9.0, False: 1.0}, 2 * TimedChoice.TRIES)
    assert choice.chosen(one) is False
    other = ("b",)
    assert choice.chosen(other) is None and choice.pick(other) is True  # its own trial, default first


def test_trials_are_a_bounded_table_that_the_step_memo_empties() -> None:
    table: dict[int, object] = {}
    choice = TimedChoice(False, table, size=2)
    batches = [(i,) for i in range(3)]
    for b in batches:
        choice.pick(b)
    assert len(table) == 1  # emptied when the third came
    table.clear()  # StepMemo.clear: a cache slot changed
    assert choice.chosen(batches[2]) is None


class SpanBackend:
    """n ranks holding the same data; records whether each call worked in the tensors' memory."""

    name = "mpi"

    def __init__(self, n: int, tensors: list[np.ndarray]) -> None:
        self.n = n
        self.tensors = tensors
        self.in_place: list[bool] = []

    def reduce_dtypes(self) -> frozenset[str]:
        return frozenset({"float32"})

    def allreduce(self, buf: np.ndarray, op: ReduceOp, group: Group, src: np.ndarray | None = None) -> None:
        self.in_place.append(any(np.shares_memory(buf, t) for t in self.tensors))
        buf *= self.n


@pytest.mark.parametrize("in_place_faster", [True, False])
def test_executor_reduces_small_pages_the_faster_measured_way(in_place_faster: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Two large tensors whose memory is not on huge pages: by default their pieces are copied
    # through the fusion buffer; a repeated (memoized) batch is timed both ways, then reduced the
    # faster way. The values are right either way, and the calls the same.
    monkeypatch.setattr(HostPlacement, "own_memory", staticmethod(lambda out: False))
    tensors = [np.ones(1024, np.float32), np.ones(2048, np.float32)]
    backend = SpanBackend(2, tensors)
    tun = Tunables(fusion_threshold=1 << 20, max_tensor_bytes=1 << 20, chunk_bytes=4096)
    ex = Executor(backend, {0: Group([0, 1], 0, None)}, 0, tun)
    record = ex.small_pages.record
    monkeypatch.setattr(ex.small_pages, "record",
                        lambda batch, way, s: record(batch, way, 1.0 if way == in_place_faster else 2.0))
    reqs = [Request(f"t{i}", RequestType.ALLREDUCE, "float32", (t.shape,), ReduceOp.AVERAGE, 1.0, 1.0)
            for i, t in enumerate(tensors)]
    batch = tuple(Response(r) for r in reqs)
    steps = []
    for _ in range(2 * TimedChoice.TRIES + 3):
        backend.in_place.clear()
        ex.run(batch, [Entry(r, [t], [t], None) for r, t in zip(reqs, tensors)])
        assert all(np.all(t == 1) for t in tensors)  # Average over 2 identical ranks
        steps.append(list(backend.in_place))
    assert all(len(s) == 3 for s in steps)  # one 4 KiB piece, two pieces: the plan never changes
    assert steps[0] == [False] * 3 and steps[1] == [True] * 3  # tried both
    assert steps[-3:] == [[in_place_faster] * 3] * 3
    assert ex.placement.small_pages_in_place is False  # set for a batch only
    backend.in_place.clear()
    ex.run(list(batch), [Entry(r, [t], [t], None) for r, t in zip(reqs, tensors)])
    assert backend.in_place == [False] * 3  # a batch planned afresh: copied (the default)


@pytest.mark.parametrize("elements, timed", [(UNTIMED_BYTES // 4, False), (UNTIMED_BYTES // 4 + 1, True)])
def test_a_batch_of_one_small_call_is_copied_untimed(elements: int, timed: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Timing both ways costs more than copying a call of at most UNTIMED_BYTES: such a batch is
    # always copied through the buffer and never timed; one byte more and it is timed as before.
    monkeypatch.setattr(HostPlacement, "own_memory", staticmethod(lambda out: False))
    tensor = np.ones(elements, np.float32)
    backend = SpanBackend(2, [tensor])
    ex = Executor(backend, {0: Group([0, 1], 0, None)}, 0, Tunables(fusion_threshold=1 << 20))
    req = Request("t", RequestType.ALLREDUCE, "float32", (tensor.shape,), ReduceOp.AVERAGE, 1.0, 1.0)
    batch = (Response(req),)
    for _ in range(2 * TimedChoice.TRIES + 1):
        ex.run(batch, [Entry(req, [tensor], [tensor], None)])
        assert np.all(tensor == 1)
    assert bool(ex.memo.choices) is timed
    assert (True in backend.in_place) is timed  # untimed: never reduced where it lies


def test_a_cached_request_reduces_by_the_rule_of_its_group_size() -> None:
    # The executor remembers a request's reduction (a cached step's request is the same object
    # every step); the same request object on a group of another size must average by that size.
    tensor = np.ones(4, np.float32)
    backend = SpanBackend(2, [tensor])
    groups = {0: Group([0, 1], 0, None)}
    ex = Executor(backend, groups, 0, Tunables())
    req = Request("t", RequestType.ALLREDUCE, "float32", (tensor.shape,), ReduceOp.AVERAGE, 1.0, 1.0)
    for n in [2, 2, 3, 3, 2]:
        if len(groups[0].ranks) != n:
            groups[0] = Group(list(range(n)), 0, None)
        backend.n = n  # every rank holds ones: the sum is n, the average 1
        tensor[:] = 1
        ex.run((Response(req),), [Entry(req, [tensor], [tensor], None)])
        assert np.all(tensor == 1), (n, tensor)
