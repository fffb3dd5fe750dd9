"""One elastic session: the part of an elastic job every launcher shares.

``horovodrun`` (processes over ssh or local), Spark (``horovod.spark.run_elastic``: workers in
agent tasks) and Ray (``RayExecutor`` with ``min_workers``: actors) run the same driver
(``driver.ElasticDriver``). What differs between them is only how a worker is started on a slot
and how it is stopped or killed: the launcher gives ``ElasticSession`` a
``start_worker(key, slot) -> WorkerHandle`` and reports every worker's end with
``session.worker_exited(key, code, signal, record)``. The session owns the rest:

* the rendezvous service's elastic handler, attached for the run and detached after it (and the
  service itself, stopped at the end, when ``own_service``);
* the end of the job: every worker still alive is asked to stop (``WorkerHandle.stop``), the
  session waits on the driver's condition until each has ended, and kills those still alive after
  ``exit_wait`` seconds (``WorkerHandle.kill``);
* the results: what each worker's function returned or raised, or that its process was lost
  (``protocol.WorkerOutcome``: reported with ``record_outcome``, or the ``run_task`` results the
  workers stored under their slot names in the rendezvous store, read at the end), and the job's
  outcome, a ``JobOutcome`` as every job's (``runner/job_outcome.py``): the final round's results
  by rank, the workers' outcomes by slot, the driver's rounds and failures;
* the failure: :meth:`ElasticSession.results` returns the final round's values in rank order or
  raises ``JobOutcome.failure``, the one text of every launcher, the root-cause worker named
  first by the rule of static jobs (``horovod.runner.failures.root_cause`` over the workers'
  exit records).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from horovod.common import protocol
from horovod.runner.elastic.discovery import HostManager
from horovod.runner.elastic.driver import ElasticDriver, ElasticResult, Key, WorkerHandle, key_name
from horovod.runner.elastic.settings import DriverSettings
from horovod.runner.failures import exception_record
from horovod.runner.hosts import SlotInfo
from horovod.runner.job_outcome import JobOutcome

__all__ = ["ElasticSession", "ElasticService", "EXIT_WAIT_SECONDS"]

log = logging.getLogger("horovod.runner.elastic")

# How long the workers get to end after the job is over before they are killed.
EXIT_WAIT_SECONDS = 10.0


class ElasticService(Protocol):
    """The rendezvous service the workers reach the driver through (``RendezvousServer``, or a
    ``FunctionJob`` around one)."""

    def put(self, scope: str, key: str, value: bytes) -> None: ...

    def get(self, scope: str, key: str) -> bytes | None: ...

    def set_elastic_handler(self, handler: Callable[[str, bytes], tuple[int, bytes]] | None,
                            ) -> None: ...

    def stop(self) -> None: ...


class ElasticSession:
    """One elastic job around an ``ElasticDriver`` (see the module docstring).

    Args:
        settings, hosts, np, min_np, max_np: as ``ElasticDriver.from_settings``.
        start_worker: ``f(key, slot) -> WorkerHandle``: start a worker on a slot (the launcher's
            one job); the launcher reports its end with ``worker_exited``.
        service: the rendezvous service the workers reach the driver through.
        own_service: stop ``service`` when the run ends (False: the launcher keeps it for more
            runs, as ``RayExecutor`` does).
        discovery_interval: seconds between host discovery runs.
        exit_wait: seconds the workers get to end after the job before they are killed.
        caller: what its failure's text starts with (``"horovod.run"``,
            ``"horovod.spark.run_elastic"``, ``"RayExecutor.run(f) [elastic]"``).
        wording: how the launcher words a lost worker and its notes (``format_failure``).
    """

    def __init__(self, settings: DriverSettings, hosts: HostManager, np: int, min_np: int,
                 max_np: int | None, start_worker: Callable[[Key, SlotInfo], WorkerHandle],
                 service: ElasticService, *, own_service: bool = True,
                 discovery_interval: float = 1.0, exit_wait: float = EXIT_WAIT_SECONDS,
                 caller: str = "horovodrun", **wording: Any) -> None:
        self.service, self.own_service, self.exit_wait = service, own_service, exit_wait
        self.caller, self.wording = caller, wording
        self.driver = ElasticDriver.from_settings(settings, hosts, np, min_np, max_np,
                                                  start_worker, put_kv=service.put,
                                                  discovery_interval=discovery_interval)
        self._lock = threading.Lock()
        self._outcomes: dict[Key, protocol.WorkerOutcome] = {}

    # ------------------------------------------------------------------ the launcher's reports
    def worker_exited(self, key: Key, code: int | None, signum: int | None,
                      record: protocol.FailureRecord | None = None) -> None:
        """The worker on ``key`` ended (``record``: the exit record its program left)."""
        self.driver.worker_exited(key, code, signum, record)

    def record_outcome(self, key: Key, outcome: protocol.WorkerOutcome) -> None:
        """What the function of the worker on ``key`` returned or raised (the last one wins)."""
        with self._lock:
            self._outcomes[key] = outcome

    def collect_outcomes(self, get: Callable[[str, str], bytes | None]) -> None:
        """Read every worker's ``run_task`` result from the rendezvous store (``get``), stored
        under its slot name (``RESULT_KEY_ENV``); ``run`` does at the end.

        Raises:
            HorovodInternalError: a stored result is no ``protocol.TaskOutcome``.
        """
        import cloudpickle

        with self.driver.cv:
            keys = list(self.driver.workers)
        for key in keys:
            raw = get(protocol.RESULT_SCOPE, key_name(key))
            if raw is not None:
                self.record_outcome(key, protocol.task_outcome(cloudpickle.loads(raw),
                                                               f"worker {key_name(key)}"))

    # ------------------------------------------------------------------ the job
    def run(self, finish: Callable[[], None] | None = None) -> JobOutcome:
        """Drive the job to its end, end every worker, then call ``finish`` (the launcher's own
        clean-up: its workers are all gone by then), read the results the workers stored, and
        stop the service if it is ours. Returns the job's outcome (exit status 1 when the driver
        gave up): the final round's results by rank, every slot's by slot.

        Raises:
            KeyboardInterrupt: (or any error of the driver) after the workers were ended.
        """
        self.service.set_elastic_handler(self.driver.handle)
        ended = False
        try:
            try:
                result = self.driver.run()
            except BaseException:
                self.end_workers(grace=2.0)
                raise
            self.end_workers()
            ended = True
        finally:
            try:
                if finish is not None:
                    finish()
                if ended:  # (after finish: the launcher's workers have stored their results)
                    self.collect_outcomes(self.service.get)
            finally:
                self.service.set_elastic_handler(None)
                if self.own_service:
                    self.service.stop()
        with self._lock:
            workers = dict(self._outcomes)
        result = self._with_outcome_records(result, workers)
        final = {rank: workers[key] for key, rank in result.final_ranks.items() if key in workers}
        return JobOutcome(returncode=0 if result.error is None else 1, outcomes=final,
                          error=result.error, elastic=result, workers=workers)

    def results(self, outcome: JobOutcome, notes: Sequence[str] = ()) -> list[Any]:
        """The values the final round's workers returned, in their rank order.

        Raises:
            JobFailedError: the driver gave up (or a worker of the final round failed): why, and
                the workers that failed, the root cause first (``JobOutcome.failure``; ``notes``:
                the launcher's lines after the workers).
        """
        if outcome.ok:
            return outcome.values()
        wording = {**self.wording, "notes": [*self.wording.get("notes", ()), *notes]}
        raise outcome.failure(self.caller, **wording)

    def end_workers(self, grace: float = 5.0) -> None:
        """Ask every live worker to stop (killed after ``grace`` seconds by its handle), wait on
        the driver's condition until all have ended, and kill those still alive after
        ``exit_wait`` seconds."""
        driver = self.driver
        driver.stop_all(grace)
        with driver.cv:
            if driver.cv.wait_for(lambda: not any(w.alive for w in driver.workers.values()),
                                  timeout=self.exit_wait):
                return
            left = [w for w in driver.workers.values() if w.alive and w.proc is not None]
        log.warning("elastic: %d worker(s) still running %g s after the job ended: killing %s",
                    len(left), self.exit_wait, ", ".join(key_name(w.key) for w in left))
        for w in left:
            assert w.proc is not None
            w.proc.kill()

    @staticmethod
    def _with_outcome_records(result: ElasticResult,
                              outcomes: dict[Key, protocol.WorkerOutcome]) -> ElasticResult:
        """The failures of workers that left no exit record but whose function raised, with the
        record the exception makes (the last failure of that worker's slot)."""
        last = {f.key: i for i, f in enumerate(result.failures)}
        failures = list(result.failures)
        for key, i in last.items():
            o, f = outcomes.get(key), failures[i]
            if (f.record is None or f.record.kind == "finished") and isinstance(o, protocol.Raised):
                failures[i] = dataclasses.replace(f, record=exception_record(
                    o.error, f.time, f.code or 1))
        return dataclasses.replace(result, failures=failures)
