"""Elastic JAX worker for the tests: a jitted optax step whose result does not depend on the number
of workers (every rank feeds the same batch, a function of the step), so a lost or doubled step
shows in the weights. KILL="<host>[<slot>]@<step>": that worker SIGKILLs itself at that step; the
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


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True) * 0.5


def loss(p: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def make_step(tx: optax.GradientTransformation):  # noqa: ANN201
    @jax.jit
    def step(p, s, x, y):  # noqa: ANN001, ANN202
        u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    return step


def reference(steps: int) -> list[float]:
    tx = optax.sgd(0.05, momentum=0.9)
    p = init_params()
    s = tx.init(p)
    step = make_step(tx)
    for i in range(steps):
        p, s = step(p, s, *batch(i))
    return np.concatenate([np.ravel(p["w"]), np.ravel(p["b"])]).tolist()


def main() -> None:
    steps = int(os.environ.get("STEPS", "20"))
    me = f"{os.environ['HOROVOD_ELASTIC_HOST']}[{os.environ['HOROVOD_ELASTIC_SLOT']}]"
    kill = os.environ.get("KILL", "")
    hvd.init()
    tx = hvd.DistributedOptimizer(optax.sgd(0.05, momentum=0.9))
    step_fn = make_step(tx)
    params = init_params()
    state = hvd.elastic.JaxState(params=params, opt_state=tx.init(params), step=0)

    @hvd.elastic.run
    def train(state: hvd.elastic.JaxState) -> None:
        while state.step < steps:
            who, _, at = kill.rpartition("@")
            if kill and who == me and int(at) == state.step:
                os.kill(os.getpid(), signal.SIGKILL)
            state.params, state.opt_state = step_fn(state.params, state.opt_state, *batch(state.step))
            jax.block_until_ready(state.params)
            state.step += 1
            state.commit()
            print(f"COMMIT {json.dumps({'me': me, 'rank': hvd.rank(), 'size': hvd.size(), 'step': state.step})}",
                  flush=True)
            time.sleep(0.05)

    train(state)
    w = np.concatenate([np.ravel(state.params["w"]), np.ravel(state.params["b"])]).tolist()
    print(f"FINAL {json.dumps({'me': me, 'rank': hvd.rank(), 'size': hvd.size(), 'step': state.step, 'w': w})}",
          flush=True)


if __name__ == "__main__":
    main()
