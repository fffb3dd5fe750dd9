"""Train a small CNN with PyTorch Lightning 2 on Horovod (scikit-learn's 8x8 digits, no download).

Run on 2 processes:

    horovodrun -np 2 python examples/pytorch/pytorch_lightning_mnist.py
    mpirun -np 2 python examples/pytorch/pytorch_lightning_mnist.py     # same thing with Open MPI

Upstream Horovod's Lightning MNIST example, ported to Lightning 2: Lightning 1.x's
``Trainer(accelerator='horovod', gpus=...)`` is ``Trainer(strategy="horovod", accelerator=...,
devices=1)`` (the strategy comes from ``import horovod.lightning``); ``validation_epoch_end`` is
``on_validation_epoch_end`` with ``self.log(..., sync_dist=True)``; the callback's ``on_epoch_end``
(called for training and validation epochs) is ``on_train_epoch_end`` + ``on_validation_epoch_end``;
``checkpoint_callback=`` is a callback in ``callbacks=``. The logger is Lightning's ``CSVLogger``
(``TensorBoardLogger`` needs the tensorboard package). Works with ``pytorch_lightning`` as well:
``--package pytorch_lightning``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data

import horovod.lightning  # noqa: F401  (registers strategy="horovod" in Lightning's registry)
import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch Lightning MNIST example on Horovod")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per worker for training")
parser.add_argument("--test-batch-size", type=int, default=256, help="input batch size for testing")
parser.add_argument("--epochs", type=int, default=6, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one worker (scaled by size)")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--use-adasum", action="store_true", default=False, help="use adasum algorithm to do reduction")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer")
parser.add_argument("--output-dir", default=None, help="checkpoints and logs (default: a temporary directory)")
parser.add_argument("--package", default="lightning.pytorch", choices=["lightning.pytorch", "pytorch_lightning"],
                    help="which Lightning 2 distribution to use")

args = parser.parse_args()
pl = importlib.import_module(args.package)
from_callbacks = importlib.import_module(args.package + ".callbacks")
from_loggers = importlib.import_module(args.package + ".loggers")


# Define the model without any Horovod-specific parameters (8x8 digits instead of 28x28 MNIST).
class Net(pl.LightningModule):
    def __init__(self, lr: float, momentum: float) -> None:
        super().__init__()
        self.lr, self.momentum = lr, momentum
        self.conv1 = nn.Conv2d(1, 10, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=3, padding=1)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(80, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = x.float()
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 80)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, -1)

    def configure_optimizers(self):
        # Horovod: scale the learning rate by the number of workers (Lightning 1.x's Horovod
        # strategy did this silently; here it is the script's choice, as in every Horovod recipe).
        return optim.SGD(self.parameters(), lr=self.lr * hvd.size(), momentum=self.momentum)

    def training_step(self, batch, batch_nb):
        x, y = batch[0], batch[1]
        loss = F.nll_loss(self(x), y.long())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_nb):
        x, y = batch[0], batch[1]
        # Horovod: sync_dist=True averages the epoch's value over the workers.
        self.log("val_loss", F.nll_loss(self(x), y.long()), sync_dist=True)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def test(model, test_loader, test_sampler):
    model.eval()
    test_loss = 0.0
    test_accuracy = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            # sum up batch loss
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            # get the index of the max log-probability
            pred = output.data.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum().item()

    # Horovod: use test_sampler to determine the number of examples in this worker's partition.
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)

    # Horovod: average metric values across workers.
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")

    # Horovod: print output only on first rank.
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%\n", flush=True)
    return test_accuracy


class MyDummyCallback(pl.Callback):
    def __init__(self, epochs: int) -> None:
        self.epochs = epochs
        self.epoch_end_counter = 0
        self.train_epoch_end_counter = 0

    def on_fit_start(self, trainer, model):
        print("Trainer is initialized.")

    def on_validation_epoch_end(self, trainer, model):
        self.epoch_end_counter += 1

    def on_train_epoch_end(self, trainer, model):
        print("A train epoch ended.")
        self.epoch_end_counter += 1
        self.train_epoch_end_counter += 1

    def on_train_end(self, trainer, model):
        print("Training ends")
        assert self.epoch_end_counter == 2 * self.epochs
        assert self.train_epoch_end_counter == self.epochs


def main() -> None:
    from sklearn.datasets import load_digits

    use_cuda = not args.no_cuda and torch.cuda.is_available()
    hvd.init()
    torch.manual_seed(args.seed)

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)  # (N, 1, 8, 8)
    labels = torch.tensor(digits.target)
    perm = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    split = int(0.8 * len(images))
    train_dataset = torch.utils.data.TensorDataset(images[perm[:split]], labels[perm[:split]])
    test_dataset = torch.utils.data.TensorDataset(images[perm[split:]], labels[perm[split:]])

    # Lightning inserts the DistributedSampler into these loaders (use_distributed_sampler=True).
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True)
    val_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size)

    # The post-training test() below is a plain loop: it partitions the data itself.
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    epochs = args.epochs
    with tempfile.TemporaryDirectory() as tmp:
        run_output_dir = args.output_dir or tmp
        ckpt_path = os.path.join(run_output_dir, "checkpoint")
        logs_path = os.path.join(run_output_dir, "logger")

        model = Net(args.lr, args.momentum)
        strategy = horovod.lightning.HorovodStrategy(
            package=args.package,
            compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
            op=hvd.Adasum if args.use_adasum else hvd.Average,
            gradient_predivide_factor=args.gradient_predivide_factor)
        callbacks = [MyDummyCallback(epochs), from_callbacks.ModelCheckpoint(dirpath=ckpt_path)]
        trainer = pl.Trainer(strategy=strategy,
                             accelerator="gpu" if use_cuda else "cpu",
                             devices=1,
                             callbacks=callbacks,
                             max_epochs=epochs,
                             limit_train_batches=1.0,
                             limit_val_batches=1.0,
                             logger=from_loggers.CSVLogger(logs_path),
                             enable_progress_bar=False,
                             num_sanity_val_steps=0)
        trainer.fit(model, train_loader, val_loader)
        if hvd.rank() == 0:
            print(f"Validation loss: {float(trainer.callback_metrics['val_loss']):.4f}", flush=True)
            print(f"Checkpoints: {sorted(os.listdir(ckpt_path))}", flush=True)

        test(model, test_loader, test_sampler)


if __name__ == "__main__":
    main()
