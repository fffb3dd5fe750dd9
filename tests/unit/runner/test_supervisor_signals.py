"""The static supervisor never loses a Ctrl-C (``runner/launch/supervisor.py``).

Its signal handler runs in the main thread, at any line the main thread is executing, the
supervising loop's own wait for events included; and a signal taken after the loop's last event
(every process had ended, the handler not yet given back) still marks the job interrupted, so
that ``--monitor-linger`` does not keep horovodrun up after the user's Ctrl-C.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
from typing import Any

from horovod.runner.launch.supervisor import Supervisor


def test_the_handler_can_run_at_any_line_of_the_loops_wait_for_events() -> None:
    # A signal's Python handler runs between two lines of whatever the main thread executes: here
    # at every line executed while the loop waits for an event (with queue.Queue, inside its get,
    # which holds the lock its put then waits for: horovodrun hung, its Ctrl-C lost).
    sup = Supervisor([], 0)
    got: list[Any] = []
    calls = [0]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and calls[0] < 50:
            calls[0] += 1
            sys.settrace(None)  # the handler itself runs untraced, as a signal handler would
            try:
                sup._on_signal(signal.SIGINT, None)
            finally:
                sys.settrace(tracer)
        return tracer

    def wait() -> Any:
        return sup._events.get(timeout=0.2)  # as _supervise waits (its lines traced from here)

    def loop() -> None:
        sys.settrace(tracer)
        try:
            got.append(wait())
        finally:
            sys.settrace(None)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the signal handler blocked inside the loop's wait for events"
    assert got and type(got[0]).__name__ == "_SignalReceived" and got[0].signum == signal.SIGINT


class _LateSignal(Supervisor):
    def _supervise(self) -> None:
        super()._supervise()
        self._on_signal(signal.SIGINT, None)  # every process ended; the handler is still ours


def test_a_signal_taken_after_the_last_event_marks_the_job_interrupted() -> None:
    # (the handler before is not always Python's default: an in-process SparkContext of another
    # test installs its own)
    before = signal.getsignal(signal.SIGINT)
    outcome = _LateSignal([], 0).run()
    assert outcome.interrupted == "SIGINT"
    assert outcome.returncode == 128 + signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before  # given back


def test_the_job_is_not_marked_interrupted_without_a_signal() -> None:
    outcome = Supervisor([], 0).run()
    assert outcome.interrupted is None and outcome.returncode == 0
    assert isinstance(Supervisor([], 0)._events, queue.SimpleQueue)


def _monitored_main(monkeypatch: Any, capsys: Any, launch: Any) -> tuple[int, str, Any]:
    from horovod.common.rendezvous import make_secret
    from horovod.runner import monitor
    from horovod.runner.launch import horovodrun
    from horovod.runner.monitor import JobState, MonitorService

    svc = MonitorService(make_secret(), 0, state=JobState(2))

    def fake_launch(settings: Any) -> Any:
        monitor.finish(svc, None, linger=120)  # the ended job's monitor, left to linger
        return launch()

    monkeypatch.setattr(horovodrun, "launch", fake_launch)
    try:
        rc = horovodrun.main(["-np", "2", "--monitor-port", "0", "--monitor-linger", "120", "true"])
    finally:
        monitor.stop_lingering()
    return rc, capsys.readouterr().err, monitor


def test_a_ctrl_c_while_the_ended_job_is_collected_is_a_line_and_stops_the_monitor(monkeypatch: Any,
                                                                                  capsys: Any) -> None:
    # The supervisor had given the signal back; the launcher was still collecting the job.
    def interrupted() -> Any:
        raise KeyboardInterrupt
    rc, err, monitor = _monitored_main(monkeypatch, capsys, interrupted)
    assert rc == 128 + signal.SIGINT
    assert "horovodrun: interrupted" in err and "Traceback" not in err
    assert not monitor._LINGERING


def test_a_ctrl_c_during_the_failure_report_ends_horovodrun_without_lingering(monkeypatch: Any,
                                                                             capsys: Any) -> None:
    from horovod.runner.job_outcome import JobOutcome

    class Report(JobOutcome):
        def report(self) -> str:
            raise KeyboardInterrupt

    rc, err, monitor = _monitored_main(monkeypatch, capsys, lambda: Report([], 1))
    assert rc == 1
    assert "monitor stays up" not in err
    assert not monitor._LINGERING


def test_an_elastic_ctrl_c_whose_exception_is_lost_still_ends_the_job() -> None:
    # A signal handler's KeyboardInterrupt raised while the main thread runs a finalizer (here a
    # generator's close) is printed and dropped by Python; the elastic driver then trained on
    # (horovodrun stayed up until the job's end). The handler also tells the driver.
    import pytest

    from horovod.runner.elastic.discovery import FixedHosts, HostManager
    from horovod.runner.elastic.driver import ElasticDriver
    from horovod.runner.launch.elastic import _note_sigint

    class Proc:
        def stop(self, grace: float = 5.0) -> None:
            pass

        def kill(self) -> None:
            pass

    driver = ElasticDriver(HostManager(FixedHosts({"a": 1})), 1, 1, None, lambda key, slot: Proc())
    before = signal.getsignal(signal.SIGINT)
    restore = _note_sigint(driver)
    try:
        handler = signal.getsignal(signal.SIGINT)
        assert callable(handler) and handler is not before

        def step() -> Any:
            try:
                yield 1
            finally:
                handler(signal.SIGINT, None)  # the signal arrives while the generator is closed

        lost: list[type] = []
        hook, sys.unraisablehook = sys.unraisablehook, lambda u: lost.append(u.exc_type)
        try:
            g = step()
            next(g)
            del g  # the KeyboardInterrupt is lost ("Exception ignored in: <generator ...>")
        finally:
            sys.unraisablehook = hook
        assert lost == [KeyboardInterrupt]
        assert driver.interrupted == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            driver.run()  # at its first turn, not at the job's end
    finally:
        restore()
    assert signal.getsignal(signal.SIGINT) is before
