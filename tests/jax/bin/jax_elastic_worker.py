"""Elastic JAX worker for the tests: a jitted optax step, each rank on its own batch (a function of
the step and the rank), so the weights show a lost or doubled step and an optimizer that stopped
averaging: the state records the world size of every committed step (``sizes``) and the weights
equal ``reference(sizes)``, which averages the ranks' gradients itself.
KILL="<host>[<slot>]@<step>": that worker SIGKILLs itself at that step; the
others' next jitted allreduce fails and the job resets. Prints "COMMIT {json}" and "FINAL {json}".
"""

from __future__ import annotations

import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import horovod.jax as hvd


def init_params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(4, 1)), jnp.float32), "b": jnp.zeros((1,), jnp.float32)}


def batch(step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    x = (rng.normal(size=(8, 4)) + rank).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True) * 0.5


def loss(p: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def make_step(tx: optax.GradientTransformation):  # noqa: ANN201
    @jax.jit
    def step(p, s, x, y):  # noqa: ANN001, ANN202
        u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    return step


def reference(sizes: list[int]) -> list[float]:
    """One step per entry of ``sizes``: the gradients of ranks ``0..n-1`` summed in rank order,
    divided by ``n``, then applied."""
    tx = optax.sgd(0.05, momentum=0.9)
    p = init_params()
    s = tx.init(p)
    grad = jax.jit(jax.grad(loss))
    for i, n in enumerate(sizes):
        gs = [grad(p, *batch(i, r)) for r in range(n)]
        g = jax.tree_util.tree_map(lambda *a, n=n: sum(a[1:], a[0]) / n, *gs)
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
    return np.concatenate([np.ravel(p["w"]), np.ravel(p["b"])]).tolist()


def main() -> None:
    steps = int(os.environ.get("STEPS", "20"))
    me = f"{os.environ['HOROVOD_ELASTIC_HOST']}[{os.environ['HOROVOD_ELASTIC_SLOT']}]"
    kill = os.environ.get("KILL", "")
    hvd.init()
    tx = hvd.DistributedOptimizer(optax.sgd(0.05, momentum=0.9))
    step_fn = make_step(tx)
    params = init_params()
    state = hvd.elastic.JaxState(params=params, opt_state=tx.init(params), step=0, sizes=[])

    @hvd.elastic.run
    def train(state: hvd.elastic.JaxState) -> None:
        while state.step < steps:
            who, _, at = kill.rpartition("@")
            if kill and who == me and int(at) == state.step:
                os.kill(os.getpid(), signal.SIGKILL)
            state.sizes = state.sizes + [hvd.size()]  # a new list: a reset restores the committed one
            state.params, state.opt_state = step_fn(state.params, state.opt_state,
                                                    *batch(state.step, hvd.rank()))
            jax.block_until_ready(state.params)
            state.step += 1
            state.commit()
            print(f"COMMIT {json.dumps({'me': me, 'rank': hvd.rank(), 'size': hvd.size(), 'step': state.step})}",
                  flush=True)
            time.sleep(0.05)

    train(state)
    w = np.concatenate([np.ravel(state.params["w"]), np.ravel(state.params["b"])]).tolist()
    final = {'me': me, 'rank': hvd.rank(), 'size': hvd.size(), 'step': state.step, 'w': w, 'sizes': state.sizes}
    print(f"FINAL {json.dumps(final)}", flush=True)


if __name__ == "__main__":
    main()
