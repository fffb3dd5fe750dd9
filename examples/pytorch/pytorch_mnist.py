"""Train a small CNN on MNIST (or scikit-learn's digits) with Horovod and PyTorch.

Run on 2 processes:

    horovodrun -np 2 python examples/pytorch/pytorch_mnist.py
    mpirun -np 2 python examples/pytorch/pytorch_mnist.py          # same thing with Open MPI

Data: MNIST's original IDX files are used when a copy is found under ``--data-dir`` (``train-images-
idx3-ubyte[.gz]`` etc., directly or in ``MNIST/raw/``); nothing is downloaded. Without a copy the
script trains on scikit-learn's bundled 8x8 digits (1,797 images), which takes seconds on a CPU.

The Horovod recipe, step by step, is marked with "Horovod:" comments.
"""

from __future__ import annotations

import argparse
import gzip
import os
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data

import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch MNIST example with Horovod")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per worker for training")
parser.add_argument("--test-batch-size", type=int, default=256, help="input batch size for testing")
parser.add_argument("--epochs", type=int, default=8, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.02, help="learning rate of one worker (scaled by size)")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--log-interval", type=int, default=10, help="batches between training log lines")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer")
parser.add_argument("--data-dir", default=os.environ.get("MNIST_DIR", "./data"),
                    help="where to look for MNIST's IDX files (no download)")
parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "horovod_pytorch_mnist.pt"),
                    help="checkpoint file, written by rank 0 after every epoch")


# ---------------------------------------------------------------------------- data
def _find_idx(data_dir: str, stem: str) -> str | None:
    for sub in ("", "MNIST/raw", "raw", "mnist"):
        for suffix in ("", ".gz"):
            path = os.path.join(data_dir, sub, stem + suffix)
            if os.path.exists(path):
                return path
    return None


def _read_idx(path: str) -> np.ndarray:
    with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_data(data_dir: str) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset, str]:
    """Return (train, test, description): MNIST when its files are present, else sklearn digits."""
    stems = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
             "t10k-labels-idx1-ubyte"]
    paths = [_find_idx(data_dir, s) for s in stems]
    if all(paths):
        xtr, ytr, xte, yte = (_read_idx(p) for p in paths)  # type: ignore[arg-type]
        mean, std = 0.1307, 0.3081
        xtr = (xtr.astype(np.float32) / 255.0 - mean) / std
        xte = (xte.astype(np.float32) / 255.0 - mean) / std
        desc = f"MNIST from {os.path.dirname(paths[0])}"  # type: ignore[arg-type]
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = digits.images.astype(np.float32) / 16.0
        y = digits.target
        order = np.random.RandomState(0).permutation(len(x))  # same split on every rank
        x, y = x[order], y[order]
        split = int(0.8 * len(x))
        xtr, ytr, xte, yte = x[:split], y[:split], x[split:], y[split:]
        mean, std = xtr.mean(), xtr.std()
        xtr, xte = (xtr - mean) / std, (xte - mean) / std
        desc = "scikit-learn digits (8x8; no MNIST copy found under --data-dir)"

    def ds(x: np.ndarray, y: np.ndarray) -> torch.utils.data.Dataset:
        return torch.utils.data.TensorDataset(torch.from_numpy(np.ascontiguousarray(x)).unsqueeze(1),
                                              torch.from_numpy(y.astype(np.int64)))
    return ds(xtr, ytr), ds(xte, yte), desc


# ---------------------------------------------------------------------------- model
class Net(nn.Module):
    """A small CNN for 28x28 MNIST or 8x8 digits (the adaptive pool makes both fit)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = self.pool(F.relu(self.conv2(x)))
        x = F.dropout(F.relu(self.fc1(x.flatten(1))), p=0.2, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def metric_average(val: float, name: str) -> float:
    """Average a scalar over all workers."""
    return hvd.allreduce(torch.tensor(val), name=name).item()


def main() -> None:
    args = parser.parse_args()
    use_cuda = not args.no_cuda and torch.cuda.is_available()

    # Horovod: initialize the library.
    hvd.init()
    torch.manual_seed(args.seed)

    if use_cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    # Horovod: limit the number of CPU threads to be used per worker.
    torch.set_num_threads(1)

    train_dataset, test_dataset, desc = load_data(args.data_dir)
    if hvd.rank() == 0:
        print(f"Training on {desc}: {len(train_dataset)} train / {len(test_dataset)} test images, "
              f"{hvd.size()} workers", flush=True)

    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler)

    model = Net()
    if use_cuda:
        model.cuda()

    # Horovod: scale the learning rate by the number of workers.
    lr_scaler = hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap the optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    # Horovod: broadcast parameters & optimizer state from rank 0 to all other processes.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def train(epoch: int) -> None:
        model.train()
        # Horovod: set epoch to sampler for shuffling.
        train_sampler.set_epoch(epoch)
        total, count = 0.0, 0
        for batch_idx, (data, target) in enumerate(train_loader):
            if use_cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(data)
            count += len(data)
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                # Horovod: use train_sampler to determine the number of examples in this worker's partition.
                pct = 100.0 * batch_idx / len(train_loader)
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} ({pct:.0f}%)]\t"
                      f"Loss: {loss.item():.6f}", flush=True)
        # Horovod: average the epoch's loss over all workers.
        epoch_loss = metric_average(total / max(count, 1), "avg_train_loss")
        if hvd.rank() == 0:
            print(f"Epoch {epoch}: average training loss {epoch_loss:.4f}", flush=True)

    def test() -> float:
        model.eval()
        test_loss, correct = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                if use_cuda:
                    data, target = data.cuda(), target.cuda()
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                pred = output.argmax(dim=1)
                correct += pred.eq(target).float().sum().item()
        # Horovod: average metric values across workers (sums over the partitions, then / size).
        test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
        test_accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
        if hvd.rank() == 0:
            print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%\n",
                  flush=True)
        return test_accuracy

    start = time.time()
    for epoch in range(1, args.epochs + 1):
        train(epoch)
        # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
        if hvd.rank() == 0:
            torch.save({"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict()},
                       args.checkpoint)
    accuracy = test()
    if hvd.rank() == 0:
        print(f"Final test accuracy: {100.0 * accuracy:.2f}% ({args.epochs} epochs, "
              f"{time.time() - start:.1f} s, checkpoint: {args.checkpoint})", flush=True)


if __name__ == "__main__":
    main()
