"""Waiting for every rank's call on a Ray job, and the error that names the ranks that failed
(shared by ``RayExecutor``'s static and elastic adapters)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from horovod.common.protocol import Died, Exited, Raised, Returned, WorkerOutcome, task_outcome
from horovod.runner.job_outcome import first_line

if TYPE_CHECKING:
    from horovod.runner.job_outcome import JobOutcome

__all__ = ["FAILURE_GRACE_SECONDS", "Failure", "LOST", "call_outcome", "failure_error", "first_line",
           "wait_all", "ranks_by_cause"]

log = logging.getLogger("horovod.ray")

# After the first rank fails, how long the others get to finish or fail in turn (a dead peer
# makes their collectives fail within a second) before the job is declared stuck.
FAILURE_GRACE_SECONDS = 5.0

# How a rank failed: its function raised (or exited), or its actor died.
Failure = Raised | Died

# How a rank whose actor died is described (``job_outcome.format_failure``).
LOST = "died: {error} (its actor's process ended: killed, out of memory, or its node was lost)"


def wait_all(refs: list[Any], describe: Callable[[int], str], what: str,
             grace: float = FAILURE_GRACE_SECONDS, times: dict[int, float] | None = None,
             ) -> tuple[list[Any], dict[int, Failure], list[int]]:
    """Wait for every rank's ``execute_reported`` call.

    Returns (values by rank, failures by rank as ``Raised`` (a rank's ``sys.exit`` as a raised
    ``SystemExit``) or ``Died``, ranks still running ``grace`` seconds after the first failure).
    ``times`` (when given) receives when each failure was seen (seconds since the epoch).
    """
    import ray
    import ray.exceptions

    pending = {ref: rank for rank, ref in enumerate(refs)}
    values: list[Any] = [None] * len(refs)
    failures: dict[int, Failure] = {}
    first_failure: float | None = None
    while pending:
        timeout = 1.0 if first_failure is None else max(0.0, first_failure + grace - time.monotonic())
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
        for ref in ready:
            rank = pending.pop(ref)
            try:
                out = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                failures[rank] = Died(exc)
            except ray.exceptions.RayError as exc:
                failures[rank] = Raised(exc, str(exc))
            else:
                out = task_outcome(out, describe(rank))
                if isinstance(out, Returned):
                    values[rank] = out.value
                elif isinstance(out, Exited):
                    failures[rank] = Raised(SystemExit(out.code), f"SystemExit({out.code})")
                else:
                    failures[rank] = out
            if rank in failures and times is not None:
                times[rank] = time.time()
        if failures and first_failure is None:
            first_failure = time.monotonic()
            log.debug("%s: %s failed; waiting up to %g s for the other ranks", what,
                      describe(min(failures)), grace)
        if first_failure is not None and time.monotonic() >= first_failure + grace:
            break
    return values, failures, sorted(pending.values())


def call_outcome(values: list[Any], failures: dict[int, Failure], stuck: list[int],
                 times: dict[int, float] | None = None) -> JobOutcome:
    """One call on every rank (``wait_all``'s answer) as the ``JobOutcome`` of every launcher:
    the ranks that returned, raised, died or are still running, and when each failure was seen."""
    from horovod.runner.job_outcome import JobOutcome

    done = {r: Returned(v) for r, v in enumerate(values) if r not in failures and r not in stuck}
    outcomes: dict[int, WorkerOutcome] = {**done, **failures}
    return JobOutcome(returncode=1 if failures or stuck else 0, outcomes=outcomes,
                      stuck=list(stuck), seen=dict(times or {}))


def failure_error(what: str, failures: dict[int, Failure], stuck: list[int],
                  describe: Callable[[int], str], tail: str = "",
                  times: dict[int, float] | None = None) -> Exception:
    """The ``WorkerFailedError`` for failed ranks, in the text of every launcher
    (``horovod.runner.job_outcome.format_failure``): the root cause first, by the rule of every
    launcher (``horovod.runner.failures.root_cause``: a rank's own error before errors that only
    say a peer left, then the earliest, a dead actor before a rank that raised at the same
    moment), then the other ranks; each rank named with its node. ``times``: when each failure
    was seen (``wait_all``); without it they count as simultaneous."""
    return call_outcome([], failures, stuck, times).failure(
        what, describe, lost=LOST, notes=[tail] if tail else [], stuck_wait=FAILURE_GRACE_SECONDS,
        upstream=False)


def ranks_by_cause(failures: dict[int, Failure], times: dict[int, float]) -> list[int]:
    """The failed ranks, the root cause first (``failures.root_cause`` over their exits: a dead
    actor as killed by SIGKILL, a raised exception with the record it makes), then by rank."""
    return call_outcome([], failures, [], times).failed_ranks()
