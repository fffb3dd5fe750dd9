"""A transport's own piece sizes (``tunables.piece_sizes``) and the planner's ``alone`` bytes.

* Unset ``HOROVOD_CHUNK_BYTES``: the Gloo backend's pieces (16 MiB, tensors of 1 MiB and more as
  calls of their own); a backend that declares none (MPI) keeps 2 MiB, as before.
* Set by the user: that value, with its meaning unchanged (every tensor below a piece packed).
* ``alone`` bytes: items and tails of at least that size are calls of their own, nothing is lost
  or reduced twice, and ``alone`` 0 (or at least one piece) is exactly the plan before it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from horovod.common.backends.gloo import GLOO_ALONE_BYTES, GLOO_PIECE_BYTES, GlooBackend
from horovod.common.backends.mpi import MPIBackend
from horovod.common.config import EngineConfig
from horovod.common.engine.plan import PACKED, PIECE, plan_reduction
from horovod.common.engine.tunables import DEFAULT_CHUNK_BYTES, Tunables, piece_sizes

pytestmark = pytest.mark.unit

MiB = 1 << 20


def test_gloo_declares_larger_pieces_than_mpi() -> None:
    assert GlooBackend.piece_sizes == (GLOO_PIECE_BYTES, GLOO_ALONE_BYTES)
    assert GLOO_PIECE_BYTES > DEFAULT_CHUNK_BYTES == 2 * MiB
    assert 0 < GLOO_ALONE_BYTES < GLOO_PIECE_BYTES
    assert getattr(MPIBackend, "piece_sizes", None) is None  # the MPI plane keeps the default


@pytest.mark.parametrize("backend,want", [(GlooBackend, (GLOO_PIECE_BYTES, GLOO_ALONE_BYTES)),
                                          (MPIBackend, (DEFAULT_CHUNK_BYTES, 0)),
                                          (None, (DEFAULT_CHUNK_BYTES, 0))])
def test_unset_chunk_bytes_takes_the_transports_pieces(backend, want) -> None:
    config = EngineConfig.from_env({})
    assert config.chunk_bytes < 0  # not set
    tun = Tunables.from_config(config, backend=backend)
    assert (tun.chunk_bytes, tun.alone_bytes) == want
    assert piece_sizes(-1, backend) == want


@pytest.mark.parametrize("value", ["0", "4096", str(2 * MiB), str(16 * MiB)])
@pytest.mark.parametrize("backend", [GlooBackend, MPIBackend])
def test_the_users_chunk_bytes_wins_with_its_meaning(value: str, backend) -> None:
    config = EngineConfig.from_env({"HOROVOD_CHUNK_BYTES": value})
    tun = Tunables.from_config(config, backend=backend)
    assert (tun.chunk_bytes, tun.alone_bytes) == (int(value), 0)


def test_tunables_default_is_the_mpi_planes() -> None:
    tun = Tunables()
    assert (tun.chunk_bytes, tun.alone_bytes) == (DEFAULT_CHUNK_BYTES, 0)


def _cover(calls, sizes) -> None:
    seen = [np.zeros(n, int) for n in sizes]
    for call in calls:
        at = 0
        for i, s, e, off in call.segments:
            assert off == at and e > s
            seen[i][s:e] += 1
            at += e - s
        assert at == call.size
    assert all((s == 1).all() for s in seen)


SIZES = [3, 9000, 70, 2048, 1, 5000, 300, 4097, 16, 1024, 0, 12000, 2]


@pytest.mark.parametrize("chunk,alone", itertools.product([4096, 16384], [0, 1024, 4096, 2048, 1 << 20]))
@pytest.mark.parametrize("itemsize", [4, 8])
def test_alone_items_and_tails_are_calls_of_their_own(chunk: int, alone: int, itemsize: int) -> None:
    calls = plan_reduction(SIZES, itemsize, chunk, 1 << 30, True, False, alone)
    _cover(calls, SIZES)
    assert all(c.size * itemsize <= chunk for c in calls)
    limit = chunk if not 0 < alone < chunk else alone  # bytes from which an item is not packed
    for c in calls:
        if c.kind == PACKED:  # only items (and tails) below the limit are packed
            for _i, s, e, _ in c.segments:
                assert (e - s) * itemsize < limit, (c, limit)
        else:
            assert c.kind == PIECE and len(c.segments) == 1
    if 0 < alone < chunk:
        # an item of at least ``alone`` bytes is one call of its own below one piece; above, its
        # whole pieces are, and its tail too unless below ``alone``
        for i, n in enumerate(SIZES):
            if n * itemsize >= alone:
                own = [c for c in calls if any(seg[0] == i for seg in c.segments)]
                tail = n % (chunk // itemsize)
                packed = tail if tail * itemsize < alone and n * itemsize >= chunk else 0
                assert sum(c.size for c in own if c.kind == PIECE) == n - packed, (i, n, own)
                if n * itemsize < chunk:
                    assert len(own) == 1 and own[0].size == n
        # small items between large ones share packed calls (flushed only when full)
        small = sum(n if n * itemsize < alone else n % (chunk // itemsize) if n * itemsize >= chunk
                    and n % (chunk // itemsize) * itemsize < alone else 0 for n in SIZES)
        assert sum(c.kind == PACKED for c in calls) == -(-small * itemsize // chunk)
    else:
        assert calls == plan_reduction(SIZES, itemsize, chunk, 1 << 30, True, False)  # as before


def test_the_executor_plans_with_the_tunables_alone_bytes() -> None:
    from horovod.common.backends.base import Group
    from horovod.common.engine.executor import Entry, Executor
    from horovod.common.types import ReduceOp, Request, RequestType, Response

    class Recorder:
        name = "gloo"
        pins_pages = False

        def __init__(self) -> None:
            self.calls: list[int] = []

        def reduce_dtypes(self) -> frozenset[str]:
            return frozenset({"float32"})

        def allreduce(self, buf, op, group, src=None) -> None:
            self.calls.append(buf.size)
            buf *= 2

    backend = Recorder()
    sizes = [10, 3000, 20, 600, 5]
    # alone 0: the small item before the large one is flushed alone, the tail and the 600 packed
    for alone, want in [(0, [10, 1024, 1024, 1024, 553]), (1024, [1024, 1024, 952, 600, 35])]:
        tun = Tunables(fusion_threshold=1 << 20, max_tensor_bytes=1 << 20, chunk_bytes=4096,
                       alone_bytes=alone)
        ex = Executor(backend, {0: Group([0, 1], 0, None)}, 0, tun)
        xs = [np.full(n, i + 1, np.float32) for i, n in enumerate(sizes)]
        batch, entries = [], []
        for i, x in enumerate(xs):
            req = Request(f"t{i}", RequestType.ALLREDUCE, "float32", (x.shape,), ReduceOp.SUM)
            batch.append(Response(req))
            entries.append(Entry(req, [x], [x], None))
        backend.calls.clear()
        ex.run(batch, entries)
        assert backend.calls == want, (alone, backend.calls)
        for i, x in enumerate(xs):
            assert (x == 2 * (i + 1)).all()


def test_a_widened_reduction_ignores_alone() -> None:
    """Every element of a widened reduction goes through the buffer: packed as before."""
    for alone in (0, 1024, 2048):
        assert plan_reduction(SIZES, 4, 4096, 1 << 30, True, True, alone) == \
            plan_reduction(SIZES, 4, 4096, 1 << 30, True, True)
