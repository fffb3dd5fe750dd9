"""The writing half of ``hvd.checkpoint.save``: the host buffer a non-blocking save copies into,
DCP's save planner for rows of larger tensors, and ``SaveHandle`` (the plans exchanged over
Horovod's object collectives, the files written, the commit, and a save never waited for finished
at interpreter exit)."""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import threading
from typing import Any

import torch

from horovod.common.basics import is_initialized
from horovod.common.objects import allgather_object, broadcast_object
from horovod.torch import _checkpoint_dir as layout
from horovod.torch.reducer import RowShard

__all__ = ["SaveHandle", "Snapshot", "release_buffers", "pending", "finish_pending_at_exit"]

class Snapshot:
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
    with Snapshot.lock:
        if not Snapshot.busy:
            Snapshot.buf = None


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
                Snapshot.give_back()

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
        pending.pop(os.path.realpath(self.path), None)
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
            now = layout.resolve(self.path)
        except (OSError, ValueError):
            now = None
        print(f"hvd.checkpoint: ERROR (rank {self._r}): the non-blocking save to {self.path!r} "
              f"was NOT committed at exit: {reason}. The checkpoint there is "
              + (f"still the previous one ({now!r})" if now else "missing: there is none")
              + ". Call handle.wait() on every rank before the script ends.",
              file=sys.stderr, flush=True)


pending: dict[str, SaveHandle] = {}  # the non-blocking saves not waited for, by real path


def finish_pending_at_exit() -> None:
    """``atexit``: finish every non-blocking save whose ``wait()`` was never called, in the
    order they started (the same on every rank). Registered at the first non-blocking save, so
    it runs before Horovod's own shutdown at exit."""
    for handle in list(pending.values()):
        handle.finish_at_exit()
