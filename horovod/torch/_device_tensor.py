"""Torch tensors handed to the engine's device plane, and the CUDA stream ordering around them.

The caller records an event on its current stream when it submits (``DeviceTensor.of``); the plane's
communication stream waits for the latest event of each producer stream (``latest_ready``) and
records ``DeviceTensor.done``; the caller's stream waits for that in ``synchronize``
(``wait_done``), without ``torch.cuda.synchronize()``. On the CPU twin every hook is a no-op.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from horovod.common.current import get_context, peek_context

__all__ = ["DeviceTensor", "again", "again_many", "current_stream", "latest_ready", "set_join_device",
           "join_device", "unwrap", "user_tensors", "wait_done"]


def set_join_device(device: int) -> None:
    """Where a joined rank makes its zero contributions to CUDA allreduces (``hvd.join(device)``),
    for this job (``Context.state``)."""
    get_context().state.join_device = torch.device("cuda", device) if device >= 0 else None


def join_device() -> torch.device | None:
    """The device ``set_join_device`` chose (None: the last CUDA device the plane ran on, or no job)."""
    ctx = peek_context()
    return None if ctx is None else ctx.state.join_device  # type: ignore[no-any-return]


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_SEQ = itertools.count(1)
_get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
_STREAMS: dict[tuple[int, int, int], Any] = {}


def current_stream(device_index: int) -> Any:
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

    Carries what the engine's checks and counters read (``shape``, ``dtype`` name, ``ndim``,
    ``nbytes``) so that the core treats it like an array without knowing torch. ``ready`` is an
    event recorded on ``stream``, the caller's stream at submission.
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
        stream = current_stream(tensor.get_device())
        ready = torch.cuda.Event()
        ready.record(stream)
        return cls(tensor, ready, None, stream, next(_SEQ))

    def __getitem__(self, index: Any) -> DeviceTensor:
        return DeviceTensor(self.tensor[index], self.ready, self, self.stream, self.seq)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor (the engine's counters read it as they read an array's)."""
        return self.tensor.numel() * self.tensor.element_size()


_new = object.__new__


def again(tensor: torch.Tensor, shape: tuple[int, ...], dtype: str, ndim: int, cuda: bool) -> DeviceTensor:
    """``DeviceTensor.of(tensor)`` for a tensor whose shape, dtype name and rank are known (a
    resubmission checked them): the same wrapper without reading them from the tensor again."""
    w: DeviceTensor = _new(DeviceTensor)
    w.tensor, w.shape, w.dtype, w.ndim, w.parent, w.done = tensor, shape, dtype, ndim, None, None
    if cuda:
        stream = current_stream(tensor.get_device())
        ready = torch.cuda.Event()
        ready.record(stream)
        w.ready, w.stream, w.seq = ready, stream, next(_SEQ)
    else:
        w.ready = w.stream = None
        w.seq = 0
    return w


def again_many(tensors: Sequence[torch.Tensor], facts: Sequence[Any], cuda: bool) -> list[DeviceTensor]:
    """``again`` for the tensors of one grouped call (``facts``: each one's shape, dtype name and
    rank), sharing one ready event on CUDA: the tensors are all handed over at one point of the
    caller's stream, and an event marks that point for every one of them (one event and one
    record instead of one per tensor)."""
    out = [again(t, f.shape, f.dtype, f.ndim, False) for t, f in zip(tensors, facts)]
    if cuda and out:
        stream = current_stream(tensors[0].get_device())
        ready = torch.cuda.Event()
        ready.record(stream)
        seq = next(_SEQ)
        for w in out:
            w.ready, w.stream, w.seq = ready, stream, seq
    return out


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
        stream = current_stream(t.get_device())
        if _waited[1] is not done or _waited[0] is not stream:
            stream.wait_event(done)
            _waited[0], _waited[1] = stream, done
        for o in outputs:
            if o is not t and o.is_cuda and (w.parent is None or o is not w.parent.tensor):
                o.record_stream(stream)
        return


def latest_ready(wrappers: Sequence[DeviceTensor]) -> list[Any]:
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


def unwrap(x: Any) -> torch.Tensor:
    return x.tensor if isinstance(x, DeviceTensor) else x


def user_tensors(entry: Any) -> list[torch.Tensor]:
    """The caller's tensors of an entry that the plane's stream used (inputs, CUDA outputs)."""
    if entry is None:
        return []
    out = [unwrap(x) for x in entry.inputs]
    for o in entry.outputs or []:
        o = o[0] if isinstance(o, tuple) else o
        if isinstance(o, torch.Tensor) and o.is_cuda:
            out.append(o)
    return out
