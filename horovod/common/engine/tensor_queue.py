"""The engine's tensor queue (Horovod's ``TensorQueue``): what callers submit, until a round takes it.

Any thread submits entries (``submit``, ``submit_many``); the driver of the next round takes them
(``take``). The queue also holds the table of every submitted entry not yet completed (by name:
the duplicate-name check, the flight recorder's in-flight rows, and, when the engine stops, the
handles to fail: ``finalize``), the entries held back by deferral, and the engine's stop state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from horovod.common.engine.executor import Entry
from horovod.common.engine.tunables import Tunables
from horovod.common.exceptions import SHUT_DOWN_MESSAGE, HorovodShutdownError

__all__ = ["TensorQueue", "DUPLICATE_NAME_MESSAGE"]

DUPLICATE_NAME_MESSAGE = (
    "Requested to allreduce, allgather, or broadcast a tensor with the same name as another tensor "
    "that is currently being processed: {name!r}. If you want to request another tensor, use a "
    "different tensor name.")


class TensorQueue:
    """Submitted entries waiting for a round, the in-flight table, deferral and the stop state."""

    def __init__(self, clock: Callable[[], float], tunables: Tunables, helper: Callable[[Any], None]) -> None:
        self._clock = clock
        self.tunables = tunables
        self._helper = helper  # what handles call to drive rounds (one bound method)
        # The condition's lock, taken directly on the hot submission path (``with self.cv`` goes
        # through Condition.__enter__, a Python-level call per submitted tensor).
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.entries: list[Entry] = []
        # Every submitted entry whose handle is not yet completed, by name: when the engine stops,
        # each of them is failed (whether it was queued, pending, or in the batch that broke).
        self.in_flight: dict[str, Entry] = {}
        self.deferred: list[Entry] = []  # submitted with defer=True, held until a caller waits
        self.deferred_since = 0.0
        # True while the engine thread sleeps for want of work: only then does a submission wake
        # it. Between rounds it sleeps until the next is due and takes the queue then; waking it
        # for every submission (161 for a ResNet-50 gradient set) costs two thread switches each.
        self.idle = False
        self.shutdown_requested = False
        self.stopped = False
        self.stop_reason = SHUT_DOWN_MESSAGE

    def submit(self, entry: Entry, wake: bool = True, defer: bool = False) -> None:
        """Queue an entry for the engine thread (any thread may call this).

        With ``wake=False`` the engine thread is not woken: the caller is about to wait on the
        handle and will drive the round itself (the engine thread's tick is the fallback).
        With ``defer=True`` and ``tunables.overlap`` off, the entry is held back until a caller
        waits on any handle (or ``loop.DEFER_LIMIT_S`` passes): gradients submitted from hooks
        during the backward pass are then reduced when the optimizer waits, on otherwise idle
        cores, instead of competing with the backward pass for them.

        Raises:
            ValueError: an operation with the same name is still in flight on this rank.
            HorovodShutdownError: the engine has shut down.
        """
        name = entry.request.name
        in_flight = self.in_flight
        lock = self.lock
        lock.acquire()  # not ``with``: half the cost, once per tensor of a step
        try:
            if self.stopped:
                raise HorovodShutdownError(self.stop_reason)
            if name in in_flight:
                raise ValueError(DUPLICATE_NAME_MESSAGE.format(name=name))
            in_flight[name] = entry
            entry.handle.helper = self._helper
            entry.t_submit = self._clock()
            if defer and not self.tunables.overlap:
                self._enqueue([entry], wake, defer)
                return
            # _enqueue of one entry, inlined (once per tensor of a step)
            self.entries.append(entry)
            if wake and self.idle:
                self.idle = False
                self.cv.notify()
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
        with self.lock:
            if self.stopped:
                raise HorovodShutdownError(self.stop_reason)
            in_flight = self.in_flight
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
            if not self.deferred:
                self.deferred_since = time.perf_counter()
            self.deferred.extend(entries)
            return
        self.entries.extend(entries)
        if wake and self.idle:
            # One wake-up per idle period: the engine thread is on its way (it clears idle
            # itself too); notifying again for each tensor of a burst would only cost time.
            self.idle = False
            self.cv.notify()

    def release_deferred(self) -> None:
        """Queue the deferred entries (a caller waits, or they waited ``DEFER_LIMIT_S``)."""
        with self.cv:
            if self.deferred:
                self.entries.extend(self.deferred)
                self.deferred = []
                self.cv.notify()

    def take(self) -> tuple[list[Entry], bool]:
        """The queued entries (the queue is left empty) and whether a shutdown was requested."""
        with self.lock:  # the condition's lock, without Condition.__enter__ (once per round)
            new, self.entries = self.entries, []
            return new, self.shutdown_requested

    def snapshot(self) -> tuple[list[Entry], set[int]]:
        """The in-flight entries, in submission order, and the ids of those still queued (any thread)."""
        with self.lock:
            entries = list(self.in_flight.values())
            queued = {id(e) for e in self.entries} | {id(e) for e in self.deferred}
        return entries, queued

    def finalize(self, reason: str | None, failure: BaseException | None, rank: int) -> None:
        """Stop taking entries and fail every in-flight handle with ``HorovodShutdownError`` (the
        ``reason`` given, or the default; ``failure`` as its cause)."""
        with self.cv:
            self.stopped = True
            if reason is not None:
                self.stop_reason = reason
            leftover = list(self.in_flight.values())
            self.deferred = []
            self.entries = []
            self.in_flight.clear()
        for e in leftover:
            if e.handle.done():
                continue
            err = HorovodShutdownError(self.stop_reason, rank=rank, tensor_name=e.request.name)
            if failure is not None:
                err.__cause__ = failure
            e.handle.set_error(err)
