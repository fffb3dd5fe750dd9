"""An ordered host call whose Python function reads XLA's operand buffers and writes its result buffers.

``jax``'s own host callbacks (``io_callback``, and ``emit_python_callback`` below them) copy every
operand into a new NumPy array before the Python function runs, and copy every returned array into
XLA's result buffer afterwards: for the ResNet-50 gradient set (100 MB) that is two full copies into
freshly faulted memory, measured at about 0.12 s of a 0.26 s step at np=2 (docs/jax.md,
"Performance"). This module registers one XLA FFI handler (``jax.ffi``, the typed custom-call ABI
of ``xla/ffi/api/c_api.h``) written in Python with ``ctypes``: it wraps the operand and result
buffers as NumPy views without copying, and the host function fills the results in place (the
engine reduces straight from XLA's operands into XLA's results).

The handler is one C-callable Python function; the call's ``key`` attribute names the host
function (kept in ``_CALLS`` for the life of the process, one entry per lowering). Calls carry the
ordered-IO effect token as ``emit_python_callback`` does, so they keep program order and are never
removed. Only the CPU platform; a JAX release without ``jax.ffi`` or with another FFI major
version makes ``available()`` False and the caller uses ``horovod.jax._callback``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["available", "host_call_into"]

_TARGET = "horovod_host_call_into"
_TOKEN = 17  # XLA_FFI_DataType_TOKEN
_METADATA = 1  # XLA_FFI_Extension_Metadata
_API_MAJOR, _API_MINOR = 0, 3  # the FFI API version this module was written against (c_api.h)
_ERR_UNKNOWN = 2


class _ExtBase(ctypes.Structure):
    pass


_ExtBase._fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
                     ("next", ctypes.POINTER(_ExtBase))]


class _ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major_version", ctypes.c_int), ("minor_version", ctypes.c_int)]


class _Metadata(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", _ApiVersion),
                ("traits", ctypes.c_uint32), ("state_type_id", ctypes.c_int64)]


class _MetadataExt(ctypes.Structure):
    _fields_ = [("extension_base", _ExtBase), ("metadata", ctypes.POINTER(_Metadata))]


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("message", ctypes.c_char_p), ("errc", ctypes.c_int)]


_ErrorCreate = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_ErrorCreateArgs))


class _Api(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api_version", _ApiVersion), ("internal_api", ctypes.c_void_p),
                ("error_create", _ErrorCreate)]


class _Buffer(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("dtype", ctypes.c_int), ("data", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("dims", ctypes.POINTER(ctypes.c_int64))]


class _List(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets have one layout
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.c_void_p),
                ("items", ctypes.POINTER(ctypes.POINTER(_Buffer)))]


class _ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Scalar(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("value", ctypes.POINTER(ctypes.c_uint64))]


class _Attrs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.POINTER(ctypes.c_int)),
                ("names", ctypes.POINTER(ctypes.POINTER(_ByteSpan))),
                ("attrs", ctypes.POINTER(ctypes.POINTER(_Scalar)))]


class _CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.POINTER(_ExtBase)),
                ("api", ctypes.POINTER(_Api)), ("ctx", ctypes.c_void_p), ("stage", ctypes.c_int),
                ("args", _List), ("rets", _List), ("attrs", _Attrs), ("future", ctypes.c_void_p)]


_HANDLER_T = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))

# key -> (fn, operand (shape, dtype) list, result (shape, dtype) list)
_CALLS: dict[int, tuple[Callable[..., None], list[tuple[tuple[int, ...], np.dtype]],
                        list[tuple[tuple[int, ...], np.dtype]]]] = {}
_KEYS = itertools.count(1)
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


class _Memory:
    """The owner of a NumPy view of one XLA buffer (``numpy.asarray`` reads its array interface)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str, readonly: bool) -> None:
        self.__array_interface__ = {"data": (ptr, readonly), "shape": shape, "typestr": typestr,
                                    "version": 3}


_PTRS = ctypes.POINTER(ctypes.c_void_p)
_DATA_AT = _Buffer.data.offset
_DTYPE_AT = _Buffer.dtype.offset


def _views(lst: Any, specs: Sequence[tuple[tuple[int, ...], np.dtype]], readonly: bool) -> list[np.ndarray]:
    """NumPy views of the call's buffers (tokens skipped), shaped and typed as ``specs``."""
    n = lst.size
    addrs = ctypes.cast(lst.items, _PTRS)[:n] if n else []
    out: list[np.ndarray] = []
    k = 0
    for addr in addrs:
        if ctypes.c_int.from_address(addr + _DTYPE_AT).value == _TOKEN:
            continue
        shape, dtype = specs[k]
        k += 1
        ptr = ctypes.c_void_p.from_address(addr + _DATA_AT).value
        if not ptr or 0 in shape:
            arr = np.zeros(shape, dtype)
            arr.flags.writeable = not readonly
            out.append(arr)
            continue
        arr = np.asarray(_Memory(ptr, shape, dtype.str, readonly))
        if arr.dtype != dtype:  # typestr loses extension types (bfloat16): same bytes, their dtype
            arr = arr.view(dtype)
        out.append(arr)
    if k != len(specs):
        raise RuntimeError(f"XLA passed {k} buffers, expected {len(specs)}")
    return out


def _error(frame: Any, exc: BaseException) -> int:
    msg = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
    args = _ErrorCreateArgs(ctypes.sizeof(_ErrorCreateArgs), None, msg, _ERR_UNKNOWN)
    return frame.api.contents.error_create(ctypes.byref(args)) or 0


def _handle(frame_p: Any) -> int:
    frame = frame_p.contents
    ext = frame.extension_start
    if ext and ext.contents.type == _METADATA:  # XLA asks which FFI version the handler speaks
        meta = ctypes.cast(ext, ctypes.POINTER(_MetadataExt)).contents.metadata.contents
        meta.api_version = _ApiVersion(ctypes.sizeof(_ApiVersion), None, _API_MAJOR, _API_MINOR)
        meta.traits = 0
        return 0
    try:
        key = None
        attrs = frame.attrs
        for i in range(attrs.size):
            name = attrs.names[i].contents
            if ctypes.string_at(name.ptr, name.len) == b"key":
                key = int(attrs.attrs[i].contents.value[0])
        fn, ins, outs = _CALLS[key]  # type: ignore[index]
        fn(_views(frame.args, ins, True), _views(frame.rets, outs, False))
        return 0
    except BaseException as exc:  # noqa: BLE001 - reported to XLA, which raises JaxRuntimeError
        try:
            return _error(frame, exc)
        except BaseException:  # noqa: BLE001
            return 0


def _setup() -> bool:
    import jax
    import jax.ffi as jffi
    from jax._src import core as _core
    from jax._src import dispatch as _dispatch
    from jax._src.interpreters import mlir as _mlir
    from jax.extend.core import Primitive

    handler = _HANDLER_T(_handle)
    jffi.register_ffi_target(_TARGET, jffi.pycapsule(handler), platform="cpu")
    from jax._src import callback as _cb

    effect = _cb._OrderedIOEffect
    prim = Primitive("horovod_host_call_into")
    prim.multiple_results = True
    prim.def_impl(lambda *a, **k: _dispatch.apply_primitive(prim, *a, **k))

    def abstract(*avals: Any, key: int, result_avals: tuple[Any, ...], alias: bool) -> Any:
        return result_avals, {effect}

    def lower(ctx: Any, *args: Any, key: int, result_avals: tuple[Any, ...], alias: bool) -> Any:
        token = ctx.tokens_in.get(effect)
        # Listed as the module's host callback (never called through it): JAX then keeps the
        # executable out of the persistent compilation cache, whose entry would name this
        # process's key, and the function lives as long as the executable.
        ctx.module_context.add_host_callback(_CALLS[key][0])
        ctx2 = dataclasses.replace(ctx, avals_in=[_core.abstract_token, *ctx.avals_in],
                                   avals_out=[_core.abstract_token, *ctx.avals_out])
        extra: dict[str, Any] = {"operand_output_aliases": {i: i for i in range(1, len(args) + 1)}} if alias else {}
        op = jffi.build_ffi_lowering_function(_TARGET, has_side_effect=True, **extra)(
            ctx2, token, *args, key=np.uint64(key))
        token, *results = op.results
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(_mlir.TokenSet({effect: token})))
        return results

    prim.def_effectful_abstract_eval(abstract)
    _mlir.register_lowering(prim, lower, platform="cpu")
    _STATE.update(handler=handler, prim=prim, core=_core, jax=jax)
    return True


def available() -> bool:
    """Whether the in-place host call works with this JAX (set up once, on first use)."""
    with _LOCK:
        if "ok" not in _STATE:
            if os.environ.get("HOROVOD_JAX_FFI", "1").strip().lower() in ("0", "false", "no", "off"):
                _STATE["ok"] = False  # the user asked for jax's own (copying) host callbacks
                return False
            try:
                import jax

                _STATE["ok"] = jax.default_backend() == "cpu" and _setup()
            except Exception:  # noqa: BLE001 - another JAX release: the copying route
                _STATE["ok"] = False
        return bool(_STATE["ok"])


def host_call_into(fn: Callable[[list[np.ndarray], list[np.ndarray]], None], specs: Sequence[Any],
                   args: Sequence[Any], alias: bool = False) -> list[Any]:
    """``fn(inputs, outputs)``: read the operands (read-only NumPy views of XLA's buffers) and fill
    ``outputs`` (writable views of XLA's result buffers), as an ordered effect of the traced program.
    ``specs`` are the results' ``jax.ShapeDtypeStruct``s. With ``alias`` (same shapes and dtypes
    in and out) result i is operand i's buffer, holding the operand's value on entry: XLA reuses the
    operand's memory when nothing reads the operand later (a donated argument, an intermediate),
    else copies it first. Call only when ``available()``."""
    core = _STATE["core"]
    key = next(_KEYS)
    _CALLS[key] = (fn, [(tuple(a.shape), np.dtype(a.dtype)) for a in args],
                   [(tuple(s.shape), np.dtype(s.dtype)) for s in specs])
    avals = tuple(core.ShapedArray(tuple(s.shape), s.dtype) for s in specs)
    return list(_STATE["prim"].bind(*args, key=key, result_avals=avals, alias=bool(alias)))
