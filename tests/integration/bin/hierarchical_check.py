"""Hierarchical allreduce/allgather values on every rank, against the expected values and the flat path.

Run on 4 ranks over 2 hosts with HOROVOD_HIERARCHICAL_ALLREDUCE=1 and HOROVOD_HIERARCHICAL_ALLGATHER=1
(``horovodrun -np 4 -H a:2,b:2``, or mpirun with HOROVOD_HOSTNAME simulating the hosts). Prints
``RESULT {json}`` with the failures found (an empty list when every value matched).
"""

from __future__ import annotations

import json


def check() -> dict:
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common.context import get_context

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    ex = get_context().engine._executor
    world = get_context().groups[0]
    bad: list[str] = []
    if not (ex.hierarchical_allreduce and ex.hierarchical_allgather):
        bad.append(f"rank {r}: hierarchical flags off in the executor ({ex.tunables})")

    def values(size: int, k: int, dt: str) -> np.ndarray:
        return (np.arange(size) % 13 + k).astype(dt)

    def allreduce_cases(tag: str) -> list[np.ndarray]:
        outs = []
        for dt in ("float32", "float64", "int32", "float16"):
            for size in (1, 3, 7, 1000, 5003):
                x = values(size, r, dt)
                want = sum(values(size, k, "float64") for k in range(n))
                got = hvd.allreduce(x, op=hvd.Sum, name=f"{tag}.sum.{dt}.{size}")
                if got.dtype != x.dtype or not np.array_equal(got, want.astype(dt)):
                    bad.append(f"rank {r} ({tag}): allreduce Sum {dt}[{size}] -> {got[:8]}, "
                               f"expected {want[:8]}")
                outs.append(got)
                if dt.startswith("float"):
                    got = hvd.allreduce(x, op=hvd.Average, name=f"{tag}.avg.{dt}.{size}")
                    want_avg = (want / n).astype(dt)
                    if not np.allclose(got, want_avg, rtol=1e-3):
                        bad.append(f"rank {r} ({tag}): allreduce Average {dt}[{size}] -> {got[:8]}")
                    outs.append(got)
        x = values(2000, r, "float32")
        for op, want in ((hvd.Min, values(2000, 0, "float32")), (hvd.Max, values(2000, n - 1, "float32"))):
            got = hvd.allreduce(x, op=op, name=f"{tag}.{op}")
            if not np.array_equal(got, want):
                bad.append(f"rank {r} ({tag}): allreduce {op} -> {got[:8]}")
        got = hvd.allreduce(np.full(300, r + 1.0), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25,
                            name=f"{tag}.scaled")
        if not np.allclose(got, 0.5 * sum(k + 1 for k in range(n))):
            bad.append(f"rank {r} ({tag}): scaled allreduce -> {got[:4]}")
        # many small and large tensors in one fused batch, in place
        arrs = [values(s, r, "float32") for s in (5, 2048, 17, 9000, 1, 4096)]
        hs = [hvd.allreduce_async_(a, op=hvd.Sum, name=f"{tag}.batch.{i}") for i, a in enumerate(arrs)]
        for i, (h, a) in enumerate(zip(hs, arrs)):
            hvd.synchronize(h)
            if not np.array_equal(a, sum(values(a.size, k, "float64") for k in range(n)).astype("float32")):
                bad.append(f"rank {r} ({tag}): fused in-place tensor {i} ({a.size}) -> {a[:6]}")
            outs.append(a)
        return outs

    def allgather_cases(tag: str) -> list[np.ndarray]:
        outs = []
        for dt in ("float32", "int64", "bool", "float16"):
            x = (np.arange((r + 1) * 3).reshape(r + 1, 3) + 100 * r).astype(dt)
            want = np.concatenate([(np.arange((k + 1) * 3).reshape(k + 1, 3) + 100 * k).astype(dt)
                                   for k in range(n)])
            got = hvd.allgather(x, name=f"{tag}.ag.{dt}")
            if got.dtype != want.dtype or not np.array_equal(got, want):
                bad.append(f"rank {r} ({tag}): allgather {dt} -> {got.tolist()}, expected {want.tolist()}")
            outs.append(got)
        big = np.full((2000 + r, 5), r, np.float32)
        got = hvd.allgather(big, name=f"{tag}.ag.big")
        want = np.concatenate([np.full((2000 + k, 5), k, np.float32) for k in range(n)])
        if not np.array_equal(got, want):
            bad.append(f"rank {r} ({tag}): large allgather differs")
        outs.append(got)
        return outs

    ex.chunk_bytes = 4096  # many pieces: packed buffers, tails, pieces in place
    hier_out = allreduce_cases("hier") + allgather_cases("hier")
    # The hierarchy the engine thread made for the global set on its first hierarchical operation
    # (never made from this thread: splitting the world's communicator here would race with the
    # engine thread's own collectives on it).
    hier = ex._hierarchies.get(tuple(world.ranks))
    if hier is None:
        bad.append(f"rank {r}: no hierarchy for the global set (hosts {ex.hostnames})")
    # The same operations on the flat path (switched on every rank between blocking calls).
    ex.hierarchical_allreduce = ex.hierarchical_allgather = False
    flat_out = allreduce_cases("flat") + allgather_cases("flat")
    for i, (a, b) in enumerate(zip(hier_out, flat_out)):
        if not np.array_equal(a, b):
            bad.append(f"rank {r}: hierarchical result {i} differs from the flat one")
    ex.hierarchical_allreduce = ex.hierarchical_allgather = True
    # A process set of one rank per host (or one host): the flat collective runs.
    ps = hvd.add_process_set([0, 2])
    if r in (0, 2):
        got = hvd.allreduce(np.full(10, float(r)), op=hvd.Sum, name="ps.sum", process_set=ps)
        if not np.array_equal(got, np.full(10, 2.0)):
            bad.append(f"rank {r}: process-set allreduce -> {got}")
        got = hvd.allgather(np.full((1, 2), r), name="ps.ag", process_set=ps)
        if not np.array_equal(got, np.array([[0, 0], [2, 2]])):
            bad.append(f"rank {r}: process-set allgather -> {got.tolist()}")
    hvd.barrier()
    return {"rank": r, "bad": bad, "hierarchy": hier is not None,
            "local_rank": hvd.local_rank(), "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),
            "contiguous": None if hier is None else hier.contiguous}


if __name__ == "__main__":
    print("RESULT " + json.dumps(check()), flush=True)
