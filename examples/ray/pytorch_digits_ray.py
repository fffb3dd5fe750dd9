"""PyTorch training with Horovod, launched on a Ray cluster by ``horovod.ray.RayExecutor``.

The training function is upstream Horovod's PyTorch recipe as written (``hvd.init()``,
``DistributedSampler``, learning rate scaled by ``hvd.size()``, ``hvd.DistributedOptimizer``,
``hvd.broadcast_parameters``/``broadcast_optimizer_state``, checkpoints on rank 0 only), on
scikit-learn's digits (bundled, no download). The driver starts 2 ranks as Ray actors and gets
each rank's result back, in rank order:

    python examples/ray/pytorch_digits_ray.py                       # a local Ray cluster
    python examples/ray/pytorch_digits_ray.py --address auto        # a running cluster (ray start)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile

import ray

from horovod.ray import RayExecutor


def train(epochs: int, batch_size: int, lr: float, checkpoint: str) -> dict:
    """Runs on every rank (a Ray actor): the Horovod PyTorch recipe."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    import torch.utils.data
    from sklearn.datasets import load_digits

    import horovod.torch as hvd

    # Horovod: initialize the library.
    hvd.init()
    torch.manual_seed(42)
    # Horovod: limit the number of CPU threads used by each worker.
    torch.set_num_threads(1)

    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.long)
    train_set = torch.utils.data.TensorDataset(x[:1500], y[:1500])
    test_x, test_y = x[1500:], y[1500:]

    # Horovod: use DistributedSampler to partition the training data.
    sampler = torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank())
    loader = torch.utils.data.DataLoader(train_set, batch_size=batch_size, sampler=sampler)

    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(16 * 4 * 4, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10))

    # Horovod: scale the learning rate by the number of workers.
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)
    # Horovod: wrap the optimizer in hvd.DistributedOptimizer.
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
        # Horovod: save checkpoints only on worker 0.
        if hvd.rank() == 0:
            torch.save(model.state_dict(), checkpoint)

    model.eval()
    with torch.no_grad():
        accuracy = float((model(test_x).argmax(1) == test_y).float().mean())
    weights = b"".join(np.ascontiguousarray(p.detach().numpy()).tobytes() for p in model.parameters())
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "accuracy": accuracy, "weights": hashlib.sha256(weights).hexdigest()[:16]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start one here)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--cpus-per-worker", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate of one worker")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "horovod_ray_digits.pt"))
    args = parser.parse_args()

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_workers * args.cpus_per_worker, include_dashboard=False,
                 object_store_memory=200 * 1024 * 1024)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=args.num_workers,
                           cpus_per_worker=args.cpus_per_worker)
    executor.start()
    try:
        results = executor.run(train, kwargs={"epochs": args.epochs, "batch_size": args.batch_size,
                                              "lr": args.lr, "checkpoint": args.checkpoint})
    finally:
        executor.shutdown()
    for r in results:
        print(f"RESULT rank={r['rank']} size={r['size']} local_rank={r['local_rank']} "
              f"accuracy={r['accuracy']:.4f} weights={r['weights']}", flush=True)


if __name__ == "__main__":
    main()
