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
import os
from collections.abc import Sequence
from typing import Any

import torch

from horovod.common.job_state import next_number
from horovod.common.objects import broadcast_object
from horovod.torch import _checkpoint_dir as layout
from horovod.torch._checkpoint_load import load_version, read_metadata
from horovod.torch._checkpoint_parts import FORMAT_VERSION, local_part, world
from horovod.torch._checkpoint_save import (
    SaveHandle,
    Snapshot,
    finish_pending_at_exit,
    pending,
    release_buffers,
)

__all__ = ["save", "load", "latest", "SaveHandle", "FORMAT_VERSION", "release_buffers"]

_atexit_registered = [False]


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
    r, n = world()
    earlier = pending.get(os.path.realpath(path))
    if earlier is not None:  # serialized: the earlier save to this path commits first
        try:
            earlier.wait()
        except RuntimeError as exc:
            raise RuntimeError(f"hvd.checkpoint.save({path!r}) was not started: the earlier "
                               f"non-blocking save to the same path, finished first, failed: "
                               f"{exc}") from exc
    name = f"checkpoint.save.{next_number('checkpoint.save')}"
    part, rows = local_part(model, optimizer, extra, r, n)
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
        part, kept = Snapshot.take(part)
    handle = SaveHandle(path, tmp, part, r, n, name, background=not blocking, kept=kept,
                        created=created, rows=rows)
    if blocking:
        return handle.wait()
    pending[os.path.realpath(path)] = handle
    if not _atexit_registered[0]:
        atexit.register(finish_pending_at_exit)
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
        where, meta = read_metadata(path)
        try:
            return load_version(path, where, meta, model, optimizer)
        except (Exception, CheckpointException):  # DCP's is a BaseException
            # another process committed a newer version and removed this one while it was read
            # (DCP reports the missing file as its CheckpointException; the model and optimizer
            # change only after every read succeeded): read the newer one
            if attempt == 2 or layout.resolve(path) == where:
                raise
    raise AssertionError("unreachable")
