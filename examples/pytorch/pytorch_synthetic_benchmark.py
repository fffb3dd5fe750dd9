"""Synthetic-data training throughput with Horovod and PyTorch (img/sec per worker and in total).

    horovodrun -np 2 python examples/pytorch/pytorch_synthetic_benchmark.py
    mpirun -np 2 python examples/pytorch/pytorch_synthetic_benchmark.py --model resnet_small

torchvision is not needed: the script defines small ResNet-style models itself (``resnet_small``,
``resnet_tiny``); with torchvision installed, any of its model names works too (e.g. ``resnet50``).
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import horovod.torch as hvd


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNet(nn.Module):
    """ResNet-18-shaped network with configurable widths (for CPU-sized benchmarks)."""

    def __init__(self, widths: tuple[int, ...] = (32, 64, 128, 256), blocks: tuple[int, ...] = (2, 2, 2, 2),
                 num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        layers, cin = [], widths[0]
        for i, (w, b) in enumerate(zip(widths, blocks)):
            for j in range(b):
                layers.append(BasicBlock(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


MODELS = {
    "resnet_small": lambda: ResNet((32, 64, 128, 256), (2, 2, 2, 2)),
    "resnet_tiny": lambda: ResNet((16, 32, 64, 128), (1, 1, 1, 1)),
}


def make_model(name: str) -> nn.Module:
    if name in MODELS:
        return MODELS[name]()
    from torchvision import models  # only for torchvision model names

    return getattr(models, name)()


parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="use fp16 compression")
parser.add_argument("--model", type=str, default="resnet_small", help="model to benchmark")
parser.add_argument("--batch-size", type=int, default=16, help="input batch size per worker")
parser.add_argument("--image-size", type=int, default=32, help="height and width of the synthetic images")
parser.add_argument("--num-warmup-batches", type=int, default=3, help="warm-up batches (not timed)")
parser.add_argument("--num-batches-per-iter", type=int, default=5, help="batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=5, help="benchmark iterations")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per worker")


def main() -> None:
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    torch.set_num_threads(args.threads)
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())

    model = make_model(args.model)
    if args.cuda:
        model.cuda()
    lr_scaler = hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch_size,))
    if args.cuda:
        data, target = data.cuda(), target.cuda()

    def benchmark_step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(s: str) -> None:
        if hvd.rank() == 0:
            print(s, flush=True)

    nparams = sum(p.numel() for p in model.parameters())
    log(f"Model: {args.model} ({nparams / 1e6:.2f} M parameters, {len(list(model.parameters()))} tensors)")
    log(f"Batch size: {args.batch_size}, image size: {args.image_size}")
    log(f"Number of {'GPUs' if args.cuda else 'CPUs'}: {hvd.size()}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {'GPU' if args.cuda else 'CPU'}")
        img_secs.append(img_sec)
    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    device = "GPU" if args.cuda else "CPU"
    log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} "
        f"+-{hvd.size() * img_sec_conf:.1f}")


if __name__ == "__main__":
    main()
