"""Per-rank failure report (pure)."""

from __future__ import annotations

from horovod.runner.failures import RankExit, format_report, root_cause


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
