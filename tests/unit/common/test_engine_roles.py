"""The engine's parts by role: the step memo's one clearing rule and the observers' hooks.

``memo.StepMemo`` holds every memo of a cached step; ``clear`` empties all of its tables (the
batch runner calls it whenever a cache slot is filled or emptied) and ``full`` bounds each one.
``observers.hooks`` hands the loop only the hooks an observer overrides.
"""

from __future__ import annotations

import pytest

from horovod.common.engine.flight import FlightRecorder
from horovod.common.engine.memo import StepMemo
from horovod.common.engine.observers import FLAG_EXCHANGE, Observer, TimelineObserver, fan_out, hooks

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
    assert [h.__self__ for h in hooks(observers, "batch_run")] == [timeline, flight]
    for name in ("negotiating", "negotiated", "batch_started", "activity"):  # the timeline's alone
        assert [h.__self__ for h in hooks(observers, name)] == [timeline], name
    assert hooks(observers, "agreed") == ()


def test_fan_out_is_none_for_no_hook_the_hook_for_one_and_each_for_several():
    calls: list[tuple[str, tuple]] = []

    class Steps(Observer):
        def __init__(self, tag: str) -> None:
            self.tag = tag

        def activity(self, names, activity, begin) -> None:
            calls.append((self.tag, (tuple(names), activity, begin)))

    a, b = Steps("a"), Steps("b")
    assert fan_out(hooks([Observer(), None], "activity")) is None  # the executor records nothing
    assert fan_out(hooks([a], "activity")) == a.activity
    fan_out(hooks([a, Observer(), b], "activity"))(["t"], "MPI_ALLREDUCE", True)
    assert calls == [("a", (("t",), "MPI_ALLREDUCE", True)), ("b", (("t",), "MPI_ALLREDUCE", True))]


def test_the_timeline_observer_writes_each_phase_where_its_hook_is_called(tmp_path):
    """The events the executor and the round controller used to write themselves, now through
    the observer's hooks: negotiation (a tick per rank that reported), the operation with its
    dtype and shapes, the steps inside it; a join or a barrier writes nothing."""
    import json
    from types import SimpleNamespace

    from horovod.common.engine.negotiation_codec import encode_requests
    from horovod.common.engine.timeline import Timeline
    from horovod.common.types import Request, RequestType, Response

    path = tmp_path / "tl.json"
    obs = TimelineObserver(Timeline(str(path)))
    req = Request(name="allreduce.w", kind=RequestType.ALLREDUCE, dtype="float32", shapes=((2, 3),))
    batch = (Response(req),)
    coord = SimpleNamespace(table={"allreduce.w": SimpleNamespace(kind=RequestType.ALLREDUCE)})
    obs.negotiating(coord, ["allreduce.w"], [encode_requests([req]), encode_requests([]),
                                               encode_requests([req])])
    obs.negotiated(batch)
    obs.batch_started(RequestType.ALLREDUCE, batch)
    obs.activity(["allreduce.w"], "MPI_ALLREDUCE", True)
    obs.activity(["allreduce.w"], "MPI_ALLREDUCE", False)
    obs.batch_run(RequestType.ALLREDUCE, batch, [None], 1.0, 2.0)
    obs.batch_run(RequestType.BARRIER, batch, [None], 1.0, 2.0)
    obs.replace(None)  # closes the file
    assert not obs.active
    events = [e for e in json.loads(path.read_text()) if e and e.get("ph") != "M"]
    assert [(e["ph"], e.get("name"), e.get("args")) for e in events] == [
        ("B", "NEGOTIATE_ALLREDUCE", None), ("X", "0", None), ("X", "2", None), ("E", None, None),
        ("B", "ALLREDUCE", None), ("B", "MPI_ALLREDUCE", None), ("E", None, None),
        ("E", None, {"dtype": "float32", "shape": "[[2, 3]]"})]
    assert len({e["pid"] for e in events}) == 1


def test_the_flight_recorder_records_through_its_hook():
    from horovod.common.types import Request, RequestType, Response

    flight = FlightRecorder(4)
    batch = (Response(Request(name="allreduce.g", kind=RequestType.ALLREDUCE, dtype="float32")),)
    (run,) = hooks([flight], "batch_run")
    run(RequestType.ALLREDUCE, batch, [None], 1.0, 2.0)
    assert flight.completed == {0: 1}
