"""The elastic driver: keeps a job training on the hosts that remain, and takes in new ones.

The job advances in rounds. In each round every member worker knows its rank and size, and they
meet in a Gloo world of their own (rendezvous scope ``elastic.<round>``). Workers are known by
their slot, ``host[local_rank]``, and keep it for their whole life.

* Start: wait (up to ``--elastic-timeout``) until ``-np`` slots are discovered, start a worker on
  every available slot up to ``--max-np``; round 0 forms when they have all asked to join.
* A worker dies or raises: its host is blacklisted (``--blacklist-cooldown-range``), the other
  workers on that host are stopped, the survivors' next collective fails, they restore their last
  commit and ask to join the next round, which forms as soon as every survivor has asked.
* A worker hangs (stopped, frozen, cut off): its heartbeat (``horovod.common.elastic.heartbeat``,
  a daemon thread of the worker process) falls silent, and after
  ``HOROVOD_ELASTIC_HEARTBEAT_TIMEOUT`` seconds the driver kills it (SIGKILL through its shim:
  its sockets close, so the survivors' collectives waiting on it fail at once) and goes on
  without it, as after a death. Its host is blacklisted as after a failure, unless other workers
  on that host still beat: then the hang is the process's own, the host stays, and the slot gets
  a new worker (a second hang of the same slot blacklists the host). A worker whose main thread
  computes for minutes keeps beating and is kept.
* Hosts appear: workers are started on the new slots while the others keep training; only once
  the new workers are up and waiting are the members notified, and they move to the next round
  at their next ``state.commit()`` (so training pauses for the rendezvous, not for the
  newcomers' start-up).
* Hosts disappear from discovery: members are notified, re-form without them at their next
  commit, and the workers on the removed hosts are told to leave (they exit 0).
* A round needs ``--min-np`` slots; with fewer the survivors wait, up to ``--elastic-timeout``.
* Rank 0 of a new round is always a survivor, so ``state.sync()`` spreads the committed state.
* The job succeeds when a member exits 0; it fails when every worker has failed, when
  ``--reset-limit`` resets were not enough, or when too few slots remain for longer than the
  timeout. Every event is logged in words (logger ``horovod.runner.elastic``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from horovod.common import protocol
from horovod.common.protocol import (
    BeatAnswer,
    FailureRecord,
    Notice,
    ReadyAnswer,
    Removed,
    RoundInfo,
    Stop,
    Wait,
)
from horovod.runner.elastic.discovery import HostManager, order_hosts
from horovod.runner.elastic.settings import DEFAULT_ELASTIC_TIMEOUT, DriverSettings
from horovod.runner.failures import RESET_LIMIT_EXCEEDED, RankExit, describe_status, root_cause, with_upstream_sentence
from horovod.runner.hosts import HostSpec, SlotInfo, assign_slots

__all__ = ["ElasticDriver", "Worker", "WorkerHandle", "ElasticResult", "WorkerFailure"]

log = logging.getLogger("horovod.runner.elastic")

Key = tuple[str, int]

ADDED, REMOVED = 2, 1
# How long a ready request or a notice request is held before "ask again".
HOLD_SECONDS = 2.0


def key_name(key: Key) -> str:
    return f"{key[0]}[{key[1]}]"


class WorkerHandle(Protocol):
    """What the driver holds of a worker it started, whatever started it (a process through
    ssh or locally, a Spark task's agent, a Ray actor). The launcher reports the worker's end
    with ``driver.worker_exited(key, code, signal)``."""

    def stop(self, grace: float = 5.0) -> None:
        """Ask the worker to end (SIGTERM or the launcher's equivalent), killing it after
        ``grace`` seconds."""

    def kill(self) -> None:
        """End the worker now."""


@dataclass
class Worker:
    """The driver's record of one worker process."""

    key: Key
    proc: WorkerHandle | None = None
    state: str = "starting"  # starting | ready | running | exited
    after: int = -1  # the last round it was a member of, as it reported
    reason: str = "start"
    rank: int | None = None
    removed: bool = False  # left out (or stopped) by the driver: its exit is no failure
    exit: tuple[int | None, int | None] | None = None
    exit_handled: bool = False
    started: float = 0.0
    record: FailureRecord | None = None  # the exit record its program left (horovod/common/lifecycle.py)
    ended: float = 0.0  # when it ended (seconds since the epoch)
    beat: float | None = None  # the driver's clock at its last heartbeat (None: none yet)
    pid: int = 0  # its process id, as its heartbeat says
    placed: int = -1  # the last round the driver placed it in

    @property
    def alive(self) -> bool:
        return self.state != "exited"


@dataclass(frozen=True)
class WorkerFailure:
    """One worker failure as the driver saw it (in ``ElasticResult.failures``, in order), with
    its exit: code, signal, when (seconds since the epoch) and the exit record its program left
    (``{"kind": "cause" | "consequence", "error", "time", "code"}``, or None)."""

    key: Key
    rank: int | None
    status: str  # "exit code 1", "killed by signal 9 (SIGKILL)", "hung"
    code: int | None = None
    signal: int | None = None
    time: float = 0.0
    record: FailureRecord | None = None

    def as_exit(self) -> RankExit:
        """This failure as a rank's exit, for the one root-cause rule (``failures.root_cause``)."""
        return RankExit.with_record(self.record, self.rank, self.key[0], self.code, self.signal,
                                    self.time, hung=self.status == "hung")


@dataclass
class ElasticResult:
    """How the job ended (the outcome every launcher reports): ``error`` is None on success."""

    error: str | None
    rounds: int
    resets: int
    events: list[str] = field(default_factory=list)
    final_ranks: dict[Key, int] = field(default_factory=dict)
    failures: list[WorkerFailure] = field(default_factory=list)
    ranks: dict[Key, int | None] = field(default_factory=dict)  # each slot's last rank (None: none)

    def root_cause(self) -> WorkerFailure | None:
        """The failure to report first, by the rule of static jobs (``failures.root_cause``): a
        worker's own error before errors that only say a peer left, then the earliest."""
        exits = [f.as_exit() for f in self.failures]
        first = root_cause(exits)
        return next((f for f, e in zip(self.failures, exits) if e is first), None)


class ElasticDriver:
    """See the module docstring.

    Args:
        hosts: the discovery (script or fixed hosts) and the blacklist.
        np / min_np / max_np: processes to start with, fewest to go on with, most to use.
        start_worker: ``f(key, slot_info) -> WorkerHandle`` (how the launcher starts a worker:
            a ``WorkerProcess``, a Spark agent's task, a Ray actor); the launcher must call
            ``driver.worker_exited(key, code, signal)`` when it ends.
        put_kv: ``f(scope, key, value)`` on the rendezvous store (to abandon a round).
        timeout: ``--elastic-timeout`` seconds; reset_limit: ``--reset-limit``.
        discovery_interval: seconds between discovery runs.
        notify_when_ready: tell members about new workers only once these are up (see _scale).
        heartbeat_timeout: seconds of heartbeat silence after which a worker that has beaten
            is declared hung, killed and left behind (None: never), provided another worker's
            beats still arrive (a driver starved itself, or a job whose every worker fell
            silent at once, is left to the Gloo and rejoin timeouts).
        clock: the one time source of the elastic session: request holds, the rejoin and
            elastic timeouts, the finish grace, discovery failures (tests inject one).
    """

    def __init__(self, hosts: HostManager, np: int, min_np: int, max_np: int | None,
                 start_worker: Callable[[Key, SlotInfo], WorkerHandle],
                 put_kv: Callable[[str, str, bytes], None] | None = None,
                 timeout: float = DEFAULT_ELASTIC_TIMEOUT, reset_limit: int | None = None,
                 discovery_interval: float = 1.0, stuck_seconds: float = 90.0,
                 finish_grace: float = 30.0, notify_when_ready: bool = False,
                 heartbeat_timeout: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hosts = hosts
        self.np, self.min_np, self.max_np = np, min_np, max_np
        self.start_worker = start_worker
        self.put_kv = put_kv
        self.timeout, self.reset_limit = timeout, reset_limit
        self.discovery_interval = discovery_interval
        self.stuck_seconds, self.finish_grace = stuck_seconds, finish_grace
        self.notify_when_ready = notify_when_ready
        self.heartbeat_timeout = heartbeat_timeout
        self.clock = clock
        self._slot_hangs: dict[Key, int] = {}
        self._last_check: float | None = None
        self.cv = threading.Condition()
        # The signal that interrupted the launcher (its handler sets it, taking no lock): run()
        # raises KeyboardInterrupt at its next turn even where the handler's own exception was
        # lost (raised inside a finalizer, where Python only prints it).
        self.interrupted: str | None = None
        self.workers: dict[Key, Worker] = {}
        self.round = -1
        self.members: list[Key] = []
        self.answers: dict[Key, RoundInfo] = {}
        self.notice_version = 0
        self.notice_update = 0
        self._notified_added: frozenset[Key] = frozenset()
        self._notified_removed: frozenset[Key] = frozenset()
        self.resets = 0
        self.events: list[str] = []
        self.failures: list[WorkerFailure] = []
        self.error: str | None = None
        self.done = False
        self._finishing_since: float | None = None
        self._waiting_since: float | None = None
        self._reset_since: float | None = None
        self._discovery_ok = False
        self._discovery_error: str | None = None
        self._discovery_failing_since: float | None = None
        self._abandoned: set[int] = set()

    @classmethod
    def from_settings(cls, settings: DriverSettings, hosts: HostManager, np: int, min_np: int,
                      max_np: int | None, start_worker: Callable[[Key, SlotInfo], WorkerHandle],
                      put_kv: Callable[[str, str, bytes], None] | None = None,
                      discovery_interval: float = 1.0) -> ElasticDriver:
        """The driver of every launcher (horovodrun, Spark, Ray): settings from one place."""
        return cls(hosts, np, min_np, max_np, start_worker, put_kv=put_kv,
                   timeout=settings.timeout, reset_limit=settings.reset_limit,
                   discovery_interval=discovery_interval, stuck_seconds=settings.rejoin_timeout,
                   finish_grace=settings.finish_grace,
                   notify_when_ready=settings.notify_when_ready,
                   heartbeat_timeout=settings.heartbeat_timeout)

    # ------------------------------------------------------------------ logging
    def _event(self, text: str, level: int = logging.INFO) -> None:
        self.events.append(text)
        log.log(level, "elastic: %s", text)

    # ------------------------------------------------------------------ discovery
    def discover_once(self) -> None:
        """Run discovery and record what changed (the discovery thread calls this)."""
        try:
            added, removed = self.hosts.update()
        except Exception as exc:  # noqa: BLE001 - a script failure is reported, not fatal later on
            with self.cv:
                if not self._discovery_ok:
                    self._discovery_error = str(exc)
                    self.cv.notify_all()
                    return
                if self._discovery_failing_since is None:
                    self._discovery_failing_since = self.clock()
                    self._event(f"host discovery failed ({exc}); keeping the last known hosts and "
                                "retrying", logging.WARNING)
            return
        with self.cv:
            self._discovery_ok = True
            self._discovery_failing_since = None
            for h in added:
                self._event(f"host {h} appeared in discovery with {self.hosts.discovered[h]} "
                            "slot(s)")
            for h in removed:
                self._event(f"host {h} is no longer in discovery")
            if added or removed:
                self.cv.notify_all()

    def _discovery_loop(self) -> None:
        while True:
            with self.cv:
                if self.done:
                    return
            self.discover_once()
            with self.cv:
                if self.done:
                    return
                self.cv.wait(self.discovery_interval)

    # ------------------------------------------------------------------ requests
    def handle(self, call: str, body: bytes) -> tuple[int, bytes]:
        """The rendezvous server's ``POST /elastic/<call>`` handler."""
        req = json.loads(body or b"{}")
        ans: ReadyAnswer | Notice | BeatAnswer
        if call == protocol.BEAT_CALL:
            ans = self._beat(protocol.Beat.from_wire(req))
        elif call == protocol.READY_CALL:
            ready = protocol.ReadyRequest.from_wire(req)
            ans = self._ready((ready.host, ready.slot), ready.after, ready.reason)
        elif call == protocol.NOTICE_CALL:
            ans = self._notice(protocol.NoticeRequest.from_wire(req).after)
        else:
            return 404, f"unknown elastic call {call!r}".encode()
        return 200, json.dumps(ans.to_wire()).encode()

    def _ready(self, key: Key, after: int, reason: str) -> ReadyAnswer:
        deadline = self.clock() + HOLD_SECONDS
        with self.cv:
            w = self.workers.get(key)
            if w is None or w.removed:
                return Removed(f"{key_name(key)} is not part of this elastic job any more")
            if w.state != "exited":
                if w.state != "ready":
                    w.reason = reason
                w.state, w.after = "ready", after
                self.cv.notify_all()
            while True:
                if self.error is not None or self.done or self._finishing_since is not None:
                    return Stop(self.error or "the elastic job is over")
                if w.removed:
                    return Removed(f"{key_name(key)} has been removed from the elastic job")
                ans = self.answers.get(key)
                if ans is not None and ans.round > after:
                    w.state = "running"
                    return ans
                left = deadline - self.clock()
                if left <= 0:
                    return Wait()
                self.cv.wait(left)

    def _beat(self, beat: protocol.Beat) -> BeatAnswer:
        with self.cv:
            w = self.workers.get((beat.host, beat.slot))
            if w is None or w.removed or not w.alive or self.done:
                return BeatAnswer(False)
            w.pid = beat.pid or w.pid
            if beat.leaving:  # exiting: its end is watched from now on, not its heartbeat
                w.beat = None
                return BeatAnswer(False)
            w.beat = self.clock()
            return BeatAnswer(True)

    def _notice(self, after: int) -> Notice:
        deadline = self.clock() + HOLD_SECONDS * 5
        with self.cv:
            while self.notice_version <= after and not self.done:
                left = deadline - self.clock()
                if left <= 0:
                    break
                self.cv.wait(left)
            return Notice(self.notice_version, self.notice_update)

    def worker_exited(self, key: Key, code: int | None, signum: int | None,
                      record: FailureRecord | None = None) -> None:
        """The launcher's report that the worker on ``key`` ended (``record``: the exit record
        its program left, if any)."""
        with self.cv:
            w = self.workers.get(key)
            if w is not None:
                w.state, w.exit = "exited", (code, signum)
                w.record, w.ended = record, time.time()
                self.cv.notify_all()

    # ------------------------------------------------------------------ main loop
    def run(self) -> ElasticResult:
        """Drive the job to its end (blocking)."""
        threading.Thread(target=self._discovery_loop, name="hvd-elastic-discovery",
                         daemon=True).start()
        try:
            with self.cv:
                while not self.done:
                    if self.interrupted is not None:
                        raise KeyboardInterrupt(self.interrupted)
                    self._step()
                    if self.done:
                        break
                    self.cv.wait(0.25)
        finally:
            with self.cv:
                self.done = True
                self.cv.notify_all()
        return ElasticResult(self.error, self.round + 1, self.resets, list(self.events),
                             {k: a.slot.rank for k, a in self.answers.items()
                              if a.round == self.round}, list(self.failures),
                             {k: w.rank for k, w in self.workers.items()})

    def stop_all(self, grace: float = 5.0) -> None:
        with self.cv:
            procs = [w.proc for w in self.workers.values() if w.alive and w.proc is not None]
            for w in self.workers.values():
                w.removed = True
        for p in procs:
            p.stop(grace)

    def abort(self, message: str) -> None:
        """End the job now with ``message`` as its error (the launcher lost its cluster)."""
        with self.cv:
            if not self.done:
                self._fail(message)

    def _fail(self, message: str) -> None:
        if any(w.exit is not None and (w.exit[0] != 0 or w.exit[1]) for w in self.workers.values()):
            message = with_upstream_sentence(message)
        self.error = message
        self._event(message, logging.ERROR)
        self.done = True
        self.cv.notify_all()

    def _step(self) -> None:
        now = self.clock()
        if self.round < 0 and not self._discovery_ok:
            if self._discovery_error is not None:
                self._fail(f"host discovery failed on its first run: {self._discovery_error}")
            return
        self._handle_exits()
        if self.done:
            return
        self._check_heartbeats(now)
        if self._finishing_since is not None:
            alive = [w for w in self.workers.values() if w.alive]
            if not alive:
                self.done = True
            elif now - self._finishing_since > self.finish_grace:
                self._event(f"stopping {len(alive)} worker(s) that did not end within "
                            f"{self.finish_grace:g} s of the job's completion")
                for w in alive:
                    w.removed = True
                    if w.proc is not None:
                        w.proc.stop()
                self._finishing_since = now + 3600  # only once
            return
        if (self._discovery_failing_since is not None
                and now - self._discovery_failing_since > self.timeout):
            self._fail(f"host discovery kept failing for more than --elastic-timeout "
                       f"{self.timeout:g} s; stopping")
            return
        self._drop_unavailable()
        if self.round < 0:
            self._form_round(first=True)
            return
        member_states = [self.workers[k] for k in self.members]
        # a member's slot may already hold a new worker (its old one hung): that member is gone
        resetting = any(w.state in ("ready", "exited") or w.removed or w.placed != self.round
                        for w in member_states)
        if resetting:
            if self._reset_since is None:
                self._reset_since = now
                # A member left the round (it failed, or asks for the next one): the others
                # must not wait for it in the round's formation either.
                gone = [w for w in member_states
                        if w.state in ("ready", "exited") or w.removed or w.placed != self.round]
                self._abandon(f"{', '.join(key_name(w.key) for w in gone)} left round {self.round}")
            stuck = [w for w in member_states if w.state in ("running", "starting")
                     and not w.removed and w.placed == self.round]
            if stuck and now - self._reset_since > self.stuck_seconds:
                for w in stuck:
                    self._event(f"worker {key_name(w.key)} (rank {w.rank}) did not rejoin within "
                                f"{self.stuck_seconds:g} s of the others (hung or stopped? "
                                "HOROVOD_ELASTIC_REJOIN_TIMEOUT); the job goes on without it; "
                                "stopping it",
                                logging.WARNING)
                    w.removed = True
                    if w.proc is not None:
                        w.proc.kill()  # a stopped process ignores SIGTERM until it continues
                    w.state = "exited"
                    w.exit_handled = True
                    self.failures.append(WorkerFailure(w.key, w.rank, "hung", time=time.time()))
                    self._blacklist(w.key[0], f"worker {key_name(w.key)} hung")
                stuck = []
            if not stuck:
                self._form_round(first=False)
            return
        self._reset_since = None
        self._scale()

    # ------------------------------------------------------------------ pieces
    def _handle_exits(self) -> None:
        for w in self.workers.values():
            if w.state != "exited" or w.exit_handled:
                continue
            w.exit_handled = True
            code, sig = w.exit if w.exit else (None, None)
            status = describe_status(code, sig)
            who = f"worker {key_name(w.key)}" + (f" (rank {w.rank})" if w.rank is not None else "")
            if w.removed:
                log.info("elastic: %s ended (%s) after being removed from the job", who, status)
                continue
            if self._finishing_since is not None:
                log.info("elastic: %s ended (%s) after the job completed", who, status)
                continue
            if code == 0 and w.key in self.members:
                self._event(f"{who} finished training (exit 0): the job is complete")
                self._finishing_since = self.clock()
                for other in self.workers.values():
                    if other.alive and other.key not in self.members:
                        other.removed = True
                        if other.proc is not None:
                            other.proc.stop()
                continue
            self.failures.append(WorkerFailure(w.key, w.rank, status, code, sig, w.ended or time.time(),
                                               w.record))
            if w.key in self.members:
                self._abandon(f"{who} failed ({status})")
            self._blacklist(w.key[0], f"{who} failed ({status})")
        if self.round < 0 and self.workers and not any(w.alive for w in self.workers.values()) \
                and any(not w.removed for w in self.workers.values()):
            self._fail(f"all {len(self.workers)} workers failed before training started; "
                       "stopping the job (see their output above)")

    def _check_heartbeats(self, now: float) -> None:
        """Leave behind every worker whose heartbeat has been silent for the timeout."""
        last, self._last_check = self._last_check, now
        if self.heartbeat_timeout is None or self._finishing_since is not None:
            return
        if last is not None and now - last > self.heartbeat_timeout / 2:
            return  # this process was starved itself: the beats may only now be arriving
        watched = [w for w in self.workers.values() if w.alive and not w.removed and w.beat is not None]
        silent = [w for w in watched if now - w.beat > self.heartbeat_timeout]  # type: ignore[operator]
        # Only where beats do arrive from others (the driver's side works): with every worker
        # silent at once the fault is more likely here, and the Gloo and rejoin timeouts remain.
        heard = [w for w in watched if now - w.beat <= self.heartbeat_timeout / 2]  # type: ignore[operator]
        if not heard:
            return
        for w in silent:
            self._hung(w, now)

    def _hung(self, w: Worker, now: float) -> None:
        assert w.beat is not None and self.heartbeat_timeout is not None
        ids = ([f"rank {w.rank}"] if w.rank is not None else []) + ([f"pid {w.pid}"] if w.pid else [])
        who = f"worker {key_name(w.key)}" + (f" ({', '.join(ids)})" if ids else "")
        self._event(f"{who} sent no heartbeat for {now - w.beat:.1f} s "
                    f"(HOROVOD_ELASTIC_HEARTBEAT_TIMEOUT {self.heartbeat_timeout:g} s): it is "
                    "stopped, frozen or cut off; killing it (SIGKILL) and going on without it",
                    logging.WARNING)
        w.removed = True
        if w.proc is not None:
            w.proc.kill()
        self.failures.append(WorkerFailure(w.key, w.rank, "hung", time=time.time()))
        if w.key in self.members:
            self._abandon(f"{who} hung")
        self._slot_hangs[w.key] = hangs = self._slot_hangs.get(w.key, 0) + 1
        host = w.key[0]
        healthy = sorted(key_name(o.key) for o in self.workers.values()
                         if o.key[0] == host and o is not w and o.alive and not o.removed
                         and o.beat is not None and now - o.beat <= self.heartbeat_timeout)
        if healthy and hangs == 1:
            self._event(f"host {host} stays in the job: its other worker(s) {', '.join(healthy)} "
                        f"still beat, so the hang is {key_name(w.key)}'s own; the slot may get a "
                        "new worker (a second hang there blacklists the host)")
        else:
            self._blacklist(host, f"worker {key_name(w.key)} hung")

    def _blacklist(self, host: str, why: str) -> None:
        """Blacklist ``host`` after a failure there, and stop the other workers on it."""
        cooldown = self.hosts.blacklist_host(host)
        until = ("for good" if cooldown is None else f"for {cooldown:.0f} s "
                 "(--blacklist-cooldown-range)")
        self._event(f"{why}; blacklisting host {host} {until}", logging.WARNING)
        for other in self.workers.values():
            if other.key[0] == host and other.alive and not other.removed:
                self._event(f"stopping worker {key_name(other.key)}: its host {host} is "
                            "blacklisted")
                other.removed = True
                if other.proc is not None:
                    other.proc.stop()

    def _abandon(self, why: str) -> None:
        """Give the current round up: its members still forming it stop waiting for each other
        (store, Gloo device, process group) within a fraction of a second and ask for the next."""
        if self.put_kv is None or self.round < 0 or self.round in self._abandoned:
            return
        self._abandoned.add(self.round)
        scope = protocol.round_scope(self.round)
        try:
            self.put_kv(scope, protocol.ABANDONED_KEY, why.encode())
            # a member still waiting for rank 0's address
            self.put_kv(scope, protocol.STORE_KEY, protocol.ABANDONED_STORE)
        except Exception:  # noqa: BLE001 - best effort: the members' own timeouts remain
            log.debug("elastic: could not mark round %d abandoned", self.round, exc_info=True)

    def _drop_unavailable(self) -> None:
        """Stop non-member workers on hosts that are gone; notify members about removals."""
        avail = self.hosts.available()
        for w in self.workers.values():
            if (w.alive and not w.removed and w.key not in self.members
                    and (w.key[0] not in avail or w.key[1] >= avail[w.key[0]])):
                self._event(f"stopping worker {key_name(w.key)}: host {w.key[0]} is not available "
                            "any more")
                w.removed = True
                if w.proc is not None:
                    w.proc.stop()
        gone = frozenset(k for k in self.members if self.workers[k].alive
                         and not self.workers[k].removed
                         and (k[0] not in avail or k[1] >= avail[k[0]]))
        if gone and not gone <= self._notified_removed:
            self._notified_removed = self._notified_removed | gone
            self._notify(REMOVED, f"{', '.join(key_name(k) for k in sorted(gone))} will leave: "
                         "telling the workers to re-form at their next commit")

    def _notify(self, update: int, text: str) -> None:
        self.notice_version += 1
        self.notice_update = update
        self._event(text)
        self.cv.notify_all()

    def _plan(self, keep_first: list[str]) -> list[SlotInfo]:
        avail = self.hosts.available()
        ordered = order_hosts(avail, keep_first)
        total = sum(s for _, s in ordered)
        n = total if self.max_np is None else min(total, self.max_np)
        if n < 1:
            return []
        return assign_slots([HostSpec(h, s) for h, s in ordered], n)

    def _scale(self) -> None:
        """Start workers on new slots and tell the members to take them in at their next commit.

        By default the members are told at once (as upstream does: scripts wait for the notice)
        and the round they then ask for waits until the new workers are up; with
        ``notify_when_ready`` they are told only once the new workers wait, so they keep
        training while those start.
        """
        if self.max_np is not None and len(self.members) >= self.max_np:
            return
        plan = self._plan(self._member_hosts())
        if len(plan) <= len(self.members):
            return
        new = []
        for s in plan:
            key = (s.hostname, s.local_rank)
            if key in self.members:
                continue
            w = self.workers.get(key)
            if w is None or (not w.alive and w.exit_handled and not self.hosts.is_blacklisted(key[0])):
                self._start(key, s, "to grow the job")
            new.append(key)
        fresh = frozenset(new)
        if self.notify_when_ready and any(self.workers[k].state != "ready" for k in fresh):
            return
        if fresh and not fresh <= self._notified_added:
            self._notified_added = self._notified_added | fresh
            self._notify(ADDED, f"new slot(s) {', '.join(key_name(k) for k in sorted(fresh))}: "
                         "telling the workers to take them in at their next commit")

    def _member_hosts(self) -> list[str]:
        seen: list[str] = []
        for k in self.members:
            if k[0] not in seen:
                seen.append(k[0])
        return seen

    def _start(self, key: Key, slot: SlotInfo, why: str) -> None:
        self._event(f"starting worker {key_name(key)} {why}")
        w = Worker(key, started=self.clock())
        self.workers[key] = w
        self.answers.pop(key, None)  # its slot's last answer was for the worker before it
        try:
            w.proc = self.start_worker(key, slot)
        except BaseException:
            # Never started (its error ends the job): no process to stop or to wait for at the end.
            w.state, w.removed, w.exit_handled = "exited", True, True
            raise

    def _form_round(self, first: bool) -> None:
        now = self.clock()
        survivors = [k for k in self.members if self.workers[k].state == "ready"
                     and not self.workers[k].removed and self.workers[k].placed == self.round]
        avail = self.hosts.available()
        if first:
            need = self.np
        else:
            need = self.min_np
            if not survivors:
                self._fail("all workers of the last round failed or left; no worker holds the "
                           "committed training state, so the job cannot go on")
                return
        plan = self._plan(self._member_hosts())
        # Survivors on hosts that left (or beyond the slots now offered) are told to go.
        planned = {(s.hostname, s.local_rank) for s in plan}
        for k in survivors:
            if k not in planned:
                w = self.workers[k]
                w.removed = True
                self._event(f"worker {key_name(k)} leaves the job (host {k[0]} was removed)")
        survivors = [k for k in survivors if k in planned]
        if len(plan) < need:
            if self._waiting_since is None:
                self._waiting_since = now
                have = sum(avail.values())
                self._event(f"waiting for hosts: {have} slot(s) available "
                            f"({', '.join(f'{h}:{s}' for h, s in avail.items()) or 'none'}), "
                            f"{'-np' if first else '--min-np'} is {need}; waiting up to "
                            f"--elastic-timeout {self.timeout:g} s")
            elif now - self._waiting_since > self.timeout:
                self._fail(f"too few hosts: only {len(plan)} slot(s) available for longer than "
                           f"--elastic-timeout {self.timeout:g} s, but "
                           f"{'-np' if first else '--min-np'} is {need}; stopping. Check the "
                           "discovery script and that enough hosts exist for at least "
                           f"{need} processes.")
            return
        self._waiting_since = None
        # Start what is missing; survivors (and ready newcomers) are enough once they reach
        # --min-np, the rest joins a later round.
        for s in plan:
            key = (s.hostname, s.local_rank)
            known = self.workers.get(key)
            if known is None or (not known.alive and not self.hosts.is_blacklisted(key[0])):
                self._start(key, s, "for the next round" if not first else "for round 0")
        ready = [s for s in plan if self.workers[(s.hostname, s.local_rank)].state == "ready"
                 and not self.workers[(s.hostname, s.local_rank)].removed]
        if first:
            if len(ready) < len(plan):
                return
            chosen = plan
        else:
            ready_keys = {(s.hostname, s.local_rank) for s in ready}
            pending = [s for s in plan if (s.hostname, s.local_rank) not in ready_keys]
            if pending and len(ready) < need:
                return
            # A reset asked for to take in new workers waits for them; after a failure the
            # survivors go on at once with whoever is ready (the others join a later round).
            if pending and any(self.workers[k].reason == "added" for k in survivors):
                return
            if pending and self.clock() - (self._reset_since or now) < 0.5:
                return  # newcomers about to be ready: give them a moment
            if pending:
                chosen = self._plan_subset(ready_keys)
            else:
                chosen = plan
        if not chosen:
            return
        self._publish(chosen, first)

    def _plan_subset(self, keys: set[Key]) -> list[SlotInfo]:
        """The plan restricted to ``keys`` (slots numbered densely per host, survivors first)."""
        per_host: dict[str, int] = {}
        order: list[str] = []
        for h in self._member_hosts() + [k[0] for k in sorted(keys)]:
            if h not in order and any(k[0] == h for k in keys):
                order.append(h)
        for h in order:
            slots = sorted(s for hh, s in keys if hh == h)
            # local ranks must be 0..n-1 on each host: keep the dense prefix only
            n = 0
            while n in slots:
                n += 1
            if n:
                per_host[h] = n
        specs = [HostSpec(h, per_host[h]) for h in order if h in per_host]
        n = sum(s.slots for s in specs)
        if self.max_np is not None:
            n = min(n, self.max_np)
        return assign_slots(specs, n) if n else []

    def _publish(self, plan: list[SlotInfo], first: bool) -> None:
        keys = [(s.hostname, s.local_rank) for s in plan]
        if not first:
            self.resets += 1
            if self.reset_limit is not None and self.resets > self.reset_limit:
                self._fail(f"{RESET_LIMIT_EXCEEDED.format(self.reset_limit)} (stopping: this would be "
                           f"reset number {self.resets}, more than --reset-limit {self.reset_limit})")
                return
        old = set(self.members)
        newcomers = [k for k in keys if k not in old]
        if not first and keys[0] not in old:
            log.warning("rank 0 of the new round (%s) is a new worker; the state it syncs is its "
                        "own initial state", key_name(keys[0]))
        skip_sync = (not first and not newcomers
                     and all(self.workers[k].reason == "removed" for k in keys))
        self.round += 1
        for s in plan:
            key = (s.hostname, s.local_rank)
            w = self.workers[key]
            w.rank, w.placed = s.rank, self.round
            self.answers[key] = RoundInfo(self.round, s, skip_sync, self.notice_version)
        # Workers that were ready but are not in the round (beyond --max-np) go.
        for w in self.workers.values():
            if (w.alive and not w.removed and w.key not in keys and w.key in old
                    and w.placed == self.round - 1):
                w.removed = True
        self.members = keys
        self._notified_added = frozenset()
        self._notified_removed = frozenset()
        self._reset_since = None
        hosts_text = ", ".join(f"{h}:{sum(1 for k in keys if k[0] == h)}"
                               for h in dict.fromkeys(k[0] for k in keys))
        if first:
            self._event(f"round 0: {len(keys)} workers on {hosts_text} started training")
        else:
            joined = (f"; new: {', '.join(key_name(k) for k in newcomers)}" if newcomers else "")
            left = sorted(old - set(keys))
            gone = f"; gone: {', '.join(key_name(k) for k in left)}" if left else ""
            self._event(f"round {self.round}: training resumes with {len(keys)} workers on "
                        f"{hosts_text}{joined}{gone} (reset {self.resets}"
                        f"{'' if self.reset_limit is None else f' of at most {self.reset_limit}'}; "
                        f"{'state kept, no sync' if skip_sync else 'state synced from rank 0'})")
        self.cv.notify_all()
