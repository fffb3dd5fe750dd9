"""Elastic PyTorch training on Ray: ``RayExecutor(min_workers=..., max_workers=...)`` survives a
lost worker and takes in nodes that join the cluster, keeping the committed state in memory.

    python examples/ray/pytorch_elastic_ray.py                       # a local Ray instance
    python examples/ray/pytorch_elastic_ray.py --address auto --min-workers 2 --max-workers 8

On a running cluster, while it trains: ``ray start --address=<head>:6379`` on another machine
adds a node, whose workers are taken in at the next commit; ``kill -9`` of a worker actor's
process (``ray::BaseHorovodWorker``) loses that worker: its node is blacklisted (all of that
node's workers leave, as upstream treats a failed host) and the workers on the other nodes go on
from the last commit. On a one-node cluster a lost worker therefore ends the job.

The Horovod elastic recipe is marked with "Horovod:" comments: the state to keep (model,
optimizer, sampler, epoch) lives in a ``TorchState``, the training function is wrapped in
``hvd.elastic.run`` and commits the state every few batches.
"""

from __future__ import annotations

import argparse

import ray

from horovod.ray import RayExecutor


def train(epochs: int, batch_size: int, lr: float, batches_per_commit: int, batch_sleep: float) -> dict:
    """Runs on every worker (a Ray actor)."""
    import time

    import torch
    import torch.nn.functional as F
    import torch.utils.data
    from sklearn.datasets import load_digits

    import horovod.torch as hvd

    # Horovod: initialize (in an elastic job this joins the driver's current round).
    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.long)
    train_set = torch.utils.data.TensorDataset(x[:1500], y[:1500])
    test_x, test_y = x[1500:], y[1500:]

    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(16 * 4 * 4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    # Horovod: scale the learning rate with the number of workers (again after every reset).
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    # Horovod: ElasticSampler splits what is left of the epoch among the current workers.
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=42)
    loader = torch.utils.data.DataLoader(train_set, batch_size=batch_size, sampler=sampler)

    @hvd.elastic.run
    def loop(state: hvd.elastic.TorchState) -> None:
        while state.epoch < epochs:
            for batch_idx, (data, target) in enumerate(loader):
                optimizer.zero_grad()
                F.cross_entropy(model(data), target).backward()
                optimizer.step()
                time.sleep(batch_sleep)
                # Horovod: record progress; commit every few batches (also checks for new hosts).
                state.sampler.record_batch(batch_idx, batch_size)
                if (batch_idx + 1) % batches_per_commit == 0:
                    state.commit()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}: {hvd.size()} workers", flush=True)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    def on_reset() -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    state.register_reset_callbacks([on_reset])
    loop(state)
    with torch.no_grad():
        accuracy = float((model(test_x).argmax(1) == test_y).float().mean())
    return {"rank": hvd.rank(), "size": hvd.size(), "accuracy": accuracy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start one here)")
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--max-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate of one worker")
    parser.add_argument("--batches-per-commit", type=int, default=5)
    parser.add_argument("--batch-sleep", type=float, default=0.02,
                        help="seconds of extra work per batch, so there is time to add or kill a worker")
    args = parser.parse_args()

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.max_workers, include_dashboard=False, object_store_memory=200 * 1024 * 1024)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=args.min_workers,
                           max_workers=args.max_workers, cpus_per_worker=1)
    executor.start()
    try:
        results = executor.run(train, kwargs={"epochs": args.epochs, "batch_size": args.batch_size,
                                              "lr": args.lr, "batches_per_commit": args.batches_per_commit,
                                              "batch_sleep": args.batch_sleep})
    finally:
        executor.shutdown()
    for r in results:
        print(f"RESULT rank={r['rank']} size={r['size']} accuracy={r['accuracy']:.4f}", flush=True)


if __name__ == "__main__":
    main()
