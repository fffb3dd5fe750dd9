"""The torch device plane: the lane that runs Horovod's batches on torch tensors where they live.

CUDA tensors run on ``torch.distributed`` NCCL process groups; CPU tensors, when
``HOROVOD_TORCH_CPU_PLANE=1``, on Gloo process groups (the CPU twin that tests this path without a
GPU). The engine negotiates, caches, plans, fuses and executes every operation as for host tensors
(``horovod.common.engine.executor``); this module only supplies the lane (``TorchPlane.lane``):

* ``TorchBuffers`` (``_torch_buffers``) on the batch's device, its fusion buffers kept per dtype;
* ``TorchTransport``: the set's process group, one per process set and device kind, made when the
  set first runs a plane batch (all of its members run the same batch, so they make it together).
  Its store is an authenticated store (``horovod.common.backends.authstore``) opened by the set's
  first member, whose ticket travels over the job's CPU transport; no ``torch.distributed``
  default group is created, so a user's own use is untouched. ``translating`` is the one place
  where torch.distributed errors become Horovod errors;
* stream ordering (CUDA, ``_device_tensor``): the plane's stream waits for the callers' ready
  events, runs the batch and records the ``done`` event their streams wait for; tensors used on
  both streams are marked with ``record_stream`` so the caching allocator never reuses them early.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from horovod.common.backends import authstore
from horovod.common.backends.base import Group
from horovod.common.engine.device import DevicePlaneError, PlaneServices, register_plane
from horovod.common.engine.placement import DevicePlacement
from horovod.common.engine.transport import Lane
from horovod.common.types import ReduceOp, Response
from horovod.torch._device_tensor import (  # noqa: F401 - re-exported for the binding
    DeviceTensor,
    join_device,
    latest_ready,
    set_join_device,
    unwrap,
    user_tensors,
    wait_done,
)
from horovod.torch._torch_buffers import TorchBuffers

__all__ = ["DeviceTensor", "TorchBuffers", "TorchPlane", "TorchTransport", "PLANE_CPU", "PLANE_CUDA",
           "set_join_device", "wait_done"]

PLANE_CPU = "torch:cpu"
PLANE_CUDA = "torch:cuda"

_TORCH_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
              ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT}
# What NCCL and Gloo reduce on torch tensors (int16 and bool are widened by the executor's rule).
_NATIVE = frozenset({"uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64"})


class TorchTransport:
    """``Transport`` on one process set's torch process group (NCCL on CUDA, Gloo on the CPU twin).

    Small exchanges (first dimensions, splits) travel over the job's CPU backend: sizing outputs
    needs no device synchronisation.
    """

    native = _NATIVE

    def __init__(self, pg: Any, nccl: bool, group: Group, backend: Any) -> None:
        self.pg, self.nccl, self.group, self._backend = pg, nccl, group, backend
        self.name = "NCCL" if nccl else "GLOO"

    @contextlib.contextmanager
    def translating(self, what: str) -> Iterator[None]:
        """The one place where torch.distributed errors become Horovod errors."""
        with _translating(what, self.group):
            yield

    def reducer(self, op: ReduceOp) -> Callable[[torch.Tensor], None]:
        return lambda t: self._reduce(t, op)

    def _reduce(self, t: torch.Tensor, op: ReduceOp) -> None:
        if t.numel() == 0 or self.group.size == 1:  # a set of one: the reduction is the identity
            return
        o = dist.AllreduceOptions()
        o.reduceOp = _TORCH_OPS[op]  # type: ignore[assignment]
        self.pg.allreduce([t], o).wait()

    def broadcast(self, buf: torch.Tensor, root: int) -> None:
        o = dist.BroadcastOptions()
        o.rootRank, o.rootTensor = root, 0
        self.pg.broadcast([buf], o).wait()

    def allgatherv(self, send: torch.Tensor, recv: torch.Tensor, counts: list[int]) -> None:
        width = max(counts)
        if not width:
            return
        if len(set(counts)) == 1:  # equal parts land directly in their place
            self.pg.allgather([list(recv.split(width))], [send]).wait()
            return
        inp = torch.zeros(width, dtype=send.dtype, device=send.device)
        inp[:send.numel()].copy_(send)
        outs = [torch.empty(width, dtype=send.dtype, device=send.device) for _ in range(self.group.size)]
        self.pg.allgather([outs], [inp]).wait()
        torch.cat([o[:c] for o, c in zip(outs, counts)], out=recv)

    def alltoallv(self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor,
                  recv_counts: list[int]) -> None:
        self.pg.alltoall_base(recv, send, recv_counts, send_counts, dist.AllToAllOptions()).wait()

    def reducescatter(self, send: torch.Tensor, recv: torch.Tensor, counts: list[int], op: ReduceOp,
                      scratch: bool) -> None:
        if self.nccl and len(set(counts)) == 1 and send.numel():
            o = dist.ReduceScatterOptions()
            o.reduceOp = _TORCH_OPS[op]  # type: ignore[assignment]
            self.pg._reduce_scatter_base(recv, send, o).wait()
            return
        # Gloo has no reduce-scatter on CPU tensors (and NCCL wants equal parts): reduce, keep ours.
        whole = send if scratch else send.clone()
        self._reduce(whole, op)
        start = sum(counts[:self.group.rank])
        recv.copy_(whole[start:start + counts[self.group.rank]])

    def allgather_ints(self, values: np.ndarray) -> np.ndarray:
        return self._backend.allgather_ints(values, self.group)

    def alltoall_ints(self, values: np.ndarray) -> np.ndarray:
        return self._backend.alltoall_ints(values, self.group)


@contextlib.contextmanager
def _translating(what: str, group: Group) -> Iterator[None]:
    try:
        yield
    except DevicePlaneError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError subclasses and others
        rank = group.ranks[group.rank] if group.rank >= 0 else -1
        raise DevicePlaneError(f"torch.distributed {what} failed on rank {rank}: {exc}",
                               rank=rank, op=what) from exc


class TorchPlane:
    """Supplies the lanes of torch tensors' batches (see the module docstring)."""

    def __init__(self, services: PlaneServices) -> None:
        self._services = services
        self._placement = DevicePlacement()
        self._buffers: dict[torch.device, TorchBuffers] = {}
        self._stores: dict[Group, Any] = {}
        self._transports: dict[tuple[Group, bool], TorchTransport] = {}
        self._streams: dict[torch.device, Any] = {}
        self._seq = 0
        self._last_cuda: torch.device | None = None

    # ------------------------------------------------------------------ the lane
    @contextlib.contextmanager
    def lane(self, batch: Sequence[Response], entries: Sequence[Any], group: Group) -> Iterator[Lane]:
        device = self._device(batch[0].request.device, entries)
        # The wrappers' events order CUDA streams; the CPU twin has none to read.
        wrappers = [w for e in entries if e is not None for w in e.inputs] if device.type == "cuda" else []
        with self._on_stream(device, wrappers) as stream:
            tr = self._transport(group, device)  # with the GPU current, as NCCL binds it on first use
            ops = self._buffers.get(device)
            if ops is None:
                ops = self._buffers[device] = TorchBuffers(device)
            with tr.translating(batch[0].request.kind.value):
                yield Lane(ops, tr, self._placement, 0, False)
            if stream is not None:
                done = torch.cuda.Event()
                done.record(stream)
                for w in wrappers:
                    w.done = done
                    if w.parent is not None:
                        w.parent.done = done
                for e in entries:
                    for t in user_tensors(e):
                        t.record_stream(stream)

    def _device(self, tag: str, entries: Sequence[Any]) -> torch.device:
        for e in entries:
            if e is not None and e.inputs:
                dev = unwrap(e.inputs[0]).device
                if dev.type == "cuda":
                    self._last_cuda = dev
                return dev
        if tag != PLANE_CUDA:
            return torch.device("cpu")
        # A joined rank with nothing of its own in this batch: zeros on its GPU.
        joined = join_device() or self._last_cuda
        return joined if joined is not None else torch.device("cuda", torch.cuda.current_device())

    @contextlib.contextmanager
    def _on_stream(self, device: torch.device, wrappers: Sequence[DeviceTensor]) -> Iterator[Any]:
        if device.type != "cuda":
            yield None
            return
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            for ready in latest_ready(wrappers):
                stream.wait_event(ready)
            yield stream

    # ------------------------------------------------------------------ process groups
    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self._services.timeout_s or 30.0)

    def _address(self, group: Group) -> str:
        hosts = self._services.hostnames
        if hosts is None or len({hosts[r] for r in group.ranks}) == 1:
            return "127.0.0.1"
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"

    def _store(self, group: Group) -> Any:
        store = self._stores.get(group)
        if store is not None:
            return store
        if group.size == 1:
            store = dist.HashStore()
        else:
            # The set's first member opens the store; its ticket travels over the CPU transport.
            msg = np.zeros(256, np.uint8)
            secret, timeout = self._services.secret, self._timeout().total_seconds()
            if group.rank == 0:
                store, text = authstore.open_for_members(self._address(group), timeout, secret)
                msg[:len(text)] = np.frombuffer(text, np.uint8)
            self._services.backend.broadcast(msg, 0, group)
            if group.rank != 0:
                store = authstore.join_members(msg.tobytes().rstrip(b"\0"), timeout, secret)
        self._stores[group] = store
        return store

    def _transport(self, group: Group, device: torch.device) -> TorchTransport:
        nccl = device.type == "cuda"
        tr = self._transports.get((group, nccl))
        if tr is not None:
            return tr
        self._seq += 1
        store = dist.PrefixStore(f"plane.{'nccl' if nccl else 'gloo'}.{self._seq}", self._store(group))
        pg: Any
        with _translating("creating a process group", group):
            if nccl:
                self._check_distinct_gpus(group, device)
                opts = dist.ProcessGroupNCCL.Options()
                opts.is_high_priority_stream = False
                # NCCL's watchdog timeout covers one collective once every member has submitted it
                # (the engine negotiated that), plus the communicator's first set-up: torch's default.
                opts._timeout = max(self._timeout(), datetime.timedelta(minutes=10))
                pg = dist.ProcessGroupNCCL(store, group.rank, group.size, opts)
            else:
                gopts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                gopts._timeout = self._timeout()
                gopts._devices = [dist.ProcessGroupGloo.create_device(hostname=self._address(group))]
                pg = dist.ProcessGroupGloo(store, group.rank, group.size, gopts)
        tr = self._transports[(group, nccl)] = TorchTransport(pg, nccl, group, self._services.backend)
        return tr

    def _check_distinct_gpus(self, group: Group, device: torch.device) -> None:
        """NCCL refuses two ranks of a communicator on one GPU: say so, naming the ranks."""
        host = zlib.crc32(socket.gethostname().encode())
        seen = self._services.backend.allgather_ints(np.array([host, device.index or 0], np.int64), group)
        where: dict[tuple[int, int], list[int]] = {}
        for i, (h, d) in enumerate(seen.tolist()):
            where.setdefault((h, d), []).append(group.ranks[i])
        shared = [(d, ranks) for (_, d), ranks in where.items() if len(ranks) > 1]
        if shared:
            d, ranks = shared[0]
            raise DevicePlaneError(
                f"ranks {ranks} use the same GPU (cuda:{d} of one host); NCCL needs one GPU per rank. "
                "Pin each process to its own GPU with torch.cuda.set_device(hvd.local_rank()), or "
                "stage GPU tensors through host memory with HOROVOD_GPU_OPERATIONS=MPI (or GLOO).",
                ranks=ranks, op="nccl")

    # ------------------------------------------------------------------ teardown
    def free_group(self, group: Group) -> None:
        for key in [k for k in self._transports if k[0] is group]:
            with contextlib.suppress(Exception):
                self._transports.pop(key).pg.shutdown()
        self._stores.pop(group, None)

    def close(self) -> None:
        transports, self._transports = self._transports, {}
        for tr in transports.values():
            with contextlib.suppress(Exception):
                tr.pg.shutdown()
        self._stores.clear()
        self._buffers.clear()
        self._streams.clear()


register_plane("torch", TorchPlane)
