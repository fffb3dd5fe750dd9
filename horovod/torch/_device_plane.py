"""The torch device plane: Horovod's batches executed on torch tensors where they live.

CUDA tensors run on ``torch.distributed`` NCCL process groups; CPU tensors, when
``HOROVOD_TORCH_CPU_PLANE=1``, run the same code on Gloo process groups (the CPU twin that tests
this path on machines without a GPU). The engine negotiates, caches, plans and fuses exactly as for
host tensors; this module only executes a planned batch (``TorchPlane.run``, on the engine thread):

* **Fusion on the device.** Tensors of at most ``HOROVOD_FUSION_MAX_TENSOR_BYTES`` in a batch are
  packed into one fusion buffer per (device, dtype), kept across batches and grown when needed;
  larger tensors are reduced in place in their output.
* **Process groups.** One per Horovod process set and device kind, made when the set first runs a
  plane batch (all of its members run the same batch, so they make it together). Its store is an
  authenticated store (``horovod.common.backends.authstore``) opened by the set's first member,
  whose address (and key, where the job has no secret) travels over the job's CPU transport; no
  ``torch.distributed`` default group is created, so a user's own use is untouched.
* **Stream ordering (CUDA).** The caller records an event on its current stream when it submits
  (``DeviceTensor.ready``); the plane's communication stream waits for it, runs the fusion copies
  and the collective, and records ``DeviceTensor.done``; the caller's stream waits for that in
  ``synchronize`` (no ``torch.cuda.synchronize()``). Tensors used on both streams are marked with
  ``record_stream`` so the caching allocator never hands their memory out early. On the CPU twin
  every ordering hook is a no-op.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from horovod.common.backends import authstore
from horovod.common.backends.base import Group
from horovod.common.context import peek_context
from horovod.common.engine.device import DevicePlaneError, register_plane
from horovod.common.engine.executor import _post_factors, reducescatter_rows
from horovod.common.types import ReduceOp, RequestType, Response

__all__ = ["DeviceTensor", "TorchPlane", "PLANE_CPU", "PLANE_CUDA", "set_join_device", "wait_done"]

PLANE_CPU = "torch:cpu"
PLANE_CUDA = "torch:cuda"

_TORCH_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
              ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT}
# Reductions neither NCCL nor Gloo have run in a wider dtype; bool is reduced as uint8 with
# logical semantics (Sum/Max = or, Min/Product = and).
_WORK = {torch.int16: torch.int32, torch.bool: torch.uint8}
_BOOL_OPS = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.MAX: ReduceOp.MAX, ReduceOp.MIN: ReduceOp.MIN,
             ReduceOp.PRODUCT: ReduceOp.MIN}

# Timeline activity names, as upstream's (NCCL_ALLREDUCE, NCCL_BCAST, GLOO_ALLGATHER ...).
_ACTIVITY = {RequestType.BROADCAST: "BCAST"}

_join_device: list[torch.device | None] = [None]


def set_join_device(device: int) -> None:
    """Where a joined rank makes its zero contributions to CUDA allreduces (``hvd.join(device)``)."""
    _join_device[0] = torch.device("cuda", device) if device >= 0 else None


class DeviceTensor:
    """A torch tensor handed to the engine for the plane, with its ordering events.

    Carries what the engine's checks read (``shape``, ``dtype`` name, ``ndim``) so that the core
    treats it like an array without knowing torch.
    """

    __slots__ = ("tensor", "shape", "dtype", "ndim", "ready", "done", "parent")

    def __init__(self, tensor: torch.Tensor, ready: Any = None, parent: DeviceTensor | None = None) -> None:
        self.tensor = tensor
        self.parent = parent  # the wrapper this one slices (the caller waits on that one)
        self.shape = tuple(tensor.shape)
        self.dtype = str(tensor.dtype).rpartition(".")[2]
        self.ndim = tensor.dim()
        self.ready = ready
        self.done: Any = None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> DeviceTensor:
        """Wrap ``tensor``; on CUDA, mark the point of the caller's stream where it is ready."""
        ready = None
        if tensor.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
        return cls(tensor, ready)

    def __getitem__(self, index: Any) -> DeviceTensor:
        return DeviceTensor(self.tensor[index], self.ready, self)


def wait_done(wrappers: Sequence[DeviceTensor], outputs: Sequence[torch.Tensor]) -> None:
    """In the caller's thread: make its current stream wait for the plane's work on ``wrappers``.

    Outputs the plane allocated are marked as used on the caller's stream.
    """
    for w in wrappers:
        if w.done is not None:
            stream = torch.cuda.current_stream(w.tensor.device)
            stream.wait_event(w.done)
            for o in outputs:
                if o.is_cuda:
                    o.record_stream(stream)
            return


def _unwrap(x: Any) -> torch.Tensor:
    return x.tensor if isinstance(x, DeviceTensor) else x


def _scale_into(dst: torch.Tensor, src: torch.Tensor, factor: float, divisor: int = 1) -> None:
    """dst = src * factor / divisor, rounded as the host path does (integers truncated)."""
    if divisor == 1 and factor == 1.0:
        if dst.data_ptr() != src.data_ptr() or dst.dtype != src.dtype:
            dst.copy_(src)
        return
    if not (src.is_floating_point() and dst.dtype == src.dtype):
        wide = src.to(torch.float64)
        wide = wide / divisor if divisor != 1 else wide * factor
        dst.copy_(wide.trunc() if not dst.is_floating_point() else wide)
    elif divisor != 1:
        torch.div(src, divisor, out=dst)
    else:
        torch.mul(src, factor, out=dst)


class _Group:
    """A process set's torch process group on one device kind."""

    __slots__ = ("pg", "nccl", "size")

    def __init__(self, pg: Any, nccl: bool, size: int) -> None:
        self.pg, self.nccl, self.size = pg, nccl, size


class TorchPlane:
    """Runs the engine's planned batches on torch tensors (see the module docstring)."""

    def __init__(self, executor: Any) -> None:
        self._executor = executor
        self._backend = executor.backend
        self._stores: dict[Group, Any] = {}
        self._groups: dict[tuple[Group, bool], _Group] = {}
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._streams: dict[torch.device, Any] = {}
        self._seq = 0
        self._last_cuda: torch.device | None = None

    # ------------------------------------------------------------------ setup
    def _timeout(self) -> datetime.timedelta:
        ctx = peek_context()
        seconds = ctx.config.gloo_timeout_seconds if ctx is not None else 30.0
        return datetime.timedelta(seconds=seconds or 30.0)

    def _address(self, group: Group) -> str:
        ctx = peek_context()
        if ctx is None:
            return "127.0.0.1"
        hosts = ctx.topology.hostnames
        if len({hosts[r] for r in group.ranks}) == 1:
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
            # The set's first member opens the store; its address travels over the CPU transport.
            msg = np.zeros(256, np.uint8)
            # An authenticated store (horovod.common.backends.authstore), not torch's TCPStore.
            secret = os.environ.get("HOROVOD_SECRET_KEY")
            if group.rank == 0:
                store, text = authstore.open_for_members(self._address(group),
                                                         self._timeout().total_seconds(), secret)
                msg[:len(text)] = np.frombuffer(text, np.uint8)
            self._backend.broadcast(msg, 0, group)
            if group.rank != 0:
                store = authstore.join_members(msg.tobytes().rstrip(b"\0"),
                                               self._timeout().total_seconds(), secret)
        self._stores[group] = store
        return store

    def _group(self, group: Group, device: torch.device) -> _Group:
        nccl = device.type == "cuda"
        g = self._groups.get((group, nccl))
        if g is not None:
            return g
        self._seq += 1
        store = dist.PrefixStore(f"plane.{'nccl' if nccl else 'gloo'}.{self._seq}", self._store(group))
        pg: Any
        with self._translate("creating a process group", group):
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
        g = self._groups[(group, nccl)] = _Group(pg, nccl, group.size)
        return g

    def _check_distinct_gpus(self, group: Group, device: torch.device) -> None:
        """NCCL refuses two ranks of a communicator on one GPU: say so, naming the ranks."""
        host = zlib.crc32(socket.gethostname().encode())
        seen = self._backend.allgather_ints(np.array([host, device.index or 0], np.int64), group)
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

    @contextlib.contextmanager
    def _translate(self, what: str, group: Group) -> Iterator[None]:
        """The one place where torch.distributed errors become Horovod errors."""
        try:
            yield
        except DevicePlaneError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError subclasses and others
            rank = group.ranks[group.rank] if group.rank >= 0 else -1
            raise DevicePlaneError(f"torch.distributed {what} failed on rank {rank}: {exc}",
                                   rank=rank, op=what) from exc

    def _buffer(self, device: torch.device, dtype: torch.dtype, n: int) -> torch.Tensor:
        buf = self._buffers.get((device, dtype))
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1024), dtype=dtype, device=device)
            self._buffers[(device, dtype)] = buf
        return buf[:n]

    # ------------------------------------------------------------------ entry point
    def run(self, batch: Sequence[Response], entries: Sequence[Any], group: Group) -> None:
        req = batch[0].request
        device = self._device(req.device, entries)
        wrappers = [w for e in entries if e is not None for w in e.inputs]
        with self._on_stream(device, wrappers) as stream:
            g = self._group(group, device)  # with the GPU current, as NCCL binds it on first use
            kind = req.kind
            tl = self._executor._timeline()
            activity = ("NCCL_" if g.nccl else "GLOO_") + _ACTIVITY.get(kind, kind.upper)
            if tl is not None:
                for r in batch:
                    tl.begin(r.name, activity)
            try:
                with self._translate(kind.value, group):
                    if kind == RequestType.ALLREDUCE:
                        self._allreduce(batch, entries, g, group, device)
                    elif kind == RequestType.BROADCAST:
                        self._broadcast(entries, g, group)
                    elif kind == RequestType.ALLGATHER:
                        self._allgather(entries[0], g, group)
                    elif kind == RequestType.ALLTOALL:
                        self._alltoall(entries[0], g, group)
                    elif kind == RequestType.REDUCESCATTER:
                        self._reducescatter(entries[0], g, group)
            finally:
                if tl is not None:  # on CUDA this spans the enqueueing, not the GPU's work
                    for r in batch:
                        tl.end(r.name)
            if stream is not None:
                done = torch.cuda.Event()
                done.record(stream)
                for w in wrappers:
                    w.done = done
                    if w.parent is not None:
                        w.parent.done = done
                for e in entries:
                    for t in self._user_tensors(e):
                        t.record_stream(stream)

    @staticmethod
    def _user_tensors(entry: Any) -> list[torch.Tensor]:
        if entry is None:
            return []
        out = [_unwrap(x) for x in entry.inputs]
        for o in entry.outputs or []:
            o = o[0] if isinstance(o, tuple) else o
            if isinstance(o, torch.Tensor) and o.is_cuda:
                out.append(o)
        return out

    def _device(self, tag: str, entries: Sequence[Any]) -> torch.device:
        for e in entries:
            if e is not None and e.inputs:
                dev = _unwrap(e.inputs[0]).device
                if dev.type == "cuda":
                    self._last_cuda = dev
                return dev
        if tag != PLANE_CUDA:
            return torch.device("cpu")
        # A joined rank with nothing of its own in this batch: zeros on its GPU.
        joined = _join_device[0] or self._last_cuda
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
            for w in wrappers:
                if w.ready is not None:
                    stream.wait_event(w.ready)
            yield stream

    # ------------------------------------------------------------------ allreduce
    def _reduce(self, g: _Group, t: torch.Tensor, op: ReduceOp) -> None:
        if t.numel() == 0 or g.size == 1:  # a set of one: the reduction is the identity
            return
        o = dist.AllreduceOptions()
        o.reduceOp = _TORCH_OPS[op]  # type: ignore[assignment]
        g.pg.allreduce([t], o).wait()

    def _allreduce(self, batch: Sequence[Response], entries: Sequence[Any], g: _Group, group: Group,
                   device: torch.device) -> None:
        req = batch[0].request
        op: ReduceOp = ReduceOp.SUM if req.reduce_op == ReduceOp.AVERAGE else req.reduce_op
        post, div = _post_factors(req, group)
        pre = req.prescale
        items: list[tuple[torch.Tensor, torch.Tensor]] = []
        dtype: torch.dtype | None = None
        for resp, entry in zip(batch, entries):
            if entry is None:  # this rank joined: contribute zeros of the agreed shapes
                zdt = getattr(torch, resp.request.dtype)
                for shape in resp.request.shapes:
                    z = torch.zeros(int(np.prod(shape)), dtype=zdt, device=device)
                    items.append((z, z))
                dtype = zdt
                continue
            xs = [_unwrap(x) for x in entry.inputs]
            outs = [_unwrap(o) for o in entry.outputs] if entry.outputs is not None else [
                torch.empty_like(x) for x in xs]
            entry.outputs = outs
            items.extend((x.reshape(-1), o.view(-1)) for x, o in zip(xs, outs))
            dtype = xs[0].dtype
        assert dtype is not None
        work = _WORK.get(dtype, dtype)
        if dtype == torch.bool:
            op = _BOOL_OPS[op]
        item = torch.empty((), dtype=work).element_size()
        small: list[tuple[torch.Tensor, torch.Tensor]] = []
        large = items
        if self._executor.fusion_enabled and len(items) > 1:
            cut = self._executor.max_tensor_bytes
            small = [p for p in items if p[0].numel() * item <= cut]
            if len(small) > 1:
                large = [p for p in items if p[0].numel() * item > cut]
            else:
                small = []
        if small:
            sizes = [x.numel() for x, _ in small]
            buf = self._buffer(device, work, sum(sizes))
            if work == dtype:
                torch.cat([x for x, _ in small], out=buf)
            else:
                for (x, _), piece in zip(small, buf.split(sizes)):
                    piece.copy_(x)
            if pre != 1.0:
                _scale_into(buf, buf, pre)
            self._reduce(g, buf, op)
            for (_, o), piece in zip(small, buf.split(sizes)):
                _scale_into(o, piece, post, div)
        for x, o in large:
            if work != dtype:
                w = x.to(work)
                if pre != 1.0:
                    _scale_into(w, w, pre)
                self._reduce(g, w, op)
                _scale_into(o, w, post, div)
                continue
            _scale_into(o, x, pre)
            self._reduce(g, o, op)
            if post != 1.0 or div != 1:
                _scale_into(o, o, post, div)

    # ------------------------------------------------------------------ data movement
    def _broadcast(self, entries: Sequence[Any], g: _Group, group: Group) -> None:
        req = next(e for e in entries if e is not None).request
        root = group.ranks.index(req.root_rank)
        is_root = group.rank == root
        flat: list[torch.Tensor] = []
        for entry in entries:
            xs = [_unwrap(x) for x in entry.inputs]
            if entry.outputs is None:
                entry.outputs = [x.clone() if is_root else torch.empty_like(x) for x in xs]
            else:
                entry.outputs = [_unwrap(o) for o in entry.outputs]
            flat.extend(o.view(-1).view(torch.uint8) for o in entry.outputs if o.numel())
        o = dist.BroadcastOptions()
        o.rootRank, o.rootTensor = root, 0
        cut = self._executor.max_tensor_bytes
        small = [b for b in flat if b.numel() <= cut] if self._executor.fusion_enabled else []
        if len(small) > 1:
            sizes = [b.numel() for b in small]
            buf = self._buffer(small[0].device, torch.uint8, sum(sizes))
            if is_root:
                torch.cat(small, out=buf)
            g.pg.broadcast([buf], o).wait()
            if not is_root:
                for b, piece in zip(small, buf.split(sizes)):
                    b.copy_(piece)
            flat = [b for b in flat if b.numel() > cut]
        for b in flat:
            g.pg.broadcast([b], o).wait()

    def _allgather(self, entry: Any, g: _Group, group: Group) -> None:
        xs = [_unwrap(x) for x in entry.inputs]
        # First dimensions travel over the CPU transport: sizing the outputs needs no device sync.
        all_dims = self._backend.allgather_ints(np.array([x.shape[0] for x in xs], np.int64), group)
        outputs = []
        for i, x in enumerate(xs):
            dims = [int(d) for d in all_dims[:, i]]
            out = torch.empty((sum(dims),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            row = int(np.prod(x.shape[1:])) * x.element_size()
            counts = [d * row for d in dims]
            width = max(counts)
            if width:
                self._gather_bytes(g, x.reshape(-1).view(torch.uint8), out.view(-1).view(torch.uint8),
                                   counts, width, group)
            outputs.append(out)
        entry.outputs = outputs

    @staticmethod
    def _gather_bytes(g: _Group, src: torch.Tensor, dst: torch.Tensor, counts: list[int], width: int,
                      group: Group) -> None:
        if len(set(counts)) == 1:  # equal parts land directly in their place
            g.pg.allgather([list(dst.split(width))], [src]).wait()
            return
        inp = torch.zeros(width, dtype=torch.uint8, device=src.device)
        inp[:src.numel()].copy_(src)
        outs = [torch.empty(width, dtype=torch.uint8, device=src.device) for _ in range(group.size)]
        g.pg.allgather([outs], [inp]).wait()
        torch.cat([o[:c] for o, c in zip(outs, counts)], out=dst)

    def _alltoall(self, entry: Any, g: _Group, group: Group) -> None:
        x = _unwrap(entry.inputs[0])
        splits = np.asarray(entry.splits, np.int64)
        recv = self._backend.alltoall_ints(splits, group)
        out = torch.empty((int(recv.sum()),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        row = int(np.prod(x.shape[1:])) * x.element_size()
        s = [int(c) * row for c in splits]
        r = [int(c) * row for c in recv]
        src = x.reshape(-1).view(torch.uint8)[:sum(s)]
        g.pg.alltoall_base(out.view(-1).view(torch.uint8), src, r, s, dist.AllToAllOptions()).wait()
        entry.outputs = [(out, recv.astype(np.int32))]

    def _reducescatter(self, entry: Any, g: _Group, group: Group) -> None:
        req = entry.request
        op = ReduceOp.SUM if req.reduce_op == ReduceOp.AVERAGE else req.reduce_op
        post, div = _post_factors(req, group)
        outputs = []
        for x in (_unwrap(v) for v in entry.inputs):
            work = _WORK.get(x.dtype, x.dtype)
            rop = _BOOL_OPS[op] if x.dtype == torch.bool else op
            w = x.reshape(-1).to(work, copy=True)
            if req.prescale != 1.0:
                _scale_into(w, w, req.prescale)
            rows = reducescatter_rows(x.shape[0], group.size)
            row = int(np.prod(x.shape[1:]))
            mine = rows[group.rank] * row
            if g.nccl and len(set(rows)) == 1 and w.numel():
                part = torch.empty(mine, dtype=work, device=x.device)
                o = dist.ReduceScatterOptions()
                o.reduceOp = _TORCH_OPS[rop]  # type: ignore[assignment]
                g.pg._reduce_scatter_base(part, w, o).wait()
            else:  # Gloo has no reduce-scatter on CPU tensors (and NCCL wants equal parts)
                self._reduce(g, w, rop)
                start = sum(rows[:group.rank]) * row
                part = w[start:start + mine]
            out = torch.empty((rows[group.rank],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            _scale_into(out.view(-1), part, post, div)
            outputs.append(out)
        entry.outputs = outputs

    # ------------------------------------------------------------------ teardown
    def free_group(self, group: Group) -> None:
        for key in [k for k in self._groups if k[0] is group]:
            with contextlib.suppress(Exception):
                self._groups.pop(key).pg.shutdown()
        self._stores.pop(group, None)

    def close(self) -> None:
        groups, self._groups = self._groups, {}
        for g in groups.values():
            with contextlib.suppress(Exception):
                g.pg.shutdown()
        self._stores.clear()
        self._buffers.clear()
        self._streams.clear()


register_plane("torch", TorchPlane)
