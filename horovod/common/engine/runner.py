"""The batch runner: a round's responses planned into batches, each taken, run and completed
(Horovod's ``PerformOperation`` over the fused response list).

``execute`` caches the round's new responses (``RoundController.store``), plans the round's
batches (``fusion.plan_batches``, memoized for all-cached rounds), and for each batch takes this
rank's pending entries (``RoundController.take``), runs it (``executor.Executor``, or here for the
control operations: process sets, join, barrier, a coordinator's error) and completes the
entries' handles. The runner owns the step memo (``memo.StepMemo``), which it clears whenever
the controller reports a cache slot filled or emptied.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from horovod.common.backends.base import EngineBackend, Group
from horovod.common.config import EngineConfig
from horovod.common.engine.device import DevicePlaneError
from horovod.common.engine.executor import Entry, Executor
from horovod.common.engine.fusion import plan_batches
from horovod.common.engine.memo import StepMemo
from horovod.common.engine.negotiation import _JOIN_UNSUPPORTED
from horovod.common.engine.observers import fan_out, hooks
from horovod.common.engine.rounds import RoundController
from horovod.common.exceptions import CollectiveMismatchError, HorovodInternalError
from horovod.common.types import RequestType, Response

__all__ = ["BatchRunner"]


class BatchRunner:
    """Plans, takes, runs and completes one engine's batches (the engine thread, or the caller
    driving a round)."""

    # Bound on memoized plans: a workload whose rounds see many different sets of ready slots
    # (gradients straggling into rounds at random) only plans afresh once the memo is full.
    PLAN_MEMO_SIZE = StepMemo.PLANS

    def __init__(self, backend: EngineBackend, config: EngineConfig, groups: dict[int, Group],
                 rounds: RoundController, executor: Executor, memo: StepMemo,
                 in_flight: dict[str, Entry], lock: threading.Lock, step_done: Callable[[], None],
                 on_process_set_added: Callable[[int, list[int]], None] | None = None,
                 on_process_set_removed: Callable[[int], None] | None = None) -> None:
        self.backend = backend
        self.config = config
        self.rank: int = backend.rank
        self.groups = groups
        self.rounds = rounds
        self.executor = executor
        self.tunables = executor.tunables
        # The step memo (``memo.py``): one owner, cleared in one place (``slot_changed``).
        self.memo = memo
        rounds.on_slot_change = self.slot_changed
        self._in_flight = in_flight  # the engine's table of submitted, not yet completed entries
        self._lock = lock  # and its lock
        self._step_done = step_done
        self._on_ps_added = on_process_set_added
        self._on_ps_removed = on_process_set_removed
        self.round_done = False  # this round completed some of this rank's entries
        # The observers' hooks (``observe``): a batch starts; a batch ran; the round's batches ran.
        self.start_hooks: tuple[Callable[..., None], ...] = ()
        self.batch_hooks: tuple[Callable[..., None], ...] = ()
        self.done_hooks: tuple[Callable[..., None], ...] = ()

    def observe(self, observers: Sequence[Any]) -> None:
        """Take the hooks this runner calls from ``observers`` (``observers.hooks``), and give the
        executor the observers' ``activity`` (None without any: it records no steps)."""
        self.start_hooks = hooks(observers, "batch_started")
        self.batch_hooks = hooks(observers, "batch_run")
        self.done_hooks = hooks(observers, "batches_done")
        self.executor.activity = fan_out(hooks(observers, "activity"))

    def slot_changed(self) -> None:
        """A cache slot was filled or emptied (on every rank alike): forget the step memo."""
        self.memo.clear()

    def execute(self, responses: list[Response], cached_slots: list[int], joined_any: bool) -> None:
        """Run a round's responses (cached ones first: ``cached_slots`` of them)."""
        rounds = self.rounds
        rounds.cache.touch_all(cached_slots)
        rounds.store(responses, len(cached_slots))
        if joined_any:
            responses = [Response(r.request, error=_JOIN_UNSUPPORTED[r.kind])
                         if r.kind in _JOIN_UNSUPPORTED and r.error is None else r for r in responses]
        batches = self.plan(responses, cached_slots, joined_any)
        for batch in batches:
            self.run_batch(batch)
        completed, self.round_done = self.round_done, False
        for hook in self.done_hooks:
            hook(responses, completed, rounds)

    def plan(self, responses: list[Response], cached_slots: list[int],
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
        plans = self.memo.plans
        batches = plans.get(key)
        if batches is None:
            batches = tuple(tuple(b) for b in plan_batches(responses, tun.fusion_threshold,
                                                           tun.max_tensor_bytes, group_fusion))
            StepMemo.full(plans, self.PLAN_MEMO_SIZE)
            plans[key] = batches
        return batches

    def complete(self, entries: list[Entry | None]) -> None:
        done = [e for e in entries if e is not None]
        if not done:
            return
        self.round_done = True
        pop = self._in_flight.pop
        with self._lock:
            for e in done:
                pop(e.request.name, None)
            step_over = not self._in_flight
        if step_over:
            self._step_done()
        for e in done:
            # The inputs are the submitter's buffers: drop them before its waiter wakes. The
            # round still holds this entry (``take``'s list, the queue's) until it returns, and
            # the waiter, on another thread, may free its tensors at once: they must then be
            # freed, not kept alive for as long as this thread takes to end the round (a fully
            # sharded module's gradients would outlive their reduction by a timing-dependent
            # while: tests/torch/test_fully_shard_memory.py).
            e.inputs = []
            e.handle.set_result(e.outputs)

    def _fail(self, e: Entry, error: BaseException) -> None:
        with self._lock:
            self._in_flight.pop(e.request.name, None)
        e.handle.set_error(error)

    def _ran(self, kind: RequestType, batch: Sequence[Response], entries: list[Entry | None],
             t0: float, t1: float) -> None:
        for hook in self.batch_hooks:
            hook(kind, batch, entries, t0, t1)
        self.complete(entries)

    def run_batch(self, batch: Sequence[Response]) -> None:
        first = batch[0]
        kind = first.kind
        group = self.groups.get(first.request.process_set_id)
        member = group is not None and group.rank >= 0
        take = self.rounds.take
        if first.error is not None:
            e = take([first])[0]
            if e is not None:
                self._fail(e, CollectiveMismatchError(first.error, **first.error_fields))
            return
        if kind == RequestType.ADD_PROCESS_SET or kind == RequestType.REMOVE_PROCESS_SET:
            self._process_set(first)
            return
        if not member:
            return
        entries = take(batch)
        if kind == RequestType.JOIN or kind == RequestType.BARRIER:
            if kind == RequestType.JOIN:
                self.rounds.joined = False
                e = entries[0]
                if e is not None:
                    e.outputs = first.result
            self._ran(kind, batch, entries, time.perf_counter(), time.perf_counter())
            return
        if None in entries and not (self.rounds.joined and kind == RequestType.ALLREDUCE):
            missing = [r.name for r, e in zip(batch, entries) if e is None]
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise HorovodInternalError(f"engine state diverged: rank {self.rank} was asked to run {shown}, "
                                       "which it never submitted")
        for hook in self.start_hooks:
            hook(kind, batch)
        carried = self.rounds.carried
        data = carried.batch(batch) if carried is not None and kind == RequestType.ALLREDUCE else None
        t0 = time.perf_counter()
        try:
            if data is not None:  # every rank sent this batch's data with the round's bits
                self.executor.carried = data.reducer
                try:
                    self.executor.run(batch, entries)
                finally:
                    self.executor.carried = None
                data.finish()
            else:
                self.executor.run(batch, entries)
        except (TypeError, DevicePlaneError) as exc:  # this batch fails; the engine keeps serving
            for e in entries:
                if e is not None:
                    self._fail(e, HorovodInternalError(f"{kind.value} {e.request.name!r}: {exc}"))
            return
        self._ran(kind, batch, entries, t0, time.perf_counter())

    def _process_set(self, first: Response) -> None:
        """Add or remove a process set (every rank, in the same round)."""
        if first.kind == RequestType.ADD_PROCESS_SET:
            ranks = list(first.request.payload)
            self.groups[first.result] = self.backend.new_group(ranks)
            if self._on_ps_added is not None:
                self._on_ps_added(first.result, ranks)
            e = self.rounds.take([first])[0]
            if e is not None:
                e.outputs = first.result
            self.complete([e])
            return
        ps_id = int(first.request.payload)
        g = self.groups.pop(ps_id, None)
        if g is not None:
            self.executor.planes.free_group(g)
            self.backend.free_group(g)
        if self._on_ps_removed is not None:
            self._on_ps_removed(ps_id)
        cache = self.rounds.cache
        for slot in cache.occupied():
            if cache.response(slot).request.process_set_id == ps_id:
                self.rounds.evict(slot)
        self.complete([self.rounds.take([first])[0]])
