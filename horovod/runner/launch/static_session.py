"""One static session: the part of a static job every launcher shares.

``horovodrun`` (processes under the ``Supervisor``: local shims, ssh clients or one mpirun),
``horovod.run`` (the same, each running ``horovod.runner.run_task``), ``horovod.spark.run`` (one
Spark barrier task per rank) and a static ``RayExecutor`` (one actor per rank, a call at a time)
differ only in how they start their ranks and see them end. Each gives ``StaticSession.run`` its
``supervise()``: start the ranks, wait for their end, and return how each one's process ended
(``JobOutcome``: exits, exit status; Ray: its ranks' outcomes, those still running). The session
owns the rest, as ``ElasticSession`` does for elastic jobs:

* the function every rank runs (``protocol.FunctionCall``), published on the job's rendezvous
  service before any rank starts, and the service itself, stopped at the end when ``own_service``;
* the results: what each rank's function returned or raised (``protocol.WorkerOutcome``: read
  from the service's ``RESULT_SCOPE``, where ``run_task`` stores them, or reported by the
  launcher with ``record_outcome``), merged into the ``JobOutcome``;
* the failure, by the one rule and in the one text of every launcher (``JobOutcome.failure``,
  ``job_outcome.format_failure``): :meth:`results` returns the values in rank order or raises it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from horovod.common import protocol
from horovod.runner.job_outcome import JobOutcome

__all__ = ["StaticSession", "StaticService", "read_outcomes"]


class StaticService(Protocol):
    """The job's rendezvous service (``RendezvousServer``, or a ``FunctionJob`` around one)."""

    def put(self, scope: str, key: str, value: bytes) -> None: ...

    def get(self, scope: str, key: str) -> bytes | None: ...

    def stop(self) -> None: ...


def read_outcomes(get: Callable[[str, str], bytes | None], keys: list[str],
                  ) -> dict[str, protocol.WorkerOutcome]:
    """The ``run_task`` results stored under ``keys`` of ``RESULT_SCOPE`` (those stored).

    Raises:
        HorovodInternalError: a stored result is no ``protocol.TaskOutcome``.
    """
    import cloudpickle

    found: dict[str, protocol.WorkerOutcome] = {}
    for key in keys:
        raw = get(protocol.RESULT_SCOPE, key)
        if raw is not None:
            found[key] = protocol.task_outcome(cloudpickle.loads(raw), f"rank {key}")
    return found


class StaticSession:
    """One static job (see the module docstring).

    Args:
        num_proc: the job's ranks.
        caller: what its failure's text starts with (``"horovod.run"``, ``"horovod.spark.run"``,
            ``"RayExecutor.run(f)"``).
        service: the job's rendezvous service (None: a command job without one, or Ray's calls).
        call: the function every rank runs, published on ``service`` (None: a command job).
        own_service: stop ``service`` when the run ends (False: the launcher keeps it for more
            runs, as ``RayExecutor`` does).
        where: a rank's place in messages (default: ``"rank R on host H"``).
        wording: how the launcher words a lost rank and its notes (``format_failure``).
    """

    def __init__(self, num_proc: int, caller: str, *, service: StaticService | None = None,
                 call: protocol.FunctionCall | None = None, own_service: bool = True,
                 where: Callable[[int], str] | None = None, **wording: Any) -> None:
        self.num_proc, self.caller, self.service = num_proc, caller, service
        self.own_service, self.where, self.wording = own_service, where, wording
        self._lock = threading.Lock()
        self._outcomes: dict[int, protocol.WorkerOutcome] = {}
        if call is not None:
            self.publish(call)

    def publish(self, call: protocol.FunctionCall) -> None:
        """Store the function every rank runs where ``run_task`` reads it."""
        import cloudpickle

        assert self.service is not None, "a function job needs a rendezvous service"
        self.service.put(protocol.FUNC_SCOPE, protocol.FUNC_KEY, cloudpickle.dumps(call))

    # ------------------------------------------------------------------ the launcher's reports
    def record_outcome(self, rank: int, outcome: protocol.WorkerOutcome) -> None:
        """What the function of ``rank`` returned or raised, or that it was lost (the last wins)."""
        with self._lock:
            self._outcomes[rank] = outcome

    def collect_outcomes(self) -> None:
        """Read every rank's ``run_task`` result from the service (those that stored one)."""
        if self.service is None:
            return
        found = read_outcomes(self.service.get, [str(r) for r in range(self.num_proc)])
        for key, outcome in found.items():
            self.record_outcome(int(key), outcome)

    # ------------------------------------------------------------------ the job
    def run(self, supervise: Callable[[], JobOutcome]) -> JobOutcome:
        """Run the launcher's ``supervise()`` to the job's end, collect the ranks' results, and
        stop the service if it is ours; returns the job's outcome with those results."""
        try:
            outcome = supervise()
            self.collect_outcomes()
        finally:
            if self.own_service and self.service is not None:
                self.service.stop()
        with self._lock:
            outcomes = {**outcome.outcomes, **self._outcomes}
        return dataclasses.replace(outcome, outcomes=outcomes)

    def results(self, outcome: JobOutcome, notes: Sequence[str] = ()) -> list[Any]:
        """The values every rank's function returned, in rank order.

        Raises:
            WorkerFailedError: a rank raised, was lost or failed, or ended without a result: the
                root cause named first (``JobOutcome.failure``; ``notes``: the launcher's lines
                after the ranks, such as what it did about the failure).
        """
        wording = {**self.wording, "notes": [*self.wording.get("notes", ()), *notes]}
        return outcome.results(self.caller, self.num_proc, self.where, **wording)
