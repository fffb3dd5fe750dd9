"""The engine's counters and the straggler rule (horovod/common/engine/metrics.py), one process."""

from __future__ import annotations

import numpy as np
import pytest

from horovod.common.engine.metrics import Counters, StragglerDetector, decode_verdict

NAN = np.nan


def rounds(late_rows: list[list[float]], period: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    late = np.array(late_rows, float)
    return late, np.where(np.isnan(late), NAN, period)


def one_late(rank: int, size: int = 4, by: float = 0.05, base: float = 0.0005) -> list[float]:
    """A round where every rank but ``rank`` waited ``by`` seconds for it."""
    return [base if r == rank else base + by for r in range(size)]


def test_consistent_straggler_is_flagged_within_five_rounds() -> None:
    d = StragglerDetector(4)
    flagged_at = None
    for i in range(5):
        d.judge(*rounds([one_late(2)]))
        if d.stragglers and flagged_at is None:
            flagged_at = i + 1
    assert d.stragglers == [2]
    assert flagged_at is not None and flagged_at <= 5
    assert d.flag_events == 1
    assert d.scores[2] > 0.5 and max(d.scores[[0, 1, 3]]) == 0.0


def test_rank_late_once_in_a_while_is_not_flagged() -> None:
    d = StragglerDetector(4)
    rng = np.random.default_rng(0)
    for i in range(400):
        if i % 4 == 0:  # rank 1 descheduled every fourth round: late, but not consistently
            d.judge(*rounds([one_late(1)]))
        else:  # otherwise a random rank is last by a little (the noise of a busy machine)
            d.judge(*rounds([one_late(int(rng.integers(4)), by=0.0005)]))
    assert d.flag_events == 0 and d.stragglers == []


def test_small_lateness_is_not_a_hit() -> None:
    d = StragglerDetector(4)
    for _ in range(20):  # rank 3 always last, but by 1 ms of a 50 ms step
        d.judge(*rounds([one_late(3, by=0.001)]))
    assert d.stragglers == []
    for _ in range(20):  # last by 20% of the step: below min_relative
        d.judge(*rounds([one_late(3, by=0.01)]))
    assert d.stragglers == []


def test_flag_has_hysteresis() -> None:
    d = StragglerDetector(4)
    for _ in range(5):
        d.judge(*rounds([one_late(2)]))
    assert d.stragglers == [2]
    # Two more late rounds among quiet ones keep it flagged (no flapping) ...
    for row in [one_late(0, by=0.0001), one_late(2), one_late(1, by=0.0001), one_late(2)]:
        d.judge(*rounds([row]))
        assert d.stragglers == [2]
    # ... and a run of quiet rounds releases it.
    for _ in range(10):
        d.judge(*rounds([one_late(0, by=0.0001)]))
    assert d.stragglers == []
    assert d.flag_events == 1


def test_two_ranks_and_partial_rounds() -> None:
    d = StragglerDetector(3)
    # rank 1 takes no part in these rounds (a process set without it): judged among 0 and 2
    for _ in range(5):
        d.judge(*rounds([[0.06, NAN, 0.001]]))
    assert d.stragglers == [2]
    d2 = StragglerDetector(3)
    d2.judge(*rounds([[0.06, NAN, NAN]]))  # one reporter: nothing to compare
    assert d2.rounds == 0


def test_feed_aligns_rounds_across_ranks() -> None:
    size = 3
    counters = [Counters(r, size, start=0.0) for r in range(size)]
    for step in range(1, 7):
        t = step * 0.1
        for r, c in enumerate(counters):
            last_submit = t - (0.0005 if r == 1 else 0.08)  # rank 1 submits just before the round
            c.record_round(10 + step, t, last_submit - 0.001, last_submit)
    d = StragglerDetector(size)
    d.feed([c.take_window() for c in counters])
    assert d.stragglers == [1] and d.rounds == 6
    for c in counters:
        c.apply_verdict(d.verdict())
    assert counters[1].snapshot()["straggler"] and not counters[0].snapshot()["straggler"]
    assert counters[0].snapshot()["stragglers"] == [1]
    assert counters[0].take_window() == b""  # taken


def test_counters_bytes_wait_and_steps() -> None:
    c = Counters(0, 2, start=0.0)
    c.record_batch("allreduce", 2, 64, 0.5)
    c.record_batch("allreduce", 1, 8, 0.25)
    c.record_batch("allgather", 1, 12, 0.125)
    c.record_round(1, t_ready=1.0, first_submit=0.5, last_submit=0.75)  # waited 0.5 s
    c.record_round(2, t_ready=1.2, first_submit=0.9, last_submit=1.1)  # overlaps: only 0.2 s new
    c.step_done(1.0)
    c.step_done(1.5)
    s = c.snapshot()
    assert s["collectives"] == {"allreduce": 3, "allgather": 1}
    assert s["collective_bytes"] == {"allreduce": 72, "allgather": 12}
    assert s["collective_seconds"] == {"allreduce": 0.75, "allgather": 0.125}
    assert s["wait_seconds"] == pytest.approx(0.7)
    assert s["steps"] == 2 and s["step_times"] == [1.0, 0.5]


def test_verdict_round_trip() -> None:
    d = StragglerDetector(5)
    for _ in range(5):
        d.judge(*rounds([one_late(4, size=5)]))
    stragglers, scores, events = decode_verdict(d.verdict(), 5)
    assert stragglers == [4] and events == 1 and scores[4] == pytest.approx(float(d.scores[4]), rel=1e-6)


def test_bad_rule_parameters() -> None:
    with pytest.raises(ValueError, match="flag_hits"):
        StragglerDetector(4, flag_window=5, flag_hits=6)
