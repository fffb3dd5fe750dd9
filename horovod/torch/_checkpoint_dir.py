"""The directory an ``hvd.checkpoint`` lives in: what is ours, how a new version commits, which
version ``load`` reads.

Layout of a checkpoint at ``path``::

    path/
      horovod_checkpoint.json     marker: the directory belongs to hvd.checkpoint (written first)
      v000007/                    a committed version: a torch.distributed.checkpoint directory
        .metadata                 (DCP's index) and __<rank>_0.distcp (one data file per rank)
      v000008.partial/            a save in progress (or the leftover of one that crashed)
      v000006.deleting/           an old version being removed

The commit of version ``k`` (rank 0, once every rank's data files are written and fsync'd):
DCP's ``.metadata`` is written and fsync'd inside ``v<k>.partial``, that directory is fsync'd, it
is renamed to ``v<k>`` (one ``rename``: the commit point) and ``path`` is fsync'd. Only then are the
older versions renamed to ``v<j>.deleting`` and removed, with leftovers of crashed saves. At every
point in between, ``load`` finds the newest committed version: the highest ``v<k>`` without a
suffix that holds a ``.metadata``, ignoring ``.partial`` and ``.deleting`` directories. A crash
before the rename leaves the previous version in place; after it, the new one.

A directory is ours when it is empty, holds the marker, or is a checkpoint of the first format
(a flat DCP directory whose index has the ``horovod`` entry); and everything in it is one of the
names above, each version directory holding only DCP files. Anything else (a user's file, a
directory of another layout) makes ``save`` refuse the path: nothing is written, emptied or
renamed there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from typing import Any

MARKER = "horovod_checkpoint.json"
LAYOUT = 2  # the versioned layout (format 1: a flat DCP directory at the path)
_VERSION = re.compile(r"^v(\d+)(\.partial|\.deleting)?$")
_DCP_FILE = re.compile(r"^(\.metadata|\.metadata\.tmp|__\d+_\d+\.distcp)$")


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (creations, renames) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory (EINVAL)
        pass
    finally:
        os.close(fd)


def _versions(path: str) -> dict[str, tuple[int, str]]:
    """``{entry: (number, suffix)}`` of the version directories in ``path``."""
    out = {}
    for entry in os.listdir(path):
        m = _VERSION.match(entry)
        if m and os.path.isdir(os.path.join(path, entry)):
            out[entry] = (int(m.group(1)), m.group(2) or "")
    return out


def _is_legacy(path: str) -> bool:
    """A checkpoint of the first format at ``path``: a flat DCP directory written by hvd.checkpoint."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return False
    try:
        from torch.distributed.checkpoint import FileSystemReader

        return "horovod" in FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable: not ours
        return False


def foreign_entries(path: str) -> list[str]:
    """What in the directory ``path`` is not part of an hvd.checkpoint (relative paths, a
    directory with a trailing ``/``); empty when the directory is ours (or empty)."""
    entries = sorted(os.listdir(path))
    if not entries:
        return []
    legacy = _is_legacy(path)
    if MARKER not in entries and not legacy:
        if os.path.isfile(os.path.join(path, ".metadata")):
            return [".metadata (a torch.distributed.checkpoint index without hvd.checkpoint's "
                    "'horovod' entry)"] + [e for e in entries if e != ".metadata"]
        return [e + ("/" if os.path.isdir(os.path.join(path, e)) else "") for e in entries]
    versions = _versions(path)
    foreign = []
    for e in entries:
        full = os.path.join(path, e)
        if e == MARKER and os.path.isfile(full):
            continue
        if _DCP_FILE.match(e) and os.path.isfile(full):  # the first format's files (being replaced)
            continue
        if e in versions:
            inside = sorted(os.listdir(full))
            bad = [f"{e}/{f}" + ("/" if os.path.isdir(os.path.join(full, f)) else "")
                   for f in inside if not (_DCP_FILE.match(f) and os.path.isfile(os.path.join(full, f)))]
            foreign += bad
            continue
        foreign.append(e + ("/" if os.path.isdir(full) else ""))
    return foreign


def _refuse(path: str, what: str) -> FileExistsError:
    return FileExistsError(
        f"hvd.checkpoint.save: refusing to write to {path!r}: {what}. save writes only into a "
        "directory that is new, empty or an hvd.checkpoint (it holds 'horovod_checkpoint.json'); "
        "nothing was changed there. Choose another path, or move those files away.")


def prepare(path: str) -> tuple[str, bool]:
    """Rank 0, before a save: check that ``path`` is ours (``FileExistsError`` naming what is
    not), create it with its marker if needed, and make the new version's ``.partial`` directory.
    Returns that directory and whether this call created ``path``."""
    created = False
    if os.path.lexists(path) and not os.path.isdir(path):
        kind = "a symbolic link to nothing" if os.path.islink(path) else "a file"
        raise _refuse(path, f"it is {kind}, not a checkpoint directory")
    if not os.path.isdir(path):
        os.makedirs(path, exist_ok=True)  # a parallel creator is fine: the marker decides
        created = True
    else:
        foreign = foreign_entries(path)
        if foreign:
            shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
            raise _refuse(path, f"it holds {shown}, which {'is' if len(foreign) == 1 else 'are'} "
                                "not part of an hvd.checkpoint")
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        with open(marker, "w") as f:
            json.dump({"layout": LAYOUT, "written_by": "horovod.torch.checkpoint.save",
                       "read_with": "hvd.checkpoint.load(path), or torch.distributed.checkpoint "
                                    "on hvd.checkpoint.latest(path)"}, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(path)
    taken = [k for k, _ in _versions(path).values()]
    k = max(taken, default=0) + 1
    while True:  # exclusive: another job saving here at the same time gets another number
        partial = os.path.join(path, f"v{k:06d}.partial")
        try:
            os.mkdir(partial)
            break
        except FileExistsError:
            k += 1
    fsync_dir(path)
    return partial, created


def commit(partial: str) -> str:
    """Rank 0, once ``.metadata`` is in ``partial``: make it the newest version (the rename is
    the commit point), then remove the older versions and leftovers. Returns the version's
    directory."""
    path, name = os.path.split(partial)
    fsync_dir(partial)
    final = os.path.join(path, name[:-len(".partial")])
    os.rename(partial, final)
    fsync_dir(path)
    try:
        prune(path, keep=int(_VERSION.match(os.path.basename(final)).group(1)))  # type: ignore[union-attr]
    except OSError as exc:  # committed all the same: the next save removes what is left
        import warnings

        warnings.warn(f"hvd.checkpoint.save: committed {final!r}, but removing the older "
                      f"versions failed: {exc!r}", stacklevel=2)
    return final


def prune(path: str, keep: int) -> None:
    """Remove what older than version ``keep`` is left in ``path``: committed versions (renamed to
    ``.deleting`` first, so that a half-removed one is never taken for a version), crashed saves'
    ``.partial`` directories, and a first-format checkpoint's files."""
    for entry, (k, suffix) in sorted(_versions(path).items()):
        if k >= keep:
            continue
        full = os.path.join(path, entry)
        if not suffix:
            gone = f"{full}.deleting"
            with contextlib.suppress(OSError):
                os.rename(full, gone)
                full = gone
        shutil.rmtree(full, ignore_errors=True)
    if os.path.isfile(os.path.join(path, ".metadata")):
        os.remove(os.path.join(path, ".metadata"))  # the index first: never half a checkpoint
        for e in os.listdir(path):
            if _DCP_FILE.match(e):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(path, e))


def abandon(partial: str, created: bool) -> None:
    """Rank 0, after a failed save: remove its ``.partial`` directory, and ``path`` itself when
    this save created it and nothing else is there."""
    shutil.rmtree(partial, ignore_errors=True)
    path = os.path.dirname(partial)
    if created:
        with contextlib.suppress(OSError):
            if os.listdir(path) == [MARKER]:
                os.remove(os.path.join(path, MARKER))
                os.rmdir(path)


def resolve(path: str) -> str:
    """The DCP directory of the newest committed checkpoint at ``path``.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: ``path`` holds no committed checkpoint (names what is there).
    """
    if not os.path.isdir(path):
        old = f"{path}.old"
        if not os.path.exists(path) and os.path.isdir(old) and _is_legacy(old):
            return old  # the first format's commit crashed between its two renames
        if os.path.exists(path):
            raise ValueError(f"hvd.checkpoint.load: {path!r} is a file, not a checkpoint directory")
        raise FileNotFoundError(f"hvd.checkpoint.load: no checkpoint at {path!r}"
                                + (" (only an uncommitted partial save is there)"
                                   if os.path.isdir(f"{path}.partial") else ""))
    versions = _versions(path)
    for entry, (_k, suffix) in sorted(versions.items(), key=lambda kv: -kv[1][0]):
        if not suffix and os.path.isfile(os.path.join(path, entry, ".metadata")):
            return os.path.join(path, entry)
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path  # the first format
    pending = sorted(e for e, (_k, s) in versions.items() if s == ".partial")
    raise ValueError(f"hvd.checkpoint.load: {path!r} is not a complete checkpoint (no committed "
                     "version with its index '.metadata'"
                     + (f"; only uncommitted saves: {', '.join(pending)}" if pending else "")
                     + "): the save did not commit")


def describe(path: str) -> dict[str, Any]:
    """What ``path`` holds, for messages and tests: versions by state."""
    out: dict[str, Any] = {"committed": [], "partial": [], "deleting": []}
    if os.path.isdir(path):
        for entry, (_k, suffix) in sorted(_versions(path).items()):
            out[{"": "committed", ".partial": "partial", ".deleting": "deleting"}[suffix]].append(entry)
    return out
