"""The round controller: what every rank agrees on in one negotiation round (Horovod's
``Controller``: ``ComputeResponseList`` with its cache bits and the coordinator's gather/broadcast).

In each round every rank of the world takes part, in the same order:

1. one bit-vector AND (``backend.and_bits``): which cached operations every rank has ready, which
   cache slots some rank wants evicted, and flags (someone has uncached requests / wants to shut
   down / has joined / an observer's question);
2. only if some rank has uncached requests: gather them to the coordinator (rank 0), which answers
   with the newly ready responses or errors (``negotiation.py``), broadcast to all.

``agree`` does both and returns the round's responses, cached first; the batch runner
(``runner.py``) then plans and runs them, taking each response's pending entry with ``take``.
The controller owns the response cache, its bit masks over cache slots and the table of this
rank's pending entries; every change of a slot is reported to ``on_slot_change`` (the runner
clears its step memo).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod.common.backends.base import EngineBackend, Group
from horovod.common.config import EngineConfig
from horovod.common.engine.cache import ResponseCache
from horovod.common.engine.carry import CarriedRound, Carrier
from horovod.common.engine.executor import Entry
from horovod.common.engine.negotiation import Coordinator
from horovod.common.engine.negotiation_codec import decode_responses, encode_requests, encode_responses
from horovod.common.engine.observers import FLAG_JOINED, FLAG_NEW, FLAG_SHUTDOWN, hooks
from horovod.common.engine.tunables import Tunables
from horovod.common.types import RequestType, Response

__all__ = ["RoundController", "DONE", "CACHED", "NEW", "SENT"]

# Entry.state: its response ran / is cached here and waits for the AND / goes to the coordinator
# in the next round / went to the coordinator.
DONE, CACHED, NEW, SENT = 0, 1, 2, 3
_WORD = (1 << 64) - 1


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


class RoundController:
    """Cache bit-vectors, masks, cache slots and the coordinator calls of one engine's rounds."""

    def __init__(self, backend: EngineBackend, config: EngineConfig, groups: dict[int, Group],
                 tunables: Tunables, clock: Callable[[], float], engine_thread: threading.Thread) -> None:
        self.backend = backend
        self.config = config
        self.rank: int = backend.rank
        self.groups = groups
        self.tunables = tunables
        self._clock = clock
        self._engine_thread = engine_thread
        # The observers' hooks this controller calls (``observe``): their flags for the AND; on
        # rank 0, the coordinator's requests and responses and its table to check.
        self.flag_hooks: tuple[Callable[[float], int], ...] = ()
        self.inspect_hooks: tuple[Callable[[Any], None], ...] = ()
        self.negotiating_hooks: tuple[Callable[..., None], ...] = ()
        self.negotiated_hooks: tuple[Callable[..., None], ...] = ()
        self.on_slot_change: Callable[[], None] = lambda: None
        self.pending: dict[str, Entry] = {}  # this rank's submitted entries, by name, until they run
        self._new: list[Entry] = []
        self.joined = False
        self.progress = True  # did the last round complete anything or take new work?
        self.cache = ResponseCache(config.cache_capacity, on_evict=self._forget_slot)
        # Bit masks over cache slots, as Python ints (bit i = slot i).
        self.ready_mask = 0
        self._excluded_mask = 0  # slots of process sets without this rank
        self._occupied_mask = 0
        self._full = (1 << (64 * self.cache.words)) - 1
        self._bits = np.zeros(2 * self.cache.words + 1, np.uint64)
        self._bit_bytes = self._bits.data.cast("B")  # written from the packed int's bytes
        # Where the transport exchanges rows (Gloo), a cached step's small allreduces travel with
        # the round's bits (``carry.py``): ``carried`` holds the round's data for the runner.
        exchange = getattr(backend, "exchange_rows", None)
        carry_bytes = int(getattr(config, "gloo_carry_bytes", 0) or 0)
        self.carrier: Carrier | None = None
        if exchange is not None and backend.size > 1 and carry_bytes > 0 and self.cache.words:
            self.carrier = Carrier(exchange, backend.size, self.cache, carry_bytes,
                                   post_ahead=hasattr(backend, "post_rows"))
        self.carried: CarriedRound | None = None
        self.coordinator = Coordinator(backend.size, self._members, clock) if self.rank == 0 else None
        self._local_stall_due = clock() + config.stall_check_time_seconds
        # When this rank's thread entered a negotiation collective it has not left (0.0: none):
        # the stall observer's watchdog reads it (ranks that never come leave it set).
        self.negotiating_since = 0.0
        # This round's number and when its AND returned; submit times for the round records: the
        # first entry taken while nothing was pending, and the latest taken (entries arrive in
        # submission order: O(1) per round).
        self.round_no = 0
        self.t_ready = 0.0
        self.first_submit = self.last_submit = 0.0

    def observe(self, observers: Sequence[Any]) -> None:
        """Take the hooks this controller calls from ``observers`` (``observers.hooks``)."""
        self.flag_hooks = hooks(observers, "flags")
        self.inspect_hooks = hooks(observers, "inspect")
        self.negotiating_hooks = hooks(observers, "negotiating")
        self.negotiated_hooks = hooks(observers, "negotiated")

    def _members(self, process_set_id: int) -> list[int] | None:
        g = self.groups.get(process_set_id)
        return None if g is None else g.ranks

    # ------------------------------------------------------------------ one round
    def agree(self, new: list[Entry], flags: int) -> tuple[list[Response], list[int], int, list[int]]:
        """Take ``new`` entries, run the round's AND (with this rank's ``flags``) and, if needed,
        the coordinator's exchange. Returns the responses (cached ones first), the cached slots,
        the flags of any rank and the slots to evict once the round ran (``evict_late``)."""
        cache = self.cache
        words = cache.words
        invalid = 0
        if new:
            pending, join = self.pending, RequestType.JOIN
            if not pending:
                self.first_submit = new[0].t_submit
            self.last_submit = new[-1].t_submit
            lookup = cache.lookup if words and self.tunables.cache_enabled else None
            # ``cache.lookup``'s first test, inlined: a request resubmitted as it is (a gradient's,
            # every step) is the one its slot last matched.
            slot_of, matched = cache.slot_of if lookup is not None else {}, cache.matched
            ready = self.ready_mask
            for e in new:
                req = e.request
                name = req.name
                pending[name] = e
                if req.kind is join:
                    self.joined = True
                slot = slot_of.get(name, -1)
                if slot >= 0 and matched[slot] is req:
                    e.state, e.slot = CACHED, slot
                    ready |= 1 << slot
                    continue
                slot, match = lookup(req) if lookup is not None else (-1, False)
                if match:
                    e.state, e.slot = CACHED, slot
                    ready |= 1 << slot
                else:
                    e.state = NEW
                    self._new.append(e)
                    if slot >= 0:
                        invalid |= 1 << slot
            self.ready_mask = ready
        now = self._clock()
        if words and now >= self._local_stall_due:
            # Cached operations that wait too long go back through the coordinator, which can
            # then say which ranks are missing.
            self._local_stall_due = now + min(self.config.stall_check_time_seconds, 1.0)
            limit = self.config.stall_check_time_seconds
            for e in self.pending.values():
                if e.state == CACHED and now - e.t_submit > limit:
                    invalid |= 1 << e.slot

        for hook in self.flag_hooks:
            flags |= hook(now)
        if any(e.state == NEW for e in self._new):
            flags |= FLAG_NEW
        if self.joined:
            flags |= FLAG_JOINED
        ready_local = self.ready_mask | self._excluded_mask
        if self.joined:
            ready_local |= self._occupied_mask
        nbytes = 8 * words
        # One AND over [ready bits | NOT invalid bits | NOT flags]: AND of negations is the
        # negation of an OR, so one collective yields "ready everywhere" and "wanted anywhere".
        packed = (ready_local | ((self._full ^ invalid) << (64 * words))
                  | ((_WORD ^ flags) << (128 * words)))
        bits = self._bits
        self._bit_bytes[:] = packed.to_bytes(2 * nbytes + 8, "little")
        self.negotiating_since = now
        carrier = self.carrier
        if carrier is not None:
            anded, self.carried = carrier.exchange(bits, self._entry_of, self.joined, FLAG_JOINED, FLAG_SHUTDOWN,
                                                   self.pending)
            raw = anded.tobytes()
        else:
            raw = self.backend.and_bits(bits, spin=threading.get_ident() != self._engine_thread.ident).tobytes()
        self.t_ready = t_ready = self._clock()
        self.negotiating_since = 0.0
        self.round_no += 1
        any_flags = _WORD ^ int.from_bytes(raw[2 * nbytes:], "little")
        ready_slots = _bits_to_slots(int.from_bytes(raw[:nbytes], "little"))
        evict = _bits_to_slots((self._full ^ int.from_bytes(raw[nbytes:2 * nbytes], "little"))
                               & self._occupied_mask)
        responses: list[Response] = cache.responses(ready_slots)
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
                    self.evict(slot)
        if any_flags & FLAG_NEW:
            self.negotiating_since = t_ready
            responses.extend(self._negotiate())
            self.negotiating_since = 0.0
        elif self.coordinator is not None:
            for check in self.inspect_hooks:
                check(self.coordinator)
        self.progress = bool(responses or new or evict)
        return responses, ready_slots, any_flags, late

    def _entry_of(self, slot: int) -> Entry:
        """This rank's pending entry waiting on cache slot ``slot`` (its ready bit is set)."""
        return self.pending[self.cache.response(slot).request.name]

    def _slot_changed(self, slot: int) -> None:
        """Cache slot ``slot`` was filled or emptied (on every rank alike): what was remembered
        for it is forgotten (the step memo; the carrier's layout of it)."""
        self.on_slot_change()
        if self.carrier is not None:
            self.carrier.forget(slot)

    def evict(self, slot: int) -> None:
        self.cache.evict(slot)  # calls _forget_slot

    def evict_late(self, late: Sequence[int]) -> None:
        for slot in late:
            self.evict(slot)

    def _forget_slot(self, slot: int, name: str) -> None:
        """A cache slot was emptied (on every rank alike): clear its bits, and send a request that
        was waiting on it through the coordinator instead."""
        self._slot_changed(slot)
        keep = ~(1 << slot)
        self.ready_mask &= keep
        self._excluded_mask &= keep
        self._occupied_mask &= keep
        e = self.pending.get(name)
        if e is not None and e.state == CACHED and e.slot == slot:
            e.state = NEW
            self._new.append(e)

    def store(self, responses: Sequence[Response], cached: int) -> None:
        """Cache the round's new responses (those after the first ``cached``), marking their slots."""
        cache = self.cache
        for resp in responses[cached:]:
            if resp.error is None and resp.kind not in (RequestType.JOIN,) and self.tunables.cache_enabled:
                before = cache.lookup(resp.request)[0]
                cache.put(resp)
                slot = cache.lookup(resp.request)[0]
                if slot >= 0 and slot != before:
                    self._slot_changed(slot)
                    self._occupied_mask |= 1 << slot
                    if self.rank not in self.groups[resp.request.process_set_id].ranks:
                        self._excluded_mask |= 1 << slot

    def take(self, batch: Sequence[Response]) -> list[Entry | None]:
        """Each response's pending entry (None where this rank has none), marked done and its
        cached slot no longer ready; one call per batch (a cached step's batch holds every
        gradient)."""
        pop = self.pending.pop
        entries: list[Entry | None] = []
        cleared = 0
        for r in batch:
            e = pop(r.request.name, None)
            if e is not None:
                if e.state == CACHED:
                    cleared |= 1 << e.slot
                e.state = DONE
            entries.append(e)
        if cleared:
            self.ready_mask &= ~cleared
        return entries

    def _negotiate(self) -> list[Response]:
        # An entry may have been queued here and then run from the cache in the same round.
        fresh = [e for e in self._new if e.state == NEW]
        mine = [e.request for e in fresh]
        for e in fresh:
            e.state = SENT
        self._new = []
        # A request that waited long on this rank (a cached one sent again after a local stall)
        # tells the coordinator how long, so that its stall report comes on time.
        now = self._clock()
        waited = [now - e.t_submit for e in fresh]
        gathered = self.backend.gather_to_root(
            encode_requests(mine, waited if waited and max(waited) >= 1.0 else None))
        responses: list[Response] | None = None
        coord = self.coordinator
        if coord is not None:
            assert gathered is not None
            first_time = coord.submit_encoded(gathered)
            for hook in self.negotiating_hooks:
                hook(coord, first_time, gathered)
            responses = coord.ready()
            for hook in self.negotiated_hooks:
                hook(responses)
            for check in self.inspect_hooks:
                check(coord)
            self.backend.bcast_from_root(encode_responses(responses))
            return responses
        return decode_responses(self.backend.bcast_from_root(None))

    def reset(self) -> None:
        """The engine stopped: nothing is pending any more."""
        self.pending.clear()
        self.carried = None
