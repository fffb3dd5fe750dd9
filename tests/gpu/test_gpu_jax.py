"""``horovod.jax`` on GPU arrays (host-staged): eagerly and inside ``jax.jit``, the results on the GPU."""

from __future__ import annotations

import pytest

from horovod.testing import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


def _jax_on_gpu():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import horovod.jax as hvd

    hvd.init()
    gpus = jax.devices("gpu")
    if not gpus:
        return ["this JAX sees no GPU"]
    dev = gpus[0]
    r, n = hvd.rank(), hvd.size()
    bad = []
    x = jax.device_put(jnp.full((4, 3), float(r + 1), dtype=jnp.float32), dev)

    def check(what, got, want):
        devs = {d.platform for d in got.devices()}
        if devs != {"gpu"}:
            bad.append(f"rank {r}: {what} result on {devs}")
        if not np.allclose(np.asarray(got), want):
            bad.append(f"rank {r}: {what} -> {np.asarray(got)}, expected {want}")

    total = float(sum(range(1, n + 1)))
    check("eager allreduce", hvd.allreduce(x, op=hvd.Sum, name="e.sum"), np.full((4, 3), total))
    jitted = jax.jit(lambda a: hvd.allreduce(a, op=hvd.Sum, name="j.sum") * 2.0)
    check("jitted allreduce", jitted(x), np.full((4, 3), 2 * total))
    check("allgather", hvd.allgather(x, name="ag"),
          np.concatenate([np.full((4, 3), float(k + 1)) for k in range(n)]))
    check("broadcast", hvd.broadcast(x, root_rank=n - 1, name="bc"), np.full((4, 3), float(n)))
    # a jitted optax step through DistributedOptimizer: identical parameters on every rank
    params = jax.device_put({"w": jnp.full((3,), float(r))}, dev)
    params = hvd.broadcast_parameters(params, root_rank=0)
    tx = hvd.DistributedOptimizer(optax.sgd(0.1))
    state = tx.init(params)

    @jax.jit
    def step(p, s, k):
        g = jax.grad(lambda q: jnp.sum((q["w"] - k) ** 2))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for _ in range(3):
        params, state = step(params, state, float(r))
    got = hvd.allgather(params["w"][None], name="params")
    if not np.allclose(np.asarray(got), np.asarray(got)[0]):
        bad.append(f"rank {r}: parameters differ across ranks: {np.asarray(got)}")
    hvd.shutdown()
    return bad


@pytest.mark.parametrize("np_", [1, 2])
def test_horovod_jax_on_gpu_arrays(np_):
    pytest.importorskip("jax.numpy", reason="JAX is not installed on this GPU machine")
    pytest.importorskip("optax", reason="optax is not installed on this GPU machine")
    # two processes share the one GPU: no preallocation of most of its memory by each
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert run_ranks(_jax_on_gpu, np=np_, timeout=300, env=env) == [[]] * np_
