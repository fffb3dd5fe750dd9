"""Placement strategies: on this rank, is a planned call reduced where its tensors lie, or through a
fusion buffer? A local choice (the transport calls are the plan's, the same on every rank), asked
once per call by ``buffers.run_reduction``.

* ``DevicePlacement`` (device planes, and the simple default for any buffer kind): in the tensors'
  memory whenever that memory is one contiguous region (a single tensor, or in-place views of one
  flat buffer end to end); else through the fusion buffer.
* ``HostPlacement`` (the engine's NumPy executor): the same, but a packed run or a whole piece of a
  large tensor is reduced in place only when its memory is on transparent huge pages
  (``pages.huge_page_backed``, known from who allocated the memory, without asking the kernel):
  Open MPI's single-copy transfer pins every page of a piece, so a piece on 4 KiB pages is reduced
  faster copied through the huge-page buffer (docs/engine.md, "Piecewise reductions"). A tensor
  above ``max_tensor_bytes`` is always reduced in its own memory. On a transport that pins no pages
  (Gloo: ``pins_pages`` False) every contiguous region is reduced where it lies.

  Whether copying pays depends on the machine's state (``choice.py``), so the executor sets
  ``small_pages_in_place`` per repeated batch from measured batch times (``choice.TimedChoice``):
  True reduces memory that is not known to be on huge pages where it lies as well.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod.common.engine.buffers import BufferOps, Item, Segment
from horovod.common.engine.choice import TimedChoice
from horovod.common.engine.pages import huge_page_backed
from horovod.common.engine.plan import PACKED, PIECE, Call

__all__ = ["DevicePlacement", "HostPlacement"]


class DevicePlacement:
    """In place whenever the call's memory is one contiguous region."""

    def region(self, call: Call, items: Sequence[Item], segs: Sequence[Segment], ops: BufferOps) -> Any:
        return ops.span(items, segs, len(segs) > 1)


class HostPlacement:
    """In place only on huge pages (see the module docstring)."""

    def __init__(self, cut: Any, pins_pages: bool = True) -> None:
        self._cut = cut  # () -> max_tensor_bytes, read at every call (a tunable)
        # False (a backend's ``pins_pages``: ``GlooBackend``'s): the transport reads and writes any
        # memory as fast (Gloo's sockets), so every contiguous region is reduced where it lies
        self.pins_pages = pins_pages  # whether the transport pins pages (where the memory lies can matter)
        # id(span over a flat group) -> its first array, whose owner says where the memory lies
        self.owners: dict[int, np.ndarray] = {}
        # memory not known to be on huge pages is reduced where it lies too (set per batch)
        self.small_pages_in_place = False

    own_memory = staticmethod(huge_page_backed)

    def run_chosen(self, choice: TimedChoice, batch: Sequence[Any], run: Callable[..., None],
                   args: tuple[Any, ...]) -> None:
        """``run(*args)`` (a reduction of ``batch``) with ``small_pages_in_place`` set the way
        ``choice`` picks for ``batch`` now, and its time recorded for that way."""
        way = choice.pick(batch)
        self.small_pages_in_place = way
        t0 = time.perf_counter()
        try:
            run(*args)
        finally:
            self.small_pages_in_place = False
        choice.record(batch, way, time.perf_counter() - t0)

    def in_own_memory(self, out: np.ndarray) -> bool:
        return not self.pins_pages or self.small_pages_in_place or self.own_memory(self.owners.get(id(out), out))

    def region(self, call: Call, items: Sequence[Item], segs: Sequence[Segment], ops: BufferOps) -> Any:
        if call.kind == PACKED:
            span = ops.span(items, segs, True)
            if span is None or not self.in_own_memory(items[segs[0][0]].o):
                return None
            return span
        if call.kind == PIECE:
            if len(segs) != 1:  # a flat group held as separate arrays here: gathered
                return None
            o = items[segs[0][0]].o
            if o.nbytes <= self._cut() and not self.in_own_memory(o):
                return None
        return ops.span(items, segs, False)
