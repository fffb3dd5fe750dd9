"""A cached step's small allreduces carried with the round's negotiation: one exchange per round.

On a transport whose calls are expensive next to the bytes of a small step (Gloo: every call is
handed to a process-group thread and completed on another, each a wake-up, about 0.2-0.4 ms on
one host), a cached step of small tensors costs two calls: the negotiation's bit AND, then the
fused reduction. Here every rank sends, with its bits, the data of the cached allreduces it has
ready, in one exchange of equal rows (``backend.exchange_rows``); every rank then ANDs the bits
itself and reduces each operation that every rank had ready from the rows it received, with no
transport call of its own.

The layout of a row needs no agreement beyond what every rank already shares: the header holds the
round's bits (ready slots, slots to evict, flags: the AND's words), the bytes this rank would have
liked to carry and whether it carries at all (``Carrier.enabled``); then come the data of the
rank's ready, carryable cache slots in slot order, each padded to 8 bytes, for as long as they fit
in the agreed capacity. Every rank holds the same cache, so from any rank's ready bits every rank
can tell which slots that rank carried and where. An operation is reduced from the rows when every
rank carried it; any other (a rank had it not ready, it did not fit, a rank joined, it is not
carryable) runs through the transport as before, in the same batches, so ranks that disagree on
what is ready simply fall back.

The capacity starts at 0 and is agreed the same way: after each exchange every rank sets it
from the largest wish in the rows (rounded up to a power of two, at most ``max_bytes`` and 1 MiB
over all rows), and lowers it after many rounds of smaller wishes. Where the transport posts the
next exchange's receives ahead (``post_ahead``: Gloo), a round's wishes set the capacity of the
round after next: every rank then knows the next row's length before this round's rows arrive,
and posts its receives for it between its sends and its wait (in the wait of a rank that came
early, off the step's critical path). A carryable slot is an
allreduce of the global process set on host memory, Sum/Average/Min/Max/Product, of a dtype NumPy
reduces exactly as the transport would (``CARRY_DTYPES``), of at most the largest capacity.

Every rank reduces the same rows in rank order with the same NumPy calls, so every rank gets
bit-identical results (the transport's summation order may differ in the last bit for 3 or more
ranks; for 2, a + b is exact either way).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from horovod.common.engine.buffers import Reduction
from horovod.common.engine.cache import ResponseCache
from horovod.common.engine.device import is_plane
from horovod.common.engine.host_buffers import scale_array
from horovod.common.exceptions import HorovodInternalError
from horovod.common.types import ReduceOp, RequestType, Response

__all__ = ["CARRY_DTYPES", "Carrier", "CarriedRound", "BatchData"]

_DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int32", "int64")
CARRY_DTYPES = frozenset(_DTYPES)
_NP_DTYPES = tuple(np.dtype(d) for d in _DTYPES)
_CARRY_OPS = frozenset({ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT})
_REDUCE = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
           ReduceOp.PRODUCT: np.multiply}
_ALL_ROWS_BYTES = 1 << 20  # the capacity times the ranks stays below this
_MIN_CAPACITY = 64
SHRINK_ROUNDS = 512  # rounds of wishes at most a quarter of the capacity before it is lowered
_UNKNOWN, _NOT_CARRIED = -2, -1


def _padded(n: int) -> int:
    return (n + 7) & ~7


def _pow2(n: int) -> int:
    return max(_MIN_CAPACITY, 1 << (max(n, 1) - 1).bit_length())


def _slots(words: np.ndarray) -> np.ndarray:
    """Set bits of little-endian uint64 words, lowest first."""
    return np.flatnonzero(np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little"))


class Carrier:
    """One engine's carried negotiation (see the module docstring): builds this rank's row,
    exchanges it, and reads the AND and every rank's data from the rows.

    Args:
        exchange: ``backend.exchange_rows`` (every rank's equal-length byte row, in rank order).
        size: ranks in the world.
        cache: the engine's response cache (identical on every rank).
        max_bytes: ``HOROVOD_GLOO_CARRY_BYTES``, the most a row carries.
        post_ahead: the transport posts the next exchange's receives during this one (Gloo's
            ``exchange_rows(row, post_next)``): ``exchange`` is then called with the next row's
            length as well (0 when this rank ends the job this round: no next exchange), known
            to every rank alike before the rows arrive (the capacity is agreed a round ahead).
    """

    def __init__(self, exchange: Callable[..., np.ndarray], size: int, cache: ResponseCache,
                 max_bytes: int, post_ahead: bool = False) -> None:
        self._exchange = exchange
        self.post_ahead = post_ahead
        self.size = size
        self.cache = cache
        self.max_bytes = min(int(max_bytes), _ALL_ROWS_BYTES // max(size, 1)) & ~7
        self.capacity = 0  # this round's: the same on every rank
        # The next round's capacity, agreed from the rows of the round before (post_ahead: the
        # next row's length is known before this round's rows arrive); else equal to capacity.
        self.next_capacity = 0
        self._quiet = 0
        # Per cache slot: its padded bytes when carryable, _NOT_CARRIED, or _UNKNOWN (the slot
        # changed since it was looked at; ``forget``).
        self._sizes = np.full(cache.capacity, _UNKNOWN, np.int64)
        self._nbytes = np.zeros(cache.capacity, np.int64)  # unpadded bytes of a carryable slot
        self._dtypes = np.zeros(cache.capacity, np.int64)  # its dtype's index in _DTYPES
        # id(batch) -> (batch, its slots): a memoized plan's batches come back every step
        self._batches: dict[int, tuple[Sequence[Response], np.ndarray]] = {}
        # (a rank's ready words, capacity) -> its _Layout: a cached step's rows look the same
        # every step, on every rank (forgotten with the slots' sizes)
        self._layouts: dict[tuple[bytes, int], _Layout] = {}
        # (batch, the rows' layouts) -> where the batch lies in every row, when it lies in one
        # piece at the same place in each (the usual case: every rank carried the same)
        self._spans: dict[tuple[int, int], tuple[Sequence[Response], _Layout, int, int]] = {}
        self.rounds = self.carried_ops = 0  # counters (tests, benchmarks)
        # Whether this rank packs its data (each row says so; data is used only when every row
        # does): off, the rows still carry the bits, and every operation takes the transport.
        self.enabled = True

    def forget(self, slot: int) -> None:
        """A cache slot was filled or emptied."""
        self._sizes[slot] = _UNKNOWN
        self._batches.clear()
        self._layouts.clear()
        self._spans.clear()

    def layout_of(self, ready: np.ndarray, capacity: int) -> _Layout:
        """``layout`` of a rank whose ready words are ``ready``, memoized."""
        key = (ready.tobytes(), capacity)
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) >= 64:
                self._layouts.clear()
                self._spans.clear()
            slots, offsets, wish = self.layout(_slots(ready), capacity)
            nbytes = self._nbytes[slots]
            codes = self._dtypes[slots]
            # one dtype and no padding: the data lie end to end from the first offset
            uniform = (bool(len(slots)) and np.array_equal(nbytes, self._sizes[slots])
                       and bool((codes == codes[0]).all()))
            table = self.cache._slots
            names = tuple(table[s].request.name for s in slots.tolist())  # type: ignore[union-attr]
            lay = self._layouts[key] = _Layout(slots, offsets, wish, _DTYPES[int(codes[0])] if uniform else None,
                                               int(nbytes.sum()), names)
        return lay

    def _size_of(self, resp: Response | None) -> int:
        if resp is None or resp.error is not None:
            return _NOT_CARRIED
        req = resp.request
        if (req.kind != RequestType.ALLREDUCE or req.process_set_id != 0 or req.dtype not in CARRY_DTYPES
                or req.reduce_op not in _CARRY_OPS or is_plane(req.device)):
            return _NOT_CARRIED
        n = _padded(req.nbytes)
        return n if 0 < n <= self.max_bytes else _NOT_CARRIED

    def sizes(self, slots: np.ndarray) -> np.ndarray:
        """Padded bytes of each slot, _NOT_CARRIED where it is not carryable."""
        sizes = self._sizes
        got = sizes[slots]
        unknown = got == _UNKNOWN
        if unknown.any():
            table = self.cache._slots
            for s in slots[unknown].tolist():
                resp = table[s]
                sizes[s] = self._size_of(resp)
                if sizes[s] >= 0:
                    self._nbytes[s] = resp.request.nbytes  # type: ignore[union-attr]
                    self._dtypes[s] = _DTYPES.index(resp.request.dtype)  # type: ignore[union-attr]
            got = sizes[slots]
        return got

    def layout(self, slots: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(carried slots, their byte offsets, bytes wished) of a rank whose ready slots are
        ``slots`` (ascending), for a row of ``capacity`` data bytes."""
        sizes = self.sizes(slots)
        ok = sizes >= 0
        slots, sizes = slots[ok], sizes[ok]
        wish = int(sizes.sum())
        if not capacity or not len(slots):
            return slots[:0], sizes[:0], wish
        ends = np.cumsum(sizes)
        k = int(np.searchsorted(ends, capacity, side="right"))
        return slots[:k], ends[:k] - sizes[:k], wish

    def exchange(self, bits: np.ndarray, entry_of: Callable[[int], Any], joined: bool,
                 joined_flag: int, stop_flag: int = 0,
                 pending: Mapping[str, Any] | None = None) -> tuple[np.ndarray, CarriedRound | None]:
        """Exchange this rank's row: ``bits`` (the AND's words: ready slots, slots kept, flags)
        and the data of its ready carryable slots (``entry_of(slot)``: this rank's pending entry;
        ``pending``, where given, holds the same entries by name: a layout's entries are then
        looked up by the names it remembers, without a call per slot; nothing when this rank
        has ``joined``). Returns the AND of every rank's words and the
        round's carried data (None when nothing can be carried: no capacity yet, or some rank
        has joined, ``joined_flag`` in its flags). A rank with ``stop_flag`` in its own flags
        posts no receives for a next exchange (a peer that stops in the same round leaves the
        receives it posted ahead unmatched: the transport's close ends them)."""
        nwords = bits.size
        nready = (nwords - 1) // 2
        header = 8 * (nwords + 2)
        capacity = self.capacity
        row = np.zeros(header + capacity, np.uint8)
        head = row[:header].view(np.uint64)
        head[:nwords] = bits
        wish = 0
        carrying = self.enabled and not joined
        own: _Layout | None = None
        if carrying:
            own = self.layout_of(bits[:nready], capacity)
            wish = own.wish
            if own.uniform is not None:  # (the arrays have the requests' dtype, or are narrowed to it)
                if pending is not None:
                    names = own.names
                    arrays = pending[names[0]].inputs if len(names) == 1 else [
                        a for n in names for a in pending[n].inputs]
                else:
                    slots = own.slots.tolist()
                    arrays = entry_of(slots[0]).inputs if len(slots) == 1 else [
                        a for s in slots for a in entry_of(s).inputs]
                out = row[header:header + own.total].view(own.uniform)
                try:  # 1-D arrays (a gradient's kept view): axis=None flattens each first, 7x slower
                    np.concatenate(arrays, out=out)
                except ValueError:  # some array is not 1-D
                    np.concatenate(arrays, axis=None, out=out)
            elif len(own.slots):
                self._pack(row, header, own.slots, own.offsets, entry_of)
        head[nwords] = wish
        head[nwords + 1] = carrying
        following = self.next_capacity
        if self.post_ahead:
            stops = int(~bits[nwords - 1]) & stop_flag
            rows = self._exchange(row, 0 if stops else header + following)
        else:
            rows = self._exchange(row)
        words = rows[:, :header].view(np.uint64)
        # A cached step's usual round: every rank sent the same header (bits, wish, carrying), so
        # the AND is this rank's words and every rank's layout is this one's.
        mine = row[:header].tobytes()
        same = all(rows[r, :header].tobytes() == mine for r in range(rows.shape[0]))
        if same:
            anded = words[0, :nwords]
            self._resize(wish)
            everyone_carries = carrying
        else:
            anded = np.bitwise_and.reduce(words[:, :nwords], axis=0)
            self._resize(int(words[:, nwords].max()))
            everyone_carries = bool(words[:, nwords + 1].all())
        self.capacity = following if self.post_ahead else self.next_capacity
        self.rounds += 1
        any_flags = int(~anded[nwords - 1])
        if not capacity or any_flags & joined_flag or not everyone_carries:
            return anded, None
        return anded, CarriedRound(self, rows, words, header, capacity, nready, own if same else None)

    def _pack(self, row: np.ndarray, header: int, slots: np.ndarray, offsets: np.ndarray,
              entry_of: Callable[[int], Any]) -> None:
        """Copy each slot's input bytes to its offset (slots of several dtypes, or padded: those
        of one dtype and no padding are copied at once by ``exchange``): a run of arrays of one
        dtype lying end to end in the row (no padding between them) by one concatenation."""
        run: list[np.ndarray] = []
        run_at = run_end = header
        run_dtype: Any = None
        for slot, off in zip(slots.tolist(), offsets.tolist()):
            pos = header + off
            # the slot's agreed dtype: a compression's float32 arrays of a float16 request are
            # narrowed on the way into the row (``collectives.allreduce_async(wire=)``)
            dtype = _NP_DTYPES[int(self._dtypes[slot])]
            for a in entry_of(slot).inputs:
                if dtype != run_dtype or pos != run_end:
                    if run:
                        np.concatenate(run, axis=None, out=row[run_at:run_end].view(run_dtype))
                    run, run_at, run_dtype = [], pos, dtype
                run.append(a)
                pos += a.size * dtype.itemsize
                run_end = pos
        if run:
            np.concatenate(run, axis=None, out=row[run_at:run_end].view(run_dtype))

    def _resize(self, wish: int) -> None:
        """``next_capacity``, from the largest wish of the round (every rank alike)."""
        cap = self.next_capacity
        if wish > cap:
            self.next_capacity = min(_pow2(wish), self.max_bytes)
            self._quiet = 0
        elif 4 * wish <= cap:
            self._quiet += 1
            if self._quiet >= SHRINK_ROUNDS:
                self.next_capacity = _pow2(wish) if wish else 0
                self._quiet = 0
        else:
            self._quiet = 0


class _Layout(NamedTuple):
    """What one rank carried: its slots, their offsets in the row's data, the bytes it wished to
    carry, the dtype of them all when they share one and need no padding (else None), and their
    unpadded bytes."""

    slots: np.ndarray
    offsets: np.ndarray
    wish: int
    uniform: str | None
    total: int
    names: tuple[str, ...] = ()  # the slots' request names (a layout is forgotten when a slot changes)


class CarriedRound:
    """The rows of one round: which operations every rank carried, and their data."""

    def __init__(self, carrier: Carrier, rows: np.ndarray, words: np.ndarray, header: int, capacity: int,
                 nready: int, every: _Layout | None = None) -> None:
        self._carrier = carrier
        self._rows = rows
        self._header = header
        self._capacity = capacity
        # Each rank's layout (memoized by its ready words: the same object for ranks that had the
        # same ready, the usual case; ``every``: known to be every rank's).
        self._layouts: list[_Layout] = ([every] * rows.shape[0] if every is not None else
                                        [carrier.layout_of(words[r, :nready], capacity) for r in range(rows.shape[0])])
        first = self._layouts[0]
        self._same = all(lay is first for lay in self._layouts)

    def batch(self, batch: Sequence[Response]) -> BatchData | None:
        """The data of ``batch`` (an allreduce batch of this round) when every rank carried all
        of its operations, else None (it runs through the transport)."""
        carrier = self._carrier
        if self._same:  # a batch seen before in rows of these layouts: where it lies, known
            span = carrier._spans.get((id(batch), id(self._layouts[0])))
            if span is not None and span[0] is batch and span[1] is self._layouts[0]:
                first, total = span[2], span[3]
                data = self._rows[:, first:first + total]
                return BatchData(data.view(np.dtype(batch[0].request.dtype)), len(batch), carrier)
        cache = carrier.cache
        slot_of, table = cache.slot_of, cache._slots
        known = carrier._batches.get(id(batch))
        if known is not None and known[0] is batch:
            want = known[1]  # (forgotten whenever a slot changes: these are its responses still)
        else:
            get = slot_of.get
            slots = [get(resp.request.name, -1) for resp in batch]
            if min(slots) < 0 or not all(table[s] is resp for s, resp in zip(slots, batch)):
                return None
            want = np.asarray(slots, np.int64)
            if type(batch) is tuple:  # a memoized plan's: the same object next step
                if len(carrier._batches) >= 256:
                    carrier._batches.clear()
                carrier._batches[id(batch)] = (batch, want)
        if (carrier._sizes[want] < 0).any():
            return None
        dtype = np.dtype(batch[0].request.dtype)
        nbytes = carrier._nbytes[want]
        total = int(nbytes.sum())
        aligned = not (nbytes % 8).any()  # no padding between the slots' bytes
        rows, header = self._rows, self._header
        parts = []
        for r, lay in enumerate(self._layouts):
            lay_slots, lay_offsets = lay.slots, lay.offsets
            pos = np.searchsorted(lay_slots, want)
            if (pos >= len(lay_slots)).any() or (lay_slots[pos] != want).any():
                return None  # rank r did not carry all of it
            starts = lay_offsets[pos] + header
            first = int(starts[0])
            if len(want) == 1 or aligned and np.array_equal(np.diff(starts), nbytes[:-1]):
                if self._same:  # every rank's bytes at the same place: one view of the rows
                    data = rows[:, first:first + total]
                    if type(batch) is tuple:  # a memoized plan's: the same object next step
                        if len(carrier._spans) >= 256:
                            carrier._spans.clear()
                        carrier._spans[(id(batch), id(lay))] = (batch, lay, first, total)
                    break
                parts.append(rows[r, first:first + total])
            else:
                parts.append(np.concatenate([rows[r, s:s + n] for s, n in zip(starts.tolist(), nbytes.tolist())]))
        else:
            data = np.stack(parts)
        return BatchData(data.view(dtype), len(batch), self._carrier)


class BatchData:
    """One carried batch: every rank's elements in batch order (rows x elements); hands the
    executor a reducer that writes the reduction of each transport call's part into its buffer."""

    def __init__(self, data: np.ndarray, ops: int, carrier: Carrier) -> None:
        self._data = data
        self._ops = ops
        self._carrier = carrier
        self._at = 0

    def reducer(self, red: Reduction) -> Callable[[np.ndarray], None]:
        fn = _REDUCE[red.op]
        pre = red.pre
        data = self._data

        def reduce(buf: np.ndarray) -> None:
            at = self._at
            n = buf.shape[0]
            part = data[:, at:at + n]
            if part.shape[1] != n:
                raise HorovodInternalError(f"carried allreduce: a call of {n} elements past the batch's "
                                           f"{data.shape[1]} (at {at})")
            if part.dtype != buf.dtype:  # widened, then scaled in the wide type (as ``pack``)
                part = part.astype(buf.dtype)
                if pre != 1.0:
                    np.multiply(part, pre, out=part)
            elif pre != 1.0:
                work = np.empty(part.shape, buf.dtype)
                for i in range(part.shape[0]):  # every rank's part as ``pack`` scales its own
                    scale_array(work[i], part[i], pre)
                part = work
            fn.reduce(part, axis=0, out=buf)
            self._at = at + n
        # every element of ``buf`` written from the rows, none read: the executor packs nothing
        # into a fusion buffer for it (``buffers.run_reduction``)
        reduce.fills = True  # type: ignore[attr-defined]
        return reduce

    def finish(self) -> None:
        """The batch ran: every element was reduced (anything else is an engine bug)."""
        if self._at != self._data.shape[1]:
            raise HorovodInternalError(f"carried allreduce reduced {self._at} of its "
                                       f"{self._data.shape[1]} elements")
        self._carrier.carried_ops += self._ops
