"""Checkpoints that each rank writes only its part of, and that load at any world size
(``hvd.checkpoint.save`` / ``hvd.checkpoint.load``).

The on-disk format is ``torch.distributed.checkpoint``'s (DCP): a directory of ``__<rank>_0.distcp``
data files and one ``.metadata`` index, written through DCP's ``DefaultSavePlanner`` and
``FileSystemWriter``. DCP normally exchanges its plans over a ``torch.distributed`` process group;
here Horovod's object collectives carry them instead (plans to the coordinator, results back), so
no process group is needed. Loading needs no communication at all: each process reads what it
needs (``torch.distributed.checkpoint.load(..., no_dist=True)``), so a checkpoint saved at N ranks
loads at M ranks or in one plain process.

Keys (a flat state dict, readable by any DCP job):

- ``model.<name>``: the model's ``state_dict()`` entries, each written by one rank (the entries
  are split across ranks by bytes);
- ``optim.state.<parameter name>.<state key>``: the optimizer state of each parameter, written by
  its owner (a ``ZeroRedundancyOptimizer``'s shard) or, for an unsharded optimizer, split across
  ranks like the model;
- ``optim.param_groups``: the groups' options with their parameters' names (rank 0);
- with a list of optimizers, each one's ``state`` and ``param_groups`` under ``optim.<i>.``
  instead (``optim.0.state.<parameter name>.<state key>``);
- ``extra``: the ``extra`` dict given to ``save`` (rank 0); ``horovod``: format version and the
  world size it was saved at (rank 0).

Write, then commit (``_checkpoint_dir``): ``path`` is a directory of versions. Rank 0 first checks
that ``path`` is new, empty or a checkpoint of ours (anything else is refused on every rank, and
nothing there is touched) and makes ``path/v<k>.partial``; the ranks write and fsync their files
there; after every rank has written, rank 0 writes ``.metadata`` and renames the directory to
``path/v<k>`` (the commit point), and only then removes the older versions. ``load`` reads the
newest committed version, so a crash at any point leaves the previous checkpoint or the new one.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import math
import os
import re
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from horovod.common.basics import is_initialized, rank, size
from horovod.common.job_state import next_number
from horovod.common.objects import allgather_object, broadcast_object
from horovod.torch import _checkpoint_dir as layout
from horovod.torch.reducer import RowShard, ShardedStateful
from horovod.torch.zero import partition_by_bytes

__all__ = ["save", "load", "latest", "SaveHandle", "FORMAT_VERSION", "release_buffers"]

FORMAT_VERSION = 2  # 2: the versioned directory, the optimizer's class and hyper-parameter names


def _world() -> tuple[int, int]:
    return (rank(), size()) if is_initialized() else (0, 1)


def _nbytes(v: Any) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 64


def _param_names(model: torch.nn.Module | None, params: list[torch.Tensor]) -> list[str]:
    names = {}
    if model is not None:
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    return [names.get(id(p), f"param{i}") for i, p in enumerate(params)]


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _algorithm(optimizer: torch.optim.Optimizer) -> type:
    """The optimizer class whose state a checkpoint holds: the wrapped class of a
    ``ZeroRedundancyOptimizer`` or a ``DistributedOptimizer``, else the optimizer's own class."""
    inner = getattr(optimizer, "optim", None)  # a ZeroRedundancyOptimizer's local optimizer
    if isinstance(inner, torch.optim.Optimizer):
        return type(inner)
    for cls in type(optimizer).__mro__:  # DistributedOptimizer: a subclass of a horovod mixin
        if not any(c.__module__.startswith("horovod.") for c in cls.__mro__):
            return cls
    return type(optimizer)


def _hyperparameters(groups: list[dict[str, Any]]) -> list[str]:
    return sorted({k for g in groups for k in g if k != "params"})


def _row_layout(model: torch.nn.Module | None, n: int, what: str) -> dict[str, RowShard]:
    """The rows each sharded parameter of a fully sharded ``model`` holds here (``{}`` for any
    other model); its process sets must span the job."""
    from horovod.torch.fully_shard import row_shards, shard_process_sets

    for ps in shard_process_sets(model):
        if ps.size() != n:
            raise ValueError(f"hvd.checkpoint.{what}: {type(model).__name__} is fully sharded over "
                             f"{ps.size()} ranks (process set {ps}), the job has {n}; checkpoints "
                             "of a fully sharded model need it sharded over the global process set")
    return row_shards(model)


def _add_rows(out: dict[str, Any], rows: dict[str, RowShard], key: str, v: torch.Tensor,
              rs: RowShard) -> None:
    """Write ``v``, this rank's rows of the tensor ``rs.shape``, as its chunk of the whole tensor
    (a 0-d tensor: whole, by the rank that holds its one row; nothing where no row is held)."""
    if tuple(v.shape) != rs.local_shape:
        raise ValueError(f"hvd.checkpoint.save: {key} has shape {tuple(v.shape)} on rank "
                         f"{_world()[0]}, its rows {rs.lo}:{rs.hi} of {rs.shape} have {rs.local_shape}")
    if rs.hi <= rs.lo:
        return
    if not rs.shape:
        out[key] = v.reshape(())
    else:
        out[key], rows[key] = v, rs


def _per_element(v: Any, rs: RowShard | None) -> bool:
    """Whether the optimizer state ``v`` of a sharded parameter is per element (rows, like the
    shard) rather than one value for the parameter (``step``)."""
    return rs is not None and isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == rs.local_shape


def _optimizer_list(optimizer: Any) -> list[tuple[str, torch.optim.Optimizer]]:
    """``(key prefix, optimizer)`` of each optimizer given to ``save``/``load``: ``optim`` for one,
    ``optim.<i>`` for each of a list (several optimizers, as a GAN's or Lightning's)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, (list, tuple)):
        return [(f"optim.{i}", o) for i, o in enumerate(optimizer)]
    return [("optim", optimizer)]


def _header(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    cls = _algorithm(optimizer)
    return {"optimizer": cls.__name__, "optimizer_module": cls.__module__,
            "hyperparameters": _hyperparameters(optimizer.param_groups)}


def _local_part(model: torch.nn.Module | None, optimizer: Any, extra: dict[str, Any] | None, r: int,
                n: int) -> tuple[dict[str, Any], dict[str, RowShard]]:
    """The flat state dict this rank writes, and which of its entries are rows of a larger
    tensor (a fully sharded parameter's, or their optimizer state's)."""
    out: dict[str, Any] = {}
    rows: dict[str, RowShard] = {}
    layout = _row_layout(model, n, "save")
    if model is not None:
        sd = model.state_dict()
        items = [(k, v) for k, v in sd.items() if k not in layout]
        owner = partition_by_bytes([_nbytes(v) for _, v in items], n)
        out.update({f"model.{k}": v for (k, v), o in zip(items, owner) if o == r})
        for key, rs in layout.items():
            if key in sd:
                _add_rows(out, rows, f"model.{key}", sd[key], rs)
    optimizers = _optimizer_list(optimizer)
    for prefix, opt in optimizers:
        _optimizer_part(out, rows, prefix, opt, model, layout, r, n)
    if r == 0:
        out["extra"] = dict(extra or {})
        out["horovod"] = {"format": FORMAT_VERSION, "world_size": n, "optimizer": None}
        if isinstance(optimizer, (list, tuple)):
            out["horovod"]["optimizers"] = [_header(o) for _, o in optimizers]
        elif optimizer is not None:
            out["horovod"].update(_header(optimizer))
    return out, rows


def _optimizer_part(out: dict[str, Any], rows: dict[str, RowShard], prefix: str,
                    optimizer: torch.optim.Optimizer, model: torch.nn.Module | None,
                    layout: dict[str, RowShard], r: int, n: int) -> None:
    """Add what this rank writes of ``optimizer`` to ``out`` under ``prefix``."""
    params = _optimizer_params(optimizer)
    names = _param_names(model, params)
    if isinstance(optimizer, ShardedStateful):
        kind = type(optimizer).__name__
        if optimizer.num_shards != n:
            raise ValueError(f"hvd.checkpoint.save: the {kind} is sharded over "
                             f"{optimizer.num_shards} ranks, the job has {n}; checkpoints of a "
                             f"{kind} need it on the global process set")
        if layout:
            raise ValueError(f"hvd.checkpoint.save: a {kind} over a fully sharded model: its "
                             "parameters are already shards; step them with a plain torch "
                             "optimizer (torch.optim.AdamW(model.parameters()))")
        mine = optimizer.local_state_dict()
    else:
        full = optimizer.state_dict()["state"]
        # ownership by the whole parameter's bytes: the same on every rank
        sizes = [math.prod(layout[nm].shape) * p.element_size() if nm in layout
                 else p.numel() * p.element_size() for nm, p in zip(names, params)]
        owner = partition_by_bytes(sizes, n)
        mine = {}
        for i, st in full.items():
            row = layout.get(names[i])
            for sk, v in st.items():
                if row is not None and _per_element(v, row):
                    _add_rows(out, rows, f"{prefix}.state.{names[i]}.{sk}", v, row)
                elif owner[i] == r:
                    mine.setdefault(i, {})[sk] = v
    for i, st in mine.items():
        for sk, v in st.items():
            out[f"{prefix}.state.{names[i]}.{sk}"] = v
    if r == 0:
        groups, start = [], 0
        for g in optimizer.param_groups:
            k = len(g["params"])
            groups.append({**{a: b for a, b in g.items() if a != "params"},
                           "params": names[start:start + k]})
            start += k
        out[f"{prefix}.param_groups"] = groups


class _Snapshot:
    """One host buffer that ``save(blocking=False)`` copies a rank's tensors into, kept for the
    next save: a buffer whose pages are already mapped copies several times faster than fresh
    allocations (``release_buffers()`` frees it)."""

    lock = threading.Lock()
    buf: torch.Tensor | None = None
    busy = False

    @classmethod
    def take(cls, part: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """``part`` with every tensor replaced by a copy in the host buffer (a fresh buffer when
        the kept one is too small or still being written); True if the kept one was taken."""
        spans, end = {}, 0
        for k, v in part.items():
            if isinstance(v, torch.Tensor):
                spans[k] = end
                end += -(-v.numel() * v.element_size() // 64) * 64  # 64-byte aligned
        with cls.lock:
            kept = not cls.busy and cls.buf is not None and cls.buf.numel() >= end
            if kept:
                cls.busy = True
                buf = cls.buf
            elif not cls.busy:
                cls.buf, cls.busy, kept = torch.empty(end, dtype=torch.uint8), True, True
                buf = cls.buf
            else:
                buf = torch.empty(end, dtype=torch.uint8)
        assert buf is not None
        out = dict(part)
        with torch.no_grad():
            for k, off in spans.items():
                v = part[k]
                dst = buf[off:off + v.numel() * v.element_size()].view(v.dtype).view(v.shape)
                dst.copy_(v.detach())
                out[k] = dst
        for k, v in part.items():  # written later: a copy, as of now
            if k not in spans:
                out[k] = copy.deepcopy(v)
        return out, kept

    @classmethod
    def give_back(cls) -> None:
        with cls.lock:
            cls.busy = False


def release_buffers() -> None:
    """Free the host buffer that non-blocking saves keep for the next one (it is as large as
    this rank's part of a checkpoint)."""
    with _Snapshot.lock:
        if not _Snapshot.busy:
            _Snapshot.buf = None


def _save_planner(rows: dict[str, RowShard]) -> Any:
    """DCP's default planner (objects stay one entry each), writing each entry of ``rows`` as
    the chunk at its first row of the whole tensor: the index then holds whole tensors that
    load at any world size (DCP checks that the chunks tile each tensor)."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class _Planner(DefaultSavePlanner):
        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            items = []
            for item in plan.items:
                rs = rows.get(item.index.fqn)
                if rs is None:
                    items.append(item)
                    continue
                v = self.state_dict[item.index.fqn]
                offsets = torch.Size((rs.lo,) + (0,) * (len(rs.shape) - 1))
                items.append(WriteItem(
                    index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(rs.local_shape)),
                        properties=TensorProperties.create_from_tensor(v), size=torch.Size(rs.shape))))
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

        def lookup_object(self, index: Any) -> Any:
            if index.fqn in rows:
                return self.state_dict[index.fqn]
            return super().lookup_object(index)

    return _Planner(flatten_state_dict=False)


class _Failed(str):
    """A rank's error while planning, sent to the other ranks in place of its plan."""


class SaveHandle:
    """A save in progress (``save(..., blocking=False)``): ``wait()`` (collective: every rank
    calls it) finishes it and raises what failed on any rank. A handle never waited for is
    finished at interpreter exit (see ``save``)."""

    def __init__(self, path: str, tmp: str, part: dict[str, Any], r: int, n: int, name: str,
                 background: bool, kept: bool = False, created: bool = False,
                 rows: dict[str, RowShard] | None = None) -> None:
        self.path, self._tmp, self._part, self._rows = path, tmp, part, dict(rows or {})
        self._r, self._n, self._name, self._kept, self._created = r, n, name, kept, created
        self.version: str | None = None  # the committed version's directory, once committed
        self._writer: Any = None
        self._metadata: Any = None
        self._result: Any = None
        self._error: RuntimeError | None = None
        self._done = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._write, name="hvd-checkpoint", daemon=True)
            self._thread.start()
        else:
            self._write()

    def _write(self) -> None:
        """Plan (the plans travel by Horovod's object collectives, every rank taking part even
        after an error of its own) and write this rank's file."""
        try:
            planner, plan = self._plan()
            fut = self._writer.write_data(plan, planner)
            fut.wait()
            self._result = fut.value()
        except BaseException as exc:  # noqa: BLE001 - reported by wait() on every rank
            self._result = exc
        finally:
            self._part = {}
            if self._kept:
                _Snapshot.give_back()

    def _plan(self) -> tuple[Any, Any]:
        from torch.distributed.checkpoint import FileSystemWriter

        r, n, name = self._r, self._n, self._name
        planner = _save_planner(self._rows)
        local: Any
        try:
            # rank 0 made the version's directory (``save``); every file is fsync'd when written
            self._writer = FileSystemWriter(self._tmp, sync_files=True)
            planner.set_up_planner(state_dict=self._part, storage_meta=self._writer.storage_meta(),
                                   is_coordinator=r == 0)
            self._writer.set_up_storage_writer(r == 0, rank=r, use_collectives=True)
            local = self._writer.prepare_local_plan(planner.create_local_plan())
        except Exception as exc:  # noqa: BLE001 - sent to every rank instead of the plan
            local = _Failed(f"rank {r} (planning): {exc!r}")
        plans = [local] if n == 1 else allgather_object(local, name=f"{name}.plans")
        failed = [p for p in plans if isinstance(p, _Failed)]
        out: Any = None
        if not failed and r == 0:
            try:
                plans, self._metadata = planner.create_global_plan(plans)
                out = self._writer.prepare_global_plan(plans)
            except Exception as exc:  # noqa: BLE001 - sent to every rank instead of the plan
                out = _Failed(f"rank 0 (global plan): {exc!r}")
        if not failed and n > 1:
            out = broadcast_object(out, 0, name=f"{name}.global")
        if isinstance(out, _Failed):
            failed.append(out)
        if failed:
            raise RuntimeError("; ".join(failed))
        return planner, planner.finish_plan(out[r])

    def done(self) -> bool:
        """True once this rank's files are written (``wait()`` still commits)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str:
        """Wait for every rank's files, then commit (rank 0 writes the index and renames the
        version's directory into place); returns the checkpoint's path. Raises ``RuntimeError``
        on every rank if any rank failed to write (nothing is committed then; a second
        ``wait()`` raises it again)."""
        if self._done:
            if self._error is not None:
                raise self._error
            return self.path
        if self._thread is not None:
            self._thread.join()
        self._done = True
        _pending.pop(os.path.realpath(self.path), None)
        results = [self._result] if self._n == 1 else allgather_object(
            self._result, name=f"{self._name}.results")
        by_error: dict[str, list[str]] = {}
        for i, res in enumerate(results):
            if isinstance(res, BaseException):
                by_error.setdefault(str(res) if isinstance(res, RuntimeError) else repr(res),
                                    []).append(str(i))
        failed = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(rs)}: {msg}"
                  for msg, rs in by_error.items()]
        status: Any = None
        if not failed and self._r == 0:
            try:
                self._writer.finish(metadata=self._metadata, results=results)  # fsync'd .metadata
                status = layout.commit(self._tmp)
            except BaseException as exc:  # noqa: BLE001 - reported on every rank
                status = _Failed(f"rank 0 (commit): {exc!r}")
        if self._n > 1:
            status = broadcast_object(status, 0, name=f"{self._name}.commit")
        if failed or isinstance(status, _Failed):
            if self._r == 0:
                layout.abandon(self._tmp, self._created)
            self._error = RuntimeError(
                f"hvd.checkpoint.save({self.path!r}) failed, nothing was committed: "
                + "; ".join(failed + ([status] if isinstance(status, _Failed) else [])))
            raise self._error
        self.version = status
        return self.path

    def finish_at_exit(self) -> None:
        """Commit at interpreter exit if every rank can still take part; else say loudly on
        stderr that the checkpoint was not committed."""
        from horovod.common import lifecycle

        reason = None
        if self._n > 1:
            if lifecycle.failure() is not None or getattr(sys, "last_value", None) is not None:
                reason = ("this rank is exiting after an error, so the other ranks cannot be "
                          "expected to finish the save with it")
            elif not is_initialized():
                reason = "Horovod was shut down (hvd.shutdown()) before the save was committed"
        if reason is None:
            try:
                self.wait()
                if self._r == 0:
                    print(f"hvd.checkpoint: committed the non-blocking save to {self.path!r} at "
                          "exit (its handle.wait() was never called)", file=sys.stderr, flush=True)
                return
            except BaseException as exc:  # noqa: BLE001 - reported below
                reason = str(exc)
        try:
            now = latest(self.path)
        except (OSError, ValueError):
            now = None
        print(f"hvd.checkpoint: ERROR (rank {self._r}): the non-blocking save to {self.path!r} "
              f"was NOT committed at exit: {reason}. The checkpoint there is "
              + (f"still the previous one ({now!r})" if now else "missing: there is none")
              + ". Call handle.wait() on every rank before the script ends.",
              file=sys.stderr, flush=True)


_pending: dict[str, SaveHandle] = {}  # the non-blocking saves not waited for, by real path
_atexit_registered = [False]


def _finish_pending_at_exit() -> None:
    """``atexit``: finish every non-blocking save whose ``wait()`` was never called, in the
    order they started (the same on every rank). Registered at the first non-blocking save, so
    it runs before Horovod's own shutdown at exit."""
    for handle in list(_pending.values()):
        handle.finish_at_exit()


def save(path: str | os.PathLike, model: torch.nn.Module | None = None,
         optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
         extra: dict[str, Any] | None = None,
         blocking: bool = True) -> SaveHandle | str:
    """Save ``model``, ``optimizer`` and ``extra`` as a new version of the checkpoint directory
    ``path``, each rank writing only its part. Collective: every rank calls it with the same path
    (on a file system every rank sees).

    ``optimizer`` may be a list of optimizers (a GAN's, Lightning's several): each one's state is
    kept under its index (``optim.<i>.``), and ``load`` takes the same list, in the same order.

    ``path`` must be new, an empty directory or a checkpoint written here: a path that holds
    anything else (a file, a user's files) is refused on every rank before anything is written,
    and nothing there is touched. The new version commits with one rename after every file is
    written and fsync'd; the previous version is removed only after that. ``load`` reads the
    newest committed version, so a crash at any point leaves the old checkpoint or the new one.

    With ``blocking=False`` the tensors are first copied into one host buffer (kept for the next
    non-blocking save; ``release_buffers()`` frees it), then ``save`` returns: the plans are
    exchanged and the files written by a background thread while training continues, and the
    returned ``SaveHandle``'s ``wait()`` (on every rank) commits the checkpoint. A later save to
    the same path first finishes this one (saves to one path are serialized). A handle never
    waited for is committed at interpreter exit; where it cannot be (the rank is exiting after
    an error, or Horovod was shut down), the exit says so on stderr. Returns the path when
    blocking.

    Raises:
        FileExistsError: ``path`` is a file or holds something that is not part of a checkpoint
            (the message names it); on every rank, nothing written.
        RuntimeError: a rank failed to plan or write; raised on every rank, and nothing is
            committed.
    """
    path = os.fspath(path)
    r, n = _world()
    earlier = _pending.get(os.path.realpath(path))
    if earlier is not None:  # serialized: the earlier save to this path commits first
        try:
            earlier.wait()
        except RuntimeError as exc:
            raise RuntimeError(f"hvd.checkpoint.save({path!r}) was not started: the earlier "
                               f"non-blocking save to the same path, finished first, failed: "
                               f"{exc}") from exc
    name = f"checkpoint.save.{next_number('checkpoint.save')}"
    part, rows = _local_part(model, optimizer, extra, r, n)
    where: Any = None
    if r == 0:  # rank 0 checks the directory and makes the new version's; every rank learns it
        try:
            where = layout.prepare(path)
        except FileExistsError as exc:
            where = exc
        except OSError as exc:
            where = RuntimeError(f"hvd.checkpoint.save({path!r}) failed, nothing was committed: "
                                 f"rank 0 (preparing the directory): {exc!r}")
    if n > 1:
        where = broadcast_object(where, 0, name=f"{name}.dir")
    if isinstance(where, BaseException):
        raise where
    tmp, created = where
    kept = False
    if not blocking:
        part, kept = _Snapshot.take(part)
    handle = SaveHandle(path, tmp, part, r, n, name, background=not blocking, kept=kept,
                        created=created, rows=rows)
    if blocking:
        return handle.wait()
    _pending[os.path.realpath(path)] = handle
    if not _atexit_registered[0]:
        atexit.register(_finish_pending_at_exit)
        _atexit_registered[0] = True
    return handle


def latest(path: str | os.PathLike) -> str:
    """The directory of the newest committed version of the checkpoint at ``path`` (a
    ``torch.distributed.checkpoint`` directory: pass it as DCP's ``checkpoint_id`` to read the
    checkpoint without Horovod).

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: ``path`` holds no committed checkpoint.
    """
    return layout.resolve(os.fspath(path))


# ------------------------------------------------------------------------------ load
def _read_metadata(path: str) -> tuple[str, Any]:
    """The newest committed version's directory at ``path`` and its DCP index."""
    from torch.distributed.checkpoint import FileSystemReader

    for attempt in range(3):
        where = layout.resolve(path)
        if where == f"{path}.old":
            warnings.warn(f"hvd.checkpoint.load: no checkpoint at {path!r}; reading {where!r}, the "
                          "previous checkpoint that a save of the first format left there when it "
                          "crashed between its two renames", stacklevel=3)
        try:
            return where, FileSystemReader(where).read_metadata()
        except FileNotFoundError:
            if attempt < 2 and layout.resolve(path) != where:
                continue  # a newer version was committed and this one removed meanwhile
            raise ValueError(f"hvd.checkpoint.load: {path!r} is not a complete checkpoint (no "
                             "index '.metadata': the save did not commit)") from None
    raise AssertionError("unreachable")


class _RowRequests:
    """The entries a rank reads as rows of a whole tensor (a fully sharded parameter's, or its
    optimizer state's): the region of each, the ones with no row here (nothing to read), and
    0-d tensors read whole and held as one row."""

    def __init__(self) -> None:
        self.regions: dict[str, RowShard] = {}
        self.ready: dict[str, torch.Tensor] = {}
        self.zero_d: set[str] = set()

    def add(self, request: dict[str, Any], key: str, rs: RowShard, dtype: torch.dtype) -> None:
        if rs.hi <= rs.lo:
            self.ready[key] = torch.empty(rs.local_shape, dtype=dtype)
        elif not rs.shape:
            request[key] = torch.empty((), dtype=dtype)
            self.zero_d.add(key)
        else:
            request[key] = torch.empty(rs.local_shape, dtype=dtype)
            self.regions[key] = rs

    def finish(self, got: dict[str, Any]) -> dict[str, Any]:
        for key in self.zero_d:
            got[key] = got[key].reshape(1)
        got.update(self.ready)
        return got


def _read(path: str, request: dict[str, Any], regions: dict[str, RowShard] | None = None) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    objects: dict[str, Any] = {}
    rows = regions or {}

    class _Planner(DefaultLoadPlanner):
        # dcp.load reads objects into a copy of the request that it drops: keep them aside
        def load_bytes(self, read_item: Any, value: Any) -> None:
            objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

        # the entries of ``regions`` are read as their rows of the whole tensor (chunks of it
        # that other world sizes wrote, or the whole tensor an unsharded model saved)
        def create_local_plan(self) -> Any:
            if not rows:
                return super().create_local_plan()
            assert self.metadata is not None
            rest = {k: v for k, v in self.state_dict.items() if k not in rows}
            plan = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load)
            items = list(plan.items)
            for fqn, rs in rows.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size((rs.lo,) + (0,) * (len(rs.shape) - 1)),
                                             sizes=torch.Size(rs.local_shape))
                md = self.metadata.state_dict_metadata[fqn]
                assert isinstance(md, TensorStorageMetadata)
                items += create_read_items_for_chunk_list(fqn, md, [chunk])
            return dataclasses.replace(plan, items=items)

        def lookup_tensor(self, index: Any) -> Any:
            if index.fqn in rows:
                return self.state_dict[index.fqn]
            return super().lookup_tensor(index)

    if request:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(request, storage_reader=FileSystemReader(path), no_dist=True,
                     planner=_Planner(flatten_state_dict=False))
        request.update(objects)
    return request


def load(path: str | os.PathLike, model: torch.nn.Module | None = None,
         optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None) -> dict[str, Any]:
    """Load the newest committed version of the checkpoint that ``save`` wrote at ``path`` into
    ``model`` and ``optimizer`` and return its ``extra`` dict (leftovers of a crashed save are
    ignored). Works at any world size and in a plain process without ``hvd.init()``; the
    optimizer may be sharded (``ZeroRedundancyOptimizer``: each rank reads only its shard) or not,
    whatever it was when saved; a list of optimizers if ``save`` was given one. Every rank checks
    the checkpoint against its model and optimizer before changing anything.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: an uncommitted checkpoint, or one of another model or optimizer (the message
            names the missing, unexpected and mismatched keys, or the optimizer classes and
            their differing hyper-parameters); nothing was loaded.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    path = os.fspath(path)
    for attempt in range(3):
        where, meta = _read_metadata(path)
        try:
            return _load_version(path, where, meta, model, optimizer)
        except (Exception, CheckpointException):  # DCP's is a BaseException
            # another process committed a newer version and removed this one while it was read
            # (DCP reports the missing file as its CheckpointException; the model and optimizer
            # change only after every read succeeded): read the newer one
            if attempt == 2 or layout.resolve(path) == where:
                raise
    raise AssertionError("unreachable")


def _load_version(path: str, where: str, meta: Any, model: torch.nn.Module | None,
                  optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = meta.state_dict_metadata
    head = _read(where, {k: None for k in md if k in ("horovod", "extra") or _GROUPS_KEY.fullmatch(k)})
    problems: list[str] = []
    request: dict[str, Any] = {}
    model_sd: dict[str, Any] = {}
    layout = _row_layout(model, _world()[1], "load")
    rows = _RowRequests()
    if model is not None:
        model_sd = model.state_dict()
        want = {f"model.{k}" for k in model_sd}
        have = {k for k in md if k.startswith("model.")}
        if want - have:
            problems.append(f"missing model keys {sorted(k[6:] for k in want - have)}")
        if have - want:
            problems.append(f"unexpected model keys {sorted(k[6:] for k in have - want)}")
        for k, v in model_sd.items():
            m = md.get(f"model.{k}")
            rs = layout.get(k)
            if isinstance(v, torch.Tensor) and isinstance(m, TensorStorageMetadata):
                shape = rs.shape if rs is not None else tuple(v.shape)  # a shard: the whole one's
                if tuple(m.size) != shape:
                    problems.append(f"model key {k!r}: shape {tuple(m.size)} in the checkpoint, "
                                    f"{shape} in the model")
                elif rs is not None:
                    rows.add(request, f"model.{k}", rs, m.properties.dtype)
                else:
                    request[f"model.{k}"] = torch.empty(v.shape, dtype=m.properties.dtype)
            elif m is not None:
                request[f"model.{k}"] = None
    header = head.get("horovod") or {}
    given = _optimizer_list(optimizer)
    optim_sds: list[tuple[torch.optim.Optimizer, Any]] = []
    count = _optimizer_count_mismatch(optimizer, header, md)
    if count:
        problems.append(count)
    else:
        for (prefix, opt), h in zip(given, header.get("optimizers") or [header]):
            optim_sds.append((opt, _optimizer_request(opt, model, md, head.get(f"{prefix}.param_groups"),
                                                      problems, request, h, layout, rows, prefix)))
    if problems:
        raise ValueError(f"hvd.checkpoint.load({path!r}): the checkpoint does not match the "
                         f"{'model and optimizer' if optimizer is not None else 'model'} given: "
                         + "; ".join(problems) + ". Nothing was loaded.")
    got = rows.finish(_read(where, request, rows.regions))
    if model is not None:
        model.load_state_dict({k: got[f"model.{k}"] for k in model_sd})
    for opt, optim_sd in optim_sds:
        for i, keys in optim_sd.pop("_keys").items():
            optim_sd["state"][i] = {sk: got[fk] for sk, fk in keys.items()}
        opt.load_state_dict(optim_sd)
    return dict(head.get("extra") or {})


_GROUPS_KEY = re.compile(r"optim(\.\d+)?\.param_groups")


def _optimizer_count_mismatch(optimizer: Any, header: dict[str, Any], md: Any) -> str | None:
    """Why the optimizers given cannot take the checkpoint's: one given where it holds a list's
    (``save(optimizer=[...])``), a list where it holds one optimizer's, lists of other lengths."""
    saved: list[Any] | None = header.get("optimizers")
    if optimizer is None:
        return None
    many = isinstance(optimizer, (list, tuple))
    if saved is None:
        if not many:
            return None
        if "optim.param_groups" not in md:
            return "the checkpoint has no optimizer state (it was saved without an optimizer)"
        return (f"the checkpoint holds one optimizer's state (saved with optimizer=<an optimizer>), a "
                f"list of {len(optimizer)} was given; pass the optimizer itself")
    if not many:
        return (f"the checkpoint holds the state of {len(saved)} optimizers (saved with optimizer=[...]), "
                f"one {type(optimizer).__name__} was given; pass the list of {len(saved)} optimizers, "
                "in the order they were saved")
    if len(saved) != len(optimizer):
        return (f"the checkpoint holds the state of {len(saved)} optimizers "
                f"({[h.get('optimizer') for h in saved]}), {len(optimizer)} were given")
    return None


_WRAPPERS = {"ZeroRedundancyOptimizer"}  # names the first format recorded instead of the class


def _optimizer_mismatch(optimizer: torch.optim.Optimizer, saved_groups: list[dict[str, Any]],
                        header: dict[str, Any]) -> str | None:
    """Why the checkpoint's optimizer state cannot go into ``optimizer`` (another class; for a
    checkpoint of the first format, which recorded no class, other hyper-parameter names)."""
    cls = _algorithm(optimizer)
    have = _hyperparameters(optimizer.param_groups)
    saved = header.get("hyperparameters") or _hyperparameters(saved_groups)
    saved_cls = header.get("optimizer")
    only_saved = sorted(set(saved) - set(have))
    only_have = sorted(set(have) - set(saved))
    diff = (f"hyper-parameters only in the checkpoint: {only_saved or 'none'}; only in the "
            f"optimizer given: {only_have or 'none'}")
    fix = ("Load the model alone (optimizer=None) and start the optimizer afresh, or build the "
           "optimizer the checkpoint was saved with")
    if isinstance(saved_cls, str) and saved_cls not in _WRAPPERS:
        if saved_cls != cls.__name__:
            where = header.get("optimizer_module")
            return (f"the checkpoint holds the state of a {f'{where}.' if where else ''}{saved_cls} "
                    f"optimizer, the optimizer given is a {cls.__module__}.{cls.__name__} ({diff}). "
                    + fix)
        return None
    if only_saved or only_have:
        return (f"the checkpoint's optimizer has other hyper-parameters than the "
                f"{cls.__module__}.{cls.__name__} given ({diff}). " + fix)
    return None


def _optimizer_request(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, md: Any,
                       saved_groups: Any, problems: list[str], request: dict[str, Any],
                       header: dict[str, Any], layout: dict[str, RowShard] | None = None,
                       rows: _RowRequests | None = None, key: str = "optim") -> Any:
    """Check the saved optimizer (its keys under ``key``) against ``optimizer``; add what to read
    to ``request`` and return the full state dict to fill (state keys under ``_keys``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    if saved_groups is None:
        problems.append("the checkpoint has no optimizer state (it was saved without an optimizer)")
        return None
    mismatch = _optimizer_mismatch(optimizer, saved_groups, header)
    if mismatch:
        problems.append(mismatch)
        return None
    params = _optimizer_params(optimizer)
    names = _param_names(model, params)
    current = [len(g["params"]) for g in optimizer.param_groups]
    if [len(g["params"]) for g in saved_groups] != current:
        problems.append(f"optimizer groups of sizes {[len(g['params']) for g in saved_groups]} in "
                        f"the checkpoint, {current} in the optimizer")
        return None
    saved_names = [n for g in saved_groups for n in g["params"]]
    if saved_names != names:
        diff = [(a, b) for a, b in zip(saved_names, names) if a != b]
        problems.append(f"optimizer parameters differ (checkpoint, optimizer): {diff[:5]}")
        return None
    owned = set(range(len(params)))
    if isinstance(optimizer, ShardedStateful):
        owned = set(optimizer.owned_indices())  # each rank reads its shard only
    keys: dict[int, dict[str, str]] = {}
    for i, name in enumerate(names):
        prefix = f"{key}.state.{name}."
        entries = {k[len(prefix):]: k for k in md if k.startswith(prefix) and "." not in k[len(prefix):]}
        if not entries or i not in owned:
            continue
        keys[i] = entries
        rs = (layout or {}).get(name)
        for sk, fk in entries.items():
            m = md[fk]
            # a sharded parameter's per-element state (its shape; of a 0-d parameter's 0-d
            # state tensors, ``step`` is the one that is not per element): this rank's rows
            if (rs is not None and rows is not None and isinstance(m, TensorStorageMetadata)
                    and tuple(m.size) == rs.shape and (rs.shape or sk != "step")):
                rows.add(request, fk, rs, m.properties.dtype)
            elif isinstance(m, TensorStorageMetadata):
                request[fk] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            elif isinstance(m, BytesStorageMetadata):
                request[fk] = None
    groups, start = [], 0
    for g in saved_groups:
        k = len(g["params"])
        groups.append({**{a: b for a, b in g.items() if a != "params"},
                       "params": list(range(start, start + k))})
        start += k
    return {"state": {}, "param_groups": groups, "_keys": keys}
