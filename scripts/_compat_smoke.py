"""The smoke tier of scripts/compat_matrix.py: run under ``horovodrun -np 2``.

``python scripts/_compat_smoke.py FRAMEWORK`` checks, on every rank: a sum allreduce, a broadcast of
parameters from rank 0, and one ``DistributedOptimizer`` step whose gradients are averaged over the
ranks. Each rank prints ``SMOKE OK rank=R framework=F version=V`` or raises with the values it saw.
"""

from __future__ import annotations

import sys


def _expect(what: str, got: object, want: object, rank: int) -> None:
    if got != want:
        raise AssertionError(f"rank {rank}: {what}: got {got!r}, expected {want!r}")


def torch_smoke() -> str:
    import torch

    import horovod.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(torch.full((3,), float(rank + 1)), op=hvd.Sum, name="smoke.sum")
    _expect("allreduce Sum", total.tolist(), [float(size * (size + 1) // 2)] * 3, rank)
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(float(rank))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    _expect("broadcast_parameters", model.weight.tolist(), [[0.0, 0.0]], rank)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    x = torch.full((1, 2), float(rank + 1))
    model(x).sum().backward()          # gradient on rank r: [r + 1, r + 1]
    opt.step()
    mean = sum(r + 1 for r in range(size)) / size
    _expect("DistributedOptimizer step", model.weight.tolist(), [[-mean, -mean]], rank)
    return torch.__version__


def tensorflow_smoke() -> str:
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(tf.fill([3], float(rank + 1)), op=hvd.Sum, name="smoke.sum")
    _expect("allreduce Sum", total.numpy().tolist(), [float(size * (size + 1) // 2)] * 3, rank)
    var = tf.Variable([float(rank), float(rank)])
    hvd.broadcast_variables([var], root_rank=0)
    _expect("broadcast_variables", var.numpy().tolist(), [0.0, 0.0], rank)
    x = tf.constant([float(rank + 1), float(rank + 1)])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(var * x)
    tape = hvd.DistributedGradientTape(tape)
    (grad,) = tape.gradient(loss, [var])
    mean = sum(r + 1 for r in range(size)) / size
    _expect("DistributedGradientTape", grad.numpy().tolist(), [mean, mean], rank)
    return tf.__version__


def jax_smoke() -> str:
    import jax
    import jax.numpy as jnp
    import optax

    import horovod.jax as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(jnp.full((3,), float(rank + 1)), op=hvd.Sum, name="smoke.sum")
    _expect("allreduce Sum", [float(v) for v in total], [float(size * (size + 1) // 2)] * 3, rank)
    params = hvd.broadcast_parameters({"w": jnp.full((2,), float(rank))}, root_rank=0)
    _expect("broadcast_parameters", [float(v) for v in params["w"]], [0.0, 0.0], rank)
    tx = hvd.DistributedOptimizer(optax.sgd(1.0))
    state = tx.init(params)
    grads = {"w": jnp.full((2,), float(rank + 1))}
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    mean = sum(r + 1 for r in range(size)) / size
    _expect("DistributedOptimizer update", [float(v) for v in params["w"]], [-mean, -mean], rank)
    return jax.__version__


def lightning_smoke() -> str:
    import lightning

    import horovod.lightning  # noqa: F401  (registers strategy="horovod")

    version = torch_smoke()
    return f"lightning {lightning.__version__}, torch {version}"


SMOKES = {"torch": torch_smoke, "tensorflow": tensorflow_smoke, "jax": jax_smoke,
          "lightning": lightning_smoke}


def main() -> None:
    framework = sys.argv[1]
    version = SMOKES[framework]()
    from horovod.common.basics import rank
    print(f"SMOKE OK rank={rank()} framework={framework} version={version}", flush=True)


if __name__ == "__main__":
    main()
