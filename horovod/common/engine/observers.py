"""What watches the engine without steering it: one small interface the loop calls.

An observer sees a round at fixed points (every rank calls them at the same point of the same
round, so an observer may run collectives where the round says so: ``agreed``). Each hook is
optional: the loop calls, per hook, only the observers whose class overrides it (``hooks``), so
an engine without a timeline or a flight recorder pays nothing for them.

- ``round_started()``: a round begins (timeline: cycle marks);
- ``flags(now) -> int``: this rank's flags for the round's AND (metrics: a straggler exchange
  is due, rank 0; stall: a question to ask);
- ``negotiating(coordinator, names, gathered)``: rank 0, the coordinator took the round's
  requests (``names``: those it saw for the first time; ``gathered``: each rank's encoded
  message) (timeline: negotiation begins, one tick per rank that reported);
- ``negotiated(responses)``: rank 0, the coordinator chose the responses ready to run
  (timeline: their negotiation ends);
- ``inspect(coordinator)``: rank 0, after negotiation or in a round without (stall: its check of
  the coordinator's table);
- ``batch_started(kind, batch)``: a batch of collectives is about to run on this rank
  (timeline: each tensor's operation begins);
- ``activity(names, activity, begin)``: a step inside a running batch begins or ends for the
  tensors ``names`` (the transport call, a copy through the fusion buffer: timeline rows);
  while an observer takes them, the executor runs a reduction's calls one at a time, so that
  its steps do not overlap;
- ``batch_run(kind, batch, entries, t0, t1)``: a batch completed on this rank (metrics: counters;
  the flight recorder; timeline: each tensor's operation ends);
- ``batches_done(responses, completed, rounds)``: a round ran its batches (autotune: samples;
  metrics: round records);
- ``agreed(flags)``: every rank, when the AND carried an observer's flag (metrics: the straggler
  exchange; stall: the answers);
- ``round_done()``: a round ends (timeline: flush).

The observers: ``TimelineObserver``, ``AutotuneObserver`` and ``MetricsObserver`` here,
``flight.FlightRecorder`` and ``stall_observer.StallObserver``. The round controller
(``RoundController.observe``), the batch runner (``BatchRunner.observe``: the executor's
``activity`` too) and the loop each take the hooks they call.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from horovod.common.engine.memo import StepMemo
from horovod.common.engine.metrics import Counters, StragglerDetector
from horovod.common.engine.negotiation_codec import decode_requests
from horovod.common.engine.timeline import Timeline
from horovod.common.types import RequestType, Response

__all__ = ["Observer", "hooks", "fan_out", "TimelineObserver", "AutotuneObserver", "MetricsObserver",
           "FLAG_NEW", "FLAG_SHUTDOWN", "FLAG_JOINED", "FLAG_EXCHANGE", "FLAG_DIAGNOSE", "OBSERVER_FLAGS"]

# A round's flags (one word of the AND; see ``rounds.RoundController``).
FLAG_NEW, FLAG_SHUTDOWN, FLAG_JOINED, FLAG_EXCHANGE, FLAG_DIAGNOSE = 1, 2, 4, 8, 16
OBSERVER_FLAGS = FLAG_EXCHANGE | FLAG_DIAGNOSE
_KIND_NAMES = {k: k.value for k in RequestType}  # (``.value`` is a Python-level property: per batch)


class Observer:
    """The hooks, each a no-op; a subclass overrides those it needs (see the module docstring)."""

    def round_started(self) -> None:
        pass

    def flags(self, now: float) -> int:
        return 0

    def negotiating(self, coordinator: Any, names: Sequence[str], gathered: Sequence[bytes]) -> None:
        pass

    def negotiated(self, responses: Sequence[Response]) -> None:
        pass

    def inspect(self, coordinator: Any) -> None:
        pass

    def batch_started(self, kind: RequestType, batch: Sequence[Response]) -> None:
        pass

    def activity(self, names: Sequence[str], activity: str, begin: bool) -> None:
        pass

    def batch_run(self, kind: RequestType, batch: Sequence[Response], entries: Sequence[Any],
                  t0: float, t1: float) -> None:
        pass

    def batches_done(self, responses: Sequence[Response], completed: bool, rounds: Any) -> None:
        pass

    def agreed(self, flags: int) -> None:
        pass

    def round_done(self) -> None:
        pass


def hooks(observers: Sequence[Any], name: str) -> tuple[Callable[..., Any], ...]:
    """The bound ``name`` methods of the observers whose class overrides ``Observer.name``."""
    base = getattr(Observer, name)
    return tuple(getattr(o, name) for o in observers
                 if o is not None and getattr(type(o), name, base) is not base)


def fan_out(found: tuple[Callable[..., None], ...]) -> Callable[..., None] | None:
    """One callable for a hook's observers: None for none (the caller skips the hook), the hook
    itself for one, else one that calls each in turn."""
    if len(found) < 2:
        return found[0] if found else None

    def each(*args: Any) -> None:
        for hook in found:
            hook(*args)
    return each


class TimelineObserver(Observer):
    """The timeline (``HOROVOD_TIMELINE``, rank 0): the round marks and every tensor's phases,
    each written where the loop calls its hook; ``timeline`` is the one in use (None: none). The
    loop gives it its hooks only while a timeline is in use (``active``)."""

    def __init__(self, timeline: Timeline | None = None) -> None:
        self.timeline = timeline

    @property
    def active(self) -> bool:
        return self.timeline is not None

    def round_started(self) -> None:
        tl = self.timeline
        if tl is not None:
            tl.cycle()

    def negotiating(self, coordinator: Any, names: Sequence[str], gathered: Sequence[bytes]) -> None:
        tl = self.timeline
        if tl is None:
            return
        for name in names:
            tl.begin(name, "NEGOTIATE_" + coordinator.table[name].kind.upper)
        for rank, data in enumerate(gathered):
            for r in decode_requests(data, rank):
                tl.tick(r.name, str(rank))

    def negotiated(self, responses: Sequence[Response]) -> None:
        tl = self.timeline
        if tl is not None:
            for resp in responses:
                tl.end(resp.name)

    def batch_started(self, kind: RequestType, batch: Sequence[Response]) -> None:
        tl = self.timeline
        if tl is not None:
            for r in batch:
                tl.begin(r.name, kind.upper)

    def activity(self, names: Sequence[str], activity: str, begin: bool) -> None:
        tl = self.timeline
        if tl is None:
            return
        for n in names:
            if begin:
                tl.begin(n, activity)
            else:
                tl.end(n)

    def batch_run(self, kind: RequestType, batch: Sequence[Response], entries: Sequence[Any],
                  t0: float, t1: float) -> None:
        tl = self.timeline
        if tl is None or kind is RequestType.JOIN or kind is RequestType.BARRIER:
            return  # (a join or a barrier runs no batch: nothing began)
        for r in batch:
            tl.end(r.name, {"dtype": r.request.dtype, "shape": str([list(s) for s in r.request.shapes])})

    def round_done(self) -> None:
        tl = self.timeline
        if tl is not None:
            tl.maybe_flush()

    def replace(self, timeline: Timeline | None) -> None:
        """Use ``timeline`` from now on; the one it replaces is closed."""
        old, self.timeline = self.timeline, timeline
        if old is not None:
            old.close()


class AutotuneObserver(Observer):
    """The autotuner's samples (``HOROVOD_AUTOTUNE``): every round's responses."""

    def __init__(self, tuner: Any, rounds: Any) -> None:
        self.tuner = tuner
        self._rounds = rounds

    @classmethod
    def from_config(cls, config: Any, tunables: Any, backend: Any, rounds: Any,
                    hostnames: Sequence[str] | None) -> AutotuneObserver | None:
        """The observer of ``HOROVOD_AUTOTUNE`` (None when off): it tunes ``tunables`` at sample
        boundaries, the same on every rank."""
        if not config.autotune:
            return None
        from horovod.common.autotune import from_config

        obs = cls(None, rounds)
        obs.tuner = from_config(config, tunables, backend.rank, backend.bcast_from_root, os.environ,
                                len(set(hostnames or [])) > 1, on_change=obs.changed)
        return obs

    def changed(self, old: dict[str, Any], new: dict[str, Any]) -> None:
        """The autotuner changed the knobs (on every rank at this same point)."""
        if old.get("cache_enabled") and not new.get("cache_enabled"):
            # Requests waiting on cache slots go back through the coordinator, on every rank alike.
            for slot in list(self._rounds.cache.occupied()):
                self._rounds.evict(slot)

    def batches_done(self, responses: Sequence[Response], completed: bool, rounds: Any) -> None:
        self.tuner.observe(responses)


class MetricsObserver(Observer):
    """The counters of ``hvd.metrics()`` and the straggler exchange: about once per
    ``HOROVOD_STRAGGLER_INTERVAL`` the coordinator asks every rank, in a round's flags, for its
    round records, judges them (``metrics.StragglerDetector``) and broadcasts the verdict."""

    _FIXED_SHAPES = (RequestType.ALLREDUCE, RequestType.BROADCAST, RequestType.REDUCESCATTER)

    def __init__(self, backend: Any, counters: Counters, rank: int, size: int, interval: float,
                 clock: Callable[[], float], memo: StepMemo) -> None:
        self.backend = backend
        self.counters = counters
        self._sizes = memo.batch_sizes  # the step memo's table (``memo.py``)
        self.straggler: StragglerDetector | None = None
        self._every = interval
        if rank == 0 and size > 1 and interval > 0:
            self.straggler = StragglerDetector(size)
        self._due = clock() + interval

    def flags(self, now: float) -> int:
        if self.straggler is not None and now >= self._due:
            self._due = now + self._every
            return FLAG_EXCHANGE
        return 0

    def batch_run(self, kind: RequestType, batch: Sequence[Response], entries: Sequence[Any],
                  t0: float, t1: float) -> None:
        """Add a batch to the counters: tensors and bytes this rank submitted, time it took. A
        memoized batch (a cached step's) of fixed-shape operations is sized once."""
        if kind is RequestType.JOIN or kind is RequestType.BARRIER:
            return
        sizes = self._sizes.get(id(batch))
        if sizes is None or sizes[0] is not batch:
            arrays = [a for e in entries if e is not None for a in e.inputs]
            sizes = (batch, len(arrays), sum([a.nbytes for a in arrays]))
            if kind in self._FIXED_SHAPES and None not in entries:
                StepMemo.full(self._sizes, StepMemo.BATCH_SIZES)
                self._sizes[id(batch)] = sizes
        self.counters.record_batch(_KIND_NAMES[kind], sizes[1], sizes[2], t1 - t0)

    def batches_done(self, responses: Sequence[Response], completed: bool, rounds: Any) -> None:
        if completed:
            self.counters.record_round(rounds.round_no, rounds.t_ready, rounds.first_submit, rounds.last_submit)

    def agreed(self, flags: int) -> None:
        if flags & FLAG_EXCHANGE:
            self.exchange()

    def exchange(self) -> None:
        """Every rank's round records to the coordinator; its straggler verdict back to all."""
        gathered = self.backend.gather_to_root(self.counters.take_window())
        verdict = None
        if self.straggler is not None:
            assert gathered is not None
            self.straggler.feed(gathered)
            verdict = self.straggler.verdict()
        self.counters.apply_verdict(self.backend.bcast_from_root(verdict))

    def snapshot(self, waiting: Sequence[float], now: float, limit: float) -> dict[str, Any]:
        """The counters (``hvd.metrics()``), with the in-flight operations (``waiting``: their
        submit times) and how many of them waited past ``limit`` seconds at ``now``."""
        snap = self.counters.snapshot()
        snap["stalled_tensors"] = sum(1 for t in waiting if now - t > limit)
        snap["in_flight"] = len(waiting)
        return snap

    def stragglers(self) -> list[int]:
        return list(self.straggler.stragglers) if self.straggler is not None else []
