"""Response cache: negotiated operations remembered by name, so repeats cost one bit each.

Every rank holds an identical cache: entries are added only from the coordinator's responses and
touched only when executed, both in the same order everywhere, so slot numbers agree across
ranks without communication. A rank marks bit ``slot`` when it has a pending request that
matches the cached entry; the AND of all ranks' bits says which cached operations are ready.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from horovod.common.types import Request, RequestType, Response

__all__ = ["ResponseCache", "CACHEABLE_KINDS"]

CACHEABLE_KINDS = frozenset({RequestType.ALLREDUCE, RequestType.ALLGATHER, RequestType.BROADCAST,
                             RequestType.ALLTOALL, RequestType.REDUCESCATTER, RequestType.BARRIER})


class ResponseCache:
    """Fixed-capacity LRU map from tensor name to (slot, response, signature)."""

    def __init__(self, capacity: int, on_evict: Callable[[int, str], None] | None = None) -> None:
        self.capacity = capacity
        # Called with (slot, name) for every eviction, whatever its cause (LRU, replacement,
        # explicit), so the owner can fix state that refers to the slot.
        self.on_evict = on_evict
        self.words = (capacity + 63) // 64
        self._by_name: dict[str, int] = {}
        self._slots: list[Response | None] = [None] * capacity
        self._signatures: list[Any] = [None] * capacity
        # The request object that last matched each slot: a request resubmitted as it is (a
        # gradient's, every step) matches again without comparing signatures.
        self._matched: list[Any] = [None] * capacity
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._free = list(range(capacity))  # min-heap: every rank reuses the lowest free slot

    def __len__(self) -> int:
        return len(self._by_name)

    def lookup(self, request: Request) -> tuple[int, bool]:
        """Return (slot, matches) for a request's name; slot -1 when the name is not cached."""
        slot = self._by_name.get(request.name, -1)
        if slot < 0:
            return -1, False
        if self._matched[slot] is request:
            return slot, True
        if self._signatures[slot] == request.signature():
            self._matched[slot] = request
            return slot, True
        return slot, False

    @property
    def slot_of(self) -> dict[str, int]:
        """Name -> slot, for a caller that inlines ``lookup``'s first test (read it, never change it)."""
        return self._by_name

    @property
    def matched(self) -> list[Any]:
        """Per slot, the request object that last matched it (``lookup``: a request resubmitted
        as it is matches again without comparing signatures). Read it, never change it."""
        return self._matched

    def response(self, slot: int) -> Response:
        resp = self._slots[slot]
        assert resp is not None
        return resp

    def put(self, response: Response) -> None:
        """Remember a successful response (all ranks call this in the same order)."""
        if self.capacity == 0 or response.error is not None or response.kind not in CACHEABLE_KINDS:
            return
        name = response.name
        if name in self._by_name:
            self.evict(self._by_name[name])
        if not self._free:
            oldest = next(iter(self._lru))
            self.evict(oldest)
        slot = heapq.heappop(self._free)
        self._by_name[name] = slot
        self._slots[slot] = response
        self._signatures[slot] = response.request.signature()
        self._matched[slot] = None
        self._lru[slot] = None

    def responses(self, slots: list[int]) -> list[Response]:
        """``response(slot)`` of each slot (the caller's slots are occupied: ready everywhere)."""
        table = self._slots
        return [table[s] for s in slots]  # type: ignore[misc]

    def touch_all(self, slots: list[int]) -> None:
        """Mark each slot as the most recently used, in order (the least recent is evicted first)."""
        move = self._lru.move_to_end
        for slot in slots:
            move(slot)

    def evict(self, slot: int) -> None:
        resp = self._slots[slot]
        if resp is None:
            return
        del self._by_name[resp.name]
        self._slots[slot] = None
        self._signatures[slot] = None
        self._matched[slot] = None
        del self._lru[slot]
        heapq.heappush(self._free, slot)
        if self.on_evict is not None:
            self.on_evict(slot, resp.name)

    def occupied(self) -> list[int]:
        return sorted(self._lru)
