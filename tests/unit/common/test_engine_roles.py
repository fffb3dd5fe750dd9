"""The engine's parts by role: the step memo's one clearing rule and the observers' hooks.

``memo.StepMemo`` holds every memo of a cached step; ``clear`` empties all of its tables (the
batch runner calls it whenever a cache slot is filled or emptied) and ``full`` bounds each one.
``observers.hooks`` hands the loop only the hooks an observer overrides.
"""

from __future__ import annotations

import pytest

from horovod.common.engine.flight import FlightRecorder
from horovod.common.engine.memo import StepMemo
from horovod.common.engine.observers import FLAG_EXCHANGE, Observer, TimelineObserver, hooks

pytestmark = pytest.mark.unit


def test_clear_empties_every_table_of_the_step_memo():
    memo = StepMemo()
    tables = [getattr(memo, name) for name in StepMemo.__slots__]
    for i, table in enumerate(tables):
        table[i] = object()
    memo.clear()
    assert all(not t for t in tables)
    # the tables are cleared in place: the executor and the buffers hold the same dicts
    assert [getattr(memo, name) for name in StepMemo.__slots__] == tables
    assert all(getattr(memo, a) is t for a, t in zip(StepMemo.__slots__, tables))


def test_full_bounds_a_table():
    table = {i: i for i in range(3)}
    StepMemo.full(table, 4)
    assert len(table) == 3
    table[3] = 3
    StepMemo.full(table, 4)
    assert table == {}


def test_hooks_are_only_the_overridden_methods():
    class Flags(Observer):
        def flags(self, now: float) -> int:
            return FLAG_EXCHANGE

    plain, flagger, timeline, flight = Observer(), Flags(), TimelineObserver(), FlightRecorder(4)
    observers = [plain, None, flagger, timeline, flight]
    assert [h(0.0) for h in hooks(observers, "flags")] == [FLAG_EXCHANGE]
    assert [h.__self__ for h in hooks(observers, "round_started")] == [timeline]
    assert [h.__self__ for h in hooks(observers, "batch_run")] == [flight]
    assert hooks(observers, "agreed") == ()


def test_the_flight_recorder_records_through_its_hook():
    from horovod.common.types import Request, RequestType, Response

    flight = FlightRecorder(4)
    batch = (Response(Request(name="allreduce.g", kind=RequestType.ALLREDUCE, dtype="float32")),)
    (run,) = hooks([flight], "batch_run")
    run(RequestType.ALLREDUCE, batch, [None], 1.0, 2.0)
    assert flight.completed == {0: 1}
