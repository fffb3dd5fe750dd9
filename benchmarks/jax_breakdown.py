"""Where the in-jit allreduce of the ResNet-50 set spends its time, next to horovod.numpy (median of REPS, interleaved).

    mpirun -np 2 python benchmarks/jax_breakdown.py   (JAX_PLATFORMS=cpu; REPS=11 by default)

Prints seconds and the ratio to horovod.numpy.grouped_allreduce: the same engine call in place on memory
like XLA's (not NumPy's, not on huge pages), a 100 MB copy into warm and into fresh memory, the jitted
step, and the step split at the collective (before: dispatch and XLA's work; in: the engine; after).
"""
import sys, time, json, statistics, os, types
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np, jax, jax.numpy as jnp
from shapes import resnet50
import horovod.jax as hvd, horovod.numpy as hnp
import horovod.jax.mpi_ops as mo
from horovod.common import collectives as C
hvd.init()
reps = int(os.environ.get("REPS", "11"))
rng = np.random.default_rng(hvd.rank())
arrays = [rng.standard_normal(s).astype(np.float32) for s in resnet50()]
tree = [jnp.asarray(a) for a in arrays]
marks = {}
def timed(*a, **k):
    marks["enter"] = time.perf_counter()
    h = C.allreduce_async(*a, **k)
    class W:
        def wait(self):
            r = h.wait(); marks["exit"] = time.perf_counter(); return r
    return W()
mo._C = types.SimpleNamespace(allreduce_async=timed)
step = jax.jit(lambda g: hvd.allreduce_tree(g, name="grads"))
jax.block_until_ready(step(tree))
def plain(a):  # memory like XLA's: not NumPy's, not on huge pages
    return np.frombuffer(bytearray(a.nbytes), a.dtype).reshape(a.shape)
warm = [plain(a) for a in arrays]
fresh_src = [np.frombuffer(bytearray(a.nbytes), a.dtype).reshape(a.shape) for a in arrays]
def inplace_warm():
    for w, a in zip(warm, arrays): np.copyto(w, a)
    t = time.perf_counter(); hnp.grouped_allreduce_(warm, name="ip"); return time.perf_counter() - t
def copy_fresh():
    t = time.perf_counter(); c = [np.copyto(np.frombuffer(bytearray(a.nbytes), a.dtype).reshape(a.shape), a) for a in arrays]; return time.perf_counter() - t
def copy_warm():
    t = time.perf_counter(); [np.copyto(w, a) for w, a in zip(warm, arrays)]; return time.perf_counter() - t
T = {k: [] for k in ["numpy", "numpy_inplace_xla_like_mem", "copy_100MB_warm", "alloc_zero_copy_100MB_fresh", "jit", "jit_before_cb", "jit_in_cb", "jit_after_cb"]}
for _ in range(reps):
    hnp.barrier(); t = time.perf_counter(); hnp.grouped_allreduce(arrays, name="np"); T["numpy"].append(time.perf_counter() - t)
    hnp.barrier(); T["numpy_inplace_xla_like_mem"].append(inplace_warm())
    hnp.barrier(); T["copy_100MB_warm"].append(copy_warm())
    hnp.barrier(); T["alloc_zero_copy_100MB_fresh"].append(copy_fresh())
    hnp.barrier(); t = time.perf_counter(); jax.block_until_ready(step(tree)); e = time.perf_counter()
    T["jit"].append(e - t); T["jit_before_cb"].append(marks["enter"] - t); T["jit_in_cb"].append(marks["exit"] - marks["enter"]); T["jit_after_cb"].append(e - marks["exit"])
if hvd.rank() == 0:
    m = {k: statistics.median(v) for k, v in T.items()}
    print(json.dumps({k: f"{v:.4f} ({v / m['numpy']:.2f}x)" for k, v in m.items()}), flush=True)
