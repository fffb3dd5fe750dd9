"""Where the in-jit allreduce of the ResNet-50 set spends its time, next to horovod.numpy.

    mpirun -np 2 python benchmarks/jax_breakdown.py   (JAX_PLATFORMS=cpu; REPS=11 by default)

Prints, on rank 0, medians in seconds and their ratio to ``horovod.numpy.grouped_allreduce``,
interleaved repetition by repetition: the same engine call in place on memory like XLA's (not
NumPy's, not on huge pages), a 100 MB copy into warm and into fresh memory, the jitted step
(``allreduce_tree``), and that step split at the collective (before: dispatch and XLA's own work;
in: the engine; after: back to the caller).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from shapes import resnet50

    import horovod.jax as hvd
    import horovod.jax.mpi_ops as mo
    import horovod.numpy as hnp
    from horovod.common import collectives as C  # noqa: N812

    hvd.init()
    reps = int(os.environ.get("REPS", "11"))
    rng = np.random.default_rng(hvd.rank())
    arrays = [rng.standard_normal(s).astype(np.float32) for s in resnet50()]
    tree = [jnp.asarray(a) for a in arrays]
    marks: dict[str, float] = {}

    def timed(*a, **k):  # noqa: ANN002, ANN003, ANN202
        marks["enter"] = time.perf_counter()
        handle = C.allreduce_async(*a, **k)

        class Wait:
            def wait(self):  # noqa: ANN202
                result = handle.wait()
                marks["exit"] = time.perf_counter()
                return result

        return Wait()

    mo._C = types.SimpleNamespace(allreduce_async=timed)  # time the engine call inside the step
    step = jax.jit(lambda g: hvd.allreduce_tree(g, name="grads"))
    jax.block_until_ready(step(tree))

    def plain(a: np.ndarray) -> np.ndarray:  # memory like XLA's: not NumPy's, not on huge pages
        return np.frombuffer(bytearray(a.nbytes), a.dtype).reshape(a.shape)

    warm = [plain(a) for a in arrays]

    def inplace_warm() -> float:
        for w, a in zip(warm, arrays):
            np.copyto(w, a)
        t = time.perf_counter()
        hnp.grouped_allreduce_(warm, name="ip")
        return time.perf_counter() - t

    def copy_fresh() -> float:
        t = time.perf_counter()
        for a in arrays:
            np.copyto(plain(a), a)
        return time.perf_counter() - t

    def copy_warm() -> float:
        t = time.perf_counter()
        for w, a in zip(warm, arrays):
            np.copyto(w, a)
        return time.perf_counter() - t

    keys = ["numpy", "numpy_inplace_xla_like_mem", "copy_100MB_warm", "alloc_zero_copy_100MB_fresh", "jit",
            "jit_before_cb", "jit_in_cb", "jit_after_cb"]
    times: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(reps):
        hnp.barrier()
        t = time.perf_counter()
        hnp.grouped_allreduce(arrays, name="np")
        times["numpy"].append(time.perf_counter() - t)
        hnp.barrier()
        times["numpy_inplace_xla_like_mem"].append(inplace_warm())
        hnp.barrier()
        times["copy_100MB_warm"].append(copy_warm())
        hnp.barrier()
        times["alloc_zero_copy_100MB_fresh"].append(copy_fresh())
        hnp.barrier()
        t = time.perf_counter()
        jax.block_until_ready(step(tree))
        e = time.perf_counter()
        times["jit"].append(e - t)
        times["jit_before_cb"].append(marks["enter"] - t)
        times["jit_in_cb"].append(marks["exit"] - marks["enter"])
        times["jit_after_cb"].append(e - marks["exit"])
    if hvd.rank() == 0:
        m = {k: statistics.median(v) for k, v in times.items()}
        print(json.dumps({k: f"{v:.4f} ({v / m['numpy']:.2f}x)" for k, v in m.items()}), flush=True)


if __name__ == "__main__":
    main()
