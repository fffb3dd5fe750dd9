"""Whether a tensor's memory sits on transparent huge pages, which decides where it is reduced.

Open MPI's shared-memory transport moves a large message with a single copy
(``process_vm_readv``), which walks and pins every page of the peer's buffer. On 4 KiB pages a
piece of a large tensor therefore reduces up to twice as slowly as the same piece on 2 MiB pages
(measured with ``benchmarks/gradsync_limit.py``: one 64 MiB float32 tensor at np=2 took 17 ms in
torch's own 4 KiB-page memory, 14 ms packed through the huge-page fusion buffer, 10.5 ms in
NumPy's own huge-page memory). So the executor reduces a large tensor in its own memory when that
memory is on huge pages; elsewhere it copies it piece by piece through its huge-page buffer unless
this rank measured reducing it in place faster for the repeated batch (``choice.TimedChoice``: in
another state of the same machine, in place was the faster way).

Which memory is on huge pages is known from who allocated it, not asked of the kernel (reading
``/proc/self/smaps`` per tensor would cost more than the copy it saves):

- NumPy asks for huge pages (``madvise(MADV_HUGEPAGE)``) on every allocation of 4 MiB or more on
  Linux 4.6 and later, unless ``NUMPY_MADVISE_HUGEPAGE=0`` (NumPy's documented switch) is set;
- a framework binding registers a test for the objects that own its tensors' memory
  (``register_owner``): PyTorch's CPU allocator asks for huge pages for blocks of 2 MiB or more
  when ``THP_MEM_ALLOC_ENABLE=1`` was set before ``import torch`` (``horovodrun`` sets it for its
  workers), but does not align them to 2 MiB, so the torch test vouches only for blocks of 4 MiB
  or more (at least half huge pages);
- with the kernel's THP mode ``always`` every large anonymous block may be on huge pages;
- a process whose malloc is jemalloc preloaded with ``thp:always`` (``LD_PRELOAD`` naming
  jemalloc plus ``MALLOC_CONF``; PyTorch's CPU tuning guide suggests jemalloc) keeps its heap in a
  few large regions on huge pages, so every block of 2 MiB or more lies on huge pages whoever
  allocated it (``malloc_thp``).

Only documented settings are read (the kernel's THP mode, ``NUMPY_MADVISE_HUGEPAGE``,
``LD_PRELOAD``, ``MALLOC_CONF``), once each; no private NumPy API, no ``/proc`` scan, nothing
per call but a walk from an array to the object that owns its memory. Framework-free.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["huge_page_backed", "huge_page_empty", "register_owner", "thp_mode", "malloc_thp",
           "NUMPY_HUGE_MIN_BYTES", "HUGE_PAGE_BYTES"]

# NumPy madvises allocations of at least this many bytes (numpy/_core/src/multiarray/alloc.c).
NUMPY_HUGE_MIN_BYTES = 4 * 1024 * 1024
HUGE_PAGE_BYTES = 2 * 1024 * 1024
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"

_owners: list[Callable[[Any], bool | None]] = []
_mode: str | None = None
_malloc_thp: bool | None = None
_numpy_madvise: bool | None = None


def thp_mode(path: str = _THP_ENABLED) -> str:
    """The kernel's transparent huge page mode: ``always``, ``madvise``, ``never`` (or ``never``
    when the kernel has no THP), read once."""
    global _mode
    if _mode is None:
        try:
            with open(path) as fh:
                text = fh.read()
            start = text.index("[") + 1
            _mode = text[start:text.index("]", start)]
        except (OSError, ValueError):
            _mode = "never"
    return _mode


def malloc_thp(preload: str | None = None, conf: str | None = None) -> bool:
    """Whether this process's malloc is a preloaded jemalloc with ``thp:always`` in ``MALLOC_CONF``
    (read once from the environment).

    jemalloc then backs its few large regions with transparent huge pages, so a block of 2 MiB or
    more lies on huge pages except at most its two ends, where glibc gives each such block its own
    unaligned mapping whose ends cannot be huge pages.
    """
    global _malloc_thp
    if _malloc_thp is None:
        text = os.environ.get("MALLOC_CONF", "") if conf is None else conf
        options = dict(o.split(":", 1) for o in text.replace(" ", "").split(",") if ":" in o)
        libs = os.environ.get("LD_PRELOAD", "") if preload is None else preload
        _malloc_thp = options.get("thp") == "always" and "jemalloc" in libs
    return _malloc_thp


def _numpy_madvises(setting: str | None = None, release: str | None = None) -> bool:
    """Whether NumPy madvises its large allocations: NumPy's own rule (``NUMPY_MADVISE_HUGEPAGE``,
    else Linux 4.6 or later), read once."""
    global _numpy_madvise
    if _numpy_madvise is None:
        value = os.environ.get("NUMPY_MADVISE_HUGEPAGE") if setting is None else setting
        if value is not None and value.strip():
            _numpy_madvise = value.strip() != "0"
        else:
            try:
                rel = os.uname().release if release is None else release
                major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in rel.split(".")[:2])
                _numpy_madvise = (major, minor) >= (4, 6)
            except (AttributeError, ValueError):
                _numpy_madvise = False
    return _numpy_madvise


def register_owner(test: Callable[[Any], bool | None]) -> None:
    """Add a test for memory owners that are not NumPy arrays: ``test(owner)`` returns True (its
    large blocks are on huge pages), False (they are not) or None (not an owner it knows)."""
    if test not in _owners:
        _owners.append(test)


def huge_page_backed(arr: np.ndarray) -> bool:
    """Whether ``arr``'s memory was allocated so that its whole 2 MiB ranges are huge pages."""
    mode = thp_mode()
    if mode == "never":
        return False
    owner: Any = arr
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
        if isinstance(owner, memoryview):  # np.frombuffer: the exporter owns the memory
            owner = owner.obj
    if isinstance(owner, np.ndarray):
        if mode == "always" or malloc_thp():
            return owner.nbytes >= HUGE_PAGE_BYTES
        return owner.flags.owndata and owner.nbytes >= NUMPY_HUGE_MIN_BYTES and _numpy_madvises()
    for test in _owners:
        verdict = test(owner)
        if verdict is not None:
            return verdict
    return mode == "always"


def huge_page_empty(nbytes: int) -> np.ndarray:
    """Uninitialised bytes starting on a 2 MiB boundary, backed by transparent huge pages where the
    kernel allows them.

    NumPy asks the kernel for huge pages (``madvise(MADV_HUGEPAGE)``) for allocations of 4 MiB and
    more; the aligned start lets whole 2 MiB pieces sit on one huge page each. A reduction piece on
    huge pages is up to twice as fast as one on 4 KiB pages (Open MPI's single-copy transfer pins
    every page; measured with ResNet-50 gradients at np=2: 13 ms packed on huge pages vs 20 ms on
    4 KiB pages vs 27 ms in the tensors' own memory, raw flat buffer 10.5 ms). The engine's fusion
    buffers and ``DistributedOptimizer``'s flat gradients are allocated here.
    """
    raw = np.empty(max(nbytes + HUGE_PAGE_BYTES, 2 * HUGE_PAGE_BYTES), np.uint8)
    off = (-raw.__array_interface__["data"][0]) % HUGE_PAGE_BYTES
    return raw[off:off + nbytes]
