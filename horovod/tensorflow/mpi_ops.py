"""Horovod's collective ops on TensorFlow tensors (eager, ``tf.function`` and TF1 graphs).

Every op here must be called by all ranks of ``process_set`` with the same name (in graphs: the
same node name), dtype and shape rules; a disagreement raises on every rank (see ``_bridge``).
Ops are differentiable with the gradients upstream Horovod registers: allreduce -> allreduce with
the same op and factors; allgather -> averaged allreduce, then this rank's slice; broadcast ->
averaged allreduce, zero on non-root ranks; alltoall -> alltoall back with the received splits;
reducescatter -> allgather (times the set size for Sum; as upstream, Average's is the plain allgather).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from horovod.common import basics as _basics
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.types import ReduceOp
from horovod.tensorflow import _bridge as B

__all__ = [
    "_allreduce", "_grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
    "alltoall", "_reducescatter", "_grouped_reducescatter", "join", "size_op", "local_size_op",
    "rank_op", "local_rank_op", "process_set_included_op", "allreduce_grads_nograd",
]


def _ps(process_set: ProcessSet | None) -> ProcessSet:
    return global_process_set if process_set is None else process_set


def _set_size(process_set: ProcessSet | None) -> int:
    ps = _ps(process_set)
    size = ps.size()
    if size is None:
        raise ValueError(f"{ps} is not registered (hvd.add_process_set) on this rank; its size is unknown.")
    return size


def _reduction(raw: Callable[..., list[Any]], backward: Callable[..., Callable[..., list[Any]]],
               tensors: list[Any], name: str | None, op: int, prescale: float, postscale: float,
               ignore_name_scope: bool, process_set: ProcessSet | None, grouped: bool) -> list[Any]:
    """Run ``raw`` (an allreduce or a reducescatter) on ``tensors`` with ``backward``'s gradient."""
    if not tensors:
        return []
    rop = ReduceOp(int(op))
    fwd = lambda xs: raw(xs, name, rop, prescale, postscale, ignore_name_scope, process_set, grouped)
    bwd = backward(rop, prescale, postscale, ignore_name_scope, process_set, grouped)
    return _differentiable(fwd, bwd, tensors)


def _differentiable(forward: Callable[[list[Any]], list[Any]],
                    backward: Callable[[list[Any], list[Any], list[Any]], list[Any]],
                    tensors: Sequence[Any]) -> list[Any]:
    """Run ``forward`` under ``tf.custom_gradient`` with ``backward(xs, ys, dys) -> dxs``."""

    @tf.custom_gradient
    def _op(*xs: Any) -> Any:
        ys = forward(list(xs))

        def _grad(*dys: Any) -> Any:
            grads = [tf.zeros_like(y) if d is None else d for d, y in zip(dys, ys)]
            dxs = backward(list(xs), ys, grads)
            return dxs if len(dxs) > 1 else dxs[0]

        return (ys if len(ys) > 1 else ys[0]), _grad

    out = _op(*[tf.convert_to_tensor(t) for t in tensors])
    return list(out) if isinstance(out, list | tuple) else [out]


# ---------------------------------------------------------------------------- allreduce
def _raw_allreduce(tensors: list[Any], name: str | None, op: ReduceOp, prescale: float, postscale: float,
                   ignore_name_scope: bool, process_set: ProcessSet | None, grouped: bool,
                   groups: Sequence[Sequence[int]] | None = None) -> list[Any]:
    op_type = "HorovodGroupedAllreduce" if grouped else "HorovodAllreduce"
    B.check_registered(process_set, op_type)
    if grouped and name is None and not tf.executing_eagerly() and tensors:
        first, last = B.normalize_name(tensors[0].name), B.normalize_name(tensors[-1].name)
        name = f"{op_type}_{first}_{last}" if len(tensors) > 1 else f"{op_type}_{first}"

    def fn(key: Any, arrays: list[np.ndarray], out: list[np.ndarray] | None = None) -> list[np.ndarray]:
        return B.np_allreduce(key, arrays, op, prescale, postscale, process_set, grouped, groups, out)

    return B.engine_call(op_type, fn, tensors, [t.dtype for t in tensors], [t.shape for t in tensors],
                         name=name, ignore_name_scope=ignore_name_scope, packed=grouped)


def _allreduce_backward(op: ReduceOp, prescale: float, postscale: float, ignore_name_scope: bool,
                        process_set: ProcessSet | None, grouped: bool) -> Callable[..., list[Any]]:
    def backward(xs: list[Any], ys: list[Any], dys: list[Any]) -> list[Any]:
        if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
            raise NotImplementedError(f"The gradient of an allreduce with op={ReduceOp(op).name} is not "
                                      "defined; only Sum and Average allreduces are differentiable.")
        return _raw_allreduce(dys, None, op, prescale, postscale, ignore_name_scope, process_set, grouped)

    return backward


def _allreduce(tensor: Any, name: str | None = None, op: int = ReduceOp.SUM, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, ignore_name_scope: bool = False,
               process_set: ProcessSet = global_process_set) -> Any:
    """Allreduce one dense tensor (differentiable). Default op is Sum, as upstream's ``_allreduce``."""
    return _reduction(_raw_allreduce, _allreduce_backward, [tensor], name, op, prescale_factor, postscale_factor,
                      ignore_name_scope, process_set, False)[0]


def _grouped_allreduce(tensors: Sequence[Any], name: str | None = None, op: int = ReduceOp.SUM,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       ignore_name_scope: bool = False,
                       process_set: ProcessSet = global_process_set) -> list[Any]:
    """Allreduce a list of dense tensors as one negotiated, fused unit (differentiable)."""
    return _reduction(_raw_allreduce, _allreduce_backward, list(tensors), name, op, prescale_factor,
                      postscale_factor, ignore_name_scope, process_set, True)


def allreduce_grads_nograd(tensors: Sequence[Any], name: str | None, op: int, prescale_factor: float,
                           postscale_factor: float, process_set: ProcessSet | None,
                           groups: Sequence[Sequence[int]] | None = None,
                           ignore_name_scope: bool = False) -> list[Any]:
    """Grouped allreduce without a gradient (for gradients themselves): one op for the whole list."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    return _raw_allreduce(tensors, name, ReduceOp(int(op)), prescale_factor, postscale_factor,
                          ignore_name_scope, process_set, True, groups)


# ---------------------------------------------------------------------------- allgather
def _raw_allgather(tensors: list[Any], name: str | None, ignore_name_scope: bool,
                   process_set: ProcessSet | None, grouped: bool) -> list[Any]:
    op_type = "HorovodGroupedAllgather" if grouped else "HorovodAllgather"
    B.check_registered(process_set, op_type)

    def fn(key: Any, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return B.np_allgather(key, arrays, process_set, grouped)

    shapes = [tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank else None for t in tensors]
    return B.engine_call(op_type, fn, tensors, [t.dtype for t in tensors], shapes, name=name,
                         ignore_name_scope=ignore_name_scope)


def _allgather_backward(ignore_name_scope: bool, process_set: ProcessSet | None) -> Callable[..., list[Any]]:
    ps = _ps(process_set)

    def backward(xs: list[Any], ys: list[Any], dys: list[Any]) -> list[Any]:
        reduced = _raw_allreduce(dys, None, ReduceOp.AVERAGE, 1.0, 1.0, ignore_name_scope, process_set,
                                 len(dys) > 1)
        firsts = [tf.reshape(tf.shape(x, out_type=tf.int32)[0], [1]) for x in xs]
        dims = _raw_allgather(firsts, None, ignore_name_scope, process_set, len(firsts) > 1)
        n, me = ps.size(), ps.rank()
        out = []
        for g, d in zip(reduced, dims):
            d = tf.reshape(d, [n])
            out.append(tf.split(g, num_or_size_splits=d, num=n, axis=0)[me])
        return out

    return backward


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's ``tensor`` along dimension 0, in set-rank order.

    First dimensions may differ between ranks; the other dimensions must agree.
    """
    fwd = lambda xs: _raw_allgather(xs, name, ignore_name_scope, process_set, False)
    return _differentiable(fwd, _allgather_backward(ignore_name_scope, process_set), [tensor])[0]


def grouped_allgather(tensors: Sequence[Any], name: str | None = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Allgather each tensor of the list as one negotiated unit."""
    tensors = list(tensors)
    if not tensors:
        return []
    fwd = lambda xs: _raw_allgather(xs, name, ignore_name_scope, process_set, True)
    return _differentiable(fwd, _allgather_backward(ignore_name_scope, process_set), tensors)


# ---------------------------------------------------------------------------- broadcast
def _raw_broadcast(tensors: list[Any], root_rank: int, name: str | None, ignore_name_scope: bool,
                   process_set: ProcessSet | None) -> list[Any]:
    op_type = "HorovodBroadcast"
    B.check_registered(process_set, op_type)

    def fn(key: Any, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return B.np_broadcast(key, arrays, root_rank, process_set)

    return B.engine_call(op_type, fn, tensors, [t.dtype for t in tensors], [t.shape for t in tensors],
                         name=name, ignore_name_scope=ignore_name_scope)


def broadcast(tensor: Any, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> Any:
    """Return the value of ``tensor`` on ``root_rank`` (a global rank) on every rank of the set."""
    root_rank = int(root_rank)

    def backward(xs: list[Any], ys: list[Any], dys: list[Any]) -> list[Any]:
        g = _raw_allreduce(dys, None, ReduceOp.AVERAGE, 1.0, 1.0, ignore_name_scope, process_set, False)[0]
        return [g if _basics.rank() == root_rank else g * 0]

    fwd = lambda xs: _raw_broadcast(xs, root_rank, name, ignore_name_scope, process_set)
    return _differentiable(fwd, backward, [tensor])[0]


def _is_variable(v: Any) -> bool:
    return isinstance(v, tf.Variable) or (hasattr(v, "assign") and hasattr(v, "value")
                                           and hasattr(v, "dtype") and hasattr(v, "shape"))


def broadcast_(variables: Any, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> Any:
    """Overwrite ``variables`` (one or a list) with their values on ``root_rank``.

    All variables go to the engine as one request. Returns the updated values (eager) or the
    assign ops' results (graph).

    Raises:
        TypeError: an element is not a variable (use ``broadcast`` for tensors).
    """
    single = not isinstance(variables, list | tuple)
    vs = [variables] if single else list(variables)
    for v in vs:
        if not _is_variable(v):
            raise TypeError(f"broadcast_ expects tf.Variable objects, got {type(v).__name__}. Use "
                            "hvd.broadcast(tensor, root_rank) to broadcast a tensor value.")
    if not vs:
        return [] if not single else None
    values = [tf.convert_to_tensor(v) for v in vs]
    out = _raw_broadcast(values, int(root_rank), name, False, process_set)
    results = [v.assign(o) for v, o in zip(vs, out)]
    if tf.executing_eagerly():
        results = [tf.convert_to_tensor(v) for v in vs]
    return results[0] if single else results


# ---------------------------------------------------------------------------- alltoall
def _raw_alltoall(tensor: Any, splits: Any, name: str | None, ignore_name_scope: bool,
                  process_set: ProcessSet | None) -> list[Any]:
    B.check_registered(process_set, "HorovodAlltoall")
    has_splits = splits is not None

    def fn(key: Any, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return B.np_alltoall(key, arrays[0], arrays[1] if has_splits else None, process_set)

    inputs = [tensor] + ([tf.cast(tf.convert_to_tensor(splits), tf.int32)] if has_splits else [])
    n = _ps(process_set).size()
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:]) if tensor.shape.rank else None
    return B.engine_call("HorovodAlltoall", fn, inputs, [tensor.dtype, tf.int32], [shape, [n]], name=name,
                         ignore_name_scope=ignore_name_scope)


def alltoall(tensor: Any, splits: Any = None, name: str | None = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` to rank i of the set and receive every rank's rows.

    Returns the output, or ``(output, received_splits)`` when ``splits`` is given.
    """
    tensor = tf.convert_to_tensor(tensor)

    @tf.custom_gradient
    def _op(x: Any) -> Any:
        out, received = _raw_alltoall(x, splits, name, ignore_name_scope, process_set)

        def _grad(dy: Any, dsplits: Any = None) -> Any:
            return _raw_alltoall(dy, received, None, ignore_name_scope, process_set)[0]

        return (out, received), _grad

    out, received = _op(tensor)
    return out if splits is None else (out, received)


# ---------------------------------------------------------------------------- reducescatter
def _raw_reducescatter(tensors: list[Any], name: str | None, op: ReduceOp, prescale: float,
                       postscale: float, ignore_name_scope: bool, process_set: ProcessSet | None,
                       grouped: bool) -> list[Any]:
    op_type = "HorovodGroupedReducescatter" if grouped else "HorovodReducescatter"
    B.check_registered(process_set, op_type)

    def fn(key: Any, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return B.np_reducescatter(key, arrays, op, prescale, postscale, process_set, grouped)

    shapes = [tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank else None for t in tensors]
    return B.engine_call(op_type, fn, tensors, [t.dtype for t in tensors], shapes, name=name,
                         ignore_name_scope=ignore_name_scope)


def _reducescatter_backward(op: ReduceOp, prescale: float, postscale: float, ignore_name_scope: bool,
                            process_set: ProcessSet | None, grouped: bool) -> Callable[..., list[Any]]:
    # Upstream's definition: Sum -> allgather(dy) * set size, Average -> allgather(dy); the
    # scale factors multiply in as the chain rule says.
    def backward(xs: list[Any], ys: list[Any], dys: list[Any]) -> list[Any]:
        gathered = _raw_allgather(dys, None, ignore_name_scope, process_set, grouped)
        scale = prescale * postscale * (_set_size(process_set) if op == ReduceOp.SUM else 1)
        return [g * tf.cast(scale, g.dtype) if scale != 1 else g for g in gathered]

    return backward


def _reducescatter(tensor: Any, name: str | None = None, op: int = ReduceOp.AVERAGE,
                   ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    """Reduce ``tensor`` over the set and return this rank's rows (differentiable)."""
    return _reduction(_raw_reducescatter, _reducescatter_backward, [tensor], name, op, prescale_factor,
                      postscale_factor, ignore_name_scope, process_set, False)[0]


def _grouped_reducescatter(tensors: Sequence[Any], name: str | None = None, op: int = ReduceOp.AVERAGE,
                           ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set,
                           prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[Any]:
    """Reducescatter each tensor of the list as one unit (all must share a dtype)."""
    return _reduction(_raw_reducescatter, _reducescatter_backward, list(tensors), name, op, prescale_factor,
                      postscale_factor, ignore_name_scope, process_set, True)


# ---------------------------------------------------------------------------- join and queries
def join() -> Any:
    """Declare that this rank has no more data; returns (as an int32 tensor) the last rank to join."""
    from horovod.common import collectives as C

    def fn(key: Any, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(C.join(), dtype=np.int32)]

    return B.engine_call("HorovodJoin", fn, [], [tf.int32], [[]])[0]


def _query_op(op_type: str, value: Callable[[], int], name: str | None) -> Any:
    if tf.executing_eagerly():
        return tf.constant(value(), dtype=tf.int32)
    out = tf.numpy_function(lambda: np.asarray(value(), dtype=np.int32), [], tf.int32, stateful=True,
                            name=name or op_type)
    out.set_shape([])
    return out


def size_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """An int32 op giving the size of the process set when it runs (not when it is built)."""
    from horovod.common.context import get_context

    return _query_op("HorovodSize", lambda: len(get_context().groups[process_set_id].ranks), name)


def local_size_op(name: str | None = None) -> Any:
    """An int32 op giving the number of ranks on this host when it runs."""
    return _query_op("HorovodLocalSize", _basics.local_size, name)


def rank_op(name: str | None = None) -> Any:
    """An int32 op giving this process's global rank when it runs."""
    return _query_op("HorovodRank", _basics.rank, name)


def local_rank_op(name: str | None = None) -> Any:
    """An int32 op giving this process's rank on its host when it runs."""
    return _query_op("HorovodLocalRank", _basics.local_rank, name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """An int32 op: 1 if this rank belongs to the process set, 0 if not, -1 if the set is unknown."""
    from horovod.common.context import get_context

    def value() -> int:
        groups = get_context().groups
        if process_set_id not in groups:
            return -1
        return int(_basics.rank() in groups[process_set_id].ranks)

    return _query_op("HorovodProcessSetIncluded", value, name)
