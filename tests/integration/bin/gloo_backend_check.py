"""Exercise every Controller/CollectiveBackend method of the Gloo backend on this rank.

Run under ``horovodrun --gloo`` (or with the Gloo variables set); prints one JSON line
``GLOO_CHECK {...}`` with what this rank computed; exits non-zero on a wrong result.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import ml_dtypes
import numpy as np

from horovod.common.backends.factories import create_gloo
from horovod.common.config import EngineConfig
from horovod.common.types import ReduceOp


def main() -> int:
    import torch.distributed  # noqa: F401 - torch's own import adds filters of its own

    filters = list(warnings.filters)
    b = create_gloo(EngineConfig.from_env(), os.environ)
    r, n = b.rank, b.size
    world = b.world_group()
    out: dict[str, object] = {"rank": r, "size": n}

    def check(name: str, got: np.ndarray, want: np.ndarray) -> None:
        if not np.array_equal(got, want):
            raise AssertionError(f"rank {r}: {name} -> {got.tolist()}, expected {want.tolist()}")
        out[name] = np.asarray(got).tolist()

    for name in sorted(b.reduce_dtypes()):
        dt = ml_dtypes.bfloat16 if name == "bfloat16" else name  # NumPy's bfloat16 is ml_dtypes'
        buf = np.full(5, r + 1, dtype=dt)
        b.allreduce(buf, ReduceOp.SUM, world)
        check(f"allreduce_sum_{name}", buf, np.full(5, n * (n + 1) // 2, dtype=dt))
    buf = np.arange(4, dtype=np.float32) + r
    b.allreduce(buf, ReduceOp.MAX, world)
    check("allreduce_max", buf, np.arange(4, dtype=np.float32) + n - 1)
    buf = np.empty(3, np.float64)
    b.allreduce(buf, ReduceOp.MIN, world, src=np.full(3, 10.0 - r))
    check("allreduce_min_src", buf, np.full(3, 10.0 - (n - 1)))

    counts = [i + 1 for i in range(n)]  # ragged
    send = np.full(counts[r], r, dtype=np.int16)
    recv = np.empty(sum(counts), np.int16)
    b.allgatherv(send, recv, counts, world)
    check("allgatherv_ragged", recv, np.concatenate([np.full(c, i, np.int16) for i, c in enumerate(counts)]))
    send = np.full(2, r, dtype=np.float32)
    recv = np.empty(2 * n, np.float32)
    b.allgatherv(send, recv, [2] * n, world)
    check("allgatherv_equal", recv, np.repeat(np.arange(n, dtype=np.float32), 2))

    buf = np.arange(6, dtype=np.float64) * (r + 1)
    b.broadcast(buf, n - 1, world)
    check("broadcast", buf, np.arange(6, dtype=np.float64) * n)

    # rank r sends (r + j) % 2 elements (some zero) of value 100r + j to member j.
    sc = [(r + j) % 2 + (1 if n == 1 else 0) for j in range(n)]
    send = np.concatenate([np.full(c, 100 * r + j, np.int64) for j, c in enumerate(sc)])
    rc = [(i + r) % 2 + (1 if n == 1 else 0) for i in range(n)]
    recv = np.empty(sum(rc), np.int64)
    b.alltoallv(send.astype(np.int64), sc, recv, rc, world)
    want = np.concatenate([np.full(c, 100 * i + r, np.int64) for i, c in enumerate(rc)])
    check("alltoallv_ragged", recv, want)
    send = np.array([10 * r + j for j in range(n)], np.int64)
    check("alltoall_ints", b.alltoall_ints(send, world), np.array([10 * i + r for i in range(n)], np.int64))
    check("allgather_ints", b.allgather_ints(np.array([r, -r], np.int64), world),
          np.array([[i, -i] for i in range(n)], np.int64))

    counts = [2] * n
    send = np.arange(2 * n, dtype=np.float32) + r
    recv = np.empty(2, np.float32)
    b.reducescatter(send, recv, counts, ReduceOp.SUM, world)
    base = np.arange(2 * n, dtype=np.float32)[2 * r:2 * r + 2]
    check("reducescatter", recv, base * n + sum(range(n)))

    bits = np.array([0xFFFF_FFFF_FFFF_FFFF, 0b1111], np.uint64)
    bits[1] &= ~np.uint64(1 << r)
    got = b.and_bits(bits)
    want_bits = np.uint64(0b1111)
    for i in range(n):
        want_bits &= ~np.uint64(1 << i)
    check("and_bits", got, np.array([0xFFFF_FFFF_FFFF_FFFF, want_bits], np.uint64))
    objs = b.allgather_object({"r": r, "pad": "x" * r})
    assert objs == [{"r": i, "pad": "x" * i} for i in range(n)], objs
    gathered = b.gather_to_root(("req", r))
    assert gathered == ([("req", i) for i in range(n)] if r == 0 else None), gathered
    assert b.bcast_from_root({"resp": [1, 2]} if r == 0 else None) == {"resp": [1, 2]}
    if n >= 2:
        sub = b.new_group([0, n - 1])
        if r in (0, n - 1):
            buf = np.array([r], np.int64)
            b.allreduce(buf, ReduceOp.SUM, sub)
            check("subgroup_allreduce", buf, np.array([n - 1], np.int64))
        b.free_group(sub)
    # a read-only send buffer: torch's "not writable" warning is silenced for that call only, and
    # the process's warning filters are as they were before the backend existed
    send = np.full(2, r, dtype=np.float32)
    send.setflags(write=False)
    recv = np.empty(2 * n, np.float32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        b.allgatherv(send, recv, [2] * n, world)
    check("allgatherv_readonly", recv, np.repeat(np.arange(n, dtype=np.float32), 2))
    out["readonly_warnings"] = [str(w.message) for w in seen]
    out["filters_unchanged"] = warnings.filters == filters
    b.barrier(world)
    b.close()
    print("GLOO_CHECK " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
