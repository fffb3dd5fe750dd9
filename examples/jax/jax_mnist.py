"""Data-parallel JAX + optax training with Horovod on scikit-learn's digits (8x8 "MNIST").

    horovodrun -np 2 python examples/jax/jax_mnist.py --epochs 10

Each rank trains on its own shard; ``hvd.DistributedOptimizer`` averages the gradients inside the
jitted step, ``hvd.broadcast_parameters`` starts every rank from rank 0's weights, and the test
accuracy is averaged over the ranks' shards of the test set.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import horovod.jax as hvd


def init_mlp(key: jax.Array, sizes: list[int]) -> list[dict[str, jax.Array]]:
    params = []
    for k, (m, n) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        params.append({"w": jax.random.normal(k, (m, n)) * jnp.sqrt(2.0 / m), "b": jnp.zeros(n)})
    return params


def predict(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(predict(params, x), y).mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    hvd.init()
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    # Each rank its own shard of the data.
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    x_test, y_test = x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()]

    # Different seeds on purpose: the broadcast gives every rank rank 0's weights.
    params = init_mlp(jax.random.PRNGKey(hvd.rank()), [64, 64, 10])
    params = hvd.broadcast_parameters(params, root_rank=0)
    # Scale the learning rate by the number of ranks (the global batch is size() times larger).
    tx = hvd.DistributedOptimizer(optax.sgd(args.lr * hvd.size(), momentum=0.9))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, xb, yb):  # noqa: ANN001, ANN202
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, params)   # averaged across ranks here
        return optax.apply_updates(params, updates), opt_state, loss

    # Every rank runs the same number of steps (the smallest shard decides).
    steps = hvd.allreduce(jnp.array(len(x_train) // args.batch_size), op=hvd.Min, name="steps")
    rng = np.random.default_rng(hvd.rank())
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(x_train))
        losses = []
        for i in range(int(steps)):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            params, opt_state, loss = step(params, opt_state, x_train[idx], y_train[idx])
            losses.append(loss)
        avg = hvd.allreduce(jnp.mean(jnp.stack(losses)), name="epoch_loss")
        if hvd.rank() == 0:
            print(f"Epoch {epoch}: average training loss {float(avg):.4f}", flush=True)

    correct = jnp.sum(jnp.argmax(predict(params, x_test), -1) == y_test)
    total = hvd.allreduce(jnp.array([correct, len(y_test)], jnp.float32), op=hvd.Sum, name="accuracy")
    if hvd.rank() == 0:
        print(f"Final test accuracy: {100.0 * float(total[0] / total[1]):.2f}%", flush=True)


if __name__ == "__main__":
    main()
