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
import itertools
import socket
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from horovod.common import wire
from horovod.common.backends import authstore
from horovod.common.backends.base import Group
from horovod.common.context import peek_context
from horovod.common.engine.buffers import Item, Reduction, Segment, batch_items, power_of_two, run_reduction
from horovod.common.engine.device import DevicePlaneError, PlaneServices, register_plane
from horovod.common.engine.executor import reducescatter_rows
from horovod.common.engine.placement import DevicePlacement
from horovod.common.engine.plan import PACKED, plan_reduction, post_factors, work_op
from horovod.common.types import ReduceOp, RequestType, Response

__all__ = ["DeviceTensor", "TorchBuffers", "TorchPlane", "PLANE_CPU", "PLANE_CUDA", "set_join_device",
           "wait_done"]

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


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_SEQ = itertools.count(1)
_get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
_STREAMS: dict[tuple[int, int, int], Any] = {}


def _current_stream(device_index: int) -> Any:
    """The caller's current CUDA stream on a device, one ``Stream`` object per stream (building one
    per call, as ``torch.cuda.current_stream`` does, was most of a submission's cost on an H100)."""
    if _get_stream is None:  # pragma: no cover - a torch without the private accessor
        return torch.cuda.current_stream(device_index)
    key = _get_stream(device_index)
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) > 256:  # streams a script made and dropped
            _STREAMS.clear()
        stream = _STREAMS[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return stream


class DeviceTensor:
    """A torch tensor handed to the engine for the plane, with its ordering events.

    Carries what the engine's checks read (``shape``, ``dtype`` name, ``ndim``) so that the core
    treats it like an array without knowing torch. ``ready`` is an event recorded on ``stream``,
    the caller's stream at submission.
    """

    __slots__ = ("tensor", "shape", "dtype", "ndim", "ready", "stream", "seq", "done", "parent")

    def __init__(self, tensor: torch.Tensor, ready: Any = None, parent: DeviceTensor | None = None,
                 stream: Any = None, seq: int = 0) -> None:
        self.tensor = tensor
        self.seq = seq  # submission order of ``ready`` events
        self.parent = parent  # the wrapper this one slices (the caller waits on that one)
        self.shape = tuple(tensor.shape)
        name = _DTYPE_NAMES.get(tensor.dtype)
        if name is None:
            name = _DTYPE_NAMES[tensor.dtype] = str(tensor.dtype).rpartition(".")[2]
        self.dtype = name
        self.ndim = tensor.dim()
        self.ready = ready
        self.stream = stream
        self.done: Any = None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> DeviceTensor:
        """Wrap ``tensor``; on CUDA, mark the point of the caller's stream where it is ready."""
        if not tensor.is_cuda:
            return cls(tensor)
        stream = _current_stream(tensor.get_device())
        ready = torch.cuda.Event()
        ready.record(stream)
        return cls(tensor, ready, None, stream, next(_SEQ))

    def __getitem__(self, index: Any) -> DeviceTensor:
        return DeviceTensor(self.tensor[index], self.ready, self, self.stream, self.seq)


# (stream, done event) the caller's stream last waited for: every handle of a batch shares one
# "done" event, so synchronizing a batch's handles makes one wait, not one per handle.
_waited: list[Any] = [None, None]


def wait_done(wrappers: Sequence[DeviceTensor], outputs: Sequence[torch.Tensor]) -> None:
    """In the caller's thread: make its current stream wait for the plane's work on ``wrappers``.

    Outputs the plane allocated (on its own stream) are marked as used on the caller's stream.
    """
    for w in wrappers:
        done = w.done
        if done is None:
            continue
        t = w.tensor
        stream = _current_stream(t.get_device())
        if _waited[1] is not done or _waited[0] is not stream:
            stream.wait_event(done)
            _waited[0], _waited[1] = stream, done
        for o in outputs:
            if o is not t and o.is_cuda and (w.parent is None or o is not w.parent.tensor):
                o.record_stream(stream)
        return


def _latest_ready(wrappers: Sequence[DeviceTensor]) -> list[Any]:
    """The ready events the plane's stream must wait for: events recorded on one stream complete
    in order, so the latest one submitted on each producer stream covers the others (one wait per
    stream, not one per tensor)."""
    latest: dict[Any, tuple[int, Any]] = {}
    for w in wrappers:
        if w.ready is not None:
            seen = latest.get(w.stream)
            if seen is None or seen[0] < w.seq:
                latest[w.stream] = (w.seq, w.ready)
    return [ready for _, ready in latest.values()]


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


def _whole(items: Sequence[Item], segs: Sequence[Segment]) -> bool:
    for i, st, e, _ in segs:
        if st != 0 or e != items[i].n:
            return False
    return True


def _flat(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return t if start == 0 and stop == t.numel() else t.reshape(-1)[start:stop]


class TorchBuffers:
    """``BufferOps`` on torch tensors where they live (CUDA memory; CPU on the twin).

    Whole tensors are packed and unpacked with one ``torch._foreach_copy_`` each way (a few fused
    kernels, one Python call for any number of tensors), a fused buffer is scaled once, and
    tensors reduced in place are scaled together at the end of the batch (``defer_scale``).
    """

    defer_scale = True
    #: scale a fused buffer in one pass before unpacking (None: on CUDA; on the CPU twin a pass over
    #: the whole buffer wakes torch's thread pool, which costs more than it saves on a busy host)
    scale_once: bool | None = None

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def piece(self, a: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return _flat(a, start, stop)

    def span(self, items: Sequence[Item], segs: Sequence[Segment], inplace_only: bool) -> torch.Tensor | None:
        i, st, e, _ = segs[0]
        item = items[i]
        if len(segs) == 1:
            if inplace_only and not item.inplace:
                return None
            return _flat(item.o, st, e)
        first = item.o
        size = first.element_size()
        at = first.data_ptr() + st * size
        # One span only over views of one storage (a flat gradient buffer). Tensors that merely lie
        # end to end in memory have storages of their own (CUDA's caching allocator places small
        # ones side by side), and a view past the first one's storage is out of bounds.
        storage = first.untyped_storage().data_ptr()
        total = 0
        for i, st, e, _ in segs:
            item = items[i]
            o = item.o
            if not item.inplace or o.data_ptr() + st * size != at or o.untyped_storage().data_ptr() != storage:
                return None
            at += (e - st) * size
            total += e - st
        return first.as_strided((total,), (1,), first.storage_offset() + segs[0][1])

    def outputs(self, inputs: Sequence[Any], given: Sequence[Any] | None) -> list[torch.Tensor]:
        if given is not None:
            return [_unwrap(o) for o in given]
        return [torch.empty_like(_unwrap(x)) for x in inputs]

    def items(self, name: str, inputs: Sequence[Any], outputs: Sequence[Any]) -> list[Item]:
        new = tuple.__new__  # an Item without NamedTuple's keyword handling (per tensor)
        out = []
        for x, o in zip(inputs, outputs):
            t = _unwrap(x)
            o = _unwrap(o)
            out.append(new(Item, (t, o, o is t, name, t.numel())))
        return out

    def buffer(self, work: torch.dtype, n: int) -> torch.Tensor:
        key = (self.device, work)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1024), dtype=work, device=self.device)
            self._buffers[key] = buf
        return buf[:n]

    def zeros(self, n: int, dtype: str) -> torch.Tensor:
        return torch.zeros(n, dtype=getattr(torch, dtype), device=self.device)

    scale = staticmethod(lambda dst, src, factor, divisor=1: _scale_into(dst, src, factor, divisor))

    def pack(self, buf: torch.Tensor, items: Sequence[Item], segs: Sequence[Segment], pre: float,
             widen: bool) -> None:
        if _whole(items, segs):
            srcs = [items[i].x for i, *_ in segs]
            torch._foreach_copy_(torch._C._nn.unflatten_dense_tensors(buf, srcs), srcs)
        else:
            for i, st, e, b in segs:
                buf[b:b + e - st].copy_(_flat(items[i].x, st, e))
        if pre != 1.0:
            _scale_into(buf, buf, pre)

    def unpack(self, buf: torch.Tensor, items: Sequence[Item], segs: Sequence[Segment], post: float,
               div: int) -> None:
        scaled = post != 1.0 or div != 1
        if scaled and (buf.is_cuda if self.scale_once is None else self.scale_once):
            _scale_into(buf, buf, post, div)  # one kernel for the whole buffer
            scaled = False
        if _whole(items, segs):
            dsts = [items[i].o for i, *_ in segs]
            pieces = torch._C._nn.unflatten_dense_tensors(buf, dsts)
            if not scaled:
                torch._foreach_copy_(dsts, pieces)
                return
            for o, piece in zip(dsts, pieces):
                _scale_into(o, piece, post, div)
        else:
            for i, st, e, b in segs:
                _scale_into(_flat(items[i].o, st, e), buf[b:b + e - st], post if scaled else 1.0,
                            div if scaled else 1)

    def scale_all(self, regions: Sequence[torch.Tensor], post: float, div: int) -> None:
        if regions[0].is_floating_point():
            if div != 1:
                torch._foreach_div_(list(regions), div)
            else:
                torch._foreach_mul_(list(regions), post)
            return
        for r in regions:  # integers: scaled in float64 and truncated, as the host path
            _scale_into(r, r, post, div)

    def clear(self) -> None:
        self._buffers.clear()


class _Group:
    """A process set's torch process group on one device kind."""

    __slots__ = ("pg", "nccl", "size")

    def __init__(self, pg: Any, nccl: bool, size: int) -> None:
        self.pg, self.nccl, self.size = pg, nccl, size


class TorchPlane:
    """Runs the engine's planned batches on torch tensors (see the module docstring)."""

    def __init__(self, services: PlaneServices) -> None:
        self._services = services
        self._tunables = services.tunables
        self._backend = services.backend
        self._ops = TorchBuffers()
        self._placement = DevicePlacement()
        self._stores: dict[Group, Any] = {}
        self._groups: dict[tuple[Group, bool], _Group] = {}
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
            secret = wire.job_secret(self._backend)  # None: a random key, sent over the CPU transport
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

    # ------------------------------------------------------------------ entry point
    def run(self, batch: Sequence[Response], entries: Sequence[Any], group: Group) -> None:
        req = batch[0].request
        device = self._device(req.device, entries)
        wrappers = [w for e in entries if e is not None for w in e.inputs]
        with self._on_stream(device, wrappers) as stream:
            g = self._group(group, device)  # with the GPU current, as NCCL binds it on first use
            kind = req.kind
            tl = self._services.timeline()
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
            for ready in _latest_ready(wrappers):
                stream.wait_event(ready)
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
        """The engine's plan (unchunked: tensors above ``max_tensor_bytes`` alone, the others in one
        fused buffer) carried out by ``TorchBuffers``."""
        req = batch[0].request
        op = work_op(req.reduce_op)
        post, div = post_factors(req.reduce_op, req.postscale, group.size)
        ops = self._ops
        ops.device = device
        items, _ = batch_items(batch, entries, ops)
        dtype = items[0].x.dtype if items else getattr(torch, req.dtype)
        work = _WORK.get(dtype, dtype)
        if dtype == torch.bool:
            op = _BOOL_OPS[op]
        tun = self._tunables
        calls = plan_reduction([it.n for it in items], work.itemsize, 0, tun.max_tensor_bytes,
                               tun.fusion_threshold > 0, work != dtype)
        exact = dtype.is_floating_point and op == ReduceOp.SUM and power_of_two(post / div)
        red = Reduction(op, req.prescale, post, div, work, work != dtype, exact)
        run_reduction(calls, items, ops, red, lambda t: self._reduce(g, t, op), self._placement)

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
        tun = self._tunables
        ops = self._ops
        ops.device = flat[0].device if flat else torch.device("cpu")
        items = [Item(b, b, True, "", b.numel()) for b in flat]
        for call in plan_reduction([b.numel() for b in flat], 1, 0, tun.max_tensor_bytes,
                                   tun.fusion_threshold > 0):
            segs = call.segments
            if call.kind == PACKED and len(segs) > 1:
                buf = ops.buffer(torch.uint8, call.size)
                if is_root:
                    ops.pack(buf, items, segs, 1.0, False)
                g.pg.broadcast([buf], o).wait()
                if not is_root:
                    ops.unpack(buf, items, segs, 1.0, 1)
            else:
                g.pg.broadcast([flat[segs[0][0]]], o).wait()

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
        op = work_op(req.reduce_op)
        post, div = post_factors(req.reduce_op, req.postscale, group.size)
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
        self._ops.clear()
        self._streams.clear()


register_plane("torch", TorchPlane)
