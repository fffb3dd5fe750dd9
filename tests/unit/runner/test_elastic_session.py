"""The elastic session every launcher shares (horovodrun, Spark, Ray), with fake workers: the
service's handler, the end of the workers (stop, wait on the driver's condition, kill), the
results (read from the store at the end, or reported), the root cause and the one failure text
(``JobOutcome.failure``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from horovod.common.exceptions import HorovodInternalError
from horovod.common.protocol import FailureRecord, Raised, Returned
from horovod.runner.elastic.discovery import FixedHosts, HostManager
from horovod.runner.elastic.session import ElasticSession
from horovod.runner.elastic.settings import DriverSettings
from horovod.runner.hosts import SlotInfo

pytestmark = pytest.mark.unit

Key = tuple[str, int]


class Service:
    def __init__(self) -> None:
        self.handlers: list[Any] = []
        self.stopped = False
        self.kv: dict[tuple[str, str], bytes] = {}

    def put(self, scope: str, key: str, value: bytes) -> None:
        self.kv[(scope, key)] = value

    def get(self, scope: str, key: str) -> bytes | None:
        return self.kv.get((scope, key))

    def set_elastic_handler(self, handler: Any) -> None:
        self.handlers.append(handler)

    def stop(self) -> None:
        self.stopped = True


class Worker:
    """A fake worker: ``behaviour(key)`` decides how it ends by itself; ``stop`` ends it unless
    it is stubborn; ``kill`` always does."""

    def __init__(self, session: ElasticSession, key: Key, stubborn: bool) -> None:
        self.session, self.key, self.stubborn = session, key, stubborn
        self.calls: list[str] = []

    def end(self, code: int | None, sig: int | None, record: FailureRecord | None = None) -> None:
        threading.Thread(target=self.session.worker_exited,
                         args=(self.key, code, sig, record)).start()

    def stop(self, grace: float = 5.0) -> None:
        self.calls.append("stop")
        if not self.stubborn:
            self.end(None, 15)

    def kill(self) -> None:
        self.calls.append("kill")
        self.end(None, 9)


def make(hosts: dict[str, int], np: int, fail: dict[str, tuple[int, object]], *,
         stubborn: bool = False, timeout: float = 0.5, own: bool = True, **wording: Any,
         ) -> tuple[ElasticSession, Service, dict[Key, Worker]]:
    """A session whose workers on the hosts in ``fail`` end at once with (code, record)."""
    service = Service()
    workers: dict[Key, Worker] = {}
    session: ElasticSession

    def start_worker(key: Key, slot: SlotInfo) -> Worker:
        w = Worker(session, key, stubborn)
        workers[key] = w
        if key[0] in fail:
            code, record = fail[key[0]]
            w.end(code, None, record)
        return w

    session = ElasticSession(DriverSettings(timeout=timeout), HostManager(FixedHosts(hosts)), np,
                             np, None, start_worker, service, own_service=own,
                             discovery_interval=0.05, exit_wait=0.3, **wording)
    return session, service, workers


def test_every_worker_failing_ends_the_job_and_the_session_cleans_up() -> None:
    own = FailureRecord(1, "cause", "ValueError: bad batch", 5.0)
    lost = FailureRecord(1, "consequence", "HorovodInternalError: peer left", 1.0)
    session, service, _ = make({"a": 1, "b": 1}, 2, {"a": (1, lost), "b": (1, own)})
    finished: list[bool] = []
    out = session.run(lambda: finished.append(service.stopped))
    assert out.error is not None and "failed before training started" in out.error
    assert out.returncode == 1 and not out.ok
    assert out.elastic is not None and len(out.elastic.failures) == 2
    # the worker whose error is its own, whichever ended first
    root = out.elastic.root_cause()
    assert root is not None and root.key == ("b", 0) and root.as_exit().error == own.error
    assert out.root_cause() is not None and out.root_cause().host == "b"
    # the handler was attached for the run, then detached; finish ran before the service stopped
    assert service.handlers == [session.driver.handle, None] and finished == [False]
    assert service.stopped


def test_outcomes_give_values_in_rank_order_and_records_for_raised_errors() -> None:
    session, service, _ = make({"a": 1, "b": 1}, 2, {"a": (1, None), "b": (1, None)}, own=False)
    session.record_outcome(("a", 0), Raised(HorovodInternalError("peer left")))
    session.record_outcome(("b", 0), Raised(KeyError("label"), "tb"))
    out = session.run()
    assert not service.stopped  # the launcher keeps its service (RayExecutor)
    assert out.elastic is not None
    root = out.elastic.root_cause()
    assert root is not None and root.key == ("b", 0)  # its own error, from the exception
    assert root.record is not None and root.as_exit().error_kind == "cause"
    assert [k for k, *_ in out.failed_workers()] == [("b", 0), ("a", 0)]
    assert out.values() == [] and out.outcomes == {}  # no final round


def test_values_are_the_final_rounds_in_rank_order() -> None:
    """The workers store their results under their slot names (``run_task``); the session reads
    them at the end: the final round's by rank, every slot's by slot."""
    import cloudpickle

    from horovod.common.protocol import RESULT_SCOPE
    from horovod.runner.elastic.driver import ElasticResult, Worker

    session, service, _ = make({"a": 1, "b": 1}, 2, {})
    stored = {("a", 0): Returned("A"), ("b", 0): Returned("B"), ("c", 0): Returned("left earlier")}
    for key, value in stored.items():
        session.driver.workers[key] = Worker(key, state="exited")
        service.put(RESULT_SCOPE, f"{key[0]}[{key[1]}]", cloudpickle.dumps(value))
    session.driver.run = lambda: ElasticResult(None, 2, 1, final_ranks={("b", 0): 0, ("a", 0): 1})
    out = session.run()
    assert out.ok and out.returncode == 0
    assert out.values() == ["B", "A"] and out.outcomes == {0: Returned("B"), 1: Returned("A")}
    assert out.workers == stored
    assert session.results(out) == ["B", "A"]


@pytest.mark.parametrize("stubborn", [False, True])
def test_workers_left_are_stopped_and_killed_only_if_they_do_not_end(stubborn: bool) -> None:
    # a fails at once and its host is blacklisted; b waits for a second slot that never comes
    session, _, workers = make({"a": 1, "b": 1}, 2, {"a": (1, None)}, stubborn=stubborn,
                               timeout=0.2)
    out = session.run()
    assert out.error is not None and "too few hosts" in out.error
    b = workers[("b", 0)]
    assert b.calls == (["stop", "kill"] if stubborn else ["stop"])
    assert not any(w.alive for w in session.driver.workers.values())


def test_collected_run_task_results_are_protocol_outcomes_and_nothing_else() -> None:
    import cloudpickle

    from horovod.common.protocol import RESULT_SCOPE

    session, _, _ = make({"a": 1, "b": 1}, 2, {"a": (1, None), "b": (1, None)})
    session.run()
    stored = {"a[0]": Returned("A"), "b[0]": Raised(KeyError("label"), "tb")}
    session.collect_outcomes(lambda scope, key: cloudpickle.dumps(stored[key])
                             if scope == RESULT_SCOPE and key in stored else None)
    got = session._outcomes
    assert got[("a", 0)] == Returned("A") and isinstance(got[("b", 0)], Raised)
    assert got[("b", 0)].error.args == ("label",) and got[("b", 0)].traceback == "tb"
    # the tuples older Ray workers sent are no outcome
    with pytest.raises(HorovodInternalError, match=r"worker a\[0\] reported tuple .* not an outcome"):
        session.collect_outcomes(lambda scope, key: cloudpickle.dumps(("ok", 1)))


def test_a_failed_job_raises_the_one_failure_text_naming_the_root_cause_worker() -> None:
    """Every launcher's elastic failure (horovod.run, run_elastic, RayExecutor) is this one:
    why the driver gave up, then the root-cause worker in the words of a static job's rank,
    the others, the launcher's notes and the root cause's traceback."""
    from horovod.runner.failures import EXITED_NON_ZERO
    from horovod.runner.job_outcome import JobFailedError

    session, _, _ = make({"a": 1, "b": 1}, 2, {"a": (1, None), "b": (1, None)},
                         caller="Launcher.run(f) [elastic]", notes=["  (what the launcher knows)"])
    peer = HorovodInternalError("peer left")
    own = KeyError("label")
    session.record_outcome(("a", 0), Raised(peer, "tb of a"))
    session.record_outcome(("b", 0), Raised(own, "Traceback (most recent call last):\n  in b\n"))
    out = session.run()
    with pytest.raises(JobFailedError) as info:
        session.results(out, ["  (this run's note)"])
    err = info.value
    lines = str(err).splitlines()
    # (the driver's reason ends with upstream's sentence: a worker exited non-zero; it goes last)
    assert out.error is not None and out.error.endswith(EXITED_NON_ZERO)
    reason = out.error.replace(EXITED_NON_ZERO, "").strip()
    assert lines[0] == f"Launcher.run(f) [elastic]: the elastic job failed: {reason}", lines
    assert lines[1] == "  (0 round(s), 0 reset(s))", lines
    assert lines[2] == "  root cause: worker b[0] raised KeyError: 'label'", lines
    assert lines[3] == "  also worker a[0]: HorovodInternalError: peer left", lines
    assert lines[4:6] == ["  (what the launcher knows)", "  (this run's note)"], lines
    assert lines[6:] == ["Traceback of worker b[0]:", "Traceback (most recent call last):", "  in b",
                         EXITED_NON_ZERO]
    assert (err.rank, err.host, err.exception, err.ranks) == (None, "b", own, [])
    assert err.__cause__ is own and err.outcome is out and err.resets == 0
