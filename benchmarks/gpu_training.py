"""Training throughput: ``hvd.DistributedOptimizer`` against DDP on the same GPU, same run.

On a GPU machine (one GPU: np=1 measures what each library adds to a step on the device):

    python benchmarks/gpu_training.py                          # np=1, both models, fp32 and AMP
    python benchmarks/gpu_training.py --np 2                   # two processes, one GPU each
    mpirun -np 2 python benchmarks/gpu_training.py             # the same, launched by hand
    python benchmarks/gpu_training.py --model resnet50 --precision amp --steps 30

Without a GPU, ``--cpu-smoke`` runs every mode on tiny models on the CPU (Gloo for DDP and for
the device plane's CPU twin, ``HOROVOD_TORCH_CPU_PLANE=1``): it checks the script, not speed.

    python benchmarks/gpu_training.py --cpu-smoke --np 2

Models (synthetic data, fixed on the device before timing):
  resnet50     ResNet-50 (161 parameter tensors, 25.6 M parameters), 224x224 images, cross-entropy
               against random labels; reported in images/s
  transformer  a stack of 4 BERT-base encoder blocks (``nn.TransformerEncoderLayer``, d=768, 12
               heads, feed-forward 3072) on random embeddings, sequence 128; reported in tokens/s
Precisions: fp32, and amp (``torch.autocast`` float16 with a ``GradScaler`` on CUDA; bfloat16
autocast without a scaler on the CPU).

Modes, each with its own copy of the model (same initial weights), in the same processes; every
repetition runs one step of each mode, in an order that rotates, so that machine noise hits them
alike:
  hvd     ``hvd.DistributedOptimizer(named_parameters=...)`` (its gradient hooks; at np=1 the hooks
          are registered anyway, so that the device plane runs as at np > 1: a bare optimizer
          would skip the reduction of one rank)
  ddp     ``torch.nn.parallel.DistributedDataParallel`` on NCCL (Gloo on the CPU)
  local   the bare optimizer, no communication: the step's own compute

Each step is timed in four parts, with CUDA events on the current stream (host clocks on the
CPU): forward, backward (including the wait for the reduced gradients, which both libraries
finish before ``backward()`` returns), the optimizer step; ``wait_ms`` is the backward part less
the ``local`` mode's backward: the time the gradients' reduction added to the step. Rank 0 prints
one JSON line per model, precision and mode (medians over the timed steps) and one summary line
per model and precision with ``hvd_over_ddp``: Horovod's throughput over DDP's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default="all", choices=["all", "resnet50", "transformer"])
parser.add_argument("--precision", default="all", choices=["all", "fp32", "amp"])
parser.add_argument("--modes", default="hvd,ddp,local")
parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
parser.add_argument("--warmup", type=int, default=5, help="untimed steps per mode first")
parser.add_argument("--batch-size", type=int, default=0, help="per rank (default: 64 images, 16 sequences)")
parser.add_argument("--np", type=int, default=0, help="start this many processes (mpirun) and run in them")
parser.add_argument("--cpu-smoke", action="store_true", help="tiny models on the CPU, Gloo: checks the script")
parser.add_argument("--out", default="", help="also append the JSON lines to this file (rank 0)")


# ---------------------------------------------------------------------------- models
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inp: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * self.expansion
        self.conv1 = nn.Conv2d(inp, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.down: nn.Module | None = None
        if stride != 1 or inp != out:
            self.down = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    """torchvision's ResNet-50 layout (v1.5: the stride on the 3x3 convolution), written here so
    that the benchmark needs no torchvision."""

    def __init__(self, classes: int = 1000, base: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        layers: list[nn.Module] = []
        inp = base
        for i, blocks in enumerate((3, 4, 6, 3)):
            width = base * 2 ** i
            for b in range(blocks):
                layers.append(Bottleneck(inp, width, 2 if b == 0 and i > 0 else 1))
                inp = width * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(inp, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class Blocks(nn.Module):
    """A stack of transformer encoder blocks on given embeddings (BERT-base's blocks by default)."""

    def __init__(self, layers: int = 4, d: int = 768, heads: int = 12, ff: int = 3072) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
                                      for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def make(model: str, smoke: bool, batch: int, dev: torch.device
         ) -> tuple[Callable[[], nn.Module], torch.Tensor, torch.Tensor | None, int, str]:
    """(model factory, inputs, labels or None, items per step per rank, unit)."""
    g = torch.Generator().manual_seed(0)
    if model == "resnet50":
        n, size = batch or (2 if smoke else 64), 32 if smoke else 224
        x = torch.randn(n, 3, size, size, generator=g).to(dev)
        y = torch.randint(0, 10 if smoke else 1000, (n,), generator=g).to(dev)
        return (lambda: ResNet50(10, 8) if smoke else ResNet50()), x, y, n, "images"
    n, seq = batch or (2 if smoke else 16), 8 if smoke else 128
    d = 32 if smoke else 768
    x = torch.randn(n, seq, d, generator=g).to(dev)
    return ((lambda: Blocks(2, 32, 4, 64)) if smoke else Blocks), x, None, n * seq, "tokens"


# ---------------------------------------------------------------------------- timing
class Clock:
    """Marks on the current CUDA stream (events), or host times on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def spans(self, marks: list[Any]) -> list[float]:
        """Milliseconds between consecutive marks (waits for the last one on CUDA)."""
        if not self.cuda:
            return [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
        marks[-1].synchronize()
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _step(run: nn.Module, opt: Any, scaler: Any, hvd_opt: bool, amp: bool, amp_dtype: torch.dtype,
          x: torch.Tensor, y: torch.Tensor | None, clock: Clock) -> Callable[[], list[float]]:
    """One training step of a mode, returning its parts' milliseconds (forward, backward, optimizer)."""

    def step() -> list[float]:
        opt.zero_grad(set_to_none=True)
        marks = [clock.mark()]
        with torch.autocast(x.device.type, dtype=amp_dtype, enabled=amp):
            out = run(x)
            loss = nn.functional.cross_entropy(out.float(), y) if y is not None else out.float().pow(2).mean()
        marks.append(clock.mark())
        (scaler.scale(loss) if scaler is not None else loss).backward()
        marks.append(clock.mark())
        if scaler is not None:
            if hvd_opt:  # upstream's AMP recipe: reduce, unscale, then step without reducing again
                opt.synchronize()
                scaler.unscale_(opt)
                with opt.skip_synchronize():
                    scaler.step(opt)
            else:
                scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        marks.append(clock.mark())
        return clock.spans(marks)
    return step


def _launch(args: argparse.Namespace) -> int:
    """Run this script in ``--np`` processes under mpirun (one GPU each on CUDA)."""
    argv = [a for a in sys.argv[1:]]
    i = argv.index("--np") if "--np" in argv else -1
    if i >= 0:
        del argv[i:i + 2]
    else:
        argv = [a for a in argv if not a.startswith("--np=")]
    cmd = ["mpirun", "-np", str(args.np), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return subprocess.call(cmd + [sys.executable, os.path.abspath(__file__)] + argv)


def main() -> None:  # noqa: C901 - one benchmark, read top to bottom
    args = parser.parse_args()
    if args.np and "OMPI_COMM_WORLD_SIZE" not in os.environ and "HOROVOD_RANK" not in os.environ:
        sys.exit(_launch(args))
    cuda = not args.cpu_smoke
    if cuda and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: run with --cpu-smoke to check the script on the CPU")
    if args.cpu_smoke:
        os.environ["HOROVOD_TORCH_CPU_PLANE"] = "1"  # CPU tensors through the device plane's twin
        torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import horovod.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    port = hvd.broadcast_object(_free_port() if rank == 0 else None, 0, name="ddp.port")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    models = ["resnet50", "transformer"] if args.model == "all" else [args.model]
    precisions = ["fp32", "amp"] if args.precision == "all" else [args.precision]
    modes = [m for m in args.modes.split(",") if m]
    device_name = torch.cuda.get_device_name(dev) if cuda else "cpu (smoke)"
    clock = Clock(cuda)
    lines: list[dict[str, Any]] = []

    for model in models:
        factory, x, y, items, unit = make(model, args.cpu_smoke, args.batch_size, dev)
        torch.manual_seed(0)
        reference = factory().to(dev)
        for precision in precisions:
            amp = precision == "amp"
            amp_dtype = torch.float16 if cuda else torch.bfloat16
            steps: dict[str, Callable[[], list[float]]] = {}
            for mode in modes:
                net = factory().to(dev)
                net.load_state_dict(reference.state_dict())
                scaler = torch.amp.GradScaler("cuda") if amp and cuda else None
                opt: Any = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
                run: nn.Module = net
                if mode == "hvd":
                    opt = hvd.DistributedOptimizer(
                        opt, named_parameters=[(f"{model}.{precision}.{n}", p) for n, p in net.named_parameters()])
                    if size == 1:  # one rank: the wrapper reduces nothing unless its hooks run
                        opt.reducer.register_hooks()
                elif mode == "ddp":
                    run = DistributedDataParallel(net, device_ids=[dev.index] if cuda else None,
                                                  gradient_as_bucket_view=True)
                elif mode != "local":
                    raise SystemExit(f"unknown mode {mode!r}: hvd, ddp or local")

                steps[mode] = _step(run, opt, scaler, mode == "hvd", amp, amp_dtype, x, y, clock)

            for mode in modes:
                for _ in range(args.warmup):
                    steps[mode]()
            timed: dict[str, list[list[float]]] = {m: [] for m in modes}
            for rep in range(args.steps):
                order = modes[rep % len(modes):] + modes[:rep % len(modes)]
                for mode in order:
                    hvd.barrier()
                    timed[mode].append(steps[mode]())
            if rank != 0:
                continue
            med = {m: [statistics.median(part) for part in zip(*timed[m])] for m in modes}
            local_bwd = med["local"][1] if "local" in med else None
            per: dict[str, float] = {}
            for mode in modes:
                fwd, bwd, optim = med[mode]
                step_ms = statistics.median([sum(s) for s in timed[mode]])
                per[mode] = items * 1e3 / step_ms
                lines.append({"bench": "gpu_training", "device": device_name, "np": size, "model": model,
                              "precision": precision, "mode": mode, "step_ms": round(step_ms, 3),
                              "forward_ms": round(fwd, 3), "backward_ms": round(bwd, 3),
                              "wait_ms": round(bwd - local_bwd, 3) if local_bwd is not None else None,
                              "optimizer_ms": round(optim, 3), f"{unit}_per_s": round(per[mode], 1),
                              "steps": args.steps})
            summary: dict[str, Any] = {"bench": "gpu_training", "device": device_name, "np": size,
                                       "model": model, "precision": precision, "summary": True}
            if "hvd" in per and "ddp" in per:
                summary["hvd_over_ddp"] = round(per["hvd"] / per["ddp"], 3)
            if "local" in per:
                for m in ("hvd", "ddp"):
                    if m in per:
                        summary[f"{m}_over_local"] = round(per[m] / per["local"], 3)
            lines.append(summary)
            for line in lines[-len(modes) - 1:]:
                print(json.dumps(line), flush=True)
    if rank == 0 and args.out:
        with open(args.out, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
