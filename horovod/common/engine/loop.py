"""The engine: one background thread per process that owns all communication.

Callers ``submit`` entries and get handles at once. The thread runs negotiation rounds; in each
round every rank of the world takes part, in the same order:

1. one bit-vector AND (``Controller.and_bits``): which cached operations every rank has ready, which
   cache slots some rank wants evicted, and flags (someone has uncached requests / wants to shut
   down / has joined);
2. only if some rank has uncached requests: gather them to the coordinator (rank 0), which answers
   with the newly ready responses or errors (``negotiation.py``), broadcast to all;
3. every rank plans the same batches (``fusion.py``) and executes them (``executor.py``).

A rank with nothing to do waits on a condition variable with a timeout of ``HOROVOD_CYCLE_TIME``;
a submission wakes it at once, so a lone operation never waits for a tick. A rank with pending
operations starts the next round at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod.common.backends.base import EngineBackend, Group
from horovod.common.config import EngineConfig
from horovod.common.engine.cache import ResponseCache
from horovod.common.engine.device import DevicePlaneError
from horovod.common.engine.executor import Entry, Executor
from horovod.common.engine.flight import FlightRecorder, in_flight_rows
from horovod.common.engine.fusion import plan_batches
from horovod.common.engine.metrics import Counters, StragglerDetector
from horovod.common.engine.negotiation import _JOIN_UNSUPPORTED, Coordinator
from horovod.common.engine.negotiation_codec import decode_requests, decode_responses, encode_requests, encode_responses
from horovod.common.engine.stall_observer import StallObserver
from horovod.common.engine.timeline import Timeline
from horovod.common.engine.tunables import Tunables
from horovod.common.exceptions import (
    SHUT_DOWN_MESSAGE,
    CollectiveMismatchError,
    HorovodInternalError,
    HorovodShutdownError,
)
from horovod.common.protocol import job_secret
from horovod.common.types import RequestType, Response

__all__ = ["Engine"]

log = logging.getLogger("horovod")

_DONE, _CACHED, _NEW, _SENT = 0, 1, 2, 3
_FLAG_NEW, _FLAG_SHUTDOWN, _FLAG_JOINED, _FLAG_EXCHANGE, _FLAG_DIAGNOSE = 1, 2, 4, 8, 16
_WORD = (1 << 64) - 1

DUPLICATE_NAME_MESSAGE = (
    "Requested to allreduce, allgather, or broadcast a tensor with the same name as another tensor "
    "that is currently being processed: {name!r}. If you want to request another tensor, use a "
    "different tensor name.")


def _bits_to_slots(bits: int) -> list[int]:
    """Indices of the set bits of a Python int, lowest first."""
    if bits and bits.bit_count() > 16:  # many (a cached step's gradients): one C pass over the bytes
        raw = np.frombuffer(bits.to_bytes((bits.bit_length() + 7) // 8, "little"), np.uint8)
        return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()
    out = []
    while bits:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return out


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
        self._on_ps_added = on_process_set_added
        self._on_ps_removed = on_process_set_removed
        # The condition's lock, taken directly on the hot submission path (``with self._cv`` goes
        # through Condition.__enter__, a Python-level call per submitted tensor).
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        # Whoever holds the driver lock runs negotiation rounds: the engine thread, or a caller
        # waiting on a handle while the engine thread is idle (saves two thread hand-offs per
        # blocking operation). Rounds are serialized, so MPI sees one caller at a time.
        self._driver = threading.Lock()
        self._queue: list[Entry] = []
        # Every submitted entry whose handle is not yet completed, by name: when the engine stops,
        # each of them is failed (whether it was queued, pending, or in the batch that broke).
        self._in_flight: dict[str, Entry] = {}
        self._shutdown_requested = False
        self._stopped = False
        self._stop_reason = SHUT_DOWN_MESSAGE
        # Engine-thread state below.
        self._pending: dict[str, Entry] = {}
        self._new: list[Entry] = []
        self._joined = False
        self._progress = True  # did the last round complete anything or take new work?
        self._deferred: list[Entry] = []  # submitted with defer=True, held until a caller waits
        self._deferred_since = 0.0
        # Speed knobs, read afresh every round/batch (an autotuner changes them at run time).
        local_size = hostnames.count(hostnames[self.rank]) if hostnames else 1
        self.tunables = Tunables.from_config(config, local_size)
        self._last_round = 0.0  # when the engine thread last started a round (perf_counter)
        # True while the engine thread sleeps for want of work: only then does a submission wake
        # it. Between rounds it sleeps until the next is due and takes the queue then; waking it
        # for every submission (161 for a ResNet-50 gradient set) costs two thread switches each.
        self._idle = False
        # With only the global process set, a rank with nothing pending cannot help any
        # operation finish (each needs this rank's own submission, which wakes it at once), so it
        # joins rounds rarely: often enough for stall reports and shutdowns, not so often that
        # its empty rounds interrupt the busy ranks. Other process sets need it every cycle.
        self._idle_tick_floor = 0.05
        self.cache = ResponseCache(config.cache_capacity, on_evict=self._forget_slot)
        # Fusion plans of all-cached rounds, by (ready slots, planning settings): a cached step
        # plans the same batches every step. Cleared whenever a cache slot is filled or emptied
        # (``_forget_slot`` sees every eviction, whatever its cause), so a slot in a key always
        # holds the response it was planned with. See ``_plan``.
        self._plans: dict[tuple[Any, ...], tuple[tuple[Response, ...], ...]] = {}
        # Bit masks over cache slots, as Python ints (bit i = slot i).
        self._ready_mask = 0
        self._excluded_mask = 0  # slots of process sets without this rank
        self._occupied_mask = 0
        self._full = (1 << (64 * self.cache.words)) - 1
        self._bits = np.zeros(2 * self.cache.words + 1, np.uint64)
        self._coordinator = Coordinator(self.size, self._members, clock) if self.rank == 0 else None
        # Observers the loop calls: the flight recorder (every rank: one record per completed
        # batch) and the stall observer (its inspector on rank 0; on every rank, its answers to
        # the coordinator's questions).
        self.flight: FlightRecorder | None = None
        if config.flight_recorder > 0:
            self.flight = FlightRecorder(config.flight_recorder)
        self.host = hostnames[self.rank] if hostnames else ""
        self.hostnames = list(hostnames or [])
        self.pids = list(pids or [])
        # When this rank's thread entered a negotiation collective it has not left (0.0: none):
        # the stall observer's watchdog reads it (ranks that never come leave it set).
        self.negotiating_since = 0.0
        self.stall = StallObserver(self, config, clock)
        self._stall_shutdown: str | None = None
        self._local_stall_due = clock() + config.stall_check_time_seconds
        self.timeline: Timeline | None = None
        if self.rank == 0 and config.timeline and config.timeline.upper() != "DYNAMIC":
            self.timeline = Timeline(config.timeline, config.timeline_mark_cycles)
        self._executor = Executor(backend, groups, self.rank, self.tunables, lambda: self.timeline,
                                  hostnames, timeout_s=getattr(config, "gloo_timeout_seconds", 0.0) or 30.0,
                                  secret=job_secret(backend))
        self._autotune = None
        if config.autotune:  # HOROVOD_AUTOTUNE: tunes self.tunables at sample boundaries (same on every rank)
            from horovod.common.autotune import from_config

            self._autotune = from_config(config, self.tunables, self.rank, backend.bcast_from_root, os.environ,
                                         len(set(hostnames or [])) > 1, on_change=self._autotuned)
        # Counters (hvd.metrics()) and the straggler exchange: about once per
        # HOROVOD_STRAGGLER_INTERVAL the coordinator asks every rank, in a round's flags, for its
        # round records, judges them (``metrics.StragglerDetector``) and broadcasts the verdict.
        self.metrics = Counters(self.rank, self.size, clock())
        self._round_no = 0
        # Submit times, for the round records: the first entry taken while nothing was pending,
        # and the latest taken (entries arrive in submission order: O(1) per round).
        self._first_submit = self._last_submit = 0.0
        self._round_done = False  # this round completed some of this rank's entries
        # Bytes and tensors of memoized batches of fixed-shape operations, by batch identity.
        self._batch_sizes: dict[int, tuple[Sequence[Response], int, int]] = {}
        self._straggler: StragglerDetector | None = None
        self._exchange_every = config.straggler_interval_seconds
        if self.rank == 0 and self.size > 1 and self._exchange_every > 0:
            self._straggler = StragglerDetector(self.size)
        self._exchange_due = clock() + self._exchange_every
        self._thread = threading.Thread(target=self._run, name="horovod-engine", daemon=True)
        self._helper = self.help_until  # what handles call to drive rounds (one bound method)

    # ================================================================ caller side
    def start(self) -> None:
        if self._coordinator is not None:
            self._coordinator.reserve_process_set_ids(max(self.groups) + 1)
        self._thread.start()
        self.stall.start()

    def submit(self, entry: Entry, wake: bool = True, defer: bool = False) -> None:
        """Queue an entry for the engine thread (any thread may call this).

        With ``wake=False`` the engine thread is not woken: the caller is about to wait on the
        handle and will drive the round itself (the engine thread's tick is the fallback).
        With ``defer=True`` and ``tunables.overlap`` off, the entry is held back until a caller
        waits on any handle (or ``DEFER_LIMIT_S`` passes): gradients submitted from hooks during
        the backward pass are then reduced when the optimizer waits, on otherwise idle cores,
        instead of competing with the backward pass for them.

        Raises:
            ValueError: an operation with the same name is still in flight on this rank.
            HorovodShutdownError: the engine has shut down.
        """
        name = entry.request.name
        in_flight = self._in_flight
        lock = self._lock
        lock.acquire()  # not ``with``: half the cost, once per tensor of a step
        try:
            if self._stopped:
                raise HorovodShutdownError(self._stop_reason)
            if name in in_flight:
                raise ValueError(DUPLICATE_NAME_MESSAGE.format(name=name))
            in_flight[name] = entry
            entry.handle.helper = self._helper
            entry.t_submit = self._clock()
            if defer and not self.tunables.overlap:
                self._enqueue([entry], wake, defer)
                return
            # _enqueue of one entry, inlined (once per tensor of a step)
            self._queue.append(entry)
            if wake and self._idle:
                self._idle = False
                self._cv.notify()
        finally:
            lock.release()

    def submit_many(self, entries: list[Entry], wake: bool = True, defer: bool = False) -> None:
        """``submit`` for several entries at once (one lock, one wake-up): a gradient bundle.

        The entries are negotiated, cached and executed exactly as if each had been submitted on
        its own (other ranks cannot tell); they usually share one ``GroupHandle``. Their names
        must differ from each other (the caller's guarantee: a model's parameter names).

        Raises:
            ValueError: one of the names is still in flight on this rank (nothing is submitted).
            HorovodShutdownError: the engine has shut down.
        """
        names = [e.request.name for e in entries]
        with self._lock:
            if self._stopped:
                raise HorovodShutdownError(self._stop_reason)
            in_flight = self._in_flight
            if not in_flight.keys().isdisjoint(names):
                name = next(n for n in names if n in in_flight)
                raise ValueError(DUPLICATE_NAME_MESSAGE.format(name=name))
            now = self._clock()
            helper = self._helper
            for e in entries:
                e.t_submit = now
                e.handle.helper = helper
            in_flight.update(zip(names, entries))
            self._enqueue(entries, wake, defer)

    def _enqueue(self, entries: list[Entry], wake: bool, defer: bool) -> None:
        """Hold (``defer``, overlap off) or queue submitted entries; the caller holds the lock."""
        if defer and not self.tunables.overlap:
            if not self._deferred:
                self._deferred_since = time.perf_counter()
            self._deferred.extend(entries)
            return
        self._queue.extend(entries)
        if wake and self._idle:
            # One wake-up per idle period: the engine thread is on its way (it clears _idle
            # itself too); notifying again for each tensor of a burst would only cost time.
            self._idle = False
            self._cv.notify()

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
        if self.timeline is not None:
            self.timeline.close()
            self.timeline = None

    @property
    def stopped(self) -> bool:
        return self._stopped

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        if self.rank != 0:
            return
        old, self.timeline = self.timeline, Timeline(path, mark_cycles)
        if old is not None:
            old.close()

    def stop_timeline(self) -> None:
        old, self.timeline = self.timeline, None
        if old is not None:
            old.close()

    # ================================================================ engine thread
    @property
    def _cycle(self) -> float:
        """Seconds between background rounds (``tunables.cycle_time_ms``, read every round)."""
        return self.tunables.cycle_time_ms / 1000.0

    @property
    def _idle_tick(self) -> float:
        return max(self._cycle, self._idle_tick_floor)

    def _members(self, process_set_id: int) -> list[int] | None:
        g = self.groups.get(process_set_id)
        return None if g is None else g.ranks

    def _run(self) -> None:
        _low_timer_slack()
        while not self._stopped:
            if self._deferred and time.perf_counter() - self._deferred_since >= DEFER_LIMIT_S:
                self._release_deferred()  # nobody waited: reduce them in the background after all
            with self._cv:
                # Idle, or waiting for other ranks after a round that completed nothing: sleep
                # until new local work arrives or one cycle passes. Rounds that cannot finish
                # anything would only take CPU from the training thread.
                idle = not self._pending and len(self.groups) == 1
                if self._driver.locked() or (not self._queue and not self._shutdown_requested and (
                        not self._pending or not self._progress)):
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
                    self._last_round = time.perf_counter()
                    self._drive_once()
                finally:
                    self._driver.release()

    def _drive_once(self) -> None:
        """Run one round (the caller holds the driver lock)."""
        if self._stopped:
            return
        try:
            with self._cv:
                new, self._queue = self._queue, []
                shutdown = self._shutdown_requested
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

    def _release_deferred(self) -> None:
        with self._cv:
            if self._deferred:
                self._queue.extend(self._deferred)
                self._deferred = []
                self._cv.notify()

    def help_until(self, handle: Any) -> None:
        """Drive rounds from a waiting caller's thread until ``handle`` completes."""
        if self._deferred:
            self._release_deferred()
        while not handle.done():
            if self._stopped:
                return
            if self._driver.acquire(blocking=False):
                try:
                    self._drive_once()
                finally:
                    self._driver.release()
                if not self._progress:
                    handle.wait_event(self._cycle)
            else:
                handle.wait_event(0.002)
        with self._cv:
            if self._queue or self._pending:
                self._cv.notify()  # hand what is left (async work of other threads) to the engine

    def _finish(self, failure: BaseException | None) -> None:
        with self._cv:
            self._stopped = True
            if failure is not None:
                self._stop_reason = f"{SHUT_DOWN_MESSAGE} Cause on rank {self.rank}: {failure}"
            elif self._stall_shutdown:
                self._stop_reason = ("Horovod has been shut down because a collective stalled "
                                     f"(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS).\n{self._stall_shutdown}")
            leftover = list(self._in_flight.values())
            self._deferred = []
            self._pending.clear()
            self._queue = []
            self._in_flight.clear()
        for e in leftover:
            if e.handle.done():
                continue
            err = HorovodShutdownError(self._stop_reason, rank=self.rank, tensor_name=e.request.name)
            if failure is not None:
                err.__cause__ = failure
            e.handle.set_error(err)
        if self.timeline is not None:
            self.timeline.flush()

    def _round(self, new: list[Entry], shutdown: bool) -> bool:
        cache = self.cache
        words = cache.words
        tl = self.timeline
        if tl is not None:
            tl.cycle()
        invalid = 0
        if new:
            pending, join = self._pending, RequestType.JOIN
            if not pending:
                self._first_submit = new[0].t_submit
            self._last_submit = new[-1].t_submit
            lookup = cache.lookup if words and self.tunables.cache_enabled else None
            # ``cache.lookup``'s first test, inlined: a request resubmitted as it is (a gradient's,
            # every step) is the one its slot last matched.
            slot_of, matched = cache.slot_of if lookup is not None else {}, cache.matched
            ready = self._ready_mask
            for e in new:
                req = e.request
                name = req.name
                pending[name] = e
                if req.kind is join:
                    self._joined = True
                slot = slot_of.get(name, -1)
                if slot >= 0 and matched[slot] is req:
                    e.state, e.slot = _CACHED, slot
                    ready |= 1 << slot
                    continue
                slot, match = lookup(req) if lookup is not None else (-1, False)
                if match:
                    e.state, e.slot = _CACHED, slot
                    ready |= 1 << slot
                else:
                    e.state = _NEW
                    self._new.append(e)
                    if slot >= 0:
                        invalid |= 1 << slot
            self._ready_mask = ready
        now = self._clock()
        if words and now >= self._local_stall_due:
            # Cached operations that wait too long go back through the coordinator, which can
            # then say which ranks are missing.
            self._local_stall_due = now + min(self.config.stall_check_time_seconds, 1.0)
            limit = self.config.stall_check_time_seconds
            for e in self._pending.values():
                if e.state == _CACHED and now - e.t_submit > limit:
                    invalid |= 1 << e.slot

        flags = 0
        if any(e.state == _NEW for e in self._new):
            flags |= _FLAG_NEW
        if shutdown or self._stall_shutdown:
            flags |= _FLAG_SHUTDOWN
        if self._straggler is not None and now >= self._exchange_due:
            flags |= _FLAG_EXCHANGE
            self._exchange_due = now + self._exchange_every
        if self.stall.asking:
            flags |= _FLAG_DIAGNOSE
        if self._joined:
            flags |= _FLAG_JOINED
        ready_local = self._ready_mask | self._excluded_mask
        if self._joined:
            ready_local |= self._occupied_mask
        nbytes = 8 * words
        # One AND over [ready bits | NOT invalid bits | NOT flags]: AND of negations is the
        # negation of an OR, so one collective yields "ready everywhere" and "wanted anywhere".
        packed = (ready_local | ((self._full ^ invalid) << (64 * words))
                  | ((_WORD ^ flags) << (128 * words)))
        bits = self._bits
        bits.view(np.uint8)[:] = np.frombuffer(packed.to_bytes(2 * nbytes + 8, "little"), np.uint8)
        self.negotiating_since = now
        raw = self.backend.and_bits(bits, spin=threading.current_thread() is not self._thread).tobytes()
        t_ready = self._clock()
        self.negotiating_since = 0.0
        self._round_no += 1
        any_flags = _WORD ^ int.from_bytes(raw[2 * nbytes:], "little")
        ready_slots = _bits_to_slots(int.from_bytes(raw[:nbytes], "little"))
        evict = _bits_to_slots((self._full ^ int.from_bytes(raw[nbytes:2 * nbytes], "little"))
                               & self._occupied_mask)
        responses: list[Response] = cache.responses(ready_slots)
        cached_slots: list[int] = list(ready_slots)
        late: list[int] = []
        if evict:
            # A slot ready on every rank runs from the cache this round even if some rank asked
            # to evict it (a local stall check does, for an entry that waited long): it is evicted
            # after it ran. Evicted now, its entries would also be sent to the coordinator as new
            # requests in this round, where they would stay after the operation completed.
            ready_now = set(ready_slots)
            late = [slot for slot in evict if slot in ready_now]
            for slot in evict:
                if slot not in ready_now:
                    self._evict(slot)
        if any_flags & _FLAG_NEW:
            self.negotiating_since = t_ready
            responses.extend(self._negotiate())
            self.negotiating_since = 0.0
        elif self._coordinator is not None and self.stall.due():
            self.stall.check(self._coordinator)
        self._progress = bool(responses or new or evict)
        if responses:
            self._execute(responses, cached_slots, bool(any_flags & _FLAG_JOINED))
            if self._round_done:
                self._round_done = False
                self.metrics.record_round(self._round_no, t_ready, self._first_submit, self._last_submit)
        for slot in late:
            self._evict(slot)
        if any_flags & _FLAG_EXCHANGE:
            self._exchange()
        if any_flags & _FLAG_DIAGNOSE:
            self.negotiating_since = self._clock()
            self.stall.answer_round()
            self.negotiating_since = 0.0
        if tl is not None:
            tl.maybe_flush()
        return bool(any_flags & _FLAG_SHUTDOWN)

    def _exchange(self) -> None:
        """Every rank's round records to the coordinator; its straggler verdict back to all."""
        gathered = self.backend.gather_to_root(self.metrics.take_window())
        verdict = None
        if self._straggler is not None:
            assert gathered is not None
            self._straggler.feed(gathered)
            verdict = self._straggler.verdict()
        self.metrics.apply_verdict(self.backend.bcast_from_root(verdict))

    # ------------------------------------------------ what the observers ask of the loop
    def wake(self) -> None:
        """Have the engine thread run a round soon (an observer has something to ask)."""
        with self._cv:
            self._cv.notify()

    def stragglers(self) -> list[int]:
        return list(self._straggler.stragglers) if self._straggler is not None else []

    def stall_shutdown(self, report: str | None) -> None:
        """Rank 0 decided to shut down for a stall (every rank, in the same round): the next
        round stops every engine, and each shutdown error carries ``report``."""
        self._stall_shutdown = report or "a collective stalled past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"

    def flight_record(self, done: int | None = None, in_flight: int | None = None) -> dict[str, Any]:
        """This rank's flight record (``flight.py``): the last ``done`` completed collectives
        (all kept: None) and the first ``in_flight`` in-flight ones (all: None); any thread."""
        now = self._clock()
        with self._lock:
            entries = list(self._in_flight.values())
            queued = {id(e) for e in self._queue} | {id(e) for e in self._deferred}
        flight = self.flight
        if flight is None:
            return {"done": [], "in_flight": in_flight_rows(entries, queued, now, {}, in_flight)}
        return {"done": flight.done(time.perf_counter(), done),
                "in_flight": flight.in_flight(entries, queued, now, in_flight)}

    def metrics_snapshot(self) -> dict[str, Any]:
        """This rank's counters (``hvd.metrics()``); any thread may call it."""
        snap = self.metrics.snapshot()
        limit = self.config.stall_check_time_seconds
        now = self._clock()
        with self._lock:
            waiting = [e.t_submit for e in self._in_flight.values()]
        snap["stalled_tensors"] = sum(1 for t in waiting if now - t > limit)
        snap["in_flight"] = len(waiting)
        return snap

    def _evict(self, slot: int) -> None:
        self.cache.evict(slot)  # calls _forget_slot

    def _forget_slot(self, slot: int, name: str) -> None:
        """A cache slot was emptied (on every rank alike): clear its bits, and send a request that
        was waiting on it through the coordinator instead."""
        self._plans.clear()
        keep = ~(1 << slot)
        self._ready_mask &= keep
        self._excluded_mask &= keep
        self._occupied_mask &= keep
        e = self._pending.get(name)
        if e is not None and e.state == _CACHED and e.slot == slot:
            e.state = _NEW
            self._new.append(e)

    def _negotiate(self) -> list[Response]:
        # An entry may have been queued here and then run from the cache in the same round.
        fresh = [e for e in self._new if e.state == _NEW]
        mine = [e.request for e in fresh]
        for e in fresh:
            e.state = _SENT
        self._new = []
        # A request that waited long on this rank (a cached one sent again after a local stall)
        # tells the coordinator how long, so that its stall report comes on time.
        now = self._clock()
        waited = [now - e.t_submit for e in fresh]
        gathered = self.backend.gather_to_root(
            encode_requests(mine, waited if waited and max(waited) >= 1.0 else None))
        responses: list[Response] | None = None
        coord = self._coordinator
        if coord is not None:
            assert gathered is not None
            tl = self.timeline
            first_time = coord.submit_encoded(gathered)
            if tl is not None:
                for name in first_time:
                    tl.begin(name, "NEGOTIATE_" + coord.table[name].kind.upper)
                for rank, data in enumerate(gathered):
                    for r in decode_requests(data, rank):
                        tl.tick(r.name, str(rank))
            responses = coord.ready()
            if tl is not None:
                for resp in responses:
                    tl.end(resp.name)
            if self.stall.due():
                self.stall.check(coord)
            self.backend.bcast_from_root(encode_responses(responses))
            return responses
        return decode_responses(self.backend.bcast_from_root(None))

    def _execute(self, responses: list[Response], cached_slots: list[int], joined_any: bool) -> None:
        cache = self.cache
        cache.touch_all(cached_slots)
        for resp in responses[len(cached_slots):]:
            if resp.error is None and resp.kind not in (RequestType.JOIN,) and self.tunables.cache_enabled:
                before = cache.lookup(resp.request)[0]
                cache.put(resp)
                slot = cache.lookup(resp.request)[0]
                if slot >= 0 and slot != before:
                    self._plans.clear()
                    self._occupied_mask |= 1 << slot
                    if self.rank not in self.groups[resp.request.process_set_id].ranks:
                        self._excluded_mask |= 1 << slot
        if joined_any:
            responses = [Response(r.request, error=_JOIN_UNSUPPORTED[r.kind])
                         if r.kind in _JOIN_UNSUPPORTED and r.error is None else r for r in responses]
        batches = self._plan(responses, cached_slots, joined_any)
        for batch in batches:
            self._run_batch(batch)
        if self._autotune is not None:
            self._autotune.observe(responses)

    # Bound on memoized plans: a workload whose rounds see many different sets of ready slots
    # (gradients straggling into rounds at random) only plans afresh once the memo is full.
    PLAN_MEMO_SIZE = 64

    def _plan(self, responses: list[Response], cached_slots: list[int],
              joined_any: bool) -> Sequence[Sequence[Response]]:
        """This round's batches (``fusion.plan_batches``), memoized for rounds of cached responses
        only: the key is the ready slots (the responses are ``cache.response(slot)``, unchanged
        while the memo lives) and every setting ``plan_batches`` reads. A round with new
        responses or a joined rank (whose responses are rewritten) is planned afresh. A memoized
        plan is a tuple of tuples: nobody can change what a later round gets."""
        tun = self.tunables
        group_fusion = not self.config.disable_group_fusion
        if joined_any or len(cached_slots) != len(responses):
            return plan_batches(responses, tun.fusion_threshold, tun.max_tensor_bytes, group_fusion)
        key = (tuple(cached_slots), tun.fusion_threshold, tun.max_tensor_bytes, group_fusion)
        plans = self._plans
        batches = plans.get(key)
        if batches is None:
            batches = tuple(tuple(b) for b in plan_batches(responses, tun.fusion_threshold,
                                                           tun.max_tensor_bytes, group_fusion))
            if len(plans) >= self.PLAN_MEMO_SIZE:
                plans.clear()
            plans[key] = batches
        return batches

    def _autotuned(self, old: dict[str, Any], new: dict[str, Any]) -> None:
        """The autotuner changed the knobs (on every rank at this same point)."""
        if old.get("cache_enabled") and not new.get("cache_enabled"):
            # Requests waiting on cache slots go back through the coordinator, on every rank alike.
            for slot in list(self.cache.occupied()):
                self._evict(slot)

    def _take_batch(self, batch: Sequence[Response]) -> list[Entry | None]:
        """Each response's pending entry (None where this rank has none), marked done and its
        cached slot no longer ready; one call per batch (a cached step's batch holds every
        gradient)."""
        pop = self._pending.pop
        entries: list[Entry | None] = []
        cleared = 0
        for r in batch:
            e = pop(r.request.name, None)
            if e is not None:
                if e.state == _CACHED:
                    cleared |= 1 << e.slot
                e.state = _DONE
            entries.append(e)
        if cleared:
            self._ready_mask &= ~cleared
        return entries

    _FIXED_SHAPES = (RequestType.ALLREDUCE, RequestType.BROADCAST, RequestType.REDUCESCATTER)

    def _count_batch(self, kind: RequestType, batch: Sequence[Response], entries: list[Entry | None],
                     seconds: float) -> None:
        """Add a batch to the counters: tensors and bytes this rank submitted, time it took. A
        memoized batch (a cached step's) of fixed-shape operations is sized once."""
        sizes = self._batch_sizes.get(id(batch))
        if sizes is None or sizes[0] is not batch:
            arrays = [a for e in entries if e is not None for a in e.inputs]
            sizes = (batch, len(arrays), sum([a.nbytes for a in arrays]))
            if kind in self._FIXED_SHAPES and None not in entries:
                if len(self._batch_sizes) >= 4 * self.PLAN_MEMO_SIZE:
                    self._batch_sizes.clear()
                self._batch_sizes[id(batch)] = sizes
        self.metrics.record_batch(kind.value, sizes[1], sizes[2], seconds)

    def _complete(self, entries: list[Entry | None]) -> None:
        done = [e for e in entries if e is not None]
        if not done:
            return
        self._round_done = True
        pop = self._in_flight.pop
        with self._lock:
            for e in done:
                pop(e.request.name, None)
            step_over = not self._in_flight
        if step_over:
            self.metrics.step_done(self._clock())
        for e in done:
            e.handle.set_result(e.outputs)

    def _run_batch(self, batch: Sequence[Response]) -> None:
        first = batch[0]
        kind = first.kind
        group = self.groups.get(first.request.process_set_id)
        member = group is not None and group.rank >= 0
        if first.error is not None:
            e = self._take_batch([first])[0]
            if e is not None:
                with self._cv:
                    self._in_flight.pop(first.name, None)
                e.handle.set_error(CollectiveMismatchError(first.error, **first.error_fields))
            return
        if kind == RequestType.ADD_PROCESS_SET:
            ranks = list(first.request.payload)
            self.groups[first.result] = self.backend.new_group(ranks)
            if self._on_ps_added is not None:
                self._on_ps_added(first.result, ranks)
            e = self._take_batch([first])[0]
            if e is not None:
                e.outputs = first.result
            self._complete([e])
            return
        if kind == RequestType.REMOVE_PROCESS_SET:
            ps_id = int(first.request.payload)
            g = self.groups.pop(ps_id, None)
            if g is not None:
                self._executor.planes.free_group(g)
                self.backend.free_group(g)
            if self._on_ps_removed is not None:
                self._on_ps_removed(ps_id)
            for slot in self.cache.occupied():
                if self.cache.response(slot).request.process_set_id == ps_id:
                    self._evict(slot)
            e = self._take_batch([first])[0]
            self._complete([e])
            return
        if not member:
            return
        entries = self._take_batch(batch)
        if kind == RequestType.JOIN:
            self._joined = False
            e = entries[0]
            if e is not None:
                e.outputs = first.result
            if self.flight is not None:
                self.flight.batch_done(batch, time.perf_counter(), time.perf_counter())
            self._complete(entries)
            return
        if kind == RequestType.BARRIER:
            if self.flight is not None:
                self.flight.batch_done(batch, time.perf_counter(), time.perf_counter())
            self._complete(entries)
            return
        if None in entries and not (self._joined and kind == RequestType.ALLREDUCE):
            missing = [r.name for r, e in zip(batch, entries) if e is None]
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise HorovodInternalError(f"engine state diverged: rank {self.rank} was asked to run {shown}, "
                                       "which it never submitted")
        t0 = time.perf_counter()
        try:
            self._executor.run(batch, entries)
        except (TypeError, DevicePlaneError) as exc:  # this batch fails; the engine keeps serving
            for e in entries:
                if e is not None:
                    with self._cv:
                        self._in_flight.pop(e.request.name, None)
                    e.handle.set_error(HorovodInternalError(f"{kind.value} {e.request.name!r}: {exc}"))
            return
        t1 = time.perf_counter()
        self._count_batch(kind, batch, entries, t1 - t0)
        flight = self.flight
        if flight is not None:
            flight.batch_done(batch, t0, t1)
        self._complete(entries)
