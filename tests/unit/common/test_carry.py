"""The carried negotiation's rows (``engine/carry.py``): two or three ranks as threads.

Each "rank" has its own identical cache and a Carrier whose exchange hands every rank's row to
all (a barrier between threads, as Gloo's exchange does between processes). The tests check the
layout every rank reads from every other rank's bits: operations every rank carried are reduced
from the rows (values on every rank), ranks with different ready sets carry only what all had
ready, odd sizes are padded, the capacity is agreed from the wishes, and a joined rank or a rank
that does not carry turns the data off for everyone.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from horovod.common.engine.buffers import Reduction
from horovod.common.engine.cache import ResponseCache
from horovod.common.engine.carry import Carrier
from horovod.common.types import ReduceOp, Request, RequestType, Response

FLAG_JOINED = 4
WORDS = 1  # cache of 64 slots: 2 * 1 + 1 words


class _Exchange:
    """Every rank's row, to every rank (each call is one rank's part of a collective)."""

    def __init__(self, size: int) -> None:
        self.rows: list[np.ndarray | None] = [None] * size
        self.barrier = threading.Barrier(size)

    def for_rank(self, rank: int):
        def exchange(row: np.ndarray) -> np.ndarray:
            self.rows[rank] = row.copy()
            self.barrier.wait()
            out = np.stack(self.rows)  # type: ignore[arg-type]
            self.barrier.wait()
            return out
        return exchange


class _Entry:
    def __init__(self, inputs: list[np.ndarray]) -> None:
        self.inputs = inputs


def _responses(specs: list[tuple[str, str, tuple[tuple[int, ...], ...], ReduceOp]]) -> list[Response]:
    return [Response(Request(name, RequestType.ALLREDUCE, dtype, shapes, op)) for name, dtype, shapes, op in specs]


SPECS = [("a", "float32", ((4,),), ReduceOp.SUM),       # 16 bytes
         ("b", "int8", ((3,),), ReduceOp.SUM),          # 3 bytes: padded to 8
         ("g", "float64", ((2,), (1, 3)), ReduceOp.MAX),  # grouped: 40 bytes
         ("c", "float32", ((5,),), ReduceOp.AVERAGE),   # 20 bytes: padded to 24
         ("big", "float32", ((1000,),), ReduceOp.SUM),  # above the largest capacity
         ("bc", "float32", ((4,),), ReduceOp.SUM)]      # broadcast: never carried


def _setup(size: int, max_bytes: int = 256):
    resps = _responses(SPECS)
    resps[-1] = Response(Request("bc", RequestType.BROADCAST, "float32", ((4,),), root_rank=0))
    ex = _Exchange(size)
    ranks = []
    for r in range(size):
        cache = ResponseCache(64)
        for resp in resps:
            cache.put(resp)
        ranks.append(Carrier(ex.for_rank(r), size, cache, max_bytes))
    return resps, ranks


def _inputs(rank: int, resp: Response) -> list[np.ndarray]:
    out = []
    for i, shape in enumerate(resp.request.shapes):
        n = int(np.prod(shape))
        out.append((np.arange(n) + 10 * rank + i + 1).astype(resp.request.dtype).reshape(shape))
    return out


def _round(carriers, ready: list[list[str]], resps, joined=(), enabled=None, by_name_too=False):
    """One exchange on every rank: rank r has the slots of ``ready[r]`` ready (``by_name_too``:
    the entries are also handed over by name, as the engine's rounds do)."""
    by_name = {r.name: r for r in resps}
    out: list = [None] * len(carriers)

    def run(rank: int) -> None:
        c = carriers[rank]
        if enabled is not None:
            c.enabled = enabled[rank]
        bits = np.zeros(2 * WORDS + 1, np.uint64)
        mask = 0
        for name in ready[rank]:
            mask |= 1 << c.cache.slot_of[name]
        bits[0] = mask
        bits[1] = ~np.uint64(0)
        flags = FLAG_JOINED if rank in joined else 0
        bits[2] = ~np.uint64(flags)
        entries = {c.cache.slot_of[n]: _Entry(_inputs(rank, by_name[n])) for n in ready[rank]}
        pending = {n: entries[c.cache.slot_of[n]] for n in ready[rank]} if by_name_too else None
        out[rank] = c.exchange(bits, entries.__getitem__, rank in joined, FLAG_JOINED, 0, pending)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(carriers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def _reduce(carried, resp: Response, size: int) -> list[np.ndarray] | None:
    data = carried.batch([resp])
    if data is None:
        return None
    req = resp.request
    op = ReduceOp.SUM if req.reduce_op == ReduceOp.AVERAGE else req.reduce_op
    red = Reduction(op, 1.0, 1.0, 1, np.dtype(req.dtype), False, False)
    n = sum(int(np.prod(s)) for s in req.shapes)
    buf = np.empty(n, req.dtype)
    data.reducer(red)(buf)
    data.finish()
    return [buf]


def _expected(resp: Response, size: int) -> np.ndarray:
    parts = [np.concatenate([x.reshape(-1) for x in _inputs(k, resp)]) for k in range(size)]
    fn = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MAX: np.maximum}[resp.request.reduce_op]
    return fn.reduce(np.stack(parts), axis=0)


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_reads_what_all_carried(size):
    resps, carriers = _setup(size)
    everything = ["a", "b", "g", "c", "big", "bc"]
    first = _round(carriers, [everything] * size, resps)
    # no capacity agreed yet: bits only; the wish (8 + 16 + 40 + 24 = 88 bytes) sets it
    assert all(c is None for _, c in first)
    assert all(c.capacity == 128 for c in carriers)
    anded = first[0][0]
    assert all(np.array_equal(a, anded) for a, _ in first)
    second = _round(carriers, [everything] * size, resps)
    for rank, (_, carried) in enumerate(second):
        assert carried is not None
        for resp in resps:
            got = _reduce(carried, resp, size)
            if resp.name in ("big", "bc"):
                assert got is None, resp.name  # too large / not an allreduce: the transport's
                continue
            assert got is not None, (rank, resp.name)
            np.testing.assert_array_equal(got[0], _expected(resp, size), err_msg=f"rank {rank} {resp.name}")


def test_ranks_that_disagree_carry_only_what_all_had_ready():
    resps, carriers = _setup(2)
    _round(carriers, [["a", "b", "g", "c"]] * 2, resps)  # agree on a capacity
    # rank 0 has everything, rank 1 lacks "b": the slots after it sit elsewhere in its row
    out = _round(carriers, [["a", "b", "g", "c"], ["a", "g", "c"]], resps)
    by_name = {r.name: r for r in resps}
    for rank, (anded, carried) in enumerate(out):
        assert carried is not None
        ready = int(anded[0])
        assert not ready & (1 << carriers[rank].cache.slot_of["b"])
        for name in ("a", "g", "c"):
            got = _reduce(carried, by_name[name], 2)
            assert got is not None
            np.testing.assert_array_equal(got[0], _expected(by_name[name], 2))
        assert _reduce(carried, by_name["b"], 2) is None  # rank 1 did not carry it
    # "a" and "c" both float32: one batch, rank 1's bytes are at other offsets than rank 0's
    out = _round(carriers, [["a", "b", "c"], ["a", "c"]], resps)
    for _, carried in out:
        data = carried.batch([by_name["a"], by_name["c"]])
        assert data is not None
        buf = np.empty(9, np.float32)
        data.reducer(Reduction(ReduceOp.SUM, 1.0, 1.0, 1, np.dtype(np.float32), False, False))(buf)
        data.finish()
        np.testing.assert_array_equal(buf, np.concatenate([_expected(by_name["a"], 2), _expected(by_name["c"], 2)]))


def test_a_joined_or_non_carrying_rank_turns_the_data_off():
    resps, carriers = _setup(2)
    ready = [["a", "c"]] * 2
    _round(carriers, ready, resps)
    assert all(c is not None for _, c in _round(carriers, ready, resps))
    assert all(c is None for _, c in _round(carriers, ready, resps, joined=(1,)))
    assert all(c is None for _, c in _round(carriers, ready, resps, enabled=[True, False]))
    assert all(c is not None for _, c in _round(carriers, ready, resps, enabled=[True, True]))


def test_the_capacity_grows_to_the_largest_wish_and_shrinks_after_quiet_rounds(monkeypatch):
    from horovod.common.engine import carry

    monkeypatch.setattr(carry, "SHRINK_ROUNDS", 3)
    resps, carriers = _setup(2, max_bytes=64)
    _round(carriers, [["a", "g", "c"], ["a"]], resps)  # wishes 80 and 16: capped at 64
    assert [c.capacity for c in carriers] == [64, 64]
    out = _round(carriers, [["a", "g", "c"]] * 2, resps)
    by_name = {r.name: r for r in resps}
    carried = out[0][1]
    assert _reduce(carried, by_name["a"], 2) is not None and _reduce(carried, by_name["g"], 2) is not None
    assert _reduce(carried, by_name["c"], 2) is None  # 16 + 40 + 24 > 64: the prefix that fits
    for _ in range(3):
        _round(carriers, [[], []], resps)
    assert [c.capacity for c in carriers] == [0, 0]


def test_a_reducer_past_the_batch_is_an_engine_bug():
    from horovod.common.exceptions import HorovodInternalError

    resps, carriers = _setup(2)
    _round(carriers, [["a"]] * 2, resps)
    carried = _round(carriers, [["a"]] * 2, resps)[0][1]
    data = carried.batch([resps[0]])
    red = Reduction(ReduceOp.SUM, 1.0, 1.0, 1, np.dtype(np.float32), False, False)
    with pytest.raises(HorovodInternalError):
        data.reducer(red)(np.empty(5, np.float32))
    data = carried.batch([resps[0]])
    data.reducer(red)(np.empty(2, np.float32))
    with pytest.raises(HorovodInternalError):
        data.finish()


def test_posted_ahead_the_next_rows_length_is_agreed_a_round_early_and_not_posted_by_a_rank_that_stops():
    # With ``post_ahead`` (Gloo's ``exchange_rows(row, post_next)``) each exchange is told the
    # next row's length before the rows arrive: the header (the AND's words and two more) and a
    # capacity agreed from the round before, the same on every rank; the row of each round has
    # exactly the length the round before announced. A rank that stops this round announces none.
    resps, carriers = _setup(2, max_bytes=64)
    calls: list[list[tuple[int, int]]] = [[], []]
    for r, c in enumerate(carriers):
        def exchange(row: np.ndarray, post_next: int, inner=c._exchange, r=r) -> np.ndarray:
            calls[r].append((row.size, post_next))
            return inner(row)
        c._exchange, c.post_ahead = exchange, True
    header = 8 * (2 * WORDS + 1 + 2)
    ready = [["a", "g", "c"], ["a"]]  # wishes 80 and 16: capacity 64 (the most), "a" and "g" fit
    first = _round(carriers, ready, resps)
    assert calls == [[(header, header)]] * 2  # nothing agreed before the first rows
    assert all(c is None for _, c in first)
    assert [(c.capacity, c.next_capacity) for c in carriers] == [(0, 64)] * 2
    second = _round(carriers, ready, resps)
    assert all(c is None for _, c in second)  # the wish of round 1 is round 3's capacity
    assert [k[-1] for k in calls] == [(header, header + 64)] * 2
    third = _round(carriers, ready, resps)
    assert [k[-1] for k in calls] == [(header + 64, header + 64)] * 2
    a = resps[0]
    for rank, (_, carried) in enumerate(third):
        got = _reduce(carried, a, 2)
        assert got is not None, rank
        np.testing.assert_array_equal(got[0], _expected(a, 2), err_msg=f"rank {rank}")
    stop = 2

    def last(rank: int, c: Carrier) -> None:
        bits = np.zeros(2 * WORDS + 1, np.uint64)
        bits[1] = ~np.uint64(0)
        bits[2] = ~np.uint64(stop if rank == 1 else 0)
        c.exchange(bits, lambda s: None, False, FLAG_JOINED, stop)

    threads = [threading.Thread(target=last, args=(r, c)) for r, c in enumerate(carriers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    # rank 1 stops: no next exchange for it; rank 0 learns it only from the rows
    assert [k[-1] for k in calls] == [(header + 64, header + 64), (header + 64, 0)]


@pytest.mark.parametrize("by_name", [False, True])
def test_slots_of_one_dtype_are_packed_at_once_from_their_entries_by_slot_or_by_name(by_name):
    """Slots of one dtype without padding are packed by one concatenation of their entries' arrays,
    found by slot (``entry_of``) or by the names the layout remembers (``pending``): every rank
    reads every rank's values, whichever subset each had ready."""
    size = 3
    specs = [(f"u{i}", "float32", ((2,), (2,)) if i == 2 else ((4,),), ReduceOp.SUM) for i in range(6)]
    resps = _responses(specs)
    ex = _Exchange(size)
    carriers = []
    for r in range(size):
        cache = ResponseCache(64)
        for resp in reversed(resps):  # slots in another order than the names
            cache.put(resp)
        carriers.append(Carrier(ex.for_rank(r), size, cache, 256))
    names = [sp[0] for sp in specs]
    _round(carriers, [names] * size, resps, by_name_too=by_name)  # agrees the capacity
    for ready in ([names] * size, [names[1:4]] * size):
        got = _round(carriers, ready, resps, by_name_too=by_name)
        for rank, (_, carried) in enumerate(got):
            assert carried is not None
            for resp in resps:
                want = _expected(resp, size) if resp.name in ready[0] else None
                out = _reduce(carried, resp, size)
                if want is None:
                    assert out is None, (rank, resp.name)
                else:
                    assert out is not None and np.array_equal(out[0], want), (rank, resp.name, out, want)
