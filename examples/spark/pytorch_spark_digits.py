"""PyTorch training on scikit-learn's digits, launched from Spark with ``horovod.spark.run``.

    python examples/spark/pytorch_spark_digits.py --num-proc 2 --master 'local-cluster[2,1,1024]'
    spark-submit examples/spark/pytorch_spark_digits.py --num-proc 4     # on a real cluster

``train`` is an ordinary Horovod PyTorch training function (the steps marked "Horovod:" are the
usual recipe); ``horovod.spark.run`` runs it on ``num_proc`` Spark tasks, one rank each, and
returns every rank's return value in rank order. The ranks' output appears on the driver with
``[rank]<stdout>:`` prefixes.
"""

from __future__ import annotations

import argparse
from typing import Any


def train(epochs: int = 3, lr: float = 0.02, batch_size: int = 32) -> dict[str, Any]:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torch.utils.data
    from sklearn.datasets import load_digits

    import horovod.torch as hvd

    # Horovod: initialize.
    hvd.init()
    # Horovod: pin the GPU of this process to its local rank (one GPU per process).
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
    torch.manual_seed(42 + hvd.rank())  # different initial weights: the broadcast below fixes that
    torch.set_num_threads(1)

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(digits.target, dtype=torch.long)
    train_set = torch.utils.data.TensorDataset(x[:1500], y[:1500])
    test_x, test_y = x[1500:], y[1500:]
    # Horovod: each rank trains on its own shard of the data.
    sampler = torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=42)
    loader = torch.utils.data.DataLoader(train_set, batch_size=batch_size, sampler=sampler)

    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))
    # Horovod: scale the learning rate by the number of workers.
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)
    # Horovod: wrap the optimizer in hvd.DistributedOptimizer (gradients averaged by allreduce).
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    # Horovod: broadcast the initial state from rank 0 to all other processes.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for data, target in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
        with torch.no_grad():
            accuracy = float((model(test_x).argmax(1) == test_y).float().mean())
        # Horovod: report (and checkpoint) on rank 0 only.
        if hvd.rank() == 0:
            print(f"epoch {epoch}: test accuracy {accuracy:.3f}", flush=True)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "accuracy": accuracy, "params": params.numpy()}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-proc", type=int, default=2, help="Horovod processes (Spark tasks)")
    parser.add_argument("--master", default=None,
                        help="Spark master when not under spark-submit, e.g. local-cluster[2,1,1024]")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.02)
    args = parser.parse_args(argv)

    from pyspark.sql import SparkSession

    import horovod.spark

    builder = SparkSession.builder.appName("horovod-pytorch-digits")
    if args.master:
        builder = builder.master(args.master)
    spark = builder.getOrCreate()
    try:
        results = horovod.spark.run(train, kwargs={"epochs": args.epochs, "lr": args.lr},
                                    num_proc=args.num_proc)
    finally:
        spark.stop()
    for r in results:
        print(f"rank {r['rank']} of {r['size']} (local rank {r['local_rank']}): "
              f"test accuracy {r['accuracy']:.3f}")
    return results


if __name__ == "__main__":
    main()
