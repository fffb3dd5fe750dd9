"""Bridge from TensorFlow tensors to Horovod's engine.

Eager tensors are handed to the engine as NumPy arrays (``.numpy()`` shares the CPU buffer). Inside
``tf.function`` and TF1 graphs one ``tf.numpy_function`` op runs the engine call when the graph
executes; its outputs get the static shapes we know. Every op that takes a list (a whole step's
gradients, a model's variables) submits all its tensors before waiting, so they are negotiated and
fused together.

Engine keys: an explicit ``name`` in eager mode, else the engine's call-order counter (as in
``horovod.torch``); in graphs the TF node name of the op (``HorovodAllreduce_<input name>`` by
default, scope included unless ``ignore_name_scope``), so keys do not depend on the order in which
TF's executor happens to run independent ops.

Errors (see ``_errors``): ranks disagreeing raise ``tf.errors.FailedPreconditionError``, bad
arguments ``tf.errors.InvalidArgumentError``, a failed or shut-down engine ``tf.errors.UnknownError``,
in eager mode and in graphs alike; each message starts with the op type (``HorovodAllreduce``...)
and carries the engine's text (in eager mode the Horovod exception is chained as ``__cause__``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from horovod.common import collectives as C
from horovod.common.engine.host_buffers import SMALL_OUTPUT_BYTES
from horovod.common.engine.outputs import OutputPool
from horovod.common.process_sets import ProcessSet
from horovod.common.types import ReduceOp
from horovod.tensorflow import _errors

__all__ = ["engine_call", "check_registered", "normalize_name", "np_allreduce", "np_allgather", "np_broadcast",
           "np_alltoall", "np_reducescatter", "check_not_xla"]

NpFn = Callable[[Any, list[np.ndarray]], list[np.ndarray]]

_XLA_HINT = (
    "{op}: Horovod's TensorFlow ops run on the host (tf.numpy_function), which XLA cannot compile. "
    "Turn XLA off for this function: tf.function(..., jit_compile=False), or for Keras "
    "model.compile(..., jit_compile=False). hvd.DistributedOptimizer does this itself when it is "
    "passed to model.compile() before the first fit()."
)


def normalize_name(name: str) -> str:
    """Replace every character outside ``[A-Za-z0-9_]`` by ``_`` (upstream's node-name rule)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def check_registered(process_set: ProcessSet | None, op_type: str) -> None:
    """Raise ``ValueError`` now, when the op is built, if ``process_set`` was never registered (or
    was removed), as upstream does; membership is checked when the op runs (InvalidArgumentError).
    """
    from horovod.common.context import peek_context

    ctx = peek_context()
    if ctx is None or process_set is None:
        return  # before init(): graphs may be built first; the op reports it when it runs
    ps_id = process_set.process_set_id
    if ps_id is None or ps_id not in ctx.groups:
        raise ValueError(f"{op_type}: process set {process_set!r} does not exist or has not been registered "
                         f"(known ids: {sorted(ctx.groups)}). Register it with hvd.add_process_set() or "
                         "hvd.init(process_sets=...).")


def check_not_xla(op_type: str) -> None:
    """Raise a clear error if the op is being traced into an XLA-compiled function."""
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - private module moved
        return
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise NotImplementedError(_XLA_HINT.format(op=op_type))


def engine_call(op_type: str, fn: NpFn, inputs: Sequence[Any], tout: Sequence[tf.DType],
                shapes: Sequence[Any] | None = None, name: str | None = None,
                ignore_name_scope: bool = False, packed: bool = False) -> list[Any]:
    """Run ``fn(key, arrays) -> arrays`` on the engine now (eager) or when the graph runs.

    Args:
        op_type: ``HorovodAllreduce`` etc.; used for default node names and error messages.
        fn: the engine call on NumPy arrays; ``key`` is the engine name (None = call order).
        inputs: tensors to pass (converted with ``tf.convert_to_tensor``).
        tout: output dtypes.
        shapes: static output shapes to set in graphs (None entries are left unknown).
        name: explicit op name.
        ignore_name_scope: key graph ops by the last part of their node name only.
        packed: in graphs, when every output has a known static shape and all share one dtype,
            ``fn(key, arrays, out)`` writes into ``out``, views of one pooled buffer that is the
            single output of the ``numpy_function``; TF slices it into the outputs without copying
            (``numpy_function`` spends about 25 us on each output it returns).
    """
    if tf.executing_eagerly():
        arrays = [np.asarray(t) if isinstance(t, np.ndarray) else t.numpy() for t in inputs]
        try:
            results = fn(name, arrays)
        except Exception as exc:  # noqa: BLE001 - translated, re-raised
            err = _errors.eager_error(op_type, name, exc)
            if err is exc:
                raise
            raise err from exc
        return [tf.convert_to_tensor(o) for o in results]

    check_not_xla(op_type)
    _errors.install()  # a mismatch in this graph op surfaces as FailedPreconditionError (upstream's)
    inputs = [tf.convert_to_tensor(t) for t in inputs]
    if name is None:
        base = f"{op_type}_{normalize_name(inputs[0].name)}" if inputs else op_type
    else:
        base = normalize_name(name)
    cell: list[Any] = [None]
    layout = _packed_layout(tout, shapes) if packed else None

    def _run(*arrays: np.ndarray) -> Any:
        try:
            if layout is None:
                return fn(cell[0], list(arrays))
            flat = pooled_empty((layout.total,), layout.dtype)
            fn(cell[0], list(arrays), layout.views(flat))  # type: ignore[call-arg]
            return flat
        except Exception as exc:  # noqa: BLE001 - translated, re-raised
            err = _errors.graph_error(op_type, cell[0], exc)
            if err is exc:
                raise
            raise err from exc

    if layout is not None:
        # In a graph numpy_function returns tensors (TensorFlow annotates it with NumPy's types).
        packed_out: Any = tf.numpy_function(_run, inputs, layout.tf_dtype, stateful=True, name=base)
        packed_out.set_shape([layout.total])
        cell[0] = _key(packed_out.op.name, ignore_name_scope)
        return [tf.reshape(packed_out[o:o + n], s)
                for o, n, s in zip(layout.offsets, layout.sizes, layout.shapes)]
    outs: Any = tf.numpy_function(_run, inputs, list(tout), stateful=True, name=base)
    if not isinstance(outs, list | tuple):
        outs = [outs]
    outs = list(outs)
    cell[0] = _key(outs[0].op.name if outs else base, ignore_name_scope)
    if shapes is not None:
        for o, s in zip(outs, shapes):
            if s is not None:
                o.set_shape(s)
    return outs


def _key(node: str, ignore_name_scope: bool) -> str:
    return node.rsplit("/", 1)[-1] if ignore_name_scope else node


class _PackedLayout:
    """Where each output lives in one flat buffer: 64-byte aligned offsets, so that TF's slice of
    a piece whose byte size is a multiple of 64 shares the buffer (others are copied by TF)."""

    def __init__(self, dtype: tf.DType, shapes: list[tuple[int, ...]]) -> None:
        self.tf_dtype = dtype
        self.dtype = np.dtype(dtype.as_numpy_dtype)
        self.shapes = shapes
        step = max(1, 64 // self.dtype.itemsize)
        self.sizes = [int(np.prod(sh, dtype=np.int64)) for sh in shapes]
        self.offsets = []
        off = 0
        for n in self.sizes:
            self.offsets.append(off)
            off += -(-n // step) * step
        self.total = off

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        return [flat[o:o + n].reshape(sh) for o, n, sh in zip(self.offsets, self.sizes, self.shapes)]


def _packed_layout(tout: Sequence[tf.DType], shapes: Sequence[Any] | None) -> _PackedLayout | None:
    """The layout for packed outputs, or None when they cannot be packed (unknown shapes, several
    dtypes, or fewer than two outputs)."""
    if shapes is None or len(tout) < 2 or len(set(tout)) != 1:
        return None
    dims = []
    for sh in shapes:
        sh = tf.TensorShape(sh)
        if not sh.is_fully_defined():
            return None
        dims.append(tuple(int(d) for d in sh.as_list()))
    return _PackedLayout(tout[0], dims)


# ---------------------------------------------------------------------------- NumPy side
def _sub(key: Any, suffix: str) -> Any:
    return None if key is None else f"{key}{suffix}"


def _contig(a: np.ndarray) -> np.ndarray:
    """``a`` C-contiguous, in its own dtype (bfloat16 as ml_dtypes' type, TensorFlow's): what
    crosses the wire is the engine's rule per transport (``horovod.common.dtypes``). Unlike
    np.ascontiguousarray, keeps 0-d arrays 0-d."""
    return a if a.flags.c_contiguous else np.array(a, order="C")


def _by_dtype(arrays: Sequence[np.ndarray]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(a.dtype.name, []).append(i)
    return groups


# Output arrays kept warm across steps. ``numpy_function`` must hand TF new arrays, and MPI
# writing 100 MB of never-touched memory each step pays a page fault per 4 KiB (1.3-3x the time of
# the same reduction into warm memory). TF wraps an aligned array without copying and holds it
# while any tensor uses the buffer; the engine's pool hands a buffer out again only once nothing
# reaches it (``horovod.common.engine.outputs``). TF runs ops on several threads: one lock.
output_pool = OutputPool(min_bytes=SMALL_OUTPUT_BYTES)
_pool_lock = threading.Lock()


def pooled_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A warm output array of this shape and dtype (a plain new one when it is small)."""
    with _pool_lock:
        return output_pool.empty(shape, dtype)


def _outputs(key: Any, arrays: Sequence[np.ndarray]) -> list[np.ndarray] | None:
    """Pooled outputs shaped like ``arrays`` (outputs of op ``key``), or None when the op has no
    stable key (ops named by call order)."""
    if key is None:
        return None
    return [pooled_empty(a.shape, a.dtype) for a in arrays]


def _gathered(arrays: Sequence[np.ndarray], pending: list[tuple[list[int], Any]]) -> list[Any]:
    """Wait for each ``(indices, handle)`` and place its results at those indices of ``arrays``."""
    res: list[Any] = [None] * len(arrays)
    for idx, h in pending:
        for i, r in zip(idx, h.wait()):
            res[i] = r
    return res


def np_allreduce(key: Any, arrays: Sequence[np.ndarray], op: ReduceOp, prescale: float, postscale: float,
                 process_set: ProcessSet | None, grouped: bool,
                 groups: Sequence[Sequence[int]] | None = None,
                 out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """Allreduce arrays; grouped requests are split per dtype (and per ``groups``), all submitted
    before any is waited on. Results go into ``out`` when given, else into pooled arrays when the
    op has a stable ``key``."""
    if not arrays:
        return []
    if not grouped:
        x = _contig(arrays[0])
        h = C.allreduce_async([x], name=key, op=op, prescale_factor=prescale,
                              postscale_factor=postscale, process_set=process_set,
                              out=out or _outputs(key, [x]))
        return [h.wait()[0]]
    parts = [list(g) for g in groups] if groups else [list(range(len(arrays)))]
    pending = []
    for gi, part in enumerate(parts):
        by_dt = _by_dtype([arrays[i] for i in part])
        for dt, local in by_dt.items():
            idx = [part[j] for j in local]
            suffix = ("" if len(parts) == 1 else f".g{gi}") + ("" if len(by_dt) == 1 else f".{dt}")
            xs = [_contig(arrays[i]) for i in idx]
            outs = [out[i] for i in idx] if out else _outputs(key, xs)
            h = C.allreduce_async(xs, name=_sub(key, suffix), op=op,
                                  prescale_factor=prescale, postscale_factor=postscale,
                                  process_set=process_set, grouped=True, out=outs)
            pending.append((idx, h))
    return _gathered(arrays, pending)


def np_allgather(key: Any, arrays: Sequence[np.ndarray], process_set: ProcessSet | None,
                 grouped: bool) -> list[np.ndarray]:
    """Allgather arrays (concatenate along dimension 0 in set-rank order)."""
    if not arrays:
        return []
    if not grouped:
        return C.allgather_async([_contig(arrays[0])], name=key, process_set=process_set).wait()[:1]
    pending = []
    by_dt = _by_dtype(arrays)
    for dt, idx in by_dt.items():
        suffix = "" if len(by_dt) == 1 else f".{dt}"
        h = C.allgather_async([_contig(arrays[i]) for i in idx], name=_sub(key, suffix),
                              process_set=process_set, grouped=True)
        pending.append((idx, h))
    return _gathered(arrays, pending)


def np_broadcast(key: Any, arrays: Sequence[np.ndarray], root_rank: int,
                 process_set: ProcessSet | None) -> list[np.ndarray]:
    """Broadcast arrays from ``root_rank``; several arrays go as one request per dtype."""
    if not arrays:
        return []
    by_dt = _by_dtype(arrays)
    pending = []
    for dt, idx in by_dt.items():
        suffix = "" if len(by_dt) == 1 else f".{dt}"
        work = [_contig(arrays[i]).copy() for i in idx]
        h = C.broadcast_async(work, root_rank, name=_sub(key, suffix), process_set=process_set,
                              inplace=True, grouped=len(arrays) > 1)
        pending.append((idx, work, h))
    res: list[Any] = [None] * len(arrays)
    for idx, work, h in pending:
        h.wait()
        for i, r in zip(idx, work):
            res[i] = r
    return res


def np_alltoall(key: Any, array: np.ndarray, splits: np.ndarray | None,
                process_set: ProcessSet | None) -> list[np.ndarray]:
    """Alltoall; returns ``[output, received_splits (int32)]``."""
    out, received = C.alltoall_async(_contig(array), splits, name=key,
                                     process_set=process_set).wait()[0]
    return [out, np.asarray(received, dtype=np.int32)]


def np_reducescatter(key: Any, arrays: Sequence[np.ndarray], op: ReduceOp, prescale: float,
                     postscale: float, process_set: ProcessSet | None, grouped: bool) -> list[np.ndarray]:
    """Reducescatter arrays (grouped requests need one dtype)."""
    if not arrays:
        return []
    h = C.reducescatter_async([_contig(a) for a in arrays], name=key, op=op,
                              prescale_factor=prescale, postscale_factor=postscale,
                              process_set=process_set, grouped=grouped)
    return list(h.wait())
