"""An ordered host call inside compiled JAX programs that hands the host function NumPy arrays.

``jax.experimental.io_callback`` first copies every operand into a new JAX array
(``device_put``) before the Python function sees it: for a gradient set that is one more full copy
and a Python object per array. This primitive lowers to the same ordered host callback
(``emit_python_callback`` with the ordered-IO effect token, so calls keep program order and are
never removed) but passes the operands as the NumPy views that XLA's CPU runtime provides.

It uses JAX internals (``jax._src``) that the pinned JAX release has; where they are missing the
binding falls back to ``io_callback`` (same semantics, one copy more).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental import io_callback

__all__ = ["host_call"]

try:
    from jax._src import callback as _cb
    from jax._src import core as _core
    from jax._src import dispatch as _dispatch
    from jax._src.interpreters import mlir as _mlir
    from jax.extend.core import Primitive

    _EFFECT = _cb._OrderedIOEffect
    _emit = _cb.emit_python_callback
    _host_p: Any = Primitive("horovod_host_call")
    _host_p.multiple_results = True
    _host_p.def_impl(functools.partial(_dispatch.apply_primitive, _host_p))

    def _abstract(*avals: Any, fn: Callable[..., Any], result_avals: tuple[Any, ...]) -> Any:
        return result_avals, {_EFFECT}

    def _lower(ctx: Any, *args: Any, fn: Callable[..., Any], result_avals: tuple[Any, ...]) -> Any:
        token = ctx.tokens_in.get(_EFFECT)
        result, token, _ = _emit(ctx, lambda *xs: tuple(fn(*xs)), token, list(args), ctx.avals_in,
                                 ctx.avals_out, has_side_effect=True, returns_token=True)
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(_mlir.TokenSet({_EFFECT: token})))
        return result

    _host_p.def_effectful_abstract_eval(_abstract)
    _mlir.register_lowering(_host_p, _lower)
except (ImportError, AttributeError):  # another JAX release: the public route
    _host_p = None


def host_call(fn: Callable[..., Sequence[Any]], specs: Sequence[jax.ShapeDtypeStruct],
              args: Sequence[Any]) -> list[Any]:
    """``fn(*numpy_arrays) -> list of numpy arrays`` as an ordered effect of the traced program."""
    if _host_p is None:
        return list(io_callback(fn, list(specs), *args, ordered=True))
    avals = tuple(_core.ShapedArray(s.shape, s.dtype) for s in specs)
    return list(_host_p.bind(*args, fn=fn, result_avals=avals))
