"""Sharded elastic commits: each rank keeps the committed copy of its own part of a sharded state
(a ``hvd.fully_shard`` model's rows, the optimizer state of its rows, a
``ZeroRedundancyOptimizer``'s shard) plus a replica of one other rank's part, about 2/N of the
whole per rank instead of the whole.

``save`` (every ``commit()``, collective): this rank's part is serialized into one byte buffer
(its *own* copy) and sent to the rank that keeps its replica, the next rank on the ring of
``_replica_plan.ring``, in one ``alltoall`` where each rank sends to one rank and receives from
one (no allgather). ``restore`` (local) puts the own copy back when the world has not changed.
After a reset (``sync``, or ``reset`` when the new round skips the sync: every member is a
survivor), the members announce which old ranks' parts they hold (own + replica), the rows are
laid out over the new world, ``_replica_plan.plan_transfer`` says who sends which rows to whom,
one ``alltoall`` moves them, each rank installs its new part, and a new commit is made in the new
world (so that a second failure before the next ``commit()`` is survivable too). If an old rank's
part is held by nobody (it and the holder of its replica were both lost), every member raises
``LostRowsError`` naming them: never a silently wrong state.
"""

from __future__ import annotations

import abc
import copy
import io
import pickle
import struct
from typing import Any

import torch

from horovod.common.current import get_context
from horovod.common.elastic.state import Committed
from horovod.common.elastic.worker import current_round
from horovod.common.job_state import next_number
from horovod.common.objects import allgather_object
from horovod.common.process_sets import ProcessSet
from horovod.torch.elastic._replica_plan import (
    LostRowsError,
    chunk,
    plan_transfer,
    replica_holders,
    replica_source,
    ring,
)
from horovod.torch.mpi_ops import alltoall

__all__ = ["ReplicatedStateHandler", "LostRowsError", "pack", "unpack_index", "unpack_values"]

# An entry of a part: (kind, lo, hi, rows, meta, value); meta: (dtype name, row shape) of a "rows"
# entry (what a rank that takes 0 rows of it builds), else None.
Entry = tuple[str, int, int, int, Any, Any]


def pack(index: dict[Any, Any], values: dict[Any, Any]) -> torch.Tensor:
    """One uint8 tensor: the index (pickled, length first) then the values (``torch.save``)."""
    head = pickle.dumps(index)
    buf = io.BytesIO()
    buf.write(struct.pack("<Q", len(head)))
    buf.write(head)
    torch.save(values, buf)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def unpack_index(blob: torch.Tensor) -> dict[Any, Any]:
    raw = blob.numpy()
    (n,) = struct.unpack("<Q", raw[:8].tobytes())
    return pickle.loads(raw[8:8 + n].tobytes())


def unpack_values(blob: torch.Tensor) -> dict[Any, Any]:
    raw = blob.numpy()
    (n,) = struct.unpack("<Q", raw[:8].tobytes())
    return torch.load(io.BytesIO(raw[8 + n:].tobytes()), weights_only=False)


def _hosts(ps: ProcessSet) -> list[str]:
    """Every member's host, in the set's rank order: the context's, gathered at ``init`` (in an
    elastic round, each worker's slot)."""
    names, ranks = get_context().hostnames, ps.ranks
    assert ranks is not None  # (a registered set's ranks are known, a communicator's too)
    return [names[g] for g in ranks]


def _empty_rows(meta: Any) -> torch.Tensor:
    dtype_name, row_shape = meta
    return torch.empty((0, *row_shape), dtype=getattr(torch, dtype_name.split(".")[-1]))


def rows_meta(v: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    return str(v.dtype), tuple(v.shape[1:])


class _Held:
    """What this rank holds of one commit: its own part and the replica of another rank's."""

    def __init__(self, gen: int, n: int, r: int, order: list[int], own: torch.Tensor,
                 own_index: dict[Any, Any], replica: torch.Tensor | None, replica_of: int | None) -> None:
        self.gen, self.n, self.r, self.order = gen, n, r, order
        self.own, self.own_index = own, own_index
        self.replica, self.replica_of = replica, replica_of
        self.replica_index = unpack_index(replica) if replica is not None else None

    def parts(self) -> dict[int, dict[Any, Any]]:
        out = {self.r: self.own_index}
        if self.replica_of is not None and self.replica_index is not None:
            out[self.replica_of] = self.replica_index
        return out

    def nbytes(self) -> int:
        """The bytes of the memory the copies keep alive (their storages, not only their views)."""
        return sum(t.untyped_storage().nbytes() for t in (self.own, self.replica) if t is not None)


class ReplicatedStateHandler(Committed, abc.ABC):
    """The sharded commit of one sharded object (see the module docstring). Subclasses say what
    this rank's part is (``_part``), which rows each rank takes in a world of ``n`` (``_needs``),
    how to lay the object out over the current world (``_relayout``) and how to put a part back
    (``_install``)."""

    label = "sharded"

    def __init__(self, value: Any) -> None:
        self.value = value
        self._held: _Held | None = None
        self._gen = 0
        self._order: list[int] | None = None  # the ring of the current world, once known
        self._pending = False  # the world changed since the commit: the rows are not in place
        self._name = f"elastic.{self.label.replace(' ', '_')}.{next_number('elastic.replicated')}"

    # ------------------------------------------------------------------ what subclasses say
    @abc.abstractmethod
    def _process_set(self) -> ProcessSet:
        """The process set the object is sharded over."""

    @abc.abstractmethod
    def _part(self) -> dict[Any, Entry]:
        """This rank's part: ``{key: Entry}`` (its rows of each sharded value, whole the rest)."""

    def _needs(self, n: int, kinds: dict[Any, tuple[str, int]]) -> dict[int, dict[Any, tuple[int, int]]]:
        """``{new rank: {key: (lo, hi)}}`` for every rank of a world of ``n`` (after ``_relayout``)."""
        out: dict[int, dict[Any, tuple[int, int]]] = {j: {} for j in range(n)}
        for key, (kind, rows) in kinds.items():
            for j in range(n):
                out[j][key] = chunk(rows, n, j) if kind == "rows" else (0, 1)
        return out

    @abc.abstractmethod
    def _relayout(self) -> None:
        """Lay the object out over the current world (its shards' sizes), values to be installed."""

    @abc.abstractmethod
    def _install(self, values: dict[Any, Any]) -> None:
        """Put ``values`` (``{key: this rank's rows, or the whole value}``) in place."""

    # ------------------------------------------------------------------ the commit
    def _world(self) -> tuple[int, int]:
        ps = self._process_set()
        return ps.size() or 1, ps.rank() or 0

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def committed_bytes(self) -> int:
        """The bytes this rank holds of the last commit (own part and replica)."""
        return self._held.nbytes() if self._held is not None else 0

    def save(self) -> None:
        ps = self._process_set()
        n, r = self._world()
        if self._order is None or len(self._order) != n:
            self._order = ring(_hosts(ps))
        part = self._part()
        index = {k: e[:5] for k, e in part.items()}
        own = pack(index, {k: e[5] for k, e in part.items()})
        replica = replica_of = None
        if n > 1:
            holders, source = replica_holders(self._order), replica_source(self._order)
            splits = [0] * n
            splits[holders[r]] = own.numel()
            replica, _ = alltoall(own, splits=splits, name=f"{self._name}.commit", process_set=ps)
            replica_of = source[r]
        self._gen += 1
        self._held = _Held(self._gen, n, r, list(self._order), own, index, replica, replica_of)
        self._pending = False

    def restore(self) -> None:
        """Back to the last commit, locally: the own copy when the world is the commit's;
        otherwise the rows wait for the next ``sync`` (or the reset of a round without one)."""
        held = self._held
        if held is None:
            return
        if (held.n, held.r) == self._world() and not self._pending:
            self._relayout()
            with torch.no_grad():
                self._install({k: v for k, v in unpack_values(held.own).items()})
        else:
            self._pending = True

    def reset(self) -> None:
        """The world changed: the rows move at the next ``sync``, or now when the new round
        skips the sync (every member a survivor of the last round, all here together)."""
        self._order = None
        self._pending = True
        info = current_round()
        if info is not None and info.skip_sync:
            self._redistribute()

    def sync(self) -> None:
        self._redistribute()

    # ------------------------------------------------------------------ after a reset
    def _redistribute(self) -> None:
        ps = self._process_set()
        n, r = self._world()
        held = self._held
        mine = (None if held is None else (held.gen, held.n, tuple(held.order)),
                None if held is None else held.r, {} if held is None else held.parts())
        seen = allgather_object(mine, name=f"{self._name}.announce", process_set=ps) if n > 1 else [mine]
        order = ring(_hosts(ps))
        commits = {s[0] for s in seen if s[0] is not None}
        self._relayout()
        if not commits:  # nothing committed anywhere yet: the live state is the first commit
            self._order, self._gen = order, 0
            self.save()
            return
        if len(commits) > 1:
            by = {c: [j for j, s in enumerate(seen) if s[0] == c] for c in commits}
            raise RuntimeError(
                f"hvd.elastic: the survivors hold different commits of {self.label} (commit number, "
                f"world size: ranks): {by}; a rank failed in the middle of a commit. Resume from the "
                "last hvd.checkpoint")
        gen, n_old, old_order = commits.pop()
        index: dict[int, dict[Any, Any]] = {}
        suppliers: dict[int, list[int]] = {}
        primary: dict[int, int] = {}
        for j, s in enumerate(seen):
            for old, idx in s[2].items():
                index.setdefault(old, idx)
                suppliers.setdefault(old, []).append(j)
            if s[1] is not None:  # the survivor whose own part it was sends first
                primary[s[1]] = j
        for old, js in suppliers.items():
            if old in primary:
                js.sort(key=lambda j: (j != primary[old], j))
        lost = [k for k in range(n_old) if k not in suppliers]
        if lost:
            holders = replica_holders(old_order)
            where = ", ".join(f"old rank {k}: kept by itself and by old rank {holders[k]}" if k in holders
                              else f"old rank {k}: kept by itself only" for k in lost)
            raise LostRowsError(
                f"hvd.elastic: the committed {self.label} of old rank{'s' if len(lost) > 1 else ''} "
                f"{', '.join(map(str, lost))} (of {n_old}) is held by no surviving rank: each part was "
                f"kept by its rank and replicated on the next rank of the ring {list(old_order)} "
                f"({where}), and all of them were lost (the survivors hold the parts of old ranks "
                f"{sorted(suppliers)}). The state cannot be restored; resume from the last "
                "hvd.checkpoint (hvd.checkpoint.load), or commit with replicas='all' to survive this")
        kinds: dict[Any, tuple[str, int]] = {}
        metas: dict[Any, Any] = {}
        for idx in index.values():
            for key, (kind, _, _, rows, meta) in idx.items():
                kinds.setdefault(key, (kind, rows))
                if meta is not None:
                    metas.setdefault(key, meta)
        needs = self._needs(n, kinds)
        pieces = plan_transfer({k: {key: e[:4] for key, e in idx.items()} for k, idx in index.items()},
                               suppliers, needs)
        got = self._move(pieces, r, n, ps)
        values: dict[Any, Any] = {}
        for key in needs[r]:
            kind = kinds[key][0]
            parts = sorted(got.get(key, []), key=lambda p: p[0])
            if kind == "rows":
                values[key] = torch.cat([v for _, v in parts]) if parts else _empty_rows(metas[key])
            elif parts:
                values[key] = parts[0][1]
        with torch.no_grad():
            self._install(values)
        self._order, self._gen = order, gen
        self.save()

    def _move(self, pieces: list[Any], r: int, n: int, ps: ProcessSet) -> dict[Any, list[tuple[int, Any]]]:
        """Send this rank's pieces, receive the others': ``{key: [(lo, value)]}`` of this rank."""
        held = self._held
        cache: dict[int, dict[Any, Any]] = {}

        def source(old: int) -> dict[Any, Any]:
            if old not in cache:
                assert held is not None
                cache[old] = unpack_values(held.own if old == held.r else held.replica)  # type: ignore[arg-type]
            return cache[old]

        outgoing: dict[int, list[tuple[Any, int, Any]]] = {}
        for p in pieces:
            if p.src != r:
                continue
            assert held is not None
            entry_index = held.own_index if p.old == held.r else held.replica_index
            assert entry_index is not None
            kind, lo, _, _, _ = entry_index[p.key]
            v = source(p.old)[p.key]
            if kind == "rows":
                v = v[p.lo - lo:p.hi - lo].clone()
            outgoing.setdefault(p.dest, []).append((p.key, p.lo, v))
        got: dict[Any, list[tuple[int, Any]]] = {}
        for key, lo, v in outgoing.pop(r, []):
            got.setdefault(key, []).append((lo, v if isinstance(v, torch.Tensor) else copy.deepcopy(v)))
        if n > 1:
            blobs = [pack({}, {"pieces": outgoing.get(j, [])}) if outgoing.get(j) else torch.empty(0, dtype=torch.uint8)
                     for j in range(n)]
            out, received = alltoall(torch.cat(blobs), splits=[b.numel() for b in blobs],
                                     name=f"{self._name}.move", process_set=ps)
            start = 0
            for size in (received.tolist() if isinstance(received, torch.Tensor) else list(received)):
                if size:
                    for key, lo, v in unpack_values(out[start:start + size])["pieces"]:
                        got.setdefault(key, []).append((lo, v))
                start += size
        return got
