"""Averaging a whole step's gradients: shared by DistributedGradientTape and both optimizers.

All dense gradients of a step go to the engine as one op (one grouped request per dtype, or per
``groups`` entry), so they are negotiated once and fused; sparse gradients (``tf.IndexedSlices``)
go through one grouped allgather of values and indices, unless ``sparse_as_dense``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from horovod.common.collectives import check_adasum
from horovod.common.elastic import worker as _elastic_worker
from horovod.common.optimizer_args import check_op_args, normalize_groups
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.types import ReduceOp
from horovod.tensorflow import _bridge as B
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.mpi_ops import allreduce_grads_nograd

__all__ = ["make_allreduce_grads_fn", "reduce_except_local", "check_op_args", "normalize_groups", "sparse_allreduce"]


def _var_key(v: Any) -> Any:
    inner = getattr(v, "value", None)
    if isinstance(inner, tf.Variable):
        v = inner
    try:
        return v.ref()
    except (AttributeError, TypeError):
        return id(v)


def reduce_except_local(grads: Sequence[Any], variables: Sequence[Any], local_keys: set[Any],
                        allreduce: Callable[[list[Any], list[Any]], list[Any]], process_set: ProcessSet,
                        scale_local: bool) -> list[Any]:
    """``grads`` with those of variables not in ``local_keys`` (``_var_key``) passed through
    ``allreduce`` (one call for all of them); local ones stay, divided by the set's size when
    ``scale_local`` (upstream's ``scale_local_gradients``)."""
    glob = [i for i, v in enumerate(variables) if _var_key(v) not in local_keys]
    out = list(grads)
    for i, g in zip(glob, allreduce([grads[i] for i in glob], [variables[i] for i in glob])):
        out[i] = g
    if local_keys and scale_local and process_set.included():
        n = process_set.size()
        for i in set(range(len(grads))) - set(glob):
            if out[i] is not None:
                out[i] = out[i] / tf.cast(n, out[i].dtype)
    return out


def _index_groups(groups: Any, positions: list[int],
                  variables: Sequence[Any] | None) -> list[list[int]] | None:
    """Turn ``groups`` into lists of indices into the dense list (``positions`` = their var index)."""
    if groups is None:
        return None
    n = len(positions)
    if isinstance(groups, int):
        k = max(1, min(groups, n))
        bounds = np.linspace(0, n, k + 1).astype(int)
        return [list(range(bounds[i], bounds[i + 1])) for i in range(k) if bounds[i + 1] > bounds[i]]
    if variables is None:
        return None
    where = {_var_key(variables[p]): j for j, p in enumerate(positions)}
    out, used = [], set()
    for g in groups:
        idx = [where[k] for k in (_var_key(v) for v in g) if k in where and where[k] not in used]
        used.update(idx)
        if idx:
            out.append(sorted(idx))
    out += [[j] for j in range(n) if j not in used]
    return out


def sparse_allreduce(slices: Sequence[tf.IndexedSlices], op: ReduceOp, process_set: ProcessSet | None,
                     name: str | None = None, ignore_name_scope: bool = False) -> list[tf.IndexedSlices]:
    """Allreduce IndexedSlices by gathering values and indices (duplicates are not merged)."""
    if not slices:
        return []
    B.check_registered(process_set, "HorovodAllgather")
    values = [tf.convert_to_tensor(s.values) for s in slices]
    indices = [tf.convert_to_tensor(s.indices) for s in slices]
    tensors = values + indices

    def fn(key: Any, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return B.np_allgather(key, arrays, process_set, grouped=True)

    shapes = [tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank else None for t in tensors]
    if name is None and not tf.executing_eagerly():
        name = "HorovodAllgather_" + B.normalize_name(values[0].name)
    outs = B.engine_call("HorovodAllgather", fn, tensors, [t.dtype for t in tensors], shapes, name=name,
                         ignore_name_scope=ignore_name_scope)
    n = len(slices)
    size = (global_process_set if process_set is None else process_set).size()
    res = []
    for s, v, i in zip(slices, outs[:n], outs[n:]):
        if op == ReduceOp.AVERAGE:
            v = v / tf.cast(size, v.dtype)
        res.append(tf.IndexedSlices(v, i, dense_shape=s.dense_shape))
    return res


def make_allreduce_grads_fn(name: str | None, device_dense: str, device_sparse: str, compression: Any,
                            sparse_as_dense: bool, op: int, gradient_predivide_factor: float = 1.0,
                            groups: Any = None, process_set: ProcessSet = global_process_set,
                            default_name: str = "DistributedGradients"
                            ) -> Callable[..., list[Any]]:
    """Return ``allreduce_grads(grads, variables=None, use_generic_names=False) -> grads``.

    ``None`` gradients stay ``None``. Ranks outside ``process_set`` (or a set of one) get their
    gradients back unchanged (densified when ``sparse_as_dense``).
    """
    op = ReduceOp(int(op))
    compression = compression or Compression.none
    prescale, postscale = 1.0, 1.0
    if op == ReduceOp.AVERAGE and gradient_predivide_factor != 1.0:
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor

    def allreduce_grads(grads: Sequence[Any], variables: Sequence[Any] | None = None,
                        use_generic_names: bool = False) -> list[Any]:
        grads = list(grads)
        if sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        ps = process_set if process_set is not None else global_process_set
        if op == ReduceOp.ADASUM and ps.process_set_id is not None:  # at trace time, as upstream
            check_adasum(ps.process_set_id, "float32")
        # An elastic job may grow after a function is traced at size 1: keep the allreduce.
        if not ps.included() or (ps.size() == 1 and not _elastic_worker.is_elastic()):
            return grads
        dense_pos = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
        sparse_pos = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        out = list(grads)
        graph = not tf.executing_eagerly()
        base = (name or default_name) if graph else name
        if dense_pos:
            with tf.device(device_dense):
                compressed, ctxs = zip(*[compression.compress(tf.convert_to_tensor(grads[i]))
                                         for i in dense_pos])
                idx_groups = _index_groups(groups, dense_pos, variables)
                reduced = allreduce_grads_nograd(list(compressed), base, op, prescale, postscale, ps,
                                                 idx_groups, ignore_name_scope=True)
                for i, r, c in zip(dense_pos, reduced, ctxs):
                    out[i] = compression.decompress(r, c)
        if sparse_pos:
            if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
                raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices; "
                                          "pass sparse_as_dense=True to reduce them as dense tensors.")
            with tf.device(device_sparse):
                sparse = sparse_allreduce([grads[i] for i in sparse_pos], op, ps,
                                          name=(base + "_sparse") if base else None, ignore_name_scope=True)
            for i, s in zip(sparse_pos, sparse):
                out[i] = s
        return out

    return allreduce_grads

