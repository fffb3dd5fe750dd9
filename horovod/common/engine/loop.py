"""The engine: one background thread per process that owns all communication.

Callers ``submit`` entries and get handles at once. The thread (or a caller waiting on a handle,
whoever holds the driver lock) runs negotiation rounds; a round has three parts, each its own
class (Horovod's C++ core: ``Controller``, ``PerformOperation``, the observers around them):

1. the round controller (``rounds.RoundController``) agrees with every rank on the round's
   responses: one bit-vector AND over cache slots and flags, and, only if some rank has uncached
   requests, the coordinator's gather and broadcast (``negotiation.py``);
2. the batch runner (``runner.BatchRunner``) plans the same batches on every rank
   (``fusion.py``), takes each batch's pending entries, runs it (``executor.py``) and completes
   their handles; it owns the step memo (``memo.py``);
3. the observers (``observers.py``: timeline, autotune, metrics and stragglers, the flight
   recorder, stall checks, the piece-size follower ``pieces.py``) are called at fixed points of
   the round.

This module is the loop around them: the queue, submission, deferral, the driver lock, the
engine thread's pacing, and stopping. A rank with nothing to do waits on a condition variable
with a timeout of ``HOROVOD_CYCLE_TIME``; a submission wakes it at once, so a lone operation never
waits for a tick. A rank with pending operations starts the next round at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from horovod.common.backends.base import EngineBackend, Group
from horovod.common.config import EngineConfig
from horovod.common.engine.cache import ResponseCache
from horovod.common.engine.executor import Entry, Executor
from horovod.common.engine.flight import FlightRecorder, flight_record
from horovod.common.engine.memo import StepMemo
from horovod.common.engine.metrics import Counters
from horovod.common.engine.observers import (
    FLAG_JOINED,
    FLAG_SHUTDOWN,
    OBSERVER_FLAGS,
    AutotuneObserver,
    MetricsObserver,
    TimelineObserver,
    hooks,
)
from horovod.common.engine.pieces import PieceFollower
from horovod.common.engine.rounds import RoundController
from horovod.common.engine.runner import BatchRunner
from horovod.common.engine.stall_observer import StallObserver
from horovod.common.engine.tensor_queue import DUPLICATE_NAME_MESSAGE, TensorQueue
from horovod.common.engine.timeline import Timeline
from horovod.common.engine.tunables import Tunables
from horovod.common.exceptions import SHUT_DOWN_MESSAGE
from horovod.common.protocol import job_secret

__all__ = ["Engine", "DEFER_LIMIT_S", "DUPLICATE_NAME_MESSAGE"]

log = logging.getLogger("horovod")

def _low_timer_slack() -> None:
    """Let this thread's short sleeps be short (Linux rounds them up to 50 us by default)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK = 29, 1 us
    except Exception:  # noqa: BLE001 - not Linux, or no prctl: sleeps are just coarser
        pass


# Deferred submissions (``submit(defer=True)``) start in the background after this long if no
# caller waits for any handle meanwhile.
DEFER_LIMIT_S = 2.0


def _queue_field(name: str) -> Any:
    """A read-write property on ``self.queue.<name>``."""

    def get(self: Any) -> Any:
        return getattr(self.queue, name)

    def put(self: Any, value: Any) -> None:
        setattr(self.queue, name, value)
    return property(get, put, doc=f"``queue.{name}``")


def _nothing_to_do(eng: Engine) -> bool:
    """Whether the engine thread's round now would be an empty one before its idle tick is due:
    nothing queued or pending, the global process set only, no shutdown, no observer's question,
    and a round (any thread's) began less than an idle tick ago. A submission wakes the engine
    thread; when its caller then drives the round itself (a synchronous step), the engine thread
    would otherwise run an empty round one cycle later, which every peer pairs with one of its
    own: a whole exchange for nothing, in the way of the next step. A skipped round still counts
    for the engine thread's pacing (the next background round is due a cycle later): otherwise it
    races the next step's caller for the driver lock, and on MPI a round it wins runs without
    spinning and wakes its caller through the handle's latch."""
    return (not eng._queue and not eng.rounds.pending and not eng._shutdown_requested
            and not eng._round_wanted and len(eng.groups) == 1
            and time.perf_counter() - eng._any_round < eng._idle_tick)


class Engine:
    """Background communication engine of one process."""

    def __init__(self, backend: EngineBackend, config: EngineConfig, groups: dict[int, Group],
                 on_process_set_added: Callable[[int, list[int]], None] | None = None,
                 on_process_set_removed: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, hostnames: list[str] | None = None,
                 pids: list[int] | None = None) -> None:
        self.backend = backend
        self.config = config
        self.rank: int = backend.rank
        self.size: int = backend.size
        self.groups = groups
        self._clock = clock
        self._stall_shutdown: str | None = None
        # Speed knobs, read afresh every round/batch (an autotuner changes them at run time).
        local_size = hostnames.count(hostnames[self.rank]) if hostnames else 1
        self.tunables = Tunables.from_config(config, local_size, backend=backend)
        self._last_round = 0.0  # when the engine thread last started a round (perf_counter)
        self._any_round = 0.0  # when any thread last started one
        self._round_wanted = False  # an observer asked for a round (``wake``)
        # What callers submit (``tensor_queue.py``); its submission methods are the engine's.
        self.queue = TensorQueue(clock, self.tunables, self.help_until)
        self.submit = self.queue.submit
        self.submit_many = self.queue.submit_many
        self._lock, self._cv, self._in_flight = self.queue.lock, self.queue.cv, self.queue.in_flight
        # Whoever holds the driver lock runs negotiation rounds: the engine thread, or a caller
        # waiting on a handle while the engine thread is idle (saves two thread hand-offs per
        # blocking operation). Rounds are serialized, so MPI sees one caller at a time.
        self._driver = threading.Lock()
        # With only the global process set, a rank with nothing pending cannot help any
        # operation finish (each needs this rank's own submission, which wakes it at once), so it
        # joins rounds rarely: often enough for stall reports and shutdowns, not so often that
        # its empty rounds interrupt the busy ranks. Other process sets need it every cycle.
        self._idle_tick_floor = 0.05
        self.host = hostnames[self.rank] if hostnames else ""
        self.hostnames = list(hostnames or [])
        self.pids = list(pids or [])
        self._thread = threading.Thread(target=self._run, name="horovod-engine", daemon=True)

        # The round controller and the batch runner (with the step memo it owns).
        self._timelines = TimelineObserver()
        if self.rank == 0 and config.timeline and config.timeline.upper() != "DYNAMIC":
            self._timelines.timeline = Timeline(config.timeline, config.timeline_mark_cycles)
        self._reobserve = False  # the timeline changed: take the hooks again at the next round
        self.rounds = RoundController(backend, config, groups, self.tunables, clock, self._thread)
        memo = StepMemo()
        executor = Executor(backend, groups, self.rank, self.tunables, hostnames,
                            timeout_s=getattr(config, "gloo_timeout_seconds", 0.0) or 30.0,
                            secret=job_secret(backend), memo=memo)
        self.metrics = Counters(self.rank, self.size, clock())
        self.runner = BatchRunner(backend, config, groups, self.rounds, executor, memo, self._in_flight,
                                  self._lock, lambda: self.metrics.step_done(self._clock()),
                                  on_process_set_added, on_process_set_removed)

        # The observers (``observers.py``), each called through the hooks it overrides.
        self._metrics = MetricsObserver(backend, self.metrics, self.rank, self.size,
                                        config.straggler_interval_seconds, clock, memo)
        self._tuning = AutotuneObserver.from_config(config, self.tunables, backend, self.rounds, hostnames)
        self.pieces = PieceFollower.from_config(config, self.tunables, backend, memo)
        self.stall = StallObserver(self, config, clock)
        self._flight: FlightRecorder | None = None
        if config.flight_recorder > 0:
            self._flight = FlightRecorder(config.flight_recorder)
        self._observe()

    def _observe(self) -> None:
        """(Re)build the hooks the round controller, the runner and the loop call (the timeline's
        only while one is in use: an engine without one pays nothing for it)."""
        self._reobserve = False
        observers = [self._timelines if self._timelines.active else None, self._metrics, self._tuning,
                     self.pieces, self.stall, self._flight]
        self.rounds.observe(observers)
        self.runner.observe(observers)
        self._started_hooks = hooks(observers, "round_started")
        self._agreed_hooks = hooks(observers, "agreed")
        self._done_hooks = hooks(observers, "round_done")

    @property
    def _autotune(self) -> Any:
        """The autotuner (``HOROVOD_AUTOTUNE``; None: off); settable (benchmarks)."""
        return self._tuning.tuner if self._tuning is not None else None

    @_autotune.setter
    def _autotune(self, tuner: Any) -> None:
        self._tuning = AutotuneObserver(tuner, self.rounds) if tuner is not None else None
        if tuner is not None:
            self.pieces = None  # (the autotuner decides the piece size)
        self._observe()

    timeline = property(lambda self: self._timelines.timeline, doc="The timeline in use (None: none).")

    @property
    def flight(self) -> FlightRecorder | None:
        """The flight recorder (None: ``HOROVOD_FLIGHT_RECORDER=0``); settable (benchmarks)."""
        return self._flight

    @flight.setter
    def flight(self, recorder: FlightRecorder | None) -> None:
        self._flight = recorder
        self._observe()

    # Parts of the engine, by role, for tests and benchmarks.
    @property
    def cache(self) -> ResponseCache:
        return self.rounds.cache

    @property
    def _executor(self) -> Executor:
        return self.runner.executor

    # ================================================================ caller side
    def start(self) -> None:
        if self.rounds.coordinator is not None:
            self.rounds.coordinator.reserve_process_set_ids(max(self.groups) + 1)
        self._thread.start()
        self.stall.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask every rank's engine to stop at the next round, and wait for this one to stop."""
        with self._cv:
            self._shutdown_requested = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.stall.stop()
        if not self._thread.is_alive():
            self._executor.planes.close()  # device planes' process groups, while the transport lives
        self._timelines.replace(None)

    @property
    def stopped(self) -> bool:
        return self.queue.stopped

    # The queue's state the loop reads and sets (``tensor_queue.TensorQueue``).
    _queue = _queue_field("entries")
    _deferred = _queue_field("deferred")
    _deferred_since = _queue_field("deferred_since")
    _idle = _queue_field("idle")
    _shutdown_requested = _queue_field("shutdown_requested")
    _stopped = _queue_field("stopped")

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        if self.rank == 0:
            self._timelines.replace(Timeline(path, mark_cycles))
            self._reobserve = True  # (between rounds: a round's hooks stay those it started with)

    def stop_timeline(self) -> None:
        self._timelines.replace(None)
        self._reobserve = True

    # ================================================================ engine thread
    @property
    def _cycle(self) -> float:
        """Seconds between background rounds (``tunables.cycle_time_ms``, read every round)."""
        return self.tunables.cycle_time_ms / 1000.0

    @property
    def _idle_tick(self) -> float:
        return max(self._cycle, self._idle_tick_floor)

    def _run(self) -> None:
        _low_timer_slack()
        while not self._stopped:
            if self._deferred and time.perf_counter() - self._deferred_since >= DEFER_LIMIT_S:
                self.queue.release_deferred()  # nobody waited: reduce them in the background after all
            with self._cv:
                # Idle, or waiting for other ranks after a round that completed nothing: sleep
                # until new local work arrives or one cycle passes. Rounds that cannot finish
                # anything would only take CPU from the training thread.
                idle = not self.rounds.pending and len(self.groups) == 1
                if self._driver.locked() or (not self._queue and not self._shutdown_requested and (
                        not self.rounds.pending or not self.rounds.progress)):
                    self._idle = True
                    try:
                        self._cv.wait(self._idle_tick if idle else self._cycle)
                    finally:
                        self._idle = False
            # Background rounds start at most one cycle apart (HOROVOD_CYCLE_TIME), so that
            # gradients arriving from hooks meanwhile are negotiated and fused together. A caller
            # waiting on a handle drives its rounds at once.
            due = self._last_round + self._cycle
            if due > time.perf_counter():
                with self._cv:
                    while not self._shutdown_requested and (left := due - time.perf_counter()) > 0:
                        self._cv.wait(left)
            # A caller waiting on a handle may be driving; then it does this round's work and
            # the engine thread goes back to waiting (blocking here would make it run an empty
            # round between two of the caller's, which a peer would pair with a real one).
            if self._driver.acquire(blocking=False):
                try:
                    self._last_round = time.perf_counter()  # (also when skipped: ``_nothing_to_do``)
                    if not _nothing_to_do(self):
                        self._drive_once()
                finally:
                    self._driver.release()

    def _drive_once(self) -> None:
        """Run one round (the caller holds the driver lock)."""
        if self.queue.stopped:
            return
        self._any_round = time.perf_counter()
        self._round_wanted = False
        try:
            new, shutdown = self.queue.take()
            stop = self._round(new, shutdown)
        except BaseException as exc:  # the transport failed: fail everything, loudly
            # Ctrl-C or sys.exit() from a signal handler of a caller driving this round: the
            # engine stops (the round is cut short), and the caller gets its own exception.
            exiting = isinstance(exc, (KeyboardInterrupt, SystemExit))
            if not exiting:
                log.error("Horovod engine on rank %d stopped: %s", self.rank, exc)
            self._finish(None if exiting else exc)
            if exiting and threading.current_thread() is not self._thread:
                raise
            return
        if stop:
            self._finish(None)

    def help_until(self, handle: Any) -> None:
        """Drive rounds from a waiting caller's thread until ``handle`` completes."""
        queue = self.queue  # (its fields read directly: once per blocking call)
        if queue.deferred:
            queue.release_deferred()
        while not handle._done:  # ``Handle.done()``, inlined
            if queue.stopped:
                return
            if self._driver.acquire(blocking=False):
                try:
                    self._drive_once()
                finally:
                    self._driver.release()
                if not self.rounds.progress:
                    handle.wait_event(self._cycle)
            else:
                handle.wait_event(0.002)
        # What is left (other threads' async work) goes to the engine thread; read unlocked: only
        # rounds and submitters (which wake an idle engine thread themselves) add to it.
        if queue.entries or self.rounds.pending:
            with self._cv:
                self._cv.notify()

    def _finish(self, failure: BaseException | None) -> None:
        reason = None
        if failure is not None:
            reason = f"{SHUT_DOWN_MESSAGE} Cause on rank {self.rank}: {failure}"
        elif self._stall_shutdown:
            reason = ("Horovod has been shut down because a collective stalled "
                      f"(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS).\n{self._stall_shutdown}")
        self.rounds.reset()
        self.queue.finalize(reason, failure, self.rank)
        if self.timeline is not None:
            self.timeline.flush()

    def _round(self, new: list[Entry], shutdown: bool) -> bool:
        """One round: the controller agrees on its responses, the runner runs them, the observers
        watch. Returns whether every rank's engine stops now."""
        if self._reobserve:
            self._observe()
        for hook in self._started_hooks:
            hook()
        flags = FLAG_SHUTDOWN if shutdown or self._stall_shutdown else 0
        rounds = self.rounds
        responses, cached_slots, any_flags, late = rounds.agree(new, flags)
        if responses:
            self.runner.execute(responses, cached_slots, bool(any_flags & FLAG_JOINED))
        if late:
            rounds.evict_late(late)
        if any_flags & OBSERVER_FLAGS:
            for hook in self._agreed_hooks:
                hook(any_flags)
        for hook in self._done_hooks:
            hook()
        return bool(any_flags & FLAG_SHUTDOWN)

    # ------------------------------------------------ what the observers ask of the loop
    def wake(self) -> None:
        """Have the engine thread run a round soon (an observer has something to ask)."""
        with self._cv:
            self._round_wanted = True
            self._cv.notify()

    def stragglers(self) -> list[int]:
        return self._metrics.stragglers()

    def stall_shutdown(self, report: str | None) -> None:
        """Rank 0 decided to shut down for a stall (every rank, in the same round): the next
        round stops every engine, and each shutdown error carries ``report``."""
        self._stall_shutdown = report or "a collective stalled past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"

    def flight_record(self, done: int | None = None, in_flight: int | None = None) -> dict[str, Any]:
        """This rank's flight record (``flight.py``): the last ``done`` completed collectives
        (all kept: None) and the first ``in_flight`` in-flight ones (all: None); any thread."""
        return flight_record(self.flight, self.queue.snapshot(), self._clock(), done, in_flight)

    def metrics_snapshot(self) -> dict[str, Any]:
        """This rank's counters (``hvd.metrics()``); any thread may call it."""
        with self._lock:
            waiting = [e.t_submit for e in self._in_flight.values()]
        return self._metrics.snapshot(waiting, self._clock(), self.config.stall_check_time_seconds)
