"""The planning of sharded elastic commits (horovod/torch/elastic/_replica_plan.py), pure logic:
the ring alternates hosts, each rank's part has exactly one other holder, which losses are
survivable (exhaustively for small worlds: a rank's rows are lost exactly when it and the next
rank on the ring are both gone), and the transfer plan gives every new rank exactly its rows,
from survivors only, taking locally what it holds."""

from __future__ import annotations

import itertools

import pytest

from horovod.torch.elastic._replica_plan import (
    LostRowsError,
    chunk,
    lost_ranks,
    plan_transfer,
    replica_holders,
    replica_source,
    ring,
)


def test_ring_alternates_hosts():
    # two hosts of two slots: ranks 0, 1 on a, 2, 3 on b (host-contiguous ranks, as launched)
    assert ring(["a", "a", "b", "b"]) == [0, 2, 1, 3]
    assert replica_holders([0, 2, 1, 3]) == {0: 2, 2: 1, 1: 3, 3: 0}
    # every rank's replica is on the other host: losing a whole host loses nothing
    hosts = ["a", "a", "b", "b"]
    holders = replica_holders(ring(hosts))
    assert all(hosts[k] != hosts[h] for k, h in holders.items())
    for host in "ab":
        gone = [r for r, h in enumerate(hosts) if h == host]
        assert lost_ranks(4, ring(hosts), gone) == []
    # one host, or one rank: the plain ring; one rank has no replica
    assert ring(["x"] * 3) == [0, 1, 2] and replica_holders([0, 1, 2]) == {0: 1, 1: 2, 2: 0}
    assert replica_holders([0]) == {} and replica_source([0]) == {}
    # uneven hosts: a host of 3 slots next to one of 1: two of its ranks are ring neighbours
    order = ring(["a", "a", "a", "b"])
    assert order == [0, 3, 1, 2]
    # losing host a: 1 (replica on 2) and 2 (replica on 0) are lost, 0 (replica on b) is not
    assert lost_ranks(4, order, [0, 1, 2]) == [1, 2]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_survivable_exactly_when_no_two_ring_neighbours_are_lost(n):
    hosts = [r % 2 for r in range(n)]
    order = ring(hosts)
    holders = replica_holders(order)
    assert sorted(holders) == list(range(n)) and sorted(holders.values()) == list(range(n))
    assert all(h != k for k, h in holders.items())
    assert replica_source(order) == {h: k for k, h in holders.items()}
    for size in range(1, n):
        for gone in itertools.combinations(range(n), size):
            lost = lost_ranks(n, order, gone)
            neighbours = [k for k in gone if holders[k] in gone]
            assert lost == sorted(neighbours), (n, gone, lost)
            # the plan agrees: with every survivor's holdings (own + replica), a new world of
            # the survivors gets every row, or the plan names the lost rows
            index = {k: {"w": ("rows", *chunk(10, n, k), 10)} for k in range(n)}
            held: dict[int, list[int]] = {}
            survivors = [k for k in range(n) if k not in gone]
            for j, k in enumerate(survivors):
                for part in (k, replica_source(order).get(k)):
                    if part is not None:
                        held.setdefault(part, []).append(j)
            m = len(survivors)
            needs = {j: {"w": chunk(10, m, j)} for j in range(m)}
            lost_rows = any(chunk(10, n, k)[1] > chunk(10, n, k)[0] for k in lost)
            if lost_rows:
                with pytest.raises(LostRowsError):
                    plan_transfer(index, held, needs)
            else:
                _check_plan(plan_transfer(index, held, needs), index, held, needs)


def _check_plan(pieces, index, held, needs):
    got: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for p in pieces:
        assert p.src in held[p.old], p  # only a survivor holding that old part sends it
        lo, hi = index[p.old][p.key][1:3]
        assert lo <= p.lo < p.hi <= hi, p  # rows the old part had
        if p.dest in held[p.old]:
            assert p.src == p.dest, p  # what a rank holds it takes itself
        got.setdefault((p.dest, p.key), []).append((p.lo, p.hi))
    for j, want in needs.items():
        for key, (lo, hi) in want.items():
            spans = sorted(got.get((j, key), []))
            cur = lo
            for a, b in spans:
                assert a == cur, (j, key, spans)  # contiguous, no overlap
                cur = b
            assert cur == hi, (j, key, spans, (lo, hi))


def test_plan_names_the_lost_rows_and_prefers_the_primary():
    # old world of 3, new of 2 (old rank 2 gone; its replica on old 0 in ring [0, 1, 2]: 2 -> 0)
    index = {0: {"w": ("rows", 0, 4, 10), "step": ("same", 0, 1, 1)},
             1: {"w": ("rows", 4, 8, 10), "step": ("same", 0, 1, 1)},
             2: {"w": ("rows", 8, 10, 10), "step": ("same", 0, 1, 1)}}
    held = {0: [0, 1], 1: [1], 2: [0]}  # new 0 = old 0 (holds 0 and 2), new 1 = old 1 (holds 1, 0)
    needs = {0: {"w": (0, 5), "step": (0, 1)}, 1: {"w": (5, 10), "step": (0, 1)}}
    pieces = plan_transfer(index, held, needs)
    _check_plan(pieces, index, held, needs)
    by = {(p.dest, p.lo): p for p in pieces if p.key == "w"}
    assert by[(0, 0)].src == 0 and by[(0, 4)].src == 1  # rows 4:5 from old 1's holder
    assert by[(1, 5)].src == 1 and by[(1, 8)].src == 0  # old 2's rows from its replica on new 0
    assert all(p.src == p.dest for p in pieces if p.key == "step")  # taken locally
    # a newcomer (new 2) takes the "same" value from the first holder
    needs3 = {**needs, 2: {"w": (0, 0), "step": (0, 1)}}
    step = [p for p in plan_transfer(index, held, needs3) if p.dest == 2]
    assert [(p.key, p.src) for p in step] == [("step", 0)]
    # nobody holds old 2: its rows are named
    with pytest.raises(LostRowsError, match=r"'w' rows 8:10 \(new rank 1\)"):
        plan_transfer(index, {0: [0], 1: [1]}, needs)


def test_chunk_is_fully_shards_layout():
    assert [chunk(10, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 10)]
    assert [chunk(2, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert chunk(1, 1, 0) == (0, 1)
