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
    from horovod.jax import _ffi

    route = "XLA FFI, in place" if _ffi.available() else "host callback (copies)"
    return f"{jax.__version__}, in-jit route: {route}"


def lightning_smoke() -> str:
    import lightning
    import lightning.pytorch as pl
    import torch

    import horovod.lightning  # noqa: F401  (registers strategy="horovod")
    import horovod.torch as hvd

    version = torch_smoke()

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, _index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    rank = hvd.rank()
    torch.manual_seed(rank)                      # different data and start on every rank
    data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    model = Tiny()
    trainer = pl.Trainer(strategy="horovod", accelerator="cpu", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    weights = model.layer.weight.detach().reshape(1, -1)
    gathered = hvd.allgather(weights, name="smoke.lightning")
    _expect("Lightning weights equal on every rank", torch.equal(gathered[0], gathered[-1]), True, rank)
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
