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
- ``extra``: the ``extra`` dict given to ``save`` (rank 0); ``horovod``: format version and the
  world size it was saved at (rank 0).

Write, then commit: the ranks write into ``<path>.partial``; after every rank has written, rank 0
writes ``.metadata`` and renames the directory to ``<path>``. A save that fails part way leaves no
``<path>`` (or the previous checkpoint there).
"""

from __future__ import annotations

import copy
import os
import shutil
import threading
import warnings
from typing import Any

import torch

from horovod.common.basics import is_initialized, rank, size
from horovod.common.objects import allgather_object, broadcast_object
from horovod.torch.fully_shard import refuse_in_checkpoint
from horovod.torch.zero import ZeroRedundancyOptimizer, partition_by_bytes

__all__ = ["save", "load", "SaveHandle", "FORMAT_VERSION", "release_buffers"]

FORMAT_VERSION = 1
_counter = [0]


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


def _local_part(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                extra: dict[str, Any] | None, r: int, n: int) -> dict[str, Any]:
    """The flat state dict this rank writes."""
    out: dict[str, Any] = {}
    if model is not None:
        items = list(model.state_dict().items())
        owner = partition_by_bytes([_nbytes(v) for _, v in items], n)
        out.update({f"model.{k}": v for (k, v), o in zip(items, owner) if o == r})
    if optimizer is not None:
        params = _optimizer_params(optimizer)
        names = _param_names(model, params)
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            if optimizer.world != n:
                raise ValueError(f"hvd.checkpoint.save: the ZeroRedundancyOptimizer is sharded over "
                                 f"{optimizer.world} ranks, the job has {n}; checkpoints of a "
                                 "ZeroRedundancyOptimizer need it on the global process set")
            local = optimizer.optim.state_dict()["state"]
            mine = {optimizer._local_index[k]: v for k, v in local.items()}
        else:
            full = optimizer.state_dict()["state"]
            owner = partition_by_bytes([p.numel() * p.element_size() for p in params], n)
            mine = {i: v for i, v in full.items() if owner[i] == r}
        for i, st in mine.items():
            for key, v in st.items():
                out[f"optim.state.{names[i]}.{key}"] = v
        if r == 0:
            groups, start = [], 0
            for g in optimizer.param_groups:
                k = len(g["params"])
                groups.append({**{a: b for a, b in g.items() if a != "params"},
                               "params": names[start:start + k]})
                start += k
            out["optim.param_groups"] = groups
    if r == 0:
        out["extra"] = dict(extra or {})
        out["horovod"] = {"format": FORMAT_VERSION, "world_size": n,
                          "optimizer": None if optimizer is None else type(optimizer).__name__}
    return out


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


class _Failed(str):
    """A rank's error while planning, sent to the other ranks in place of its plan."""


class SaveHandle:
    """A save in progress (``save(..., blocking=False)``): ``wait()`` (collective: every rank
    calls it) finishes it and raises what failed on any rank."""

    def __init__(self, path: str, tmp: str, part: dict[str, Any], r: int, n: int, name: str,
                 background: bool, kept: bool = False) -> None:
        self.path, self._tmp, self._part = path, tmp, part
        self._r, self._n, self._name, self._kept = r, n, name, kept
        self._writer: Any = None
        self._metadata: Any = None
        self._result: Any = None
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
        from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

        r, n, name = self._r, self._n, self._name
        planner = DefaultSavePlanner(flatten_state_dict=False)  # objects stay one entry each
        local: Any
        try:
            if r == 0:  # the other ranks write only after the plan exchange, i.e. after this
                shutil.rmtree(self._tmp, ignore_errors=True)
                os.makedirs(self._tmp, exist_ok=True)  # another rank's writer may have made it
            self._writer = FileSystemWriter(self._tmp, sync_files=False)
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
        directory); returns the checkpoint's path. Raises ``RuntimeError`` on every rank if any
        rank failed to write (nothing is committed then)."""
        if self._done:
            return self.path
        if self._thread is not None:
            self._thread.join()
        self._done = True
        results = [self._result] if self._n == 1 else allgather_object(
            self._result, name=f"{self._name}.results")
        by_error: dict[str, list[str]] = {}
        for i, res in enumerate(results):
            if isinstance(res, BaseException):
                by_error.setdefault(str(res) if isinstance(res, RuntimeError) else repr(res),
                                    []).append(str(i))
        failed = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(rs)}: {msg}"
                  for msg, rs in by_error.items()]
        status = None
        if not failed and self._r == 0:
            try:
                self._writer.finish(metadata=self._metadata, results=results)
                _commit(self._tmp, self.path)
            except BaseException as exc:  # noqa: BLE001 - reported on every rank
                status = f"rank 0 (commit): {exc!r}"
        if self._n > 1:
            status = broadcast_object(status, 0, name=f"{self._name}.commit")
        if failed or status:
            if self._r == 0:
                shutil.rmtree(self._tmp, ignore_errors=True)
            raise RuntimeError(f"hvd.checkpoint.save({self.path!r}) failed, nothing was committed: "
                               + "; ".join(failed + ([status] if status else [])))
        return self.path


def _commit(tmp: str, path: str) -> None:
    old = None
    if os.path.exists(path):
        old = f"{path}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save(path: str | os.PathLike, model: torch.nn.Module | None = None,
         optimizer: torch.optim.Optimizer | None = None, extra: dict[str, Any] | None = None,
         blocking: bool = True) -> SaveHandle | str:
    """Save ``model``, ``optimizer`` and ``extra`` to the directory ``path``, each rank writing
    only its part. Collective: every rank calls it with the same path (on a file system every
    rank sees).

    With ``blocking=False`` the tensors are first copied into one host buffer (kept for the next
    non-blocking save; ``release_buffers()`` frees it), then ``save`` returns: the plans are
    exchanged and the files written by a background thread while training continues, and the
    returned ``SaveHandle``'s ``wait()`` (on every rank) commits the checkpoint. Returns the path
    when blocking.

    Raises:
        RuntimeError: a rank failed to plan or write; raised on every rank, and nothing is
            committed.
    """
    refuse_in_checkpoint("save", model)
    path = os.fspath(path)
    r, n = _world()
    _counter[0] += 1
    part = _local_part(model, optimizer, extra, r, n)
    kept = False
    if not blocking:
        part, kept = _Snapshot.take(part)
    handle = SaveHandle(path, f"{path}.partial", part, r, n, f"checkpoint.save.{_counter[0]}",
                        background=not blocking, kept=kept)
    return handle.wait() if blocking else handle


# ------------------------------------------------------------------------------ load
def _read_metadata(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isdir(path):
        raise FileNotFoundError(f"hvd.checkpoint.load: no checkpoint at {path!r}"
                                + (" (only an uncommitted partial save is there)"
                                   if os.path.isdir(f"{path}.partial") else ""))
    try:
        return FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise ValueError(f"hvd.checkpoint.load: {path!r} is not a complete checkpoint (no index "
                         "'.metadata': the save did not commit)") from None


def _read(path: str, request: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    objects: dict[str, Any] = {}

    class _Planner(DefaultLoadPlanner):
        # dcp.load reads objects into a copy of the request that it drops: keep them aside
        def load_bytes(self, read_item: Any, value: Any) -> None:
            objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    if request:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(request, storage_reader=FileSystemReader(path), no_dist=True,
                     planner=_Planner(flatten_state_dict=False))
        request.update(objects)
    return request


def load(path: str | os.PathLike, model: torch.nn.Module | None = None,
         optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a checkpoint written by ``save`` into ``model`` and ``optimizer`` and return its
    ``extra`` dict. Works at any world size and in a plain process without ``hvd.init()``; the
    optimizer may be sharded (``ZeroRedundancyOptimizer``: each rank reads only its shard) or not,
    whatever it was when saved. Every rank checks the checkpoint against its model and
    optimizer before changing anything.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: an uncommitted checkpoint, or one of another model or optimizer (the message
            names the missing, unexpected and mismatched keys); nothing was loaded.
    """
    refuse_in_checkpoint("load", model)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.fspath(path)
    md = _read_metadata(path).state_dict_metadata
    head = _read(path, {k: None for k in ("horovod", "optim.param_groups", "extra") if k in md})
    problems: list[str] = []
    request: dict[str, Any] = {}
    model_sd: dict[str, Any] = {}
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
            if isinstance(v, torch.Tensor) and isinstance(m, TensorStorageMetadata):
                if tuple(m.size) != tuple(v.shape):
                    problems.append(f"model key {k!r}: shape {tuple(m.size)} in the checkpoint, "
                                    f"{tuple(v.shape)} in the model")
                else:
                    request[f"model.{k}"] = torch.empty(v.shape, dtype=m.properties.dtype)
            elif m is not None:
                request[f"model.{k}"] = None
    optim_sd = None
    if optimizer is not None:
        optim_sd = _optimizer_request(optimizer, model, md, head.get("optim.param_groups"),
                                      problems, request)
    if problems:
        raise ValueError(f"hvd.checkpoint.load({path!r}): the checkpoint does not match the "
                         f"{'model and optimizer' if optimizer is not None else 'model'} given: "
                         + "; ".join(problems) + ". Nothing was loaded.")
    got = _read(path, request)
    if model is not None:
        model.load_state_dict({k: got[f"model.{k}"] for k in model_sd})
    if optimizer is not None and optim_sd is not None:
        for i, keys in optim_sd.pop("_keys").items():
            optim_sd["state"][i] = {sk: got[fk] for sk, fk in keys.items()}
        optimizer.load_state_dict(optim_sd)
    return dict(head.get("extra") or {})


def _optimizer_request(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, md: Any,
                       saved_groups: Any, problems: list[str], request: dict[str, Any]) -> Any:
    """Check the saved optimizer against ``optimizer``; add what to read to ``request`` and
    return the full state dict to fill (state keys under ``_keys``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    if saved_groups is None:
        problems.append("the checkpoint has no optimizer state (it was saved without an optimizer)")
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
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        owned = set(optimizer._local_index)  # each rank reads its shard only
    keys: dict[int, dict[str, str]] = {}
    for i, name in enumerate(names):
        prefix = f"optim.state.{name}."
        entries = {k[len(prefix):]: k for k in md if k.startswith(prefix) and "." not in k[len(prefix):]}
        if not entries or i not in owned:
            continue
        keys[i] = entries
        for fk in entries.values():
            m = md[fk]
            if isinstance(m, TensorStorageMetadata):
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
