"""The step memo: every memo the engine keeps of a cached step's objects, in one place.

A cached workload (a training step whose gradients are all in the response cache) plans the
same batches from the same responses every step, and hands over the same tensors' memory. The
engine remembers what it worked out from them the first time; every such memo is a table of
``StepMemo``, owned by the batch runner (``runner.BatchRunner``) and handed to the executor and
the host buffer operations it makes (``host_buffers.NumpyBuffers``).

One clearing rule: ``clear()`` empties every table at once, and the runner calls it whenever a
cache slot is filled or emptied (``BatchRunner.slot_changed``), the only event that changes which
responses a round's ready slots stand for. Each table is also bounded: a table that reaches its
bound is emptied on the next insertion (``full``), so a workload that never repeats costs one
fresh computation per round, never memory. Identity-keyed entries (``id(batch)``) always hold the
object they were keyed by and are checked with ``is``, so an identity reused after a clear can
never hit.

| table | key -> value | was |
| --- | --- | --- |
| ``plans`` | (ready slots, fusion settings) -> the round's batches, tuples of tuples | ``Engine._plans`` |
| ``batch_sizes`` | id(batch) -> (batch, tensors, bytes) of a fixed-shape batch | ``Engine._batch_sizes`` |
| ``calls`` | ``plan.plan_reduction``'s arguments -> its calls | ``Executor._calls`` |
| ``flat`` | id(batch) -> (batch, whether a response of it is flat) | ``Executor._flat_batches`` |
| ``items`` | name -> an in-place entry's items and buffer views | ``host_buffers.NumpyBuffers._items``, ``_moves`` |
| ``batches`` | id(batch) -> its arrays' ids, then the batch's items | ``host_buffers.NumpyBuffers._batches`` |
| ``choices`` | id(batch) -> the timed trials of a rank's own choice for it (``choice.TimedChoice``) | new |
| ``agreed_bytes`` | id(batch) -> (batch, its requests' bytes: the same on every rank) | ``PieceFollower._bytes`` |
| ``reductions`` | id(request) -> (request, lane, group size, its ``Reduction``) | ``Executor._reduction``, new |

Kept elsewhere on purpose, because they are per process (or per process set), keyed by value and
right across steps and cache changes: the executor's dtype rule per (dtype, transport, buffer
kind) (``Executor._dtype_info``), its host lane per process set (remade when ``chunk_bytes``
changes) and hierarchies per set of ranks; a device plane's own buffers (the torch plane's
``_TorchBuffers``, cleared with its plane); the torch binding's repeat signatures per call name
(``Context.repeats``: they hold the context they were checked in, and go with it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["StepMemo"]


class StepMemo:
    """The tables of one engine's step memo (see the module docstring); one owner, one ``clear``."""

    __slots__ = ("plans", "batch_sizes", "calls", "flat", "items", "batches", "choices", "agreed_bytes",
                 "reductions")

    #: bounds, per table
    PLANS = 64
    BATCH_SIZES = 4 * PLANS
    CALLS = 256
    FLAT = 256
    ITEMS = 256
    BATCHES = 64
    CHOICES = 64
    AGREED_BYTES = 4 * PLANS
    REDUCTIONS = 256

    def __init__(self) -> None:
        self.plans: dict[tuple[Any, ...], tuple[tuple[Any, ...], ...]] = {}
        self.batch_sizes: dict[int, tuple[Sequence[Any], int, int]] = {}
        self.calls: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.flat: dict[int, tuple[Sequence[Any], bool]] = {}
        self.items: dict[str, Any] = {}
        self.batches: dict[int, Any] = {}
        self.choices: dict[int, Any] = {}
        self.agreed_bytes: dict[int, tuple[Sequence[Any], int]] = {}
        self.reductions: dict[int, tuple[Any, Any, int, Any]] = {}

    def clear(self) -> None:
        """Forget everything (a cache slot was filled or emptied)."""
        self.plans.clear()
        self.batch_sizes.clear()
        self.calls.clear()
        self.flat.clear()
        self.items.clear()
        self.batches.clear()
        self.choices.clear()
        self.agreed_bytes.clear()
        self.reductions.clear()

    @staticmethod
    def full(table: dict[Any, Any], bound: int) -> None:
        """Empty ``table`` when it holds ``bound`` entries (call before inserting one)."""
        if len(table) >= bound:
            table.clear()
