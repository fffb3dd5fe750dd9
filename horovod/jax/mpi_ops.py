"""Horovod's collectives on ``jax.Array``: eagerly and inside ``jax.jit``, differentiable.

A JAX array is one more kind of buffer for the NumPy path (``horovod.numpy``); there is no JAX
executor. Eagerly, an array becomes a NumPy view (free on the CPU, a device-to-host copy on a GPU),
the NumPy collective runs, and the result becomes a JAX array again. Under a trace (``jax.jit``,
``jax.grad`` of a jitted function, ``lax.scan``...) the same host function runs as an ordered
host call (on the CPU ``horovod.jax._ffi``: views of XLA's buffers, no copies; elsewhere
``horovod.jax._callback``): the compiled program calls its collectives in program order, so
ranks running the same program submit them in the same order; a program that differs between
ranks (other shapes, dtypes or names) gets the engine's mismatch error on every rank, raised from
the jitted call as ``jax.errors.JaxRuntimeError`` whose message carries Horovod's error
(``last_error()`` returns the original exception).

Shapes inside ``jax.jit`` must be known when tracing: ``allgather`` then needs the same first
dimension on every rank (checked at run time, on every rank), ``alltoall`` needs ``splits=None``.
Gradients (``jax.grad``) follow ``horovod.torch``: allreduce -> the same allreduce of the
gradient; allgather -> the averaged gradient's rows of this rank; broadcast -> the averaged
gradient on the root, zeros elsewhere; reducescatter -> the allgather of the gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import horovod.numpy as _np_ops
from horovod.common import collectives as _C
from horovod.common.basics import rank as _rank
from horovod.common.collectives import resolve_op
from horovod.common.current import peek_context
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.types import Average, ReduceOp
from horovod.jax import _ffi
from horovod.jax._callback import host_call
from horovod.jax.compression import Compression

__all__ = ["allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
           "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
           "broadcast", "broadcast_async", "alltoall", "alltoall_async", "reducescatter",
           "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
           "poll", "synchronize", "barrier", "join", "is_traced", "last_error"]

# Under jit, allreduce results alias their operands and are reduced in place (see ``_run``);
# False: the engine reads the operands and writes separate result buffers (measured slower when the
# operands are intermediates or donated, docs/jax.md "Performance").
_ALIAS = True


def last_error() -> BaseException | None:
    """The exception a collective last raised inside a compiled JAX program (or None).

    JAX reports a failed host callback as ``jax.errors.JaxRuntimeError``; this is Horovod's own
    exception (``HorovodInternalError``, ``HostsUpdatedInterrupt``, ...) behind it.
    """
    ctx = peek_context()
    return None if ctx is None else ctx.state.traced_error


def set_last_error(exc: BaseException | None) -> None:
    """Note (or, with None, forget) the exception of a collective in a compiled program, for
    this job (``Context.state``)."""
    ctx = peek_context()
    if ctx is not None:
        ctx.state.traced_error = exc


def is_traced(*values: Any) -> bool:
    """True if any of ``values`` is a JAX tracer (we are inside ``jit``/``grad``/``scan``...)."""
    return any(isinstance(v, jax.core.Tracer) for v in values)


def _host(fn: Callable[[list[np.ndarray]], list[np.ndarray]]) -> Callable[..., list[np.ndarray]]:
    def call(*arrays: Any) -> list[np.ndarray]:
        try:
            return [np.asarray(r) for r in fn([np.asarray(a) for a in arrays])]
        except BaseException as exc:
            set_last_error(exc)
            raise

    return call


def _run(fn: Callable[[list[np.ndarray]], list[np.ndarray]], arrays: Sequence[Any],
         specs: Callable[[], list[jax.ShapeDtypeStruct]],
         into: Callable[[list[np.ndarray], list[np.ndarray]], None] | None = None,
         alias: bool = False) -> list[Any]:
    """Run ``fn`` (NumPy arrays in, NumPy arrays out) on JAX arrays: at once, or as an ordered
    host callback of the program being traced. ``specs()`` gives the outputs' static shapes.

    Traced on the CPU, the callback is ``_ffi.host_call_into``: the host function gets XLA's
    operand buffers as NumPy views and fills XLA's result buffers, with ``into(inputs, outputs)``
    when given (e.g. the engine reducing straight into them), else by copying ``fn``'s results in.
    With ``alias`` (and ``into``) result i is operand i's buffer, holding its value on entry, and
    ``into`` works in place in ``outputs`` (XLA reuses an intermediate's or a donated argument's
    memory, else copies the operand first).
    Elsewhere (another JAX, a GPU) it is ``_callback.host_call`` (JAX copies operands and results).
    """
    if is_traced(*arrays):
        if _ffi.available():
            return _ffi.host_call_into(_host_into(fn, into), specs(), arrays, alias and into is not None)
        return host_call(_host(fn), specs(), arrays)
    return [jnp.asarray(r) for r in _host(fn)(*arrays)]


def _host_into(fn: Callable[[list[np.ndarray]], list[np.ndarray]],
               into: Callable[[list[np.ndarray], list[np.ndarray]], None] | None
               ) -> Callable[[list[np.ndarray], list[np.ndarray]], None]:
    def call(ins: list[np.ndarray], outs: list[np.ndarray]) -> None:
        try:
            if into is not None:
                into(ins, outs)
                return
            results = [np.asarray(r) for r in fn(ins)]
            if len(results) != len(outs):
                raise RuntimeError(f"host function returned {len(results)} arrays, expected {len(outs)}")
            for i, (o, r) in enumerate(zip(outs, results)):
                if r.shape != o.shape or r.dtype != o.dtype:
                    raise RuntimeError(f"host function result #{i} is {r.dtype}{list(r.shape)}, "
                                       f"expected {o.dtype}{list(o.shape)}")
                np.copyto(o, r)
        except BaseException as exc:
            set_last_error(exc)
            raise

    return call


def _spec(shape: Sequence[int], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _same(arrays: Sequence[Any]) -> Callable[[], list[jax.ShapeDtypeStruct]]:
    return lambda: [_spec(a.shape, a.dtype) for a in arrays]


def _with_gradient(forward: Callable[[Any], Any], gradient: Callable[[Any], Any], x: Any) -> Any:
    """``forward(x)`` as a JAX function whose vector-Jacobian product is ``gradient(g)`` (``x`` is
    an array or a list of arrays; ``forward`` returns the same kind)."""

    @jax.custom_vjp
    def f(v: Any) -> Any:
        return forward(v)

    def fwd(v: Any) -> tuple[Any, None]:
        return f(v), None

    def bwd(_: None, g: Any) -> tuple[Any]:
        return (gradient(g),)

    f.defvjp(fwd, bwd)
    return f(x)


# ---------------------------------------------------------------------------- allreduce
def _allreduce_list(arrays: list[Any], name: str | None, op: ReduceOp, pre: float, post: float,
                    ps: ProcessSet, grouped: bool) -> list[Any]:
    def host(xs: list[np.ndarray]) -> list[np.ndarray]:
        if grouped:
            return _np_ops.grouped_allreduce(xs, None, name, op, pre, post, ps)
        return [_np_ops.allreduce(xs[0], None, name, op, pre, post, ps)]

    alias = _ALIAS

    def into(xs: list[np.ndarray], outs: list[np.ndarray]) -> None:
        # no copy on either side: in place in the results (which alias the operands), or straight
        # from XLA's operands into XLA's results
        if alias:
            _C.allreduce_async(outs, name=name, op=op, prescale_factor=pre, postscale_factor=post,
                               process_set=ps, grouped=grouped, wake=False, inplace=True).wait()
        else:
            _C.allreduce_async(xs, name=name, op=op, prescale_factor=pre, postscale_factor=post,
                               process_set=ps, grouped=grouped, wake=False, out=outs).wait()

    return _with_gradient(lambda xs: _run(host, xs, _same(xs), into, alias),
                          lambda gs: _allreduce_list(list(gs), None, op, pre, post, ps, grouped), list(arrays))


def allreduce(tensor: Any, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Any:
    """Reduce ``tensor`` over all ranks of the set (default Average); returns a new array.

    Every rank of the set must call it with the same name (or in the same order), dtype and
    shape. Works eagerly and inside ``jax.jit``; differentiable.
    """
    rop = resolve_op(average, op)
    comp, ctx = compression.compress(jnp.asarray(tensor))
    out = _allreduce_list([comp], name, rop, float(prescale_factor), float(postscale_factor), process_set,
                          False)[0]
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Reduce every array of the list (per position) as one negotiated, fused unit.

    The arrays must share one dtype (after compression). Eager and under ``jax.jit``; differentiable.
    """
    rop = resolve_op(average, op)
    pairs = [compression.compress(jnp.asarray(t)) for t in tensors]
    outs = _allreduce_list([p[0] for p in pairs], name, rop, float(prescale_factor),
                           float(postscale_factor), process_set, True)
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


# ---------------------------------------------------------------------------- allgather
def _gather_host(name: str | None, ps: ProcessSet, grouped: bool, equal_dims: bool
                 ) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
    def host(xs: list[np.ndarray]) -> list[np.ndarray]:
        if equal_dims:  # inside jit: the output shape was fixed when tracing
            dims = _np_ops.allgather(np.array([[x.shape[0] if x.ndim else -1 for x in xs]], np.int64),
                                     f"{name}.dims" if name else None, ps)
            if (dims != dims[0]).any():
                raise ValueError(
                    "allgather inside jax.jit needs the same first dimension on every rank (the "
                    f"output shape is fixed when tracing); the ranks of the set have {dims.tolist()}. "
                    "Pad to a common size, or call allgather outside jit.")
        if grouped:
            return _np_ops.grouped_allgather(xs, name, ps)
        return [_np_ops.allgather(xs[0], name, ps)]

    return host


def _allgather_list(arrays: list[Any], name: str | None, ps: ProcessSet, grouped: bool) -> list[Any]:
    def forward(xs: list[Any]) -> list[Any]:
        traced = is_traced(*xs)
        n = ps.size() or 1
        return _run(_gather_host(name, ps, grouped, traced), xs,
                    lambda: [_spec((a.shape[0] * n,) + tuple(a.shape[1:]), a.dtype) for a in xs])

    def gradient(gs: list[Any]) -> list[Any]:
        gs = list(gs)
        reduced = _allreduce_list(gs, None, ReduceOp.AVERAGE, 1.0, 1.0, ps, True)
        dims = [a.shape[0] for a in arrays]
        r = ps.rank() or 0
        if is_traced(*gs):
            offsets = [r * d for d in dims]
        else:
            every = _np_ops.allgather(np.array([dims], np.int64), None, ps)
            offsets = every[:r].sum(axis=0).tolist() if r else [0] * len(dims)
        return [g[int(o):int(o) + d] for g, o, d in zip(reduced, offsets, dims)]

    return _with_gradient(forward, gradient, list(arrays))


def allgather(tensor: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's ``tensor`` along dimension 0 in rank order. Differentiable.

    Eagerly first dimensions may differ; inside ``jax.jit`` they must be equal.
    """
    return _allgather_list([jnp.asarray(tensor)], name, process_set, False)[0]


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Allgather each array of the list as one unit. Differentiable."""
    return _allgather_list([jnp.asarray(t) for t in tensors], name, process_set, True)


# ---------------------------------------------------------------------------- broadcast
def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Return the root rank's ``tensor`` (``root_rank`` is a global rank) on every rank. Differentiable."""
    root = int(root_rank)

    def host(xs: list[np.ndarray]) -> list[np.ndarray]:
        return [_np_ops.broadcast(xs[0], root, name, process_set)]

    def gradient(g: Any) -> Any:
        grad = _allreduce_list([g], None, ReduceOp.AVERAGE, 1.0, 1.0, process_set, False)[0]
        return grad if _rank() == root else jnp.zeros_like(grad)

    return _with_gradient(lambda x: _run(host, [x], _same([x]))[0], gradient, jnp.asarray(tensor))


# ---------------------------------------------------------------------------- alltoall
def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows of dimension 0 to rank i of the set and receive theirs.

    Returns the output, or ``(output, received_splits)`` when ``splits`` is given (eager only:
    inside ``jax.jit`` the output shape must be known, so only ``splits=None``, equal parts).
    The gradient (``splits=None``) is the alltoall of the gradient.
    """
    x = jnp.asarray(tensor)
    if splits is not None:
        if is_traced(x, splits):
            raise NotImplementedError(
                "alltoall with explicit splits inside jax.jit: the output shape depends on the other "
                "ranks' splits, which are unknown when tracing. Use splits=None (equal parts) inside "
                "jit, or call alltoall outside jit.")
        out, received = _np_ops.alltoall(np.asarray(x), np.asarray(splits), name, process_set)
        return jnp.asarray(out), jnp.asarray(received)

    def host(xs: list[np.ndarray]) -> list[np.ndarray]:
        return [_np_ops.alltoall(xs[0], None, name, process_set)]

    return _with_gradient(lambda v: _run(host, [v], _same([v]))[0],
                          lambda g: alltoall(g, None, None, process_set), x)


# ---------------------------------------------------------------------------- reducescatter
def _scatter_rows(rows: int, ps: ProcessSet) -> int:
    n, r = ps.size() or 1, ps.rank() or 0
    return rows // n + (1 if r < rows % n else 0)


def _reducescatter_list(arrays: list[Any], name: str | None, op: ReduceOp, pre: float, post: float,
                        ps: ProcessSet, grouped: bool) -> list[Any]:
    def host(xs: list[np.ndarray]) -> list[np.ndarray]:
        if grouped:
            return _np_ops.grouped_reducescatter(xs, name, op, ps, pre, post)
        return [_np_ops.reducescatter(xs[0], name, op, ps, pre, post)]

    def forward(xs: list[Any]) -> list[Any]:
        return _run(host, xs, lambda: [_spec((_scatter_rows(a.shape[0], ps),) + tuple(a.shape[1:]), a.dtype)
                                       for a in xs])

    def gradient(gs: list[Any]) -> list[Any]:
        scale = (float(ps.size() or 1) if op == ReduceOp.SUM else 1.0) * pre * post
        gathered = _allgather_list(list(gs), None, ps, True)
        return [g * scale if scale != 1.0 else g for g in gathered]

    return _with_gradient(forward, gradient, list(arrays))


def reducescatter(tensor: Any, name: str | None = None, compression: Any = Compression.none,
                  op: int = Average, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    """Reduce ``tensor`` over the set (Average or Sum) and return this rank's rows. Differentiable.

    With N rows and P ranks, ranks 0 .. N%P-1 get N//P+1 rows, the others N//P.
    """
    rop = resolve_op(None, op)
    comp, ctx = compression.compress(jnp.asarray(tensor))
    out = _reducescatter_list([comp], name, rop, float(prescale_factor), float(postscale_factor),
                              process_set, False)[0]
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors: Sequence[Any], name: str | None = None,
                          compression: Any = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[Any]:
    """Reducescatter each array of the list as one unit. Differentiable."""
    rop = resolve_op(None, op)
    pairs = [compression.compress(jnp.asarray(t)) for t in tensors]
    outs = _reducescatter_list([p[0] for p in pairs], name, rop, float(prescale_factor),
                               float(postscale_factor), process_set, True)
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


# ---------------------------------------------------------------------------- async (eager only)
def _eager(x: Any, what: str) -> np.ndarray:
    if is_traced(x):
        raise TypeError(f"horovod.jax.{what} runs eagerly only (it returns a handle); inside jax.jit "
                        f"use {what.removesuffix('_async')}(), which compiles to an ordered host callback.")
    return np.asarray(x)


def allreduce_async(tensor: Any, average: bool | None = None, name: str | None = None, op: int | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an allreduce; ``synchronize(handle)`` returns the JAX array. Eager only."""
    return _np_ops.allreduce_async(_eager(tensor, "allreduce_async"), average, name, op, prescale_factor,
                                   postscale_factor, process_set)


def grouped_allreduce_async(tensors: Sequence[Any], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    """Start a grouped allreduce; ``synchronize`` returns a list of arrays. Eager only."""
    return _np_ops.grouped_allreduce_async([_eager(t, "grouped_allreduce_async") for t in tensors], average,
                                           name, op, prescale_factor, postscale_factor, process_set)


def allgather_async(tensor: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather. Eager only."""
    return _np_ops.allgather_async(_eager(tensor, "allgather_async"), name, process_set)


def grouped_allgather_async(tensors: Sequence[Any], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start a grouped allgather. Eager only."""
    return _np_ops.grouped_allgather_async([_eager(t, "grouped_allgather_async") for t in tensors], name,
                                           process_set)


def broadcast_async(tensor: Any, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start a broadcast. Eager only."""
    return _np_ops.broadcast_async(_eager(tensor, "broadcast_async"), root_rank, name, process_set)


def alltoall_async(tensor: Any, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``. Eager only."""
    return _np_ops.alltoall_async(_eager(tensor, "alltoall_async"),
                                  None if splits is None else np.asarray(splits), name, process_set)


def reducescatter_async(tensor: Any, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start a reducescatter. Eager only."""
    return _np_ops.reducescatter_async(_eager(tensor, "reducescatter_async"), name, op, process_set,
                                       prescale_factor, postscale_factor)


def grouped_reducescatter_async(tensors: Sequence[Any], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start a grouped reducescatter. Eager only."""
    return _np_ops.grouped_reducescatter_async([_eager(t, "grouped_reducescatter_async") for t in tensors],
                                               name, op, process_set, prescale_factor, postscale_factor)


poll = _np_ops.poll


def synchronize(handle: int) -> Any:
    """Wait for ``handle``'s operation; return its output as JAX arrays (same structure as torch's)."""
    out = _np_ops.synchronize(handle)
    return jax.tree_util.tree_map(jnp.asarray, out)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of the set calls ``barrier`` (eager)."""
    _np_ops.barrier(process_set)


def join() -> int:
    """Declare this rank out of data; returns the last rank to join (eager; see ``horovod.torch.join``)."""
    return _np_ops.join()

