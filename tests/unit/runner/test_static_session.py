"""The static session every launcher shares (horovodrun, horovod.run, Spark, Ray), with a fake
service and fake supervisors: the function published before any rank starts, the results read
back, the service stopped, and the one failure text naming the root cause."""

from __future__ import annotations

import signal

import cloudpickle
import pytest

from horovod.common import protocol
from horovod.common.exceptions import HorovodInternalError, WorkerFailedError
from horovod.runner.failures import EXITED_NON_ZERO, RankExit
from horovod.runner.job_outcome import JobOutcome
from horovod.runner.launch.static_session import StaticSession

pytestmark = pytest.mark.unit


class Service:
    def __init__(self) -> None:
        self.kv: dict[tuple[str, str], bytes] = {}
        self.stopped = False

    def put(self, scope: str, key: str, value: bytes) -> None:
        self.kv[(scope, key)] = value

    def get(self, scope: str, key: str) -> bytes | None:
        return self.kv.get((scope, key))

    def stop(self) -> None:
        self.stopped = True


def _rank_runs(service: Service, rank: int) -> None:
    """What ``run_task`` does on ``rank``: read the call, run it, store the outcome."""
    raw = service.get(protocol.FUNC_SCOPE, protocol.FUNC_KEY)
    assert raw is not None, "the function must be published before any rank starts"
    call = protocol.function_call(cloudpickle.loads(raw))
    try:
        out: protocol.TaskOutcome = protocol.Returned(call.fn(rank, *call.args, **call.kwargs))
    except Exception as exc:  # noqa: BLE001 - as run_task
        out = protocol.Raised(exc, f"Traceback (rank {rank})")
    service.put(protocol.RESULT_SCOPE, str(rank), cloudpickle.dumps(out))


def _scaled(rank: int, factor: int, *, bad: int = -1) -> int:
    if rank == bad:
        raise ValueError(f"bad batch on rank {rank}")
    if bad >= 0:
        raise HorovodInternalError("a peer left")
    return rank * factor


def test_a_function_job_publishes_the_call_collects_the_results_and_stops_the_service() -> None:
    service = Service()
    session = StaticSession(3, "horovod.run", service=service,
                            call=protocol.FunctionCall.of(_scaled, [10]))

    def supervise() -> JobOutcome:
        assert not service.stopped
        for r in range(3):
            _rank_runs(service, r)
        return JobOutcome([RankExit(r, "h", 0, None, 1.0) for r in range(3)], 0)

    outcome = session.run(supervise)
    assert service.stopped and outcome.ok
    assert sorted(outcome.outcomes) == [0, 1, 2]
    assert session.results(outcome) == [0, 10, 20]


def test_a_raised_error_names_its_rank_host_and_traceback_and_the_others() -> None:
    service = Service()
    session = StaticSession(3, "horovod.run", service=service,
                            call=protocol.FunctionCall.of(_scaled, [10], {"bad": 1}))

    def supervise() -> JobOutcome:
        for r in range(3):
            _rank_runs(service, r)
        return JobOutcome([RankExit(0, "h0", 1, None, 1.0), RankExit(1, "h1", 1, None, 2.0),
                           RankExit(2, "h0", 1, None, 1.5)], 1)

    outcome = session.run(supervise)
    with pytest.raises(WorkerFailedError) as info:
        session.results(outcome)
    err = info.value
    assert err.rank == 1 and err.host == "h1" and err.ranks == [1, 0, 2]  # type: ignore[attr-defined]
    assert isinstance(err.exception, ValueError)  # type: ignore[attr-defined]
    text = str(err)
    assert text.startswith("horovod.run: rank 1 on host h1 raised ValueError: bad batch on rank 1\n"), text
    assert "  also rank 0 on host h0: HorovodInternalError: a peer left" in text
    assert "Traceback of rank 1:\nTraceback (rank 1)" in text and text.endswith(EXITED_NON_ZERO)


def test_the_service_is_stopped_when_the_supervisor_fails_and_kept_when_not_owned() -> None:
    service = Service()
    session = StaticSession(1, "x", service=service)

    def broken() -> JobOutcome:
        raise RuntimeError("could not start")

    with pytest.raises(RuntimeError, match="could not start"):
        session.run(broken)
    assert service.stopped
    kept = Service()
    StaticSession(1, "x", service=kept, own_service=False).run(lambda: JobOutcome())
    assert not kept.stopped


def test_reported_outcomes_lost_ranks_and_stuck_ones_in_the_launchers_words() -> None:
    """As a static RayExecutor call reports: no exits, no service; a dead actor is the root
    cause before ranks that only lost it, and a rank that never finished is named."""
    session = StaticSession(4, "RayExecutor.run(f)", where=lambda r: f"rank {r} (node n{r})",
                            lost="died: {error} (its actor ended)", upstream=False)
    session.record_outcome(0, protocol.Raised(HorovodInternalError("peer left"), "tb0"))
    session.record_outcome(1, protocol.Died(RuntimeError("The actor died unexpectedly\nmore")))
    session.record_outcome(2, protocol.Returned(2))
    outcome = session.run(lambda: JobOutcome(returncode=1, stuck=[3], seen={0: 2.0, 1: 3.0}))
    assert not outcome.ok and outcome.failed_ranks() == [1, 0]
    with pytest.raises(WorkerFailedError) as info:
        session.results(outcome, notes=["every worker was stopped"])
    text = str(info.value)
    assert text.splitlines() == [
        "RayExecutor.run(f): rank 1 (node n1) died: The actor died unexpectedly (its actor ended)",
        "  also rank 0 (node n0): HorovodInternalError: peer left",
        "  rank 3 (node n3) did not finish after the failure (waiting for the failed rank in a collective)",
        "every worker was stopped"], text
    assert info.value.stuck_ranks == [3]  # type: ignore[attr-defined]


def test_a_command_job_reports_its_processes() -> None:
    """horovodrun's command job: no service, no function; the report is the processes'."""
    outcome = StaticSession(2, "horovodrun").run(lambda: JobOutcome(
        [RankExit(0, "a", None, int(signal.SIGTERM), 2.0, stopped_by="rank 1 failed"),
         RankExit(1, "b", 3, None, 1.0, stderr_tail=["boom"])], 3))
    first = outcome.root_cause()
    assert first is not None and first.rank == 1 and outcome.returncode == 3
    report = outcome.report()
    assert "rank 1 (host b): exit code 3" in report and "| boom" in report
    assert "rank 0 (host a): killed by signal 15 (SIGTERM), stopped after the first failure" in report
