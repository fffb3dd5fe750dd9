"""Gloo through ``torch.distributed``: negotiation and CPU collectives on NumPy buffers.

The transport takes a store and this rank's place (``StoreRendezvous``, from a rendezvous handler:
``horovod.common.rendezvous_handlers`` for every launcher, ``horovod.common.elastic.rounds`` for an
elastic round) and builds its process groups on it: ``ProcessGroupGloo`` objects made directly on
that store, without torch's global default group, so ``hvd.init(); hvd.shutdown(); hvd.init()``
works and nothing leaks into a user's own ``torch.distributed`` use.

Buffers are handed to Gloo through ``torch.from_numpy`` (no copy). Data-movement collectives
(allgather, broadcast, alltoall) run on a byte view of the buffer, so every dtype works; reductions
use the buffer's own dtype (see ``reduce_dtypes``). PyTorch is imported only when this backend is
created.
"""

from __future__ import annotations

import contextlib
import datetime
import warnings
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from horovod.common import plain
from horovod.common.backends.base import LOCAL_REDUCE, Group, PartsBuffer
from horovod.common.backends.half import TORCH_PIECE, piece
from horovod.common.config import EngineConfig
from horovod.common.exceptions import BackendUnavailableError, HorovodInternalError
from horovod.common.types import ReduceOp

if TYPE_CHECKING:
    from horovod.common.launcher_detection import Launch
    from horovod.common.rendezvous_handlers import StoreRendezvous

__all__ = ["GlooBackend", "GlooErrors", "check_torch", "gloo_checks", "shm_allreduce"]


def check_torch() -> None:
    """Raise ``BackendUnavailableError`` with the fix when PyTorch's Gloo cannot be used here."""
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise BackendUnavailableError(
            f"The Gloo transport needs PyTorch, which cannot be imported here ({exc}). Install it "
            "(pip install 'horovod-py[torch]') or start the job with MPI (horovodrun --mpi).",
            backend="gloo") from exc
    if not dist.is_available() or not dist.is_gloo_available():
        raise BackendUnavailableError("This PyTorch build has no torch.distributed Gloo support; "
                                      "use a standard PyTorch wheel or MPI.", backend="gloo")


def gloo_checks(comm: Any) -> None:
    """What every Gloo factory checks first.

    Raises:
        ValueError: ``comm`` was given (sub-communicators need MPI).
        BackendUnavailableError: PyTorch's Gloo cannot be used here.
    """
    if comm is not None:
        raise ValueError("hvd.init(comm=...) needs MPI; under Gloo every started process joins the "
                         "job (use process sets for subsets).")
    check_torch()


class GlooErrors(contextlib.AbstractContextManager[None]):
    """The one place where torch/Gloo errors become Horovod errors: ``with GlooErrors(what, rank):``
    turns any other exception raised inside into ``HorovodInternalError`` naming the rank."""

    def __init__(self, what: str, rank: int) -> None:
        self.what, self.rank = what, rank

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if not isinstance(exc, Exception) or isinstance(exc, HorovodInternalError):
            return  # none, ours already, or not an error (KeyboardInterrupt, SystemExit)
        raise HorovodInternalError(
            f"Gloo {self.what} failed on rank {self.rank}: {exc}. A peer process may have died; "
            "check the other ranks' output.", rank=self.rank, op=self.what) from exc


def _gloo_reduces(dist: Any, device: Any, dtype: Any) -> bool:
    """Whether Gloo's allreduce takes ``dtype`` tensors: tried on a one-member group over an
    in-process store (Gloo picks its reduction function by dtype before it looks at the size)."""
    import torch

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=10)
    opts._devices = [device]
    pg = None
    try:
        pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, opts)
        t = torch.ones(2, dtype=dtype)
        pg.allreduce([t]).wait()
        return bool((t == 1).all())
    except Exception:  # noqa: BLE001 - any failure: not supported here, widened instead
        return False
    finally:
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.shutdown()


# Gloo's intra-host shared-memory allreduce (pytorch/gloo #455, #458: ``gloo/allreduce_shm.cc``)
# exports these functions; a torch whose Gloo predates it has neither.
SHM_ALLREDUCE_SYMBOLS = (b"_ZN4gloo13is_intra_node", b"_ZN4gloo3shmERKNS_6detail20AllreduceOptionsImplE")
_shm_found: list[str | None] = []


def shm_allreduce() -> str | None:
    """Where the installed torch's Gloo carries the shared-memory allreduce for ranks on one host:
    the library and symbol found, or None (looked up once per process, in the library's bytes:
    one to a few seconds for a 400 MiB ``libtorch_cpu``; never at init).

    Gloo takes that path by itself, inside ``allreduce``, when the group's size equals the
    ``LOCAL_WORLD_SIZE`` variable (torchrun sets it; horovodrun does not), so Horovod neither
    needs nor does anything to use it; this says whether it exists (docs/performance.md, "The Gloo
    data plane": absent from the torch 2.13 wheels)."""
    if _shm_found:
        return _shm_found[0]
    found = None
    try:
        import mmap
        import os

        import torch

        lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
            path = os.path.join(lib, name)
            if not os.path.exists(path):
                continue
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                for sym in SHM_ALLREDUCE_SYMBOLS:
                    if m.find(sym) >= 0:
                        found = f"{path}: {sym.decode()}"
                        break
            break
    except (ImportError, OSError, ValueError):
        found = None
    _shm_found.append(found)
    return found


# 16-bit allreduces of at least this many elements run as alltoall + local float32 reduction +
# allgather (``GlooBackend._allreduce_half``); smaller ones are latency-bound and stay Gloo's.
HALF_SPLIT_MIN = 1 << 16
_HALF_OPS = frozenset({ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT})
# Reduce-scatters of at least this many bytes run as one alltoall + a local reduction of the p
# parts each member receives: (p-1)/p of the buffer sent per member, half of the allreduce they
# otherwise are (and no whole-buffer copy). Gloo's raw collectives at 64 MiB on the 2-core
# machine: np=2 alltoall+sum 181-209 ms vs allreduce 156-290 ms; np=4 203-324 vs 486-695 ms.
SPLIT_REDUCESCATTER_MIN = 1 << 16
# Allgathers of equal parts of at least this many bytes per member run as point-to-point sends
# (each member sends its part to every other): Gloo's allgather at 16 MiB, np=4: 126 ms, sends:
# 56 ms; 64 MiB, np=4: 574 vs 176 ms, np=2: 280 vs 63 ms (same run, raw torch.distributed).
P2P_ALLGATHER_MIN = 1 << 20
_ALLGATHER_TAG = 0x4147  # the sends' tag, apart from sendrecv's (0)
# ``exchange_rows``: point-to-point up to this many ranks (one step), an allgather above; its tag.
ROWS_P2P_MAX = 8
_ROWS_TAG = 0x4352
# Allreduces of at most this many bytes (and at most ROWS_P2P_MAX members) run as one exchange
# of point-to-point sends and a local reduction (``GlooBackend._allreduce_small``); its tag.
SMALL_P2P_BYTES = 16 * 1024
_SMALL_TAG = 0x4152


# The Gloo plane's piece sizes (``GlooBackend.piece_sizes``; docs/performance.md).
GLOO_PIECE_BYTES = 16 << 20
GLOO_ALONE_BYTES = 1 << 20


def _done() -> None:
    """The wait of a reduction that finished when it was started."""


def _p2p(pg: Any, sends: list[tuple[Any, int]], recvs: list[tuple[Any, int]], tag: int,
         posted: list[Any] | None = None, between: Callable[[], None] | None = None) -> None:
    """Post every send (tensor, peer), then every receive, on the process group ``pg`` with
    ``tag``; wait for the receives, then the sends. ``posted``: receive works posted earlier
    (``GlooBackend.post_rows``), waited for instead of posting ``recvs``; the list is emptied.
    ``between``: called once everything is posted, before the waits (the next exchange's
    receives posted ahead: ``GlooBackend.exchange_rows``).

    Whatever happens, this frame keeps no reference to ``pg`` nor to its works (each holds the
    Gloo context, the group's connections): a failure's traceback keeps the frames it passed
    through, and a survivor keeps the failure (the engine fails its handles with it). A process
    group still referenced outlives ``close()`` with its connections open, and a peer waiting for
    this rank's row in a later exchange (it got every row of this one: a member stopped half-way
    through) then waits out the whole Gloo timeout instead of failing when this rank closes."""
    works: list[Any] = []
    try:
        if posted is not None:
            works.extend(posted)
            posted.clear()
        else:
            works.extend(pg.recv([t], j, tag) for t, j in recvs)
        works.extend(pg.send([t], j, tag) for t, j in sends)
        pg = None
        if between is not None:
            between()
        while works:
            works.pop(0).wait()
    finally:
        works.clear()
        if posted is not None:
            posted.clear()
        pg = None


def _reduce_half_pair(torch: Any, parts: Any, op: ReduceOp) -> None:
    """``GlooBackend._allreduce_half``'s local work for two members: both rows of ``parts`` (2, n,
    16-bit) set to ``op(row 0, row 1)``. torch's 16-bit kernels compute each element in float32
    and round once: the bits of ``_reduce_half_parts``' float32 accumulation, in one pass in the
    16-bit type instead of a widening, a reduction and a narrowing per row (bfloat16's rounding
    costs about a float32 copy on this project's CPUs)."""
    p = piece(torch)
    for a, b in zip(parts[0].split(p), parts[1].split(p)):  # one thread, in cache
        if op == ReduceOp.SUM:
            a.add_(b)
        elif op == ReduceOp.PRODUCT:
            a.mul_(b)
        else:
            (torch.minimum if op == ReduceOp.MIN else torch.maximum)(a, b, out=a)
        b.copy_(a)  # the same bits sent to both members


def _reduce_half_parts(torch: Any, parts: Any, op: ReduceOp) -> None:
    """``GlooBackend._allreduce_half``'s local work for p members: every row of ``parts`` (p, n,
    16-bit) set to the reduction of the p rows in member order, accumulated in float32 and
    rounded once."""
    n = parts.shape[1]
    acc = torch.empty(TORCH_PIECE, dtype=torch.float32)
    for s in range(0, n, TORCH_PIECE):  # one thread, in cache (``half.TORCH_PIECE``)
        e = min(n, s + TORCH_PIECE)
        a = acc[:e - s]
        a.copy_(parts[0, s:e])
        for k in range(1, parts.shape[0]):
            if op == ReduceOp.SUM:
                a.add_(parts[k, s:e])
            elif op == ReduceOp.PRODUCT:
                a.mul_(parts[k, s:e])
            else:
                (torch.minimum if op == ReduceOp.MIN else torch.maximum)(a, parts[k, s:e].float(), out=a)
        first = parts[0, s:e]
        first.copy_(a)  # rounded once, then the same bits copied to every member's row
        for k in range(1, parts.shape[0]):
            parts[k, s:e].copy_(first)

# --------------------------------------------------------------------------- backend
class GlooBackend:
    """Controller and collective backend on ``torch.distributed`` Gloo process groups."""

    name = "gloo"
    #: whether a reduction in memory on 4 KiB pages pays for a copy through the engine's huge-page
    #: buffers (Open MPI's single-copy transfer pins pages; Gloo sends from and receives into any
    #: memory over its sockets, so tensors are reduced where they lie: ``placement.HostPlacement``)
    pins_pages = False
    #: (piece size, alone bytes) of this transport's reductions when ``HOROVOD_CHUNK_BYTES`` is not
    #: set (``tunables.piece_sizes``): each Gloo call costs a hand-off to a process-group thread and
    #: a ring of messages, so larger pieces than MPI's 2 MiB pay, and tensors of ``alone`` bytes
    #: and more are calls of their own where they lie (copying them into large packed pieces
    #: would cost more than the calls save). docs/performance.md, "The Gloo data plane".
    piece_sizes = (GLOO_PIECE_BYTES, GLOO_ALONE_BYTES)

    def __init__(self, config: EngineConfig, rendezvous: StoreRendezvous) -> None:
        check_torch()
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self._rendezvous = rendezvous
        self.rank, self.size = rendezvous.rank, rendezvous.size
        self._timeout = datetime.timedelta(seconds=config.gloo_timeout_seconds or 30.0)
        # Reductions of one batch in flight at once (``allreduce_start``; ``buffers.run_pipelined``).
        self.pipeline = int(getattr(config, "gloo_pipeline", 2))
        self._ops = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
                     ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT}
        self._group_seq = 0
        self._bf16: bool | None = None  # ``_reduces_bfloat16``
        self._half_buf: np.ndarray | None = None  # ``_half_scratch``
        self._rs_parts = PartsBuffer()  # ``reducescatter``'s receive buffer
        # The next ``exchange_rows``' rows and its receives, posted early (``post_rows``).
        self._rows_posted: tuple[np.ndarray, list[Any]] | None = None
        self._split_seq: dict[str, int] = {}
        # Every process group and Group made here, so that close() can tear them down in order
        # while the store still exists (left to interpreter exit, a Gloo group may be destroyed
        # with its threads still running, which aborts the process).
        self._pgs: list[Any] = []
        self._groups: list[Group] = []
        # ``allreduce_start``'s works not waited for yet, by number (emptied by close()).
        self._in_flight: dict[int, Any] = {}
        self._in_flight_seq = 0
        # The job's secret where this backend has one (the device plane keys its stores with it).
        self.job_secret: str | None = rendezvous.job_secret
        # Where a job Horovod did not start met (``StoreRendezvous.launch``; the context's launch
        # takes its ports from it: ``Launch.met``).
        self.met: Launch | None = rendezvous.launch
        self._store: Any = rendezvous.store
        iface, my_addr = rendezvous.interface, rendezvous.address
        with self._translate("creating the Gloo device"):
            self._device: Any = (dist.ProcessGroupGloo.create_device(interface=iface) if iface
                                 else dist.ProcessGroupGloo.create_device(hostname=my_addr) if my_addr
                                 else dist.ProcessGroupGloo.create_default_device())
            try:
                self._world = self._make_pg("world", self.rank, self.size)
            finally:  # every rank has joined (or failed to): task 0's srun key service ends
                rendezvous.joined()
        self._world_group = Group(list(range(self.size)), self.rank, self._world)
        self._groups.append(self._world_group)

    def _make_pg(self, prefix: str, rank: int, size: int) -> Any:
        dist = self._dist
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = self._timeout
        opts._devices = [self._device]
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._store), rank, size, opts)
        self._pgs.append(pg)
        return pg

    def _translate(self, what: str) -> GlooErrors:
        return GlooErrors(what, self.rank)

    def _t(self, arr: np.ndarray) -> Any:
        if arr.dtype.char == "E":  # ml_dtypes' bfloat16, which torch.from_numpy does not know
            return self._t(arr.view(np.int16)).view(self._torch.bfloat16)
        if arr.flags.writeable:
            return self._torch.from_numpy(arr)
        # A send buffer may be read-only (pickled objects, a user's read-only array); Gloo never
        # writes to it, so torch's warning about non-writable arrays is noise, silenced here only.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                                    category=UserWarning)
            return self._torch.from_numpy(arr)

    @staticmethod
    def _bytes(arr: np.ndarray) -> np.ndarray:
        return arr.reshape(-1).view(np.uint8)

    def _run(self, what: str, fn: Callable[[], Any]) -> None:
        with self._translate(what):
            fn().wait()

    # ---------------------------------------------------------------- controller
    def and_bits(self, bits: np.ndarray, spin: bool = True) -> np.ndarray:
        out = np.ascontiguousarray(bits, dtype=np.uint64).copy()
        if self.size > 1 and out.size:
            o = self._dist.AllreduceOptions()
            o.reduceOp = self._dist.ReduceOp.BAND  # type: ignore[assignment]
            self._run("negotiation", lambda: self._world.allreduce([self._t(out.view(np.int64))], o))
        return out

    def exchange_rows(self, row: np.ndarray, post_next: int = 0) -> np.ndarray:
        """Every rank's ``row`` (bytes, the same length on every rank), as rows of a (size, len)
        array: the negotiation's one exchange when it carries data (``engine.carry``).

        Up to ``ROWS_P2P_MAX`` ranks each row goes straight to every peer (Gloo's point-to-point
        sends leave from this thread, and a receive completes on the transport's own thread: no
        hand-off to a process-group thread as a collective's, one network step); above, one
        allgather. The receives are those posted during the previous exchange when it did
        (``post_next``), else posted here. ``post_next``: the next exchange's row length (every
        rank's alike; 0: none), whose receives are posted once this rank's sends are out and
        before it waits for the peers' rows (``post_rows``): a rank that came early posts them
        while it waits anyway, off the step's critical path (Gloo matches a peer's messages of
        one tag to the receives in the order they were posted)."""
        n = row.size
        posted, self._rows_posted = self._rows_posted, None
        if posted is not None and posted[0].shape[1] != n:
            raise HorovodInternalError(
                f"Gloo negotiation on rank {self.rank}: a row of {n} bytes, but the receives posted "
                f"during the previous exchange expect {posted[0].shape[1]} (the ranks disagree on the "
                "carried capacity: an engine bug; please report it).", rank=self.rank, op="negotiation")
        out = posted[0] if posted is not None else np.empty((self.size, n), np.uint8)
        out[self.rank] = row
        if self.size == 1:
            return out
        with self._translate("negotiation"):
            if self.size > ROWS_P2P_MAX:
                self._world.allgather([[self._t(out[i]) for i in range(self.size)]],
                                      [self._t(out[self.rank])]).wait()
                return out
            src = self._t(out[self.rank])
            peers = [j for j in range(self.size) if j != self.rank]
            early = posted[1] if posted is not None else None
            posted = None  # (this frame keeps no work: see _p2p)
            _p2p(self._world, [(src, j) for j in peers],
                 [(self._t(out[j]), j) for j in peers] if early is None else [],
                 _ROWS_TAG, early, (lambda: self.post_rows(post_next)) if post_next else None)
        return out

    def post_rows(self, n: int) -> None:
        """Post the receives of the next ``exchange_rows`` now, for rows of ``n`` bytes (every rank
        posts the same ``n``: the carrier's agreed capacity, known to all a round ahead; a rank
        that posted and whose peer stopped leaves them unmatched, ended by ``close``).

        Gloo's point-to-point transfer is a rendezvous: a send leaves at once only when the
        receiver has already told the sender that its receive is posted, else the sender's
        transport thread sends the data when that notice arrives. Posted after the previous
        exchange, the notice has long reached every peer when the next round starts, so each
        row goes out from the sending thread and is received while the receiver is still busy;
        posted in the round, the rank that comes last waits for a notice to travel to a peer,
        that peer's transport thread to wake and send, and its own to receive: three thread
        wake-ups, which made it late again for the next step (docs/performance.md, "The fixed
        cost of a step on Gloo")."""
        if self.size == 1 or self.size > ROWS_P2P_MAX or self._rows_posted is not None:
            return
        out = np.empty((self.size, n), np.uint8)
        world = self._world
        with self._translate("negotiation"):
            recvs = [world.recv([self._t(out[j])], j, _ROWS_TAG) for j in range(self.size) if j != self.rank]
        self._rows_posted = (out, recvs)

    def _lengths(self, n: int, group: Group) -> np.ndarray:
        return self.allgather_ints(np.array([n], np.int64), group)[:, 0]

    # The controller's messages travel in ``horovod.common.plain`` (never pickle: a peer that
    # reached the Gloo pairs could otherwise run code in this process).
    def allgather_object(self, obj: Any) -> list[Any]:
        data = np.frombuffer(plain.dumps(obj), np.uint8)
        world = self.world_group()
        counts = [int(c) for c in self._lengths(data.size, world)]
        recv = np.empty(sum(counts), np.uint8)
        self.allgatherv(data, recv, counts, world)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        return [plain.loads(recv[offsets[i]:offsets[i + 1]]) for i in range(self.size)]

    def gather_to_root(self, obj: Any) -> list[Any] | None:
        data = np.frombuffer(plain.dumps(obj), np.uint8)
        if self.size == 1:
            return [obj]
        counts = self._lengths(data.size, self.world_group())
        width = int(counts.max())
        padded = np.zeros(width, np.uint8)
        padded[:data.size] = data
        o = self._dist.GatherOptions()
        o.rootRank = 0
        if self.rank == 0:
            outs = [np.empty(width, np.uint8) for _ in range(self.size)]
            self._run("negotiation gather",
                      lambda: self._world.gather([[self._t(x) for x in outs]], [self._t(padded)], o))
            return [plain.loads(outs[i][:counts[i]]) for i in range(self.size)]
        self._run("negotiation gather", lambda: self._world.gather([], [self._t(padded)], o))
        return None

    def bcast_from_root(self, obj: Any) -> Any:
        if self.size == 1:
            return obj
        world = self.world_group()
        data = (np.frombuffer(plain.dumps(obj), np.uint8)
                if self.rank == 0 else np.empty(0, np.uint8))
        n = np.array([data.size], np.int64)
        self.broadcast(n, 0, world)
        if self.rank != 0:
            data = np.empty(int(n[0]), np.uint8)
        else:
            data = data.copy()
        self.broadcast(data, 0, world)
        return obj if self.rank == 0 else plain.loads(data)

    # ---------------------------------------------------------------- groups
    def world_group(self) -> Group:
        return self._world_group

    def new_group(self, ranks: list[int]) -> Group:
        ranks = sorted(int(r) for r in ranks)
        self._group_seq += 1
        handle = None
        if self.rank in ranks:
            with self._translate("creating a process group"):
                handle = self._make_pg(f"group{self._group_seq}", ranks.index(self.rank), len(ranks))
        group = Group(ranks, self.rank, handle)
        self._groups.append(group)
        return group

    def split_group(self, parent: Group, colors: list[int]) -> Group:
        """This member's part of ``parent`` split by color (``colors[i]`` for ``parent.ranks[i]``).

        Made by ``parent``'s members only (each split of a parent gets its own store prefix, the
        same on every member); a negative color gives a group without handle.
        """
        key = ",".join(map(str, parent.ranks))
        seq = self._split_seq[key] = self._split_seq.get(key, 0) + 1
        color = colors[parent.rank]
        if color < 0:
            return Group([], self.rank, None)
        ranks = [r for r, c in zip(parent.ranks, colors) if c == color]
        with self._translate("creating a process group"):
            handle = self._make_pg(f"split{zlib.crc32(key.encode())}.{len(parent.ranks)}.{seq}.{color}",
                                   ranks.index(self.rank), len(ranks))
        group = Group(ranks, self.rank, handle)
        self._groups.append(group)
        return group

    def free_group(self, group: Group) -> None:
        if group.handle is not None and group.handle is not self._world:
            with contextlib.suppress(Exception):
                group.handle.shutdown()
            with contextlib.suppress(ValueError):
                self._pgs.remove(group.handle)
        group.handle = None
        with contextlib.suppress(ValueError):
            self._groups.remove(group)

    def reduce_dtypes(self) -> frozenset[str]:
        native = frozenset({"uint8", "int8", "int32", "int64", "float16", "float32", "float64"})
        return native | {"bfloat16"} if self._reduces_bfloat16() else native

    def _reduces_bfloat16(self) -> bool:
        """Whether this torch's Gloo reduces bfloat16 tensors (torch 2.x does; older releases
        raise "Invalid scalar type"): asked of a one-member group, once per backend."""
        known = self._bf16
        if known is None:
            known = self._bf16 = _gloo_reduces(self._dist, self._device, self._torch.bfloat16)
        return known

    # ---------------------------------------------------------------- collectives
    def allreduce(self, buf: np.ndarray, op: ReduceOp, group: Group,
                  src: np.ndarray | None = None) -> None:
        if src is not None:
            np.copyto(buf.reshape(-1), src.reshape(-1))
        if group.size == 1 or buf.size == 0:
            return
        if buf.size >= HALF_SPLIT_MIN and buf.dtype.char in "eE" and op in _HALF_OPS:
            self._allreduce_half(buf.reshape(-1), op, group)
            return
        if (buf.nbytes <= SMALL_P2P_BYTES and group.size <= ROWS_P2P_MAX and buf.dtype.kind in "fiu"
                and buf.dtype.char != "E"):
            self._allreduce_small(buf.reshape(-1), op, group)
            return
        o = self._dist.AllreduceOptions()
        o.reduceOp = self._ops[op]  # type: ignore[assignment]
        self._run("allreduce", lambda: group.handle.allreduce([self._t(buf.reshape(-1))], o))

    def _allreduce_small(self, buf: np.ndarray, op: ReduceOp, group: Group) -> None:
        """A small allreduce as one exchange: this member's buffer sent straight to every other
        (point-to-point sends leave from this thread; no hand-off to a process-group thread, one
        network step, where Gloo's collective takes two per peer and two thread hand-offs), then
        the members' buffers reduced here in member order: the same bits on every member."""
        p, me = group.size, group.rank
        rows = np.empty((p, buf.size), buf.dtype)
        rows[me] = buf
        src = self._t(rows[me])
        peers = [j for j in range(p) if j != me]
        with self._translate("allreduce"):
            _p2p(group.handle, [(src, j) for j in peers], [(self._t(rows[j]), j) for j in peers], _SMALL_TAG)
        LOCAL_REDUCE[op].reduce(rows, axis=0, out=buf)

    def allreduce_start(self, buf: np.ndarray, op: ReduceOp, group: Group) -> Callable[[], None]:
        """Start an in-place allreduce of ``buf`` on one of Gloo's threads and return the function
        that waits for it (the GIL is free meanwhile: the caller packs the next piece).

        ``buf`` must stay untouched until the wait returns; every member starts the same
        reductions in the same order (Gloo tags them in that order), and waits for each."""
        if group.size == 1 or buf.size == 0:
            return _done
        if buf.size >= HALF_SPLIT_MIN and buf.dtype.char in "eE" and op in _HALF_OPS:
            self._allreduce_half(buf.reshape(-1), op, group)  # two alltoalls and local work
            return _done
        o = self._dist.AllreduceOptions()
        o.reduceOp = self._ops[op]  # type: ignore[assignment]
        self._in_flight_seq = key = self._in_flight_seq + 1
        with self._translate("allreduce"):
            self._in_flight[key] = group.handle.allreduce([self._t(buf.reshape(-1))], o)
        translate, in_flight = self._translate, self._in_flight

        def wait() -> None:
            # The work (it holds the Gloo context) is referenced from ``in_flight`` only, which
            # close() empties: a wait never called (an earlier one failed) keeps no connection
            # open, nor does the frame of one that failed (no local refers to the work).
            with translate("allreduce"):
                if key in in_flight:
                    in_flight.pop(key).wait()
        return wait

    def _allreduce_half(self, buf: np.ndarray, op: ReduceOp, group: Group) -> None:
        """A large float16/bfloat16 allreduce as two alltoalls: each member sends part j of its
        buffer to member j, reduces the p parts it receives (torch's vectorized kernels,
        accumulated in float32, rounded once: ``_reduce_half_pair``, ``_reduce_half_parts``),
        and sends the result to every member, which
        receives the parts straight into place. The bytes of Gloo's ring (2(p-1)/p of the
        buffer per member); Gloo's alltoall moves them faster than its allgather (np=2, 64 MiB:
        133 against 454-488 ms, raw torch.distributed on the loaded 2-core machine)."""
        torch = self._torch
        p, me = group.size, group.rank
        base, extra = divmod(buf.size, p)
        counts = [base + (1 if i < extra else 0) for i in range(p)]
        mine = counts[me]
        pieces = self._half_scratch(buf.dtype, p * mine).reshape(p, mine)
        o = self._dist.AllToAllOptions()
        self._run("allreduce", lambda: group.handle.alltoall_base(
            self._t(pieces.reshape(-1)), self._t(buf), [mine] * p, counts, o))
        parts = self._t(pieces)
        if p == 2:
            _reduce_half_pair(torch, parts, op)
        else:
            _reduce_half_parts(torch, parts, op)
        self._run("allreduce", lambda: group.handle.alltoall_base(
            self._t(buf), self._t(pieces.reshape(-1)), counts, [mine] * p, o))

    def _half_scratch(self, dtype: np.dtype, n: int) -> np.ndarray:
        """A reusable buffer of ``n`` elements of ``dtype`` (``_allreduce_half``'s parts)."""
        buf = self._half_buf
        if buf is None or buf.nbytes < n * dtype.itemsize:
            buf = self._half_buf = np.empty(n * dtype.itemsize, np.uint8)
        return buf[:n * dtype.itemsize].view(dtype)

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int], group: Group) -> None:
        item = recv.dtype.itemsize
        out = self._bytes(recv)
        if group.size == 1:
            out[:counts[0] * item] = self._bytes(send)[:counts[0] * item]
            return
        width = max(counts) * item
        if width == 0:
            return
        nbytes = [c * item for c in counts]
        if len(set(nbytes)) == 1 and width >= P2P_ALLGATHER_MIN:
            self._allgather_p2p(self._bytes(send)[:width], out, width, group)
            return
        if len(set(nbytes)) == 1:
            # Equal parts land directly in their place in ``recv``.
            outs = [out[i * width:(i + 1) * width] for i in range(group.size)]
            inp = self._bytes(send)[:width]
        else:
            outs = [np.empty(width, np.uint8) for _ in range(group.size)]
            inp = np.zeros(width, np.uint8)
            mine = nbytes[group.rank]
            inp[:mine] = self._bytes(send)[:mine]
        self._run("allgather", lambda: group.handle.allgather([[self._t(x) for x in outs]],
                                                              [self._t(inp)]))
        if len(set(nbytes)) != 1:
            pos = 0
            for i, n in enumerate(nbytes):
                out[pos:pos + n] = outs[i][:n]
                pos += n

    def broadcast(self, buf: np.ndarray, root: int, group: Group) -> None:
        if group.size == 1 or buf.size == 0:
            return
        o = self._dist.BroadcastOptions()
        o.rootRank, o.rootTensor = root, 0
        self._run("broadcast", lambda: group.handle.broadcast([self._t(self._bytes(buf))], o))

    def alltoallv(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray,
                  recv_counts: list[int], group: Group) -> None:
        item = recv.dtype.itemsize
        if group.size == 1:
            n = send_counts[0] * item
            self._bytes(recv)[:n] = self._bytes(send)[:n]
            return
        s = [c * item for c in send_counts]
        r = [c * item for c in recv_counts]
        if min(s) > 0 and min(r) > 0:
            o = self._dist.AllToAllOptions()
            self._run("alltoall", lambda: group.handle.alltoall_base(
                self._t(self._bytes(recv)[:sum(r)]), self._t(self._bytes(send)[:sum(s)]), r, s, o))
            return
        self._alltoall_padded(send, send_counts, recv, recv_counts, group)

    def _alltoall_padded(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray,
                         recv_counts: list[int], group: Group) -> None:
        # Gloo's alltoall_base rejects zero-sized tensors, which ragged alltoalls produce; send one
        # pad byte per peer so that every rank's tensors are non-empty, and drop it on receipt.
        item = recv.dtype.itemsize
        s = [c * item for c in send_counts]
        r = [c * item for c in recv_counts]
        src = self._bytes(send)
        inp = np.zeros(sum(s) + group.size, np.uint8)
        pos_in = pos_src = 0
        for n in s:
            inp[pos_in:pos_in + n] = src[pos_src:pos_src + n]
            pos_in += n + 1
            pos_src += n
        out = np.empty(sum(r) + group.size, np.uint8)
        o = self._dist.AllToAllOptions()
        self._run("alltoall", lambda: group.handle.alltoall_base(
            self._t(out), self._t(inp), [n + 1 for n in r], [n + 1 for n in s], o))
        dst = self._bytes(recv)
        pos_out = pos_dst = 0
        for n in r:
            dst[pos_dst:pos_dst + n] = out[pos_out:pos_out + n]
            pos_out += n + 1
            pos_dst += n

    def _allgather_p2p(self, inp: np.ndarray, out: np.ndarray, width: int, group: Group) -> None:
        """Equal parts of ``width`` bytes: this member's part sent to every other member, theirs
        received straight into place (Gloo's p2p is asynchronous; pairs keep their order)."""
        me, p = group.rank, group.size
        src = self._t(inp)
        peers = [j for j in range(p) if j != me]
        out[me * width:(me + 1) * width] = inp
        with self._translate("allgather"):
            _p2p(group.handle, [(src, j) for j in peers],
                 [(self._t(out[j * width:(j + 1) * width]), j) for j in peers], _ALLGATHER_TAG)

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: list[int], op: ReduceOp,
                      group: Group) -> None:
        p = group.size
        flat = send.reshape(-1)
        if (p > 1 and min(counts) > 0 and flat.nbytes >= SPLIT_REDUCESCATTER_MIN and op in _HALF_OPS
                and flat.size == sum(counts)):
            self._reducescatter_split(flat, recv.reshape(-1), counts, op, group)
            return
        # Small or ragged: reduce everything, keep our part.
        tmp = np.array(flat, copy=True)
        self.allreduce(tmp, op, group)
        start = sum(counts[:group.rank])
        np.copyto(recv.reshape(-1)[:counts[group.rank]], tmp[start:start + counts[group.rank]])

    def _reducescatter_split(self, flat: np.ndarray, recv: np.ndarray, counts: list[int], op: ReduceOp,
                             group: Group) -> None:
        """One alltoall (member j receives every member's part j) and a local reduction of the p
        parts in member order (16-bit floats accumulated in float32, rounded once)."""
        torch = self._torch
        p, me = group.size, group.rank
        mine = counts[me]
        pieces = self._rs_parts.parts(p, mine, flat.dtype)
        o = self._dist.AllToAllOptions()
        self._run("reducescatter", lambda: group.handle.alltoall_base(
            self._t(pieces.reshape(-1)), self._t(flat), [mine] * p, counts, o))
        parts, dst = self._t(pieces), self._t(recv[:mine])
        half = flat.dtype.char in "eE"
        if op == ReduceOp.SUM:
            if half:
                dst.copy_(parts.sum(0, dtype=torch.float32))
            else:
                torch.sum(parts, 0, dtype=dst.dtype, out=dst)
        elif op == ReduceOp.PRODUCT:
            if half:
                dst.copy_(parts.prod(0, dtype=torch.float32))
            else:
                torch.prod(parts, 0, dtype=dst.dtype, out=dst)
        else:
            (torch.amin if op == ReduceOp.MIN else torch.amax)(parts, 0, out=dst)

    def allgather_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        values = np.ascontiguousarray(values, np.int64).reshape(-1)
        out = np.empty((group.size, values.size), np.int64)
        self.allgatherv(values, out.reshape(-1), [values.size] * group.size, group)
        return out

    def alltoall_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        values = np.ascontiguousarray(values, np.int64).reshape(-1)
        out = np.empty(group.size, np.int64)
        self.alltoallv(values, [1] * group.size, out, [1] * group.size, group)
        return out

    def barrier(self, group: Group) -> None:
        if group.size == 1:
            return
        # An allreduce of one value, not pg.barrier(): Gloo's barrier keeps no ordering with
        # other collectives issued on the same group, an allreduce does.
        self.allreduce(np.zeros(1, np.int32), ReduceOp.SUM, group)

    def sendrecv(self, send: np.ndarray, recv: np.ndarray, peer: int, group: Group) -> None:
        with self._translate("sendrecv"):  # Gloo's send is asynchronous: no ordering by rank needed
            _p2p(group.handle, [(self._t(self._bytes(send)), peer)] if send.size else [],
                 [(self._t(self._bytes(recv)), peer)] if recv.size else [], 0)

    def close(self) -> None:
        # Groups first (their handles are the only other references to the process groups),
        # then the process groups, then the store: each is destroyed here, in this order, not
        # at interpreter exit.
        for group in self._groups:
            group.handle = None
        self._groups.clear()
        self._in_flight.clear()
        self._rows_posted = None  # (receives never matched: the groups' shutdown ends them)
        for pg in reversed(self._pgs):
            with contextlib.suppress(Exception):
                pg.shutdown()
        self._pgs.clear()
        self._world = None
        self._device = None
        self._rendezvous.close()
        self._store = None

