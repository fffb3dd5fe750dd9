"""Per-rank failure report (pure)."""

from __future__ import annotations

import time

from horovod.common.protocol import FailureRecord
from horovod.runner.failures import EXITED_NON_ZERO, RankExit, format_report, root_cause


def test_root_cause_is_earliest_failure_not_stopped_by_launcher() -> None:
    exits = [
        RankExit(0, "a", None, 15, 5.0, stopped_by="received SIGTERM"),
        RankExit(1, "a", 1, None, 4.0, stderr_tail=["connection reset"]),
        RankExit(2, "b", None, 9, 3.0, stderr_tail=["boom"], local_rank=0),
        RankExit(3, "b", 0, None, 1.0),
    ]
    first = root_cause(exits)
    assert first is not None and first.rank == 2 and first.signal == 9
    text = format_report(exits)
    assert "rank 2 (host b, local rank 0): killed by signal 9 (SIGKILL)" in text
    assert "| boom" in text
    assert "rank 1 (host a): exit code 1 (after the first failure)" in text
    assert "rank 0 (host a): killed by signal 15 (SIGTERM), stopped after the first failure" in text
    assert "rank 3" not in text  # finished cleanly


def test_report_for_interrupt_names_the_signal() -> None:
    exits = [RankExit(0, "a", None, 2, 1.0, stopped_by="received SIGINT")]
    assert "interrupted (SIGINT)" in format_report(exits, interrupted="SIGINT")


def test_exit_status_is_code_or_128_plus_signal() -> None:
    assert RankExit(0, "a", 3, None, 0).exit_status == 3
    assert RankExit(0, "a", None, 9, 0).exit_status == 137
    assert not RankExit(0, "a", 0, None, 0).failed


def _rec(kind: str, t: float, error: str = "RuntimeError: boom", code: int = 1) -> FailureRecord:
    return FailureRecord(code, kind, error, t)


def test_cause_wins_over_an_earlier_consequence() -> None:
    """Rank 0 ended first, but only with HorovodShutdownError because rank 1 left."""
    exits = [
        RankExit.with_record(_rec("consequence", 2.0, "HorovodShutdownError: shut down"),
                             0, "a", 1, None, 2.1),
        RankExit.with_record(_rec("cause", 1.9, "RuntimeError: step 5 failed"), 1, "a", 1, None,
                             2.6),
    ]
    first = root_cause(exits)
    assert first is not None and first.rank == 1
    text = format_report(exits)
    assert text.splitlines()[1].startswith("  rank 1 (host a): exit code 1")
    assert "  error: RuntimeError: step 5 failed" in text
    assert "rank 0 (host a): exit code 1, because a peer left (HorovodShutdownError" in text


def test_cause_stuck_at_exit_and_stopped_still_wins() -> None:
    """The failing rank hung on its way out and the launcher SIGTERMed it after rank 0 ended."""
    exits = [
        RankExit.with_record(_rec("consequence", 2.0), 0, "a", 1, None, 2.1),
        RankExit.with_record(_rec("cause", 1.9, code=1), 1, "a", None, 15, 2.4,
                             stopped_by="received SIGTERM"),
    ]
    first = root_cause(exits)
    assert first is not None and first.rank == 1
    assert first.exit_status == 1  # the code its error gave, not 128 + SIGTERM
    assert "stopped on its way out" in format_report(exits)


def test_cause_without_exit_report_still_wins() -> None:
    """mpirun stopped the failing rank before its shim reported; only its error record came."""
    e1 = RankExit(1, "a", None, None, 2.5, stopped_by="by mpirun; its exit report was not forwarded")
    e1.apply_record(_rec("cause", 1.9))
    exits = [RankExit.with_record(_rec("consequence", 2.0), 0, "a", 1, None, 2.1), e1]
    first = root_cause(exits)
    assert first is not None and first.rank == 1 and first.exit_status == 1


def test_error_raised_by_a_stopped_rank_after_the_first_failure_is_not_the_cause() -> None:
    """Rank 2 was SIGKILLed (no record); rank 0's SIGTERM handler raised while being stopped."""
    exits = [
        RankExit.with_record(_rec("cause", 5.0), 0, "a", 1, None, 5.1, stopped_by="received SIGTERM"),
        RankExit(2, "b", None, 9, 3.0),
    ]
    first = root_cause(exits)
    assert first is not None and first.rank == 2


def test_consequences_are_not_root_causes_when_another_rank_failed_by_itself() -> None:
    exits = [
        RankExit.with_record(_rec("consequence", 1.0), 0, "a", 1, None, 1.0),
        RankExit(1, "a", 3, None, 1.3),  # sys.exit(3) from a program that recorded nothing
    ]
    first = root_cause(exits)
    assert first is not None and first.rank == 1


def test_earliest_of_several_causes() -> None:
    exits = [RankExit.with_record(_rec("cause", 2.0), 0, "a", 1, None, 2.2),
             RankExit.with_record(_rec("cause", 1.5), 2, "a", 1, None, 2.4)]
    first = root_cause(exits)
    assert first is not None and first.rank == 2


def test_malformed_record_is_ignored() -> None:
    # what a launcher reads is no record when malformed; a rank without one has no error kind
    for wire in ({"kind": "nonsense"}, "not a dict", None, {"error": "no kind"}):
        assert FailureRecord.from_wire(wire) is None
    e = RankExit.with_record(FailureRecord.from_wire({"kind": "nonsense"}), 0, "a", 1, None, 1.0)
    assert e.error_kind is None and e.error == ""
    # fields of the wrong type read as unknown, the record stays
    odd = FailureRecord.from_wire({"kind": "cause", "code": "1", "time": True, "error": None})
    assert odd == FailureRecord(None, "cause", "", None)


def test_a_rank_that_exited_zero_is_never_the_cause() -> None:
    ok = RankExit.with_record(_rec("cause", 0.5), 0, "a", 0, None, 3.0)
    bad = RankExit(1, "a", None, 9, 2.0)
    assert root_cause([ok, bad]) is bad
    assert root_cause([ok]) is None


# ------------------------------------------------------------ one rule for every launcher
# horovodrun (static and elastic), horovod.run, Spark and Ray all name the root cause with
# failures.root_cause; a raised exception counts as the rank's exit record where it left none.

def test_exception_record_has_the_shape_and_kind_of_a_programs_record() -> None:
    from horovod.common.exceptions import HorovodInternalError
    from horovod.runner.failures import exception_record

    own = exception_record(ValueError("bad batch"), 7.0)
    assert own == FailureRecord(1, "cause", "ValueError: bad batch", 7.0)
    assert own == FailureRecord.from_wire(own.to_wire())  # the shape of a program's record
    assert exception_record(HorovodInternalError("peer left"), 7.0, 3).kind == "consequence"
    e = RankExit.with_record(own, 1, "a", 1, None, 7.0)
    assert (e.error_kind, e.error, e.error_time) == ("cause", "ValueError: bad batch", 7.0)


def test_run_results_name_the_rank_whose_error_is_its_own() -> None:
    import pytest

    from horovod.common.exceptions import HorovodInternalError, WorkerFailedError
    from horovod.common.protocol import Raised, Returned
    from horovod.runner.job_outcome import JobOutcome

    # rank 0 only lost its peer (and ended first), rank 2 raised its own error
    outcomes = {0: Raised(HorovodInternalError("peer left"), "tb0"), 1: Returned(1),
                2: Raised(KeyError("label"), "tb2")}
    exits = [RankExit(0, "a", 1, None, 1.0), RankExit(1, "a", 0, None, 2.0),
             RankExit(2, "b", 1, None, 3.0)]
    with pytest.raises(WorkerFailedError) as info:
        JobOutcome(exits, 1, outcomes).results("test", 3)
    assert info.value.rank == 2 and isinstance(info.value.exception, KeyError)
    assert info.value.__cause__ is info.value.exception
    text = str(info.value)
    assert text.startswith("test: rank 2 on host b raised KeyError: 'label'\n  its process: exit code 1")
    assert "  also rank 0 on host a: HorovodInternalError: peer left" in text
    assert "Traceback of rank 2:\ntb2" in text and "Traceback of rank 0" not in text
    assert text.endswith(EXITED_NON_ZERO)
    # two own errors: the one recorded first, by the records the programs left
    outcomes = {0: Raised(ValueError("late"), "tb0"), 1: Raised(ValueError("early"), "tb1")}
    exits = [RankExit.with_record(FailureRecord(None, "cause", "ValueError: late", 9.0), 0, "a",
                                  1, None, 1.0),
             RankExit.with_record(FailureRecord(None, "cause", "ValueError: early", 4.0), 1, "a",
                                  1, None, 5.0)]
    with pytest.raises(WorkerFailedError) as info:
        JobOutcome(exits, 1, outcomes).results("test", 2)
    assert info.value.rank == 1, str(info.value)
    # without exit records (a cluster launcher that lost them): the lowest own error
    outcomes = {0: Raised(HorovodInternalError("peer left"), "t"), 1: Raised(ValueError("x"), "t"),
                2: Raised(ValueError("y"), "t")}
    with pytest.raises(WorkerFailedError) as info:
        JobOutcome([], 1, outcomes).results("test", 3)
    assert info.value.rank == 1 and info.value.ranks == [1, 0, 2]
    # every function returned: the values in rank order
    assert JobOutcome([], 0, {1: Returned("b"), 0: Returned("a")}).results("test", 2) == ["a", "b"]


def test_a_job_that_failed_without_a_raised_error_reports_the_processes() -> None:
    """A rank killed before its function returned: its rank, host, status and stderr, from the
    processes' report (the same text horovodrun prints)."""
    import pytest

    from horovod.common.exceptions import HorovodInternalError, WorkerFailedError
    from horovod.common.protocol import Raised, Returned
    from horovod.runner.job_outcome import JobOutcome

    exits = [RankExit(0, "a", 0, None, 2.0), RankExit(1, "b", None, 9, 1.0, stderr_tail=["oom"])]
    with pytest.raises(WorkerFailedError) as info:
        JobOutcome(exits, 137, {0: Returned(0)}).results("horovod.run", 2)
    text = str(info.value)
    assert text.startswith("horovod.run: the job failed before every rank returned a result.\n"), text
    assert "rank 1 (host b): killed by signal 9 (SIGKILL)" in text and "| oom" in text
    assert info.value.rank == 1 and info.value.host == "b"
    # a rank killed while the others raised only because it left: the killed rank is the cause
    outcomes = {0: Raised(HorovodInternalError("peer left"), "tb0")}
    exits = [RankExit(0, "a", 1, None, 1.2), RankExit(1, "b", None, 9, 1.0, stderr_tail=["oom"])]
    with pytest.raises(WorkerFailedError) as info:
        JobOutcome(exits, 137, outcomes).results("horovod.run", 2)
    assert info.value.rank == 1 and info.value.ranks == [1, 0], str(info.value)
    assert "rank 1 (host b): killed by signal 9 (SIGKILL)" in str(info.value)


def test_ray_failures_are_ordered_by_the_same_rule() -> None:
    from horovod.common.exceptions import HorovodInternalError
    from horovod.common.protocol import Died, Raised
    from horovod.ray.waiting import ranks_by_cause

    lost = Raised(HorovodInternalError("peer left"), "tb")
    died = Died(RuntimeError("actor died"))
    # a dead actor before the ranks that only lost it, whichever was seen first
    assert ranks_by_cause({0: lost, 1: died, 2: lost}, {0: 1.0, 1: 2.0, 2: 1.5}) == [1, 0, 2]
    # a rank's own error before a peer's death, as for horovodrun's ranks
    own = Raised(ValueError("bad batch"), "tb")
    assert ranks_by_cause({0: lost, 1: died, 2: own}, {0: 1.0, 1: 1.2, 2: 1.1}) == [2, 0, 1]
    # no times known (simultaneous): still the dead actor
    assert ranks_by_cause({0: lost, 1: died}, {}) == [1, 0]


def test_rank_that_finished_while_another_waited_is_the_root_cause() -> None:
    """Rank 1's program ended normally (record "finished") at 10.0, then rank 0's broadcast
    failed because it left: rank 1 exited early, whether it exited 0 or was stopped on its way
    out (issue 45)."""
    waited = FailureRecord(1, "consequence", "HorovodShutdownError: shut down", 11.0,
                           waiting="broadcast 'zero.consolidate.0.sz'")
    finished = FailureRecord(0, "finished", "its program ended normally", 10.0)
    for rank1 in (RankExit.with_record(finished, 1, "a", 0, None, 10.5),
                  RankExit.with_record(finished, 1, "a", None, 15, 11.5, stopped_by="received SIGTERM")):
        exits = [RankExit.with_record(waited, 0, "a", 1, None, 11.1), rank1]
        first = root_cause(exits)
        assert first is rank1
        text = format_report(exits)
        clock = time.strftime("%H:%M:%S", time.localtime(10.0))
        assert (f"rank 1 exited with code 0 at {clock} while rank 0 waited in broadcast "
                "'zero.consolidate.0.sz'") in text, text
        assert "rank 0 (host a): exit code 1, because a peer left in broadcast" in text, text
        assert "stopped after the first failure" not in text, text


def test_rank_that_finished_after_the_failure_is_not_the_root_cause() -> None:
    exits = [RankExit.with_record(_rec("consequence", 9.0), 0, "a", 1, None, 9.1),
             RankExit.with_record(FailureRecord(0, "finished", "", 10.0), 1, "a", 0, None, 10.5)]
    first = root_cause(exits)
    assert first is not None and first.rank == 0


def test_finished_record_round_trips() -> None:
    rec = FailureRecord(0, "finished", "ended", 3.0, rank=1)
    assert FailureRecord.from_wire(rec.to_wire()) == rec
    rec = FailureRecord(1, "consequence", "x", 3.0, waiting="allreduce 'g'")
    assert FailureRecord.from_wire(rec.to_wire()) == rec
