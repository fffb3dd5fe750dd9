"""Elastic PyTorch training on scikit-learn's digits: survives lost workers, takes in new ones.

Run on this machine, with a discovery script listing the "hosts" (two names of this machine):

    printf '#!/bin/sh\\ncat hosts.txt\\n' > discover.sh && chmod +x discover.sh
    printf 'localhost:2\\n' > hosts.txt
    horovodrun -np 2 --min-np 1 --max-np 3 --host-discovery-script ./discover.sh \\
        python examples/elastic/pytorch_digits_elastic.py
    # meanwhile: add a worker ...        printf 'localhost:2\\n127.0.0.1:1\\n' > hosts.txt
    # ... or kill one (training goes on): kill -9 <pid of a worker>

However fast the training, ``--finish-with-workers 2`` keeps it going (past ``--epochs``, one epoch
at a time) until an epoch ends with two workers, so a worker you add always takes part.

The Horovod elastic recipe is marked with "Horovod:" comments: the state to keep (model,
optimizer, sampler, epoch) lives in a ``TorchState``, the training function is wrapped in
``hvd.elastic.run`` and commits the state every few batches.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
from sklearn.datasets import load_digits

import horovod.torch as hvd

parser = argparse.ArgumentParser(description="Elastic PyTorch digits example")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.02, help="learning rate of one worker")
parser.add_argument("--batches-per-commit", type=int, default=5)
parser.add_argument("--batch-sleep", type=float, default=0.02,
                    help="seconds of extra work per batch, so there is time to add or kill a host")
parser.add_argument("--finish-with-workers", type=int, default=1, metavar="N",
                    help="train past --epochs, one epoch at a time, until an epoch ends with at "
                         "least N workers (default 1: stop after --epochs), so that workers you "
                         "add take part however fast the training is")
args = parser.parse_args()

# Horovod: initialize (in an elastic job this joins the driver's current round).
hvd.init()
torch.manual_seed(42)

digits = load_digits()
x = torch.tensor(digits.data / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
y = torch.tensor(digits.target, dtype=torch.long)
train_set = torch.utils.data.TensorDataset(x[:1500], y[:1500])
test_x, test_y = x[1500:], y[1500:]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t = F.max_pool2d(F.relu(self.conv(t)), 2)
        return self.fc2(F.relu(self.fc1(t.flatten(1))))


model = Net()
# Horovod: scale the learning rate with the number of workers (again after every reset, below).
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

# Horovod: ElasticSampler splits what is left of the epoch among the current workers.
sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=42)
loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)


def evaluate() -> float:
    with torch.no_grad():
        return float((model(test_x).argmax(1) == test_y).float().mean())


def finished(state: hvd.elastic.TorchState) -> bool:
    # Horovod: the state is the same on every worker, so all of them decide alike.
    return state.epoch >= args.epochs and state.last_epoch_workers >= args.finish_with_workers


# Horovod: the training function runs again after a reset, from the last commit.
@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> None:
    while not finished(state):
        model.train()
        for batch_idx, (data, target) in enumerate(loader):
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
            time.sleep(args.batch_sleep)
            # Horovod: record progress; commit every few batches (also checks for host changes).
            state.sampler.record_batch(batch_idx, args.batch_size)
            state.batch = batch_idx + 1
            if state.batch % args.batches_per_commit == 0:
                state.commit()
        if hvd.rank() == 0:
            print(f"epoch {state.epoch}: {hvd.size()} workers, test accuracy {evaluate():.3f}",
                  flush=True)
        # Horovod: end of epoch: reset the sampler and commit.
        state.last_epoch_workers = hvd.size()
        state.batch = 0
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()


def on_reset() -> None:
    # Horovod: the number of workers changed: rescale the learning rate.
    for group in optimizer.param_groups:
        group["lr"] = args.lr * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0,
                               last_epoch_workers=0)
state.register_reset_callbacks([on_reset])
train(state)
if hvd.rank() == 0:
    print(f"done: test accuracy {evaluate():.3f} on {hvd.size()} workers", flush=True)
