"""The engine's run-time tunables: every knob that decides speed, in one mutable struct. PURE.

One ``Tunables`` object per engine, shared by reference between the engine loop (``loop.py``),
the fusion planner's caller and the executor (``executor.py``). Every field is read afresh at
each round or batch, never baked in at init, so an autotuner may change them at run time. A
change must be made **identically on every rank at the same round boundary** (e.g. from a value
every rank agreed on in a collective, or between rounds from the engine thread): the fields decide
how batches are planned and cut, and ranks that plan differently would pair mismatched transport
calls.

Fields:
    fusion_threshold: fusion buffer size in bytes (``HOROVOD_FUSION_THRESHOLD``); responses of the
        same kind/dtype/op share a batch up to this many bytes of small tensors. 0 disables fusion.
        Read by the planner every round.
    max_tensor_bytes: tensors above this many bytes are never packed into the fusion buffer
        (``HOROVOD_FUSION_MAX_TENSOR_BYTES``); they are reduced piecewise in their own memory.
        Read by the planner and the executor every batch.
    chunk_bytes: piece size in bytes of the reductions (``HOROVOD_CHUNK_BYTES``): the fusion
        buffer and every large tensor are reduced in pieces of at most this size, each piece
        scaled/copied while it is hot in cache. 0 means one transport call per buffer. Read by
        the executor every batch. Unset, the transport's own piece size (``piece_sizes``).
    alone_bytes: on a chunked schedule, tensors (and tails of larger ones) of at least this many
        bytes are transport calls of their own, reduced where they lie, never packed into the
        fusion buffer; 0 (or a value above ``chunk_bytes``): the piece size, i.e. only tensors of
        a whole piece and more. Not a setting: the transport's choice with its own piece size
        (``piece_sizes``: Gloo's large pieces would otherwise copy most tensors); 0 when the user
        sets ``HOROVOD_CHUNK_BYTES``. Read by the executor every batch.
    cycle_time_ms: milliseconds between the engine thread's background rounds
        (``HOROVOD_CYCLE_TIME``). Read by the engine loop every round.
    cache_enabled: whether the response cache is consulted and filled (the cache's capacity is
        fixed at init by ``HOROVOD_CACHE_CAPACITY``; with capacity 0 this flag changes nothing).
        Read by the engine loop every round.
    hierarchical_allreduce: reduce within each host, allreduce across hosts among the hosts'
        first local ranks, broadcast within the host (``HOROVOD_HIERARCHICAL_ALLREDUCE``). Read by
        the executor every batch.
    hierarchical_allgather: gather within each host, allgather across hosts, broadcast within the
        host (``HOROVOD_HIERARCHICAL_ALLGATHER``). Read by the executor every operation.
    overlap: whether gradients submitted by the optimizers' hooks (``submit(defer=True)``) start in
        the background during the backward pass (True), or wait until the optimizer waits for them
        (False: they are then reduced on cores the backward pass no longer uses)
        (``HOROVOD_OVERLAP_GRADIENTS``; auto: True when the host has two cores per local rank).
        Read at every submission.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["Tunables", "DEFAULT_CHUNK_BYTES", "FOLLOWED_CHUNK_BYTES", "piece_sizes", "followed_pieces"]

# Measured on a 2-core x86 machine (benchmarks/gradsync_limit.py): 1-4 MiB pieces reduce 3-5x
# faster than one flat call streaming through memory; 2 MiB was the best raw schedule (MPI).
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
# The piece sizes the engine follows at run time (``pieces.PieceFollower``): the default, and the
# best raw schedule of a 2-core AMD EPYC machine in its state where 2 MiB pieces are 2-3x slower
# (12-24 MiB pieces were best there; benchmarks/results/piece_modes.md).
FOLLOWED_CHUNK_BYTES = (DEFAULT_CHUNK_BYTES, 16 * 1024 * 1024)


def piece_sizes(configured: int, backend: Any = None) -> tuple[int, int]:
    """(``chunk_bytes``, ``alone_bytes``): the one policy for a reduction's piece sizes.

    ``configured`` is ``HOROVOD_CHUNK_BYTES`` (negative: not set). A value the user set wins, with
    its meaning unchanged (pieces of that size; tensors below it packed). Unset, the transport's
    own preference where it declares one (``backend.piece_sizes``: (piece size, alone bytes); the
    Gloo backend's, docs/performance.md "The Gloo data plane"), else ``DEFAULT_CHUNK_BYTES`` (the
    MPI plane's 2 MiB, as before)."""
    if configured >= 0:
        return configured, 0
    preferred = getattr(backend, "piece_sizes", None)
    if preferred is not None:
        chunk, alone = preferred
        return int(chunk), int(alone)
    return DEFAULT_CHUNK_BYTES, 0


def followed_pieces(configured: int, backend: Any = None) -> tuple[int, ...]:
    """The piece sizes to follow at run time (``pieces``): ``FOLLOWED_CHUNK_BYTES`` where the
    piece size is ``piece_sizes``' default (``HOROVOD_CHUNK_BYTES`` unset, a transport without a
    preference of its own), else none."""
    if configured >= 0 or getattr(backend, "piece_sizes", None) is not None:
        return ()
    return FOLLOWED_CHUNK_BYTES


@dataclass
class Tunables:
    """The knobs an autotuner may change at run time (see the module docstring)."""

    fusion_threshold: int = 128 * 1024 * 1024
    max_tensor_bytes: int = 128 * 1024 * 1024
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    alone_bytes: int = 0
    cycle_time_ms: float = 1.0
    cache_enabled: bool = True
    hierarchical_allreduce: bool = False
    hierarchical_allgather: bool = False
    overlap: bool = True

    @classmethod
    def from_config(cls, config: Any, local_size: int = 1, cores: int | None = None,
                    backend: Any = None) -> Tunables:
        """The initial values, from an ``EngineConfig`` (missing fields keep their defaults).

        ``local_size`` (ranks on this host) and ``cores`` (usable by this process; default: its
        CPU affinity) decide ``overlap`` when the setting is auto; ``backend`` (the job's CPU
        transport) the piece sizes when ``HOROVOD_CHUNK_BYTES`` is not set (``piece_sizes``).
        """
        choice = getattr(config, "overlap_gradients", "")
        if choice == "":
            if cores is None:
                cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            overlap = cores >= 2 * max(local_size, 1)
        else:
            overlap = choice == "1"
        chunk, alone = piece_sizes(int(getattr(config, "chunk_bytes", -1)), backend)
        return cls(
            overlap=overlap,
            fusion_threshold=int(config.fusion_threshold),
            max_tensor_bytes=int(config.fusion_max_tensor_bytes),
            chunk_bytes=chunk,
            alone_bytes=alone,
            cycle_time_ms=float(config.cycle_time_ms),
            cache_enabled=int(config.cache_capacity) > 0,
            hierarchical_allreduce=bool(config.hierarchical_allreduce),
            hierarchical_allgather=bool(config.hierarchical_allgather),
        )

    def as_dict(self) -> dict[str, Any]:
        """Field name -> value (for logs and autotune CSV rows)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def update(self, **values: Any) -> None:
        """Set several fields at once; an unknown name raises ``AttributeError``."""
        names = {f.name for f in fields(self)}
        for k, v in values.items():
            if k not in names:
                raise AttributeError(f"Tunables has no field {k!r}; fields: {sorted(names)}")
            setattr(self, k, v)
