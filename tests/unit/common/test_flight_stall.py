"""The flight recorder's ring, the stall inspector's timing, the stall report's text, stacks on
demand in one process (the multi-rank behaviour: tests/integration/test_hangs.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np

from horovod.common import stacks
from horovod.common.engine import diagnosis
from horovod.common.engine.flight import FlightRecorder, format_record
from horovod.common.engine.negotiation import Coordinator
from horovod.common.engine.negotiation_codec import encode_requests
from horovod.common.engine.stall import StallDecision, Stalled, StallInspector, explain, ranks_text
from horovod.common.types import Request, RequestType, Response

A = RequestType.ALLREDUCE


def _resp(name: str, kind: RequestType = A, ps: int = 0) -> Response:
    return Response(Request(name, kind, "float32", ((4,),), process_set_id=ps))


class _Entry:
    def __init__(self, name: str, state: int, t_submit: float, ps: int = 0) -> None:
        self.request = Request(name, A, "float32", ((2, 3),), process_set_id=ps)
        self.state, self.t_submit = state, t_submit


def test_ring_keeps_the_last_collectives_oldest_first_across_batches():
    rec = FlightRecorder(size=4)
    for step in range(5):  # batches of two, then one
        batch = (_resp(f"a{step}"), _resp(f"b{step}")) if step % 2 == 0 else (_resp(f"c{step}"),)
        rec.batch_done(batch, 10.0 + step, 10.5 + step)
    rec.batch_done((_resp("p", ps=1),), 15.0, 15.0)  # another process set counts on its own
    done = rec.done(now=20.0)
    assert [row[3] for row in done] == ["c3", "a4", "b4", "p"]
    assert [(row[0], row[1]) for row in done] == [(6, 0), (7, 0), (8, 0), (1, 1)]
    seq, ps, op, name, dtype, shapes, age, ran = done[-2]
    assert (ps, op, dtype, shapes, age, ran) == (0, "allreduce", "float32", [[4]], 5.5, 0.5)
    assert [row[3] for row in rec.done(now=20.0, last=2)] == ["b4", "p"]
    assert len(rec._ring) == 4  # bounded: batches beyond the size are gone
    assert rec.completed == {0: 8, 1: 1}


def test_in_flight_rows_follow_submission_order_after_the_completed_ones():
    rec = FlightRecorder(size=8)
    rec.batch_done((_resp("a"), _resp("b")), 0.0, 0.0)
    running = _Entry("r", 0, 1.0)
    sent = _Entry("s", 3, 3.0)
    other = _Entry("o", 2, 3.5, ps=1)
    cached = _Entry("c", 1, 2.0)
    queued = _Entry("q", 0, 1.0)
    rows = rec.in_flight([running, sent, other, cached, queued], {id(queued)}, now=4.0)
    assert [(r[0], r[1], r[3], r[6], r[7]) for r in rows] == [
        (3, 0, "r", "running", 3.0), (4, 0, "s", "submitted", 1.0), (5, 0, "c", "negotiated", 2.0),
        (6, 0, "q", "submitted", 3.0), (1, 1, "o", "submitted", 0.5)]
    text = "\n".join(format_record({"done": [], "in_flight": rows}))
    assert "running    allreduce 'r' (seq 3) float32 (2, 3): submitted 3.0 s ago" in text
    assert "submitted  allreduce 'o' (seq 1, process set 1)" in text


def test_inspector_reports_once_per_period_and_at_the_shutdown_limit():
    t = [0.0]
    s = StallInspector(warn_after=5, shutdown_after=20, clock=lambda: t[0])
    young = [Stalled("w", "allreduce", 0, [0, 1], [2], 3.0)]
    assert s.check(young) is None
    reports = []
    for second in range(4, 20):
        t[0] = float(second)
        if s.due():
            d = s.check([Stalled("w", "allreduce", 0, [0, 1], [2], second - 0.5)])
            if d is not None:
                reports.append((second, d.shutdown))
    assert reports == [(6, False), (11, False), (16, False)]  # every 5 s, not every second
    t[0] = 21.0
    d = s.check([Stalled("w", "allreduce", 0, [0, 1], [2], 20.5)])
    assert d is not None and d.shutdown and d.missing == [2]
    # The stall ends; a new one is reported as soon as it is old enough.
    t[0] = 22.0
    assert s.check([]) is None
    t[0] = 23.0
    assert s.check([Stalled("x", "allreduce", 0, [0], [1], 6.0)]) is not None


def _answer(rank, in_flight=(), done=(), where="step (train.py:40)", stack=None):
    return {"rank": rank, "host": f"h{rank}", "pid": 100 + rank, "where": where, "stack": stack,
            "in_flight": [list(r) for r in in_flight], "done": [list(r) for r in done]}


def test_report_names_the_stuck_rank_with_its_stack_and_flight_record():
    stack = [["/job/train.py", 30, "<module>", "main()"], ["/job/train.py", 12, "load_batch", "ready.wait()"]]
    answers = {
        0: _answer(0, [[7, 0, "allreduce", "grad.w", "float32", [[4]], "negotiated", 6.2]]),
        1: _answer(1, [[7, 0, "allreduce", "grad.w", "float32", [[4]], "negotiated", 7.5]]),
        2: _answer(2, [], [[6, 0, "allreduce", "grad.w", "float32", [[4]], 6.3, 0.001]],
                   where="load_batch (train.py:12)", stack=stack),
    }
    d = StallDecision([Stalled("grad.w", "allreduce", 0, [0, 1], [2], 6.1)], shutdown=False)
    text = explain(d, answers, 5, 20)
    lines = text.splitlines()
    assert lines[0].startswith("Stall: 1 collective waited more than 5 s")
    assert "Horovod shuts down when one has waited 20 s" in lines[0]
    assert lines[1] == ("allreduce 'grad.w' (seq 7): ranks 0-1 submitted it and wait for 6.2-7.5 s; "
                        "rank 2 did not submit it.")
    assert ("  rank 2 (host h2, pid 102) is in no collective: its main thread is in "
            "load_batch (train.py:12).") in lines
    assert '    File "/job/train.py", line 12, in load_batch' in lines
    assert "      ready.wait()" in lines
    assert any("done       allreduce 'grad.w' (seq 6) float32 (4,): ended 6.3 s ago" in x for x in lines)
    assert lines[-2:] == ["2: [grad.w]", "In short: rank 2 is in no collective (its main thread is in "
                          "load_batch (train.py:12)) while ranks 0-1 wait in allreduce 'grad.w' (seq 7)."]
    assert "Desync" not in text


def test_report_says_a_desync_once_with_both_names():
    a = [7, 0, "allreduce", "grad.a", "float32", [[4]], "submitted", 6.0]
    b = [7, 0, "allreduce", "grad.b", "float32", [[4]], "submitted", 6.0]
    answers = {0: _answer(0, [a]), 1: _answer(1, [a]), 2: _answer(2, [b])}
    d = StallDecision([Stalled("grad.b", "allreduce", 0, [2], [0, 1], 6.0),
                       Stalled("grad.a", "allreduce", 0, [0, 1], [2], 6.0)], shutdown=True)
    text = explain(d, answers, 5, 20)
    assert "Horovod shuts down: a collective waited more than 20 s" in text
    said = "rank 2 is in allreduce 'grad.b' (seq 7) while ranks 0-1 wait in allreduce 'grad.a' (seq 7)"
    assert f"  Desync: {said}" in text and text.count("Desync:") == 1
    assert "  rank 0 is in allreduce 'grad.a' (seq 7): the other side of the desync above." in text
    assert text.endswith(f"In short: desync: {said}.")


def test_report_says_which_rank_did_not_answer():
    d = StallDecision([Stalled("w", "allreduce", 0, [0], [1], 9.0)], shutdown=False)
    text = explain(d, {0: _answer(0)}, 5, 0)
    assert "rank 1 did not answer: it is stopped, holds the GIL" in text
    assert "shuts down" not in text.splitlines()[0]


def test_ranks_text():
    assert ranks_text([2]) == "rank 2"
    assert ranks_text([1, 0]) == "ranks 0-1"
    assert ranks_text([0, 2, 3, 4, 7]) == "ranks 0, 2-4, 7"


def test_a_request_that_waited_on_its_rank_counts_that_wait():
    """A cached request sent again after a local stall carries how long it waited, so the
    coordinator reports it on time instead of after a second warning period."""
    t = [100.0]
    c = Coordinator(2, {0: [0, 1]}.get, lambda: t[0])
    c.submit_encoded([encode_requests([Request("w", A, "float32", ((4,),), rank=0)], waited=[7.0]), b""])
    (s,) = c.stalled(5.0)
    assert s.name == "w" and s.missing == [1] and abs(s.age - 7.0) < 1e-6
    # A fresh request waited nothing: the same key as without the field.
    assert encode_requests([Request("w", A, "float32", ((4,),))]) == \
        encode_requests([Request("w", A, "float32", ((4,),))], waited=[0.0])


def test_user_frame_skips_library_frames_and_folds_horovod_ones():
    lib = diagnosis._HOROVOD + "common/engine/loop.py"
    stack = [["/job/train.py", 3, "main", "x()"], ["/job/train.py", 9, "load_batch", "ev.wait()"],
             [threading.__file__, 320, "wait", "waiter.acquire()"]]
    assert diagnosis.user_frame(stack) == "load_batch (train.py:9)"
    lines = diagnosis.format_stack(stack[:1] + [[lib, 1, "help_until", ""], [lib, 2, "_round", ""]])
    assert lines == ['  File "/job/train.py", line 3, in main', "    x()", "  ... 2 frame(s) inside Horovod"]
    main = diagnosis.main_stack()
    assert main is not None and main[-1][2] == "thread_stack"  # this thread is the main thread


def test_sigusr1_prints_stacks_and_the_process_goes_on(capfd):
    before = signal.getsignal(signal.SIGUSR1)
    record = {"done": [[1, 0, "allreduce", "grad.w", "float32", [[4]], 0.5, 0.001]], "in_flight": []}
    assert stacks.install(lambda: "rank 0 (host h, pid 1)", lambda: record)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        out = ""
        deadline = time.monotonic() + 10
        while "Flight record" not in out and time.monotonic() < deadline:
            time.sleep(0.05)
            out += capfd.readouterr().err
    finally:
        stacks.uninstall()
    assert "horovod: rank 0 (host h, pid 1): stacks on demand (SIGUSR1)" in out
    assert "Thread 'MainThread' (most recent call last):" in out
    assert "test_sigusr1_prints_stacks_and_the_process_goes_on" in out
    assert "done       allreduce 'grad.w' (seq 1)" in out
    assert not stacks.installed() and signal.getsignal(signal.SIGUSR1) == before
    assert np.isfinite(1.0)  # still running


def test_in_flight_with_a_limit_builds_only_the_rows_it_shows() -> None:
    """The monitor's reporter asks for the first few in-flight collectives of a step that has
    hundreds: the rows are those of the unlimited call, cut, whatever the process sets' mix."""
    from horovod.common.engine.flight import in_flight_rows

    entries = [_Entry(f"t{i}", 2, 0.0, ps=i % 3 and 1) for i in range(200)]
    full = in_flight_rows(entries, set(), 1.0, {0: 10, 1: 4})
    for last in (1, 5, 8, 70, 300):
        assert in_flight_rows(entries, set(), 1.0, {0: 10, 1: 4}, last) == full[:last], last
