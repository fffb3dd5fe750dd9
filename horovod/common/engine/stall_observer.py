"""The stall observer the engine loop calls: report stalls with every rank's answer, and answer.

On rank 0 it runs the inspector (``stall.StallInspector``) over the coordinator's table. When a
report is due it *asks*: the next round carries a flag in its bit vector (``RoundController.agree``), and in
that round every rank calls ``answer_round``: one broadcast from rank 0 (who should send its whole
stack, and whether Horovod then shuts down) and one gather to rank 0 of each rank's answer
(``diagnosis.answer``: host, pid, where its main thread is, its flight record). The thread driving
a rank's rounds answers, usually its engine thread, which is alive while the main thread is stuck
in user code. Rank 0 then logs ``stall.explain``'s report once per period; when the stall passed
the shutdown time, the report is broadcast, and every rank's shutdown error carries it.

``ask_stacks`` (rank 0, any thread but the engine's) asks the same question for every rank's
stack and flight record (``horovod.common.stacks.all_stacks``).

A rank that is stopped (SIGSTOP, a debugger), holds the GIL, or is blocked outside Python never
comes to the round, so it cannot answer, and rank 0's own rounds stop with it. A watchdog thread
on rank 0 notices that rank 0 has waited in a negotiation collective for the warning time and
says so, with every rank's host and pid, the state of those on rank 0's host (``/proc``: stopped,
running without coming, or waiting), and what rank 0 itself waits in.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from horovod.common.engine import diagnosis
from horovod.common.engine.flight import describe
from horovod.common.engine.observers import FLAG_DIAGNOSE, Observer
from horovod.common.engine.stall import StallDecision, StallInspector, explain

if TYPE_CHECKING:
    from horovod.common.config import EngineConfig
    from horovod.common.engine.negotiation import Coordinator

__all__ = ["StallObserver"]


def _proc_states(pid: int, samples: int = 5) -> str | None:
    """The process's scheduler states (``/proc/PID/stat``), sampled over a quarter second:
    ``TTTTT`` stopped, ``RRRRR`` running all along; None if there is no such process here."""
    out = ""
    for i in range(samples):
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            return None
        out += stat[stat.rfind(b")") + 2:][:1].decode()
        if i + 1 < samples:
            time.sleep(0.05)
    return out

log = logging.getLogger("horovod")

# What a stall report shows of each rank's flight record: the last completed collectives, and the
# oldest in-flight ones.
REPORT_DONE, REPORT_IN_FLIGHT = 3, 8


class _Question:
    __slots__ = ("decision", "stacks", "done", "event", "answers")

    def __init__(self, decision: StallDecision | None, stacks: Any, done: int | None) -> None:
        self.decision = decision
        self.stacks = stacks  # "all", or the ranks that send their whole stack
        self.done = done
        self.event = threading.Event()
        self.answers: dict[int, dict[str, Any]] = {}


class StallObserver(Observer):
    """Stall checks (rank 0) and answers (every rank) for one engine: an observer of its rounds
    (``observers.py``) that raises ``FLAG_DIAGNOSE`` when it has a question, checks the
    coordinator's table when due, and answers in the round that carries the question."""

    def __init__(self, engine: Any, config: EngineConfig, clock: Callable[[], float]) -> None:
        self.engine = engine
        self.warn_after = config.stall_check_time_seconds
        self.inspector: StallInspector | None = None
        if engine.rank == 0 and not config.stall_check_disable:
            self.inspector = StallInspector(config.stall_check_time_seconds,
                                            config.stall_shutdown_time_seconds, clock)
        self.shutdown_after = self.inspector.shutdown_after if self.inspector is not None else 0.0
        self._question: _Question | None = None  # rank 0: asked in the next round
        self._lock = threading.Lock()
        self.reports = 0  # reports logged (tests and hvd.metrics() may read it)
        self._clock = clock
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    # ---------------------------------------------------------------- watchdog (rank 0)
    def start(self) -> None:
        if self.inspector is None or self.engine.size < 2:
            return
        self._watchdog = threading.Thread(target=self._watch, name="horovod-stall-watchdog", daemon=True)
        self._watchdog.start()

    def stop(self) -> None:
        self._stop.set()
        t, self._watchdog = self._watchdog, None
        if t is not None and t is not threading.current_thread():
            t.join(2.0)

    def _watch(self) -> None:
        warned_for = 0.0  # the negotiation we last reported, and when
        next_report = 0.0
        while not self._stop.wait(0.5):
            eng = self.engine
            since = eng.rounds.negotiating_since
            if eng.stopped or not since:
                continue
            now = self._clock()
            if now - since < self.warn_after:
                continue
            if since == warned_for and now < next_report:
                continue
            warned_for, next_report = since, now + self.warn_after
            try:
                log.warning("%s", self._silent_ranks_report(now - since))
            except Exception as exc:  # noqa: BLE001 - a report must never break the job
                log.debug("stall watchdog failed: %r", exc)

    def _silent_ranks_report(self, waited: float) -> str:
        eng = self.engine
        lines = [f"Stall: rank 0 has waited {waited:.1f} s in the engine's negotiation for ranks that do "
                 "not come to it: a rank that is stopped (SIGSTOP, a debugger), holds the GIL, or is "
                 "blocked outside Python cannot answer (HOROVOD_STALL_CHECK_TIME_SECONDS)."]
        hosts, pids = eng.hostnames, eng.pids
        mine = hosts[0] if hosts else None
        states = {r: _proc_states(pids[r]) for r in range(1, len(pids))
                  if hosts and hosts[r] == mine}
        stopped = [r for r, st in states.items() if st is not None and ("T" in st or "t" in st)]
        busy = [r for r, st in states.items() if st and set(st) == {"R"}]
        for r in range(1, eng.size):
            who = f"rank {r} (host {hosts[r] if hosts else '?'}, pid {pids[r] if pids else '?'})"
            st = states.get(r)
            if r not in states:
                lines.append(f"  {who}: on another host; not inspected from rank 0")
            elif st is None:
                lines.append(f"  {who}: no such process on this host (it exited)")
            elif r in stopped:
                lines.append(f"  {who}: stopped (process state T: SIGSTOP or a debugger)")
            elif r in busy:
                lines.append(f"  {who}: running all along: it waits as rank 0 does (an MPI wait "
                             "polls), or computes or holds the GIL without coming to the engine")
            else:
                lines.append(f"  {who}: waiting (process state {max(set(st), key=st.count)}), as "
                             "rank 0 does, or blocked in a system call")
        if stopped:
            lines.append(f"In short: {', '.join(f'rank {r}' for r in stopped)} "
                         f"{'is' if len(stopped) == 1 else 'are'} stopped.")
        elif busy:
            lines.append(f"In short: of {', '.join(f'rank {r}' for r in busy)} (running all along), "
                         "one may hold the GIL; py-spy dump --pid PID shows where.")
        rec = eng.flight_record(1, 4)
        for row in rec["in_flight"]:
            lines.append(f"rank 0 waits in {describe(row[2], row[3], row[0], row[1])}, submitted {row[7]:.1f} s ago")
        lines.append("Every rank that runs Python prints its stacks on SIGUSR1 (kill -USR1 <horovodrun's pid>).")
        return "\n".join(lines)

    # ---------------------------------------------------------------- the observer's hooks
    def flags(self, now: float) -> int:
        return FLAG_DIAGNOSE if self._question is not None else 0

    def inspect(self, coordinator: Coordinator) -> None:
        if self.inspector is not None and self.inspector.due():
            self.check(coordinator)

    def agreed(self, flags: int) -> None:
        if flags & FLAG_DIAGNOSE:
            rounds = self.engine.rounds
            rounds.negotiating_since = self._clock()
            self.answer_round()
            rounds.negotiating_since = 0.0

    # ---------------------------------------------------------------- rank 0
    @property
    def asking(self) -> bool:
        """A question waits for the next round (rank 0; read once per round)."""
        return self._question is not None

    def due(self) -> bool:
        return self.inspector is not None and self.inspector.due()

    def check(self, coordinator: Coordinator) -> None:
        """Look at the coordinator's table; ask every rank when a report is due."""
        assert self.inspector is not None
        decision = self.inspector.check(coordinator.stalled(self.inspector.warn_after))
        if decision is None:
            return
        with self._lock:
            if self._question is None:
                self._question = _Question(decision, decision.missing, REPORT_DONE)

    def ask_stacks(self, timeout: float = 10.0) -> dict[int, dict[str, Any]]:
        """Every rank's answer with its whole main-thread stack and flight record (rank 0 only,
        from a thread that does not drive the engine); {} when the rounds did not come in time."""
        if self.engine.rank != 0:
            raise RuntimeError("every rank's stacks are collected on rank 0 only")
        q = _Question(None, "all", None)
        while True:  # one question per round: wait for one already asked
            with self._lock:
                pending = self._question
                if pending is None:
                    self._question = q
                    break
            pending.event.wait(0.05)
        self.engine.wake()
        if not q.event.wait(timeout):
            with self._lock:
                if self._question is q:
                    self._question = None
            return {}
        return q.answers

    # ---------------------------------------------------------------- every rank
    def answer_round(self) -> None:
        """This round carries rank 0's question: answer it (every rank, in the same round)."""
        eng = self.engine
        backend = eng.backend
        q = self._question if eng.rank == 0 else None
        wire = None
        if q is not None:
            wire = {"stacks": q.stacks, "done": q.done,
                    "shutdown": bool(q.decision is not None and q.decision.shutdown)}
        asked = backend.bcast_from_root(wire)
        stacks = asked["stacks"]
        record = eng.flight_record(asked["done"], REPORT_IN_FLIGHT if asked["done"] is not None else None)
        mine = diagnosis.answer(eng.rank, eng.host, record, stacks == "all" or eng.rank in stacks)
        gathered = backend.gather_to_root(mine)
        report = None
        if q is not None:
            assert gathered is not None
            q.answers = {int(a["rank"]): a for a in gathered}
            with self._lock:
                self._question = None
            if q.decision is not None:
                report = self._report(q.decision, q.answers)
            q.event.set()
        if asked["shutdown"]:
            eng.stall_shutdown(backend.bcast_from_root(report))

    def _report(self, decision: StallDecision, answers: dict[int, dict[str, Any]]) -> str:
        assert self.inspector is not None
        message = explain(decision, answers, self.inspector.warn_after, self.inspector.shutdown_after)
        stragglers = self.engine.stragglers()
        if stragglers:
            message += (f"\nStragglers (the ranks the others have waited for in most recent steps): "
                        f"{stragglers}; see hvd.metrics().")
        self.reports += 1
        if decision.shutdown:
            log.error("%s", message)
        else:
            log.warning("%s", message)
        return message
