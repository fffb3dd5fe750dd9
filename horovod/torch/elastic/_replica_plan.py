"""Who keeps a replica of whose committed rows, and who sends which rows to whom after a reset
(pure logic, no communication: ``horovod/torch/elastic/_replicated.py`` runs it).

A sharded elastic commit keeps, on each rank, the committed copy of the rows it holds plus a
replica of one other rank's rows. The ranks are put on a *ring* (``ring``): the first rank of
every host (hosts in the order of their first rank), then the second rank of every host, and so
on; each rank's rows are replicated on the next rank of the ring (``replica_holders``). Ranks next
to each other on the ring are on different hosts whenever the hosts have equal slot counts, so the
loss of one host loses no rows then.

Survivable: any set of lost ranks that holds no rank together with the rank after it on the ring
(the holder of its replica). Lost: the rows of a rank ``k`` whose holder ``replica_holders[k]`` is
lost too (``lost_ranks``).

After a reset each survivor announces which old ranks' rows it holds and what they are (an
*index*: ``{key: (kind, lo, hi, rows)}`` per old rank); ``plan_transfer`` then says, for each new
rank, which rows of each entry it takes from which survivor. Kinds of entries:

- ``"rows"``: rows ``[lo, hi)`` of a tensor of ``rows`` rows, split across the ranks;
- ``"same"``: one value that every rank holds alike (``lo, hi = 0, 1``);
- ``"owner"``: one value held by one rank (``lo, hi = 0, 1`` on it).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ring", "replica_holders", "replica_source", "lost_ranks", "chunk", "Piece",
           "plan_transfer", "LostRowsError"]


class LostRowsError(RuntimeError):
    """The committed rows of some old ranks are held by no survivor."""


def ring(hosts: Sequence[Hashable]) -> list[int]:
    """Ranks ``0..len(hosts)-1`` (``hosts[r]``: rank r's host) in ring order: the first rank of
    every host, hosts in the order of their first rank, then the second rank of every host..."""
    first: dict[Hashable, int] = {}
    seen: dict[Hashable, int] = {}
    keys = []
    for r, h in enumerate(hosts):
        first.setdefault(h, len(first))
        k = seen.get(h, 0)
        seen[h] = k + 1
        keys.append((k, first[h], r))
    return [r for _, _, r in sorted(keys)]


def replica_holders(order: Sequence[int]) -> dict[int, int]:
    """``{rank: the rank that keeps a replica of its rows}``: the next rank on the ring ``order``
    (``{}`` for one rank: a replica on itself would not survive anything)."""
    n = len(order)
    if n < 2:
        return {}
    return {order[i]: order[(i + 1) % n] for i in range(n)}


def replica_source(order: Sequence[int]) -> dict[int, int]:
    """``{rank: the rank whose rows it keeps a replica of}`` (the inverse of ``replica_holders``)."""
    return {h: r for r, h in replica_holders(order).items()}


def lost_ranks(n: int, order: Sequence[int], gone: Iterable[int]) -> list[int]:
    """The ranks of a world of ``n`` whose committed rows no survivor holds when the ranks
    ``gone`` are lost: those lost together with the holder of their replica."""
    gone_set = set(gone)
    holders = replica_holders(order)
    return sorted(k for k in range(n) if k in gone_set and holders.get(k, k) in gone_set)


def chunk(rows: int, n: int, r: int) -> tuple[int, int]:
    """Rank ``r``'s rows ``[lo, hi)`` of ``rows`` rows over ``n`` ranks: ``c = ceil(rows / n)``
    rows each (``hvd.fully_shard``'s layout)."""
    c = -(-rows // n) if n else rows
    return min(rows, r * c), min(rows, (r + 1) * c)


@dataclass(frozen=True)
class Piece:
    """Rows ``[lo, hi)`` of entry ``key`` of old rank ``old``'s committed part, which survivor
    ``src`` (a new rank) sends to new rank ``dest`` (``src == dest``: taken locally)."""

    key: Any
    lo: int
    hi: int
    old: int
    src: int
    dest: int


def plan_transfer(index: Mapping[int, Mapping[Any, tuple[str, int, int, int]]],
                  suppliers: Mapping[int, Sequence[int]],
                  needs: Mapping[int, Mapping[Any, tuple[int, int]]]) -> list[Piece]:
    """The pieces that give every new rank the rows it needs.

    Args:
        index: ``{old rank: {key: (kind, lo, hi, rows)}}``: what each old rank's committed part
            held (from any survivor holding it).
        suppliers: ``{old rank: [new ranks holding its part]}``, the preferred first.
        needs: ``{new rank: {key: (lo, hi)}}``: the rows each new rank takes.

    A new rank that holds an old rank's part takes rows from it itself; otherwise from the first
    supplier. Raises ``LostRowsError`` naming the entries and rows that no survivor holds.
    """
    by_key: dict[Any, list[tuple[int, int, int]]] = {}
    for old in sorted(index):
        if not suppliers.get(old):
            continue
        for key, (_, lo, hi, _) in index[old].items():
            if hi > lo:
                by_key.setdefault(key, []).append((lo, hi, old))
    pieces: list[Piece] = []
    missing: list[str] = []
    for dest in sorted(needs):
        for key, (lo, hi) in needs[dest].items():
            cur = lo
            spans = by_key.get(key, [])
            while cur < hi:
                around = [(a, b, k) for a, b, k in spans if a <= cur < b]
                if not around:
                    nxt = min([a for a, _, _ in spans if a > cur] + [hi])
                    missing.append(f"{key!r} rows {cur}:{min(nxt, hi)} (new rank {dest})")
                    cur = min(nxt, hi)
                    continue
                local = [s for s in around if dest in suppliers[s[2]]]
                a, b, k = (local or around)[0]
                src = dest if local else suppliers[k][0]
                end = min(b, hi)
                pieces.append(Piece(key, cur, end, k, src, dest))
                cur = end
    if missing:
        raise LostRowsError("; ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return pieces
