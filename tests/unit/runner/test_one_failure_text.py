"""One failure text for every job: static and elastic, horovodrun, Spark and Ray.

A static job's rank and an elastic job's worker that fail the same way are described in the same
words (``job_outcome.format_failure``), the root cause named first; and no launcher makes a
``WorkerFailedError`` of its own (read from the source: every one comes from a ``JobOutcome``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from horovod.common import protocol
from horovod.common.exceptions import HorovodInternalError
from horovod.common.protocol import FailureRecord
from horovod.runner.elastic.driver import ElasticResult, WorkerFailure
from horovod.runner.failures import EXITED_NON_ZERO, RankExit, exception_record, with_upstream_sentence
from horovod.runner.job_outcome import JobFailedError, JobOutcome

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[3] / "horovod"


def _static(outcomes: dict[int, protocol.WorkerOutcome], exits: list[RankExit]) -> JobOutcome:
    return JobOutcome(exits, 1, outcomes)


def _elastic(outcomes: dict[tuple[str, int], protocol.WorkerOutcome],
             failures: list[WorkerFailure], reason: str = "reset limit 1 exceeded") -> JobOutcome:
    result = ElasticResult(reason, 3, 2, ["an event"], {}, failures)
    return JobOutcome(returncode=1, error=result.error, elastic=result, workers=outcomes)


def _failure(key: tuple[str, int], rank: int, t: float, exc: BaseException | None = None,
             sig: int | None = None) -> WorkerFailure:
    record = exception_record(exc, t) if exc is not None else None
    status = "exit code 1" if sig is None else f"killed by signal {sig} (SIGKILL)"
    return WorkerFailure(key, rank, status, None if sig else 1, sig, t, record)


def test_a_rank_and_a_worker_that_fail_alike_are_described_alike() -> None:
    own, peer = ValueError("bad batch"), HorovodInternalError("peer left")
    lost = RuntimeError("The actor died unexpectedly\nits details")
    static = _static({1: protocol.Raised(own, "tb1"), 0: protocol.Raised(peer, "tb0"),
                      2: protocol.Died(lost)},
                     [RankExit(r, "h", 1, None, 5.0) for r in (0, 1)])
    elastic = _elastic({("h", 1): protocol.Raised(own, "tb1"), ("h", 0): protocol.Raised(peer, "tb0"),
                        ("g", 0): protocol.Died(lost)},
                       [_failure(("h", 0), 0, 5.0, peer), _failure(("h", 1), 1, 5.0, own),
                        _failure(("g", 0), 2, 5.0, sig=9)])
    s = static.failure("horovod.run", lambda r: f"<{r}>", upstream=False)
    e = elastic.failure("horovod.run", upstream=False)
    s_lines, e_lines = str(s).splitlines(), str(e).splitlines()
    # the root cause first, by the one rule (its own error before a peer's "peer left")
    assert s_lines[0] == "horovod.run: <1> raised ValueError: bad batch", s_lines
    assert e_lines[:3] == ["horovod.run: the elastic job failed: reset limit 1 exceeded",
                           "  (3 round(s), 2 reset(s))",
                           "  root cause: worker h[1] (rank 1) raised ValueError: bad batch"], e_lines
    # the others in the same words, after each launcher's place
    s_also = [line.split(">", 1)[1] for line in s_lines if line.startswith("  also ")]
    e_also = [line.split(")", 1)[1] for line in e_lines if line.startswith("  also ")]
    assert sorted(s_also) == sorted(e_also) == sorted([": HorovodInternalError: peer left", " died"])
    assert s_lines[-2:] == ["Traceback of rank 1:", "tb1"], s_lines
    assert e_lines[-2:] == ["Traceback of worker h[1] (rank 1):", "tb1"], e_lines
    # the same fields, and the outcome itself
    for err, host in ((s, "h"), (e, "h")):
        assert isinstance(err, JobFailedError) and err.rank == 1 and err.host == host
        assert err.exception is own and err.__cause__ is own and err.ranks[0] == 1
    assert e.outcome is elastic and e.events == ["an event"] and e.resets == 2
    assert sorted(e.ranks) == [0, 1, 2]


def test_a_worker_lost_or_failing_without_an_outcome_is_named_by_its_exit() -> None:
    """horovodrun's command workers leave no outcome: the root cause is their exit and the error
    their program recorded; a lost worker in the launcher's words for a lost rank."""
    own = FailureRecord(2, "cause", "ValueError: bad batch", 4.0)
    peer = FailureRecord(1, "consequence", "HorovodInternalError: peer left", 5.0)
    outcome = _elastic({}, [WorkerFailure(("n0", 0), 0, "exit code 1", 1, None, 5.0, peer),
                            WorkerFailure(("n1", 0), 1, "exit code 2", 2, None, 6.0, own)],
                       with_upstream_sentence("every worker failed"))
    lines = str(outcome.failure("horovodrun")).splitlines()
    # (upstream's sentence, which the driver adds to its reason when a worker exited non-zero,
    # goes last, as in a static job's report)
    assert lines[0] == "horovodrun: the elastic job failed: every worker failed"
    assert lines[2] == "  root cause: worker n1[0] (rank 1) exit code 2: ValueError: bad batch"
    assert lines[3] == "  also worker n0[0] (rank 0): exit code 1 (HorovodInternalError: peer left)"
    assert lines[4:] == [EXITED_NON_ZERO], lines
    # horovodrun's own report names the same worker in the same words
    assert "root cause: worker n1[0] (rank 1) exit code 2: ValueError: bad batch" in outcome.report()
    died = _elastic({("n2", 0): protocol.Died(RuntimeError("gone"))}, [_failure(("n2", 0), 3, 1.0, sig=9)])
    lost = str(died.failure("R", lost="died: {error} (its actor ended)")).splitlines()[2]
    assert lost == "  root cause: worker n2[0] (rank 3) died: gone (its actor ended)"


def test_a_failed_elastic_job_without_a_failed_worker_says_why() -> None:
    outcome = _elastic({}, [])
    err = outcome.failure("horovod.spark.run_elastic", notes=["  (the cluster offers 1 slot)"],
                          upstream=False)
    assert str(err).splitlines() == [
        "horovod.spark.run_elastic: the elastic job failed: reset limit 1 exceeded",
        "  (3 round(s), 2 reset(s))", "  (the cluster offers 1 slot)"]
    assert err.rank is None and err.exception is None and err.ranks == []


def _made_here(path: Path) -> list[str]:
    """Where ``path`` constructs a ``WorkerFailedError`` (or a subclass) or writes the elastic
    failure's first words itself."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("WorkerFailedError", "JobFailedError"):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name}(...)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                "elastic job failed" in node.value:
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value[:40]!r}")
    return found


def test_no_launcher_writes_a_failure_of_its_own() -> None:
    """Every job's failure comes from its ``JobOutcome`` (``runner/job_outcome.py``): horovodrun,
    horovod.run, Spark and Ray, static and elastic."""
    own = [hit for path in sorted(PACKAGE.rglob("*.py")) if path.name != "job_outcome.py"
           for hit in _made_here(path)]
    assert not own, "failure texts written outside runner/job_outcome.py:\n" + "\n".join(own)
