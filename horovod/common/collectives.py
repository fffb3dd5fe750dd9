"""Framework-neutral submission of collectives on NumPy arrays: naming, argument checks, requests.

Every binding (``horovod.numpy``, ``horovod.torch``, ``horovod.tensorflow``) converts its tensors to
C-contiguous NumPy arrays (without copying where the framework allows it) and calls these
functions. Policy lives here once: operation names, the Average/``average=`` rules, process-set
membership, root and split checks. Each function returns a ``Handle`` at once; its ``wait()``
gives a list of output arrays, one per input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

from horovod.common.backends import half
from horovod.common.context import get_context
from horovod.common.dtypes import (
    ADASUM_DTYPES,
    FLOAT_DTYPES,
    HALF_DTYPES,
    MOVE_DTYPES,
    REDUCE_DTYPES,
    check_reduce_op,
)
from horovod.common.engine.executor import end_to_end
from horovod.common.engine.handles import Handle
from horovod.common.engine.negotiation import ArgumentError
from horovod.common.exceptions import HorovodError
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.types import ReduceOp, Request, RequestType
from horovod.common.util import op_from_average

__all__ = [
    "ARGUMENT_ERRORS", "resolve_op", "op_name", "check_dtype",
    "check_adasum",
    "fail_everywhere",
    "allreduce_async", "allgather_async", "broadcast_async", "alltoall_async",
    "reducescatter_async", "barrier", "join", "group_of",
    "register_handle", "poll", "synchronize",
]

# What a call's argument checks raise. A call that fails them is failed on every rank of its set
# (``fail_everywhere``), never on this rank alone.
ARGUMENT_ERRORS = (ValueError, TypeError, NotImplementedError)


def resolve_op(average: bool | None, op: int | None, default: ReduceOp = ReduceOp.AVERAGE) -> ReduceOp:
    """Apply upstream's rules for the deprecated ``average=`` argument.

    Raises:
        ValueError: both ``op`` and ``average`` were given.
    """
    op = op_from_average(op, average, ReduceOp.AVERAGE, ReduceOp.SUM, stacklevel=3)
    if op is None:
        return default
    if type(op) is ReduceOp:
        return op
    try:
        return _OPS[int(op)]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"op={op!r} is not a reduction op; pass hvd.Average, hvd.Sum, hvd.Min, "
                         "hvd.Max, hvd.Product or hvd.Adasum.") from None


_OPS = {int(o): o for o in ReduceOp}
_OP_TEXT = {o: f"hvd.{o.name.capitalize()}" for o in ReduceOp}


# (kind, grouped) -> the key's prefix (an enum's ``.value`` is a Python-level property: once per call)
_PREFIXES = {(k, g): ("grouped_" if g else "") + k.value for k in RequestType for g in (False, True)}


def op_name(kind: RequestType, name: str | None, number: int, grouped: bool = False,
            process_set_id: int = 0) -> str:
    """The engine key of an operation: ``allreduce.<name>`` or ``allreduce.noname.<number>``.

    ``number`` counts the unnamed calls on the process set (``HandleCounter.unnamed``).
    Operations of a process set other than the global one get the suffix ``@ps<id>``: each set
    negotiates its own names (as each has its own queue upstream), so the same name, or the same
    auto-generated one, can be in flight in two sets at once.
    """
    prefix = _PREFIXES[kind, grouped]
    key = f"{prefix}.{name}" if name is not None else f"{prefix}.noname.{number}"
    return key if process_set_id == 0 else f"{key}@ps{process_set_id}"


def _key(ctx: Any, kind: RequestType, name: str | None, grouped: bool, ps_id: int) -> str:
    return op_name(kind, name, ctx.counter.unnamed(ps_id) if name is None else 0, grouped, ps_id)


def fail_everywhere(kind: RequestType, name: str | None, process_set: ProcessSet | int | None,
                    exc: BaseException, grouped: bool = False) -> NoReturn:
    """Fail a call that failed its argument checks on this rank on every rank of its set; raise ``exc``.

    A check can fail on some ranks only (splits or a root that differ per rank, a tensor of
    another dtype on one rank). Raising on those ranks alone would leave the others waiting
    forever for the operation. Instead this rank submits the operation's name all the same (an
    unnamed call takes the same number as a valid one), marked with the error; the coordinator
    fails the name on every member (``CollectiveMismatchError`` naming this rank and its error)
    and this rank raises ``exc`` once that answer has arrived. Errors that keep a rank out of the
    operation (not initialized, not a member of the set) stay local.
    """
    if isinstance(exc, HorovodError) or getattr(exc, "_hvd_reported", False):
        raise exc
    try:
        ps_id = process_set if isinstance(process_set, int) else group_of(process_set, kind.value)[0]
    except ValueError:
        raise exc from None
    ctx = get_context()
    req = Request(name=_key(ctx, kind, name, grouped, ps_id), kind=kind, dtype="uint8",
                  process_set_id=ps_id, payload=ArgumentError(type(exc).__name__, str(exc)),
                  rank=ctx.topology.rank)
    exc._hvd_reported = True  # type: ignore[attr-defined]  # outer layers must not report it again
    try:
        handle = ctx.prepare(req).submit([], None, wake=False)
    except (ValueError, HorovodError):  # the name is in flight here, or the engine stopped
        raise exc from None
    try:
        handle.wait()
    except HorovodError:
        pass  # the expected answer: the name failed on every rank
    raise exc


_DTYPE_NAMES: dict[np.dtype, str] = {}


def check_dtype(a: np.ndarray, allowed: frozenset[str], what: str) -> str:
    name = _DTYPE_NAMES.get(a.dtype)
    if name is None:  # a device plane's buffers name their dtype (str), NumPy's have a dtype object
        name = _DTYPE_NAMES[a.dtype] = a.dtype if isinstance(a.dtype, str) else a.dtype.name
    if name not in allowed:
        raise ValueError(f"Tensor type {name} is not supported by {what}. Supported: "
                         f"{', '.join(sorted(allowed))}.")
    return name


def group_of(process_set: ProcessSet | None, what: str) -> tuple[int, list[int]]:
    """Return (process set id, ranks) after checking the set is registered and includes this rank.

    Raises:
        ValueError: the set is not registered, or this rank is not a member.
    """
    ctx = get_context()
    ps = global_process_set if process_set is None else process_set
    ps_id = ps.process_set_id
    if ps_id is None or ps_id not in ctx.groups:
        raise ValueError(f"{what}: Process set provided does not exist, or has not been registered.")
    ranks = ctx.groups[ps_id].ranks
    if ctx.topology.rank not in ranks:
        raise ValueError(f"{what}: Rank {ctx.topology.rank} is not a member of the provided process set.")
    return ps_id, ranks


def check_adasum(process_set_id: int | None, dtype: str, what: str = "allreduce") -> None:
    """Upstream's preconditions of an Adasum allreduce on the CPU.

    Raises:
        NotImplementedError: a process set other than the global one, or a world size that is not
            a power of two (upstream's messages).
        ValueError: a dtype other than float16, float32 or float64.
    """
    from horovod.common.engine.adasum import is_power_of_two

    if process_set_id != 0:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    size = get_context().topology.size
    if not is_power_of_two(size):
        raise NotImplementedError(
            "Running Adasum with non-power of 2 ranks is not supported yet. "
            f"(This job has {size} ranks; run with a power of two, or use op=hvd.Average.)")
    if dtype not in ADASUM_DTYPES:
        raise ValueError(f"{what}: Adasum reduces float16, float32 and float64 tensors only, got {dtype}; "
                         "cast the tensor to a float type or use op=hvd.Sum.")


def _rows_dtype(arrays: Sequence[np.ndarray], allowed: frozenset[str], what: str, verb: str,
                shape: str) -> str:
    """``_one_dtype`` of arrays that are split or joined along their first dimension (none is a scalar)."""
    dtype = _one_dtype(arrays, allowed, what)
    for a in arrays:
        if a.ndim == 0:
            raise ValueError(f"{what}: a rank-zero tensor (scalar) cannot be {verb} along its first "
                             f"dimension; reshape it to shape {shape} first.")
    return dtype


def _one_dtype(arrays: Sequence[np.ndarray], allowed: frozenset[str], what: str) -> str:
    if not arrays:
        raise ValueError(f"{what}: no tensors given")
    if len(arrays) == 1:
        return check_dtype(arrays[0], allowed, what)
    names = {check_dtype(a, allowed, what) for a in arrays}
    if len(names) > 1:
        raise ValueError(f"{what}: all tensors of a grouped operation must have the same dtype, got "
                         f"{sorted(names)}")
    return names.pop()


def _check_wire(wire: str, dtype: str, op: ReduceOp, device: str, what: str) -> None:
    if wire not in HALF_DTYPES:
        raise ValueError(f"{what}: wire={wire!r} must be one of {sorted(HALF_DTYPES)}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what}: wire={wire!r} narrows floating-point arrays, got {dtype}; reduce "
                         "this array without wire=")
    if op == ReduceOp.ADASUM or device != "cpu":
        raise ValueError(f"{what}: wire={wire!r} is for host arrays and Sum, Average, Min, Max or "
                         "Product; narrow the array yourself (``astype``) for Adasum or a device plane")
    if wire == "bfloat16" and half.ml_bfloat16() is None:  # (registers NumPy's "bfloat16")
        raise ValueError(f"{what}: wire='bfloat16' needs the ml_dtypes package (a dependency of "
                         "horovod): pip install ml_dtypes")


def _check_out(arrays: Sequence[np.ndarray], out: Sequence[np.ndarray], what: str,
               inplace: bool) -> list[np.ndarray]:
    if inplace:
        raise ValueError(f"{what}: give either inplace=True or out=, not both")
    outs = list(out)
    if len(outs) != len(arrays):
        raise ValueError(f"{what}: {len(arrays)} inputs but {len(outs)} output arrays")
    for i, (a, o) in enumerate(zip(arrays, outs)):
        if o.shape != a.shape or o.dtype != a.dtype or not o.flags.c_contiguous or not o.flags.writeable:
            raise ValueError(f"{what}: output {i} must be a writeable C-contiguous {a.dtype} array of "
                             f"shape {a.shape}, got {o.dtype} {o.shape}")
    return outs


def _submit(kind: RequestType, arrays: Sequence[np.ndarray], outputs: list[np.ndarray] | None,
            name: str | None, grouped: bool, ps_id: int, dtype: str, device: str, splits: Any = None,
            wake: bool = True, **fields: Any) -> Handle:
    ctx = get_context()
    req = Request(name=_key(ctx, kind, name, grouped, ps_id), kind=kind, dtype=dtype,
                  shapes=tuple([a.shape for a in arrays]), process_set_id=ps_id, device=device,
                  rank=ctx.topology.rank, **fields)
    return ctx.prepare(req).submit(list(arrays), outputs, splits, wake=wake)


def allreduce_async(arrays: Sequence[np.ndarray], *, name: str | None = None,
                    op: ReduceOp = ReduceOp.AVERAGE, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet | None = None,
                    inplace: bool = False, grouped: bool = False, device: str = "cpu", wake: bool = True,
                    out: Sequence[np.ndarray] | None = None, wire: str | None = None) -> Handle:
    """Reduce each array across the ranks of ``process_set``; all its ranks must call this.

    ``out`` gives the output arrays (C-contiguous, same shapes and dtypes as the inputs), for a
    caller that keeps warm buffers across steps; by default outputs are new arrays (or the inputs,
    with ``inplace``).

    ``wire`` ("float16" or "bfloat16"; host arrays of a wider float dtype, not Adasum): reduce the
    arrays as that 16-bit dtype, as a compression's cast does (``tensor.to(wire)``, reduced, cast
    back into outputs of the arrays' own dtype). The request is the 16-bit one (it fuses and
    negotiates with 16-bit tensors); the arrays are narrowed on their way into the fusion buffer
    and widened on the way out (``host_buffers.NumpyBuffers.pack_narrowed``): no 16-bit copy of
    them is made.

    Raises (on every rank of the set when any rank's arguments are bad, see ``fail_everywhere``):
        ValueError: unsupported dtype, or ``out`` that does not match the inputs.
        NotImplementedError: ``op`` is Adasum with a non-power-of-two world size or a process set
            other than the global one (see ``check_adasum``).
        ValueError: (on this rank only) unregistered process set, non-member rank.
    """
    what = "grouped_allreduce" if grouped else "allreduce"
    ps_id, _ = group_of(process_set, what)
    try:
        dtype = _one_dtype(arrays, REDUCE_DTYPES, what)
        if wire is not None and wire != dtype:
            _check_wire(wire, dtype, op, device, what)
            dtype = wire
        check_reduce_op(dtype, op, what)
        if op == ReduceOp.ADASUM:
            check_adasum(ps_id, dtype, what)
        outputs = list(arrays) if inplace else None
        if out is not None:
            outputs = _check_out(arrays, out, what, inplace)
    except ARGUMENT_ERRORS as exc:
        fail_everywhere(RequestType.ALLREDUCE, name, ps_id, exc, grouped)
    # In place on views of one flat buffer (a flattened gradient set): a hint that lets every rank
    # reduce the group as one span if every rank's tensors lie so (see ``Request.flat``).
    flat = (inplace and grouped and device == "cpu" and len(arrays) > 1 and op != ReduceOp.ADASUM
            and end_to_end(arrays))
    return _submit(RequestType.ALLREDUCE, arrays, outputs, name, grouped,
                   ps_id, dtype, device, wake=wake, reduce_op=op, prescale=float(prescale_factor),
                   postscale=float(postscale_factor), flat=flat)


def allgather_async(arrays: Sequence[np.ndarray], *, name: str | None = None,
                    process_set: ProcessSet | None = None, grouped: bool = False,
                    device: str = "cpu", wake: bool = True) -> Handle:
    """Concatenate each array along dimension 0 over the ranks of the set, in rank order."""
    what = "grouped_allgather" if grouped else "allgather"
    ps_id, _ = group_of(process_set, what)
    try:
        dtype = _rows_dtype(arrays, MOVE_DTYPES, what, "gathered", "(1,)")
    except ARGUMENT_ERRORS as exc:
        fail_everywhere(RequestType.ALLGATHER, name, ps_id, exc, grouped)
    return _submit(RequestType.ALLGATHER, arrays, None, name, grouped, ps_id, dtype, device, wake=wake)


def broadcast_async(arrays: Sequence[np.ndarray], root_rank: int, *, name: str | None = None,
                    process_set: ProcessSet | None = None, inplace: bool = False,
                    grouped: bool = False, device: str = "cpu", wake: bool = True) -> Handle:
    """Copy the root rank's arrays to every rank of the set (``root_rank`` is a global rank).

    Raises:
        ValueError: ``root_rank`` is not a member of the process set.
    """
    what = "broadcast"
    ps_id, ranks = group_of(process_set, what)
    try:
        dtype = _one_dtype(arrays, MOVE_DTYPES, what)
        root = int(root_rank)
        if root not in ranks:
            raise ValueError(f"broadcast: root_rank {root} is not a rank of the process set (ranks "
                             f"{ranks if len(ranks) <= 16 else f'0..{len(ranks) - 1}'}). Pass a global "
                             "rank of a member.")
    except ARGUMENT_ERRORS as exc:
        fail_everywhere(RequestType.BROADCAST, name, ps_id, exc, grouped)
    return _submit(RequestType.BROADCAST, arrays, list(arrays) if inplace else None, name, grouped,
                   ps_id, dtype, device, wake=wake, root_rank=root)


def _alltoall_splits(rows: int, splits: Any, n: int) -> np.ndarray:
    if splits is None:
        if rows % n:
            raise ValueError("splits not provided, but first dimension of tensor is not an even "
                             f"multiple of the number of workers ({rows} rows, {n} workers).")
        return np.full(n, rows // n, np.int64)
    given = np.asarray(splits)
    if given.dtype.kind not in "iu" and given.size:
        raise ValueError(f"alltoall: splits must be integers (an int32 tensor or a list of ints), "
                         f"got {given.dtype.name} values {given.reshape(-1).tolist()[:8]}.")
    split_arr = given.astype(np.int64).reshape(-1)
    if split_arr.size != n:
        raise ValueError(f"alltoall: splits has {split_arr.size} entries but the process set has "
                         f"{n} ranks; give one entry per rank.")
    if (split_arr < 0).any():
        raise ValueError(f"alltoall: splits must not be negative, got {split_arr.tolist()}.")
    if split_arr.sum() > rows:
        raise ValueError(f"alltoall: splits add up to {int(split_arr.sum())} rows but the tensor has "
                         f"only {rows}.")
    return split_arr


def alltoall_async(array: np.ndarray, splits: Any = None, *, name: str | None = None,
                   process_set: ProcessSet | None = None, device: str = "cpu", wake: bool = True) -> Handle:
    """Send ``splits[i]`` rows of ``array`` to member i; receive rows from every member.

    The handle's result is ``[(output, received_splits)]``.

    Raises (on every rank of the set when any rank's arguments are bad, see ``fail_everywhere``):
        ValueError: splits that are not integers, of the wrong length, negative, or adding up to
            more than dimension 0; without splits, dimension 0 not divisible by the set size; a
            scalar input.
    """
    what = "alltoall"
    ps_id, ranks = group_of(process_set, what)
    try:
        dtype = _one_dtype([array], MOVE_DTYPES, what)
        if array.ndim == 0:
            raise ValueError("alltoall: a rank-zero tensor (scalar) cannot be split along its first "
                             "dimension.")
        split_arr = _alltoall_splits(array.shape[0], splits, len(ranks))
    except ARGUMENT_ERRORS as exc:
        fail_everywhere(RequestType.ALLTOALL, name, ps_id, exc)
    if split_arr.sum() < array.shape[0]:
        array = array[: int(split_arr.sum())]
    return _submit(RequestType.ALLTOALL, [array], None, name, False, ps_id, dtype, device,
                   splits=split_arr, wake=wake)


def reducescatter_async(arrays: Sequence[np.ndarray], *, name: str | None = None,
                        op: ReduceOp = ReduceOp.AVERAGE, process_set: ProcessSet | None = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        grouped: bool = False, device: str = "cpu", wake: bool = True) -> Handle:
    """Reduce each array across the set, then give member i its slice of dimension 0.

    With N rows and P members, members 0 .. N%P-1 receive N//P+1 rows and the others N//P.

    Raises (on every rank of the set when any rank's arguments are bad, see ``fail_everywhere``):
        NotImplementedError: an op other than Average or Sum (upstream raised a RuntimeError).
        ValueError: a scalar input, an unsupported dtype.
    """
    what = "grouped_reducescatter" if grouped else "reducescatter"
    ps_id, _ = group_of(process_set, what)
    try:
        if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise NotImplementedError(
                f"Reducescatter currently only supports AVERAGE and SUM (got op={_OP_TEXT.get(op, op)}).")
        dtype = _rows_dtype(arrays, REDUCE_DTYPES, what, "scattered", "(1,) or more rows")
        check_reduce_op(dtype, op, what)
    except ARGUMENT_ERRORS as exc:
        fail_everywhere(RequestType.REDUCESCATTER, name, ps_id, exc, grouped)
    return _submit(RequestType.REDUCESCATTER, arrays, None, name, grouped, ps_id, dtype, device,
                   wake=wake, reduce_op=op, prescale=float(prescale_factor), postscale=float(postscale_factor))


def register_handle(handle: Handle, post: Callable[[Any], Any]) -> int:
    """Enter ``handle`` in the integer-handle table of the bindings and return its number.

    ``post`` turns the engine's result (a list of arrays) into what ``synchronize`` returns; it
    also keeps the caller's buffers alive until then.
    """
    get_context().handles[handle.id] = (handle, post)
    return int(handle.id)


def poll(handle: int) -> bool:
    """Return True if the operation of ``handle`` finished, so ``synchronize`` will not block.

    Raises:
        ValueError: the handle is unknown (already synchronized or never issued).
    """
    entry = get_context().handles.get(handle)
    if entry is None:
        raise ValueError(f"poll(): unknown handle {handle}; it was already synchronized or never issued.")
    return entry[0].done()


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` and return its output (None for an unknown handle).

    The output is an array or tensor, a list/tuple of them for grouped operations, or
    ``(output, received_splits)`` for alltoall.

    Raises:
        HorovodInternalError: the operation failed (mismatch across ranks, transport failure,
            shutdown); the message names the tensor and the ranks.
    """
    entry = get_context().handles.pop(handle, None)
    if entry is None:
        return None
    h, post = entry
    if h._done and h.error is None:  # ``h.wait()``'s answer for a finished operation, inlined
        return post(h.result)
    return post(h.wait())


def barrier(process_set: ProcessSet | None = None) -> None:
    """Block until every rank of the set reaches the barrier."""
    ps_id, _ = group_of(process_set, "barrier")
    name = "barrier.noname" if ps_id == 0 else f"barrier.noname.{ps_id}"
    get_context().control(RequestType.BARRIER, name, process_set_id=ps_id)


def join() -> int:
    """Declare that this rank has no more data; block until every rank joined.

    While waiting, this rank contributes zeros to other ranks' allreduces. Returns the rank that
    joined last (the same value on every rank).
    """
    ctx = get_context()
    last = int(ctx.control(RequestType.JOIN, "join.noname"))
    # Every rank is past the join now; ranks that joined early skipped the others' unnamed calls.
    ctx.counter.restart_unnamed(0)
    return last
