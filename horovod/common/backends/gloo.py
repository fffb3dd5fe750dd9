"""Gloo through ``torch.distributed``: negotiation and CPU collectives on NumPy buffers.

Workers started by ``horovodrun --gloo`` (or ``horovod.run(..., use_gloo=True)``) find each other
like this: rank 0 opens an authenticated store (``horovod.common.backends.authstore``: every
connection and request HMAC-checked with a key derived from the job secret, listening on the
job's interface only) on a free port and publishes its address through the launcher's rendezvous
service; the other ranks read it there. Requests to that service
are HMAC-signed with the job secret (``HOROVOD_SECRET_KEY``) and its answers are checked the same
way (protocol: ``horovod.common.rendezvous``), so a worker never connects to an address it did not
get from its own launcher. In an elastic job (``HOROVOD_ELASTIC=1``) every ``init()`` first asks
the elastic driver for this worker's place in the next round (``horovod.common.elastic.worker``)
and meets the round's other members under that round's scope. Process groups are ``ProcessGroupGloo`` objects made
directly on that store, without torch's global default group, so ``hvd.init(); hvd.shutdown();
hvd.init()`` works and nothing leaks into a user's own ``torch.distributed`` use.

Workers started by another launcher (``horovod.common.launcher``: torchrun, an initialised torch
group, srun) meet on that launcher's store instead, under a ``horovod/...`` key prefix; under srun
task 0 opens the authenticated store on the step's first node (docs/launcher.md).

Buffers are handed to Gloo through ``torch.from_numpy`` (no copy). Data-movement collectives
(allgather, broadcast, alltoall) run on a byte view of the buffer, so every dtype works; reductions
use the buffer's own dtype (see ``reduce_dtypes``). PyTorch is imported only when this backend is
created.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import logging
import os
import socket
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from horovod.common import launcher as _launcher
from horovod.common import plain, slurm_secret
from horovod.common.backends import authstore
from horovod.common.backends.base import Group
from horovod.common.config import EngineConfig
from horovod.common.elastic import worker as elastic_worker
from horovod.common.exceptions import BackendUnavailableError, HorovodInternalError
from horovod.common.rendezvous import RendezvousClient, RendezvousError, sign_request, sign_response
from horovod.common.types import ReduceOp

__all__ = ["GlooBackend", "create", "sign_request", "sign_response"]

log = logging.getLogger("horovod")

# One rendezvous scope per backend created in this process: every rank creates its backends in
# the same order (init, shutdown, init ...), so the n-th init of every rank meets the others'.
_INIT_SEQUENCE = itertools.count()
# Likewise for the stores of jobs Horovod did not start (every rank counts its inits alike).
_JOIN_SEQUENCE = itertools.count()


# --------------------------------------------------------------------- rendezvous client
class _Rendezvous:
    """The two calls the backend needs from the launcher's service: put and wait-for a key."""

    def __init__(self, addr: str, port: int, secret: str, rank: int) -> None:
        self.client = RendezvousClient(addr, port, secret)
        self.addr, self.port, self.rank = addr, port, rank

    def put(self, scope: str, key: str, value: bytes) -> None:
        try:
            self.client.put(scope, key, value)
        except RendezvousError as exc:
            raise HorovodInternalError(f"Gloo rendezvous: rank {self.rank}: {exc}",
                                       rank=self.rank) from exc

    def wait(self, scope: str, key: str, timeout: float) -> bytes:
        try:
            value = self.client.wait(scope, key, timeout)
        except RendezvousError as exc:
            if getattr(exc, "key", None) == key:
                raise HorovodInternalError(
                    f"Gloo rendezvous: rank {self.rank} waited {timeout:g} s for rank 0 to publish "
                    f"its store address ({scope}/{key}). Did rank 0 start? Raise "
                    "HOROVOD_GLOO_TIMEOUT_SECONDS if start-up is slow.", rank=self.rank) from exc
            if getattr(exc, "refused", False):
                raise HorovodInternalError(
                    f"Gloo rendezvous: the launcher at {self.addr}:{self.port} refused rank "
                    f"{self.rank} (wrong HOROVOD_SECRET_KEY: this process belongs to another job).",
                    rank=self.rank) from exc
            raise HorovodInternalError(
                f"Gloo rendezvous: rank {self.rank} cannot use the launcher's service at "
                f"{self.addr}:{self.port}: {exc}. Check that this host can reach that address "
                "(horovodrun --network-interfaces selects it).", rank=self.rank) from exc
        if value == ABANDONED:
            raise HorovodInternalError(
                f"Gloo rendezvous: round {scope} was abandoned by the elastic driver (a member "
                "left before it formed).", rank=self.rank)
        return value


# What the elastic driver writes under a round's store key when a member left before it formed.
ABANDONED = b"abandoned"


def _local_address(environ: Mapping[str, str], rendezvous_addr: str) -> str:
    """The address the other ranks can reach this one at."""
    iface = environ.get("HOROVOD_GLOO_IFACE")
    if iface:
        import psutil

        for entry in psutil.net_if_addrs().get(iface, []):
            if entry.family == socket.AF_INET:
                return str(entry.address)
        raise BackendUnavailableError(f"HOROVOD_GLOO_IFACE={iface!r}: no such interface with an IPv4 "
                                      "address on this host.", backend="gloo")
    # The interface that routes to the launcher is the one the job's hosts share.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((rendezvous_addr, 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


# --------------------------------------------------------------------------- backend
class GlooBackend:
    """Controller and collective backend on ``torch.distributed`` Gloo process groups."""

    name = "gloo"

    def __init__(self, config: EngineConfig, environ: Mapping[str, str],
                 round_info: elastic_worker.RoundInfo | None = None,
                 launch: _launcher.Launch | None = None,
                 cancel: elastic_worker.Cancel | None = None) -> None:
        try:
            import torch
            import torch.distributed as dist
        except ImportError as exc:
            raise BackendUnavailableError(
                f"The Gloo transport needs PyTorch, which cannot be imported here ({exc}). Install it "
                "(pip install 'horovod-py[torch]') or start the job with MPI (horovodrun --mpi).",
                backend="gloo") from exc
        if not dist.is_available() or not dist.is_gloo_available():
            raise BackendUnavailableError("This PyTorch build has no torch.distributed Gloo support; "
                                          "use a standard PyTorch wheel or MPI.", backend="gloo")
        self._torch, self._dist = torch, dist
        self._launch = launch or _launcher.Launch("horovod", "gloo")
        try:
            self.rank = int(environ.get("HOROVOD_RANK", "0"))
            self.size = int(environ.get("HOROVOD_SIZE", "1"))
            if self._launch.launcher != "horovod":
                self.rank, self.size = self._launch.rank or 0, self._launch.size or 1
            if round_info is not None:
                self.rank, self.size = round_info.slot.rank, round_info.slot.size
        except ValueError as exc:
            raise BackendUnavailableError(f"HOROVOD_RANK/HOROVOD_SIZE are not integers: {exc}",
                                          backend="gloo") from exc
        self._timeout = datetime.timedelta(seconds=config.gloo_timeout_seconds or 30.0)
        self._ops = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
                     ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT}
        self._group_seq = 0
        self._split_seq: dict[str, int] = {}
        # Every process group and Group made here, so that close() can tear them down in order
        # while the store still exists (left to interpreter exit, a Gloo group may be destroyed
        # with its threads still running, which aborts the process).
        self._pgs: list[Any] = []
        self._groups: list[Group] = []
        # The job's secret where this backend has one (the device plane keys its stores with it).
        self.job_secret: str | None = environ.get("HOROVOD_SECRET_KEY") or None
        self._key_service: slurm_secret.KeyService | None = None
        scope = f"gloo.{next(_INIT_SEQUENCE)}"
        if round_info is not None:
            scope = f"elastic.{round_info.round}"
        if self.size == 1:
            self._store: Any = dist.HashStore()
            my_addr = "127.0.0.1"
        elif self._launch.launcher == "horovod":
            self._store, my_addr = self._connect_store(environ, scope)
            if cancel is not None:  # an abandoned elastic round: its waits on the store end now
                cancel.on_cancel(self._store.close)
        else:
            self._store, my_addr = self._join_store(environ, self._launch)
        iface = environ.get("HOROVOD_GLOO_IFACE")
        with self._translate("creating the Gloo device"):
            self._device: Any = (dist.ProcessGroupGloo.create_device(interface=iface) if iface
                                 else dist.ProcessGroupGloo.create_device(hostname=my_addr) if my_addr
                                 else dist.ProcessGroupGloo.create_default_device())
            try:
                self._world = self._make_pg("world", self.rank, self.size)
            finally:  # every rank has joined (or failed to): task 0's srun key service ends
                self._close_key_service()
        self._world_group = Group(list(range(self.size)), self.rank, self._world)
        self._groups.append(self._world_group)

    def _connect_store(self, environ: Mapping[str, str], scope: str) -> tuple[Any, str]:
        try:
            addr = environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"]
            port = int(environ["HOROVOD_GLOO_RENDEZVOUS_PORT"])
            secret = environ["HOROVOD_SECRET_KEY"]
        except (KeyError, ValueError) as exc:
            raise BackendUnavailableError(
                f"Gloo needs HOROVOD_GLOO_RENDEZVOUS_ADDR, HOROVOD_GLOO_RENDEZVOUS_PORT and "
                f"HOROVOD_SECRET_KEY ({exc} is missing or invalid): start the job with "
                "horovodrun --gloo or horovod.run(..., use_gloo=True).", backend="gloo") from exc
        rdv = _Rendezvous(addr, port, secret, self.rank)
        my_addr = _local_address(environ, addr)
        wait = self._timeout.total_seconds()
        key = authstore.derive_key(secret)
        with self._translate("connecting to the job's store"):
            if self.rank == 0:
                store = authstore.open_store(my_addr, key, wait)
                rdv.put(scope, "store", f"{my_addr}:{store.server.port}".encode())
            else:
                host, _, p = rdv.wait(scope, "store", wait).decode().rpartition(":")
                store = authstore.connect_store(host, int(p), key, wait)
        return store, my_addr

    def _join_store(self, environ: Mapping[str, str], launch: _launcher.Launch) -> tuple[Any, str]:
        """The store of a job Horovod did not start (torchrun, a torch group, srun): see docs/launcher.md."""
        dist = self._dist
        wait = self._timeout.total_seconds()
        seen = ", ".join(f"{k}={v}" for k, v in launch.seen.items())
        seq = next(_JOIN_SEQUENCE)
        prefix = f"horovod/{launch.scope}/{seq}"
        try:
            if launch.launcher == "torch-group":
                store = dist.distributed_c10d._get_default_store()
                addr = launch.master_addr or environ.get("MASTER_ADDR")
                my_addr = _local_address(environ, addr) if addr else ""
            elif launch.launcher == "torchrun":
                assert launch.master_addr and launch.master_port
                my_addr = _local_address(environ, launch.master_addr)
                # torchrun's agent serves the store (TORCHELASTIC_USE_AGENT_STORE); a plain
                # RANK/WORLD_SIZE environment means rank 0 opens it, as torch's env:// does:
                # Horovod's authenticated store when the ranks share HOROVOD_SECRET_KEY, else
                # torch's TCPStore (every interface, anybody: docs/security.md).
                if not launch.master_is_store and self.job_secret:
                    key = authstore.derive_key(self.job_secret)
                    if self.rank == 0:
                        host = socket.gethostbyname(launch.master_addr)
                        store = authstore.open_store(host, key, wait, port=launch.master_port)
                    else:
                        store = authstore.connect_store(launch.master_addr, launch.master_port, key, wait)
                else:
                    master = self.rank == 0 and not launch.master_is_store
                    if master:
                        log.warning("rank 0 opens torch's TCPStore on port %d of every interface, which "
                                    "anybody who reaches it can read and write; export the same "
                                    "HOROVOD_SECRET_KEY=$(python -m horovod.runner.secret) to every rank "
                                    "to use Horovod's authenticated store (docs/security.md)",
                                    launch.master_port)
                    store = dist.TCPStore(launch.master_addr, launch.master_port, self.size, master,
                                          timeout=self._timeout, wait_for_workers=False)
            else:  # slurm: task 0 opens an authenticated store on the step's first node
                assert launch.master_addr and launch.master_port
                my_addr = _local_address(environ, launch.master_addr)
                host = socket.gethostbyname(launch.master_addr) if self.rank == 0 else launch.master_addr
                # The step's secret: HOROVOD_SECRET_KEY, else one only this user can get (MUNGE or
                # a private key file), else a LauncherError (horovod.common.slurm_secret).
                self.job_secret, self._key_service = slurm_secret.step_secret(
                    environ, launch, self.rank, host, wait, seq)
                key = authstore.derive_key(self.job_secret)
                if self.rank == 0:
                    store = authstore.open_store(host, key, wait, port=launch.master_port)
                else:
                    store = authstore.connect_store(launch.master_addr, launch.master_port, key, wait)
        except _launcher.LauncherError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError subclasses, OSError...
            self._close_key_service()
            raise _launcher.LauncherError(
                f"Rank {self.rank} of a job started by {launch.launcher} cannot reach the job's "
                f"store at {launch.master_addr}:{launch.master_port} within {wait:g} s ({exc}). "
                f"Variables seen: {seen or 'none'}. Check MASTER_ADDR/MASTER_PORT (or the first node "
                "of SLURM_STEP_NODELIST), that HOROVOD_SECRET_KEY is exported to every rank or to none, "
                "and that rank 0 runs; raise HOROVOD_GLOO_TIMEOUT_SECONDS if "
                "start-up is slow.", rank=self.rank, launcher=launch.launcher) from exc
        # A Python store lives only while its Python object does: keep it beside the prefix store.
        self._joined_store = store
        return dist.PrefixStore(prefix, store), my_addr

    def _close_key_service(self) -> None:
        if self._key_service is not None:
            self._key_service.close()
            self._key_service = None

    def _make_pg(self, prefix: str, rank: int, size: int) -> Any:
        dist = self._dist
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = self._timeout
        opts._devices = [self._device]
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._store), rank, size, opts)
        self._pgs.append(pg)
        return pg

    @contextlib.contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        """The one place where torch/Gloo errors become Horovod errors."""
        try:
            yield
        except HorovodInternalError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError subclasses and others
            raise HorovodInternalError(
                f"Gloo {what} failed on rank {self.rank}: {exc}. A peer process may have died; "
                "check the other ranks' output.", rank=self.rank, op=what) from exc

    def _t(self, arr: np.ndarray) -> Any:
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
        return frozenset({"uint8", "int8", "int32", "int64", "float16", "float32", "float64"})

    # ---------------------------------------------------------------- collectives
    def allreduce(self, buf: np.ndarray, op: ReduceOp, group: Group,
                  src: np.ndarray | None = None) -> None:
        if src is not None:
            np.copyto(buf.reshape(-1), src.reshape(-1))
        if group.size == 1 or buf.size == 0:
            return
        o = self._dist.AllreduceOptions()
        o.reduceOp = self._ops[op]  # type: ignore[assignment]
        self._run("allreduce", lambda: group.handle.allreduce([self._t(buf.reshape(-1))], o))

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

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: list[int], op: ReduceOp,
                      group: Group) -> None:
        # Gloo has no reduce-scatter for CPU tensors here: reduce everything, keep our part.
        tmp = np.array(send.reshape(-1), copy=True)
        self.allreduce(tmp, op, group)
        start = sum(counts[:group.rank])
        np.copyto(recv.reshape(-1)[:counts[group.rank]], tmp[start:start + counts[group.rank]])

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
            s = group.handle.send([self._t(self._bytes(send))], peer, 0) if send.size else None
            if recv.size:
                group.handle.recv([self._t(self._bytes(recv))], peer, 0).wait()
            if s is not None:
                s.wait()

    def close(self) -> None:
        # Groups first (their handles are the only other references to the process groups),
        # then the process groups, then the store: each is destroyed here, in this order, not
        # at interpreter exit.
        for group in self._groups:
            group.handle = None
        self._groups.clear()
        for pg in reversed(self._pgs):
            with contextlib.suppress(Exception):
                pg.shutdown()
        self._pgs.clear()
        self._world = None
        self._device = None
        self._close_key_service()
        for store in (self._store, getattr(self, "_joined_store", None)):
            if isinstance(store, authstore.torch_store_type()):
                store.close()
        self._store = self._joined_store = None


def create(config: EngineConfig, environ: Mapping[str, str], comm: Any = None) -> GlooBackend:
    """Make the Gloo backend for this worker (see the module docstring for how ranks meet).

    Raises:
        BackendUnavailableError: PyTorch is missing, or the process was not started by a Gloo
            launcher (no rendezvous variables).
        HorovodInternalError: the rendezvous or the store connection failed.
        ValueError: ``comm`` was given (sub-communicators need MPI).
    """
    if comm is not None:
        raise ValueError("hvd.init(comm=...) needs MPI; under Gloo every started process joins the "
                         "job (use process sets for subsets).")
    environ = os.environ if environ is None else environ
    launch = _launcher.detect(environ, _launcher.torch_default_group())
    if launch.launcher in ("torchrun", "torch-group", "slurm") and (launch.size or 1) > 1:
        return GlooBackend(config, environ, launch=launch)
    if not elastic_worker.is_elastic(environ):
        return GlooBackend(config, environ)
    # Elastic: join the driver's next round; a round that fails to form (a member died while it
    # formed) is left for the next one, so a failure elsewhere never crashes this worker.
    client = RendezvousClient.from_env(environ)
    while True:
        info = elastic_worker.join_round(client, environ)  # type: ignore[arg-type]
        try:
            # Waits on the round's members (store, Gloo device, process group) end within a
            # fraction of a second when the driver abandons the round (a member died or left).
            cancel = elastic_worker.Cancel()
            return elastic_worker.form_round(
                functools.partial(GlooBackend, config, environ, info, cancel=cancel), client, info,
                close=GlooBackend.close, cancel=cancel)
        except HorovodInternalError as exc:
            log.warning("elastic: round %d did not form (%s); asking the driver for the next one",
                        info.round, exc)
            elastic_worker.set_ready_reason("retry")
