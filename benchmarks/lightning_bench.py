"""Lightning 2 training throughput: ``strategy="horovod"`` vs Lightning's own ``strategy="ddp"``
(Gloo), the same model, data and Trainer settings, interleaved in one run.

    horovodrun -np 2 python benchmarks/lightning_bench.py
    mpirun -np 2 python benchmarks/lightning_bench.py --hidden 2048 --layers 4

Every round fits the model once with each strategy (``--steps`` timed optimizer steps after
``--warmup`` untimed ones), so machine noise hits both alike; rank 0 prints one JSON line per
round and a summary line with the median samples/s of each and their ratios to ddp.
The processes are Horovod's: DDP is given them through Lightning's environment variables
(``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), as torchrun would.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import horovod.lightning
import horovod.torch as hvd

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--hidden", type=int, default=1024, help="width of the MLP's hidden layers")
parser.add_argument("--layers", type=int, default=4, help="hidden layers")
parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
parser.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of every fit")
parser.add_argument("--steps", type=int, default=30, help="timed steps per fit")
parser.add_argument("--rounds", type=int, default=5, help="fits per strategy")
parser.add_argument("--modes", default="horovod,ddp", help="horovod, horovod-flat (flat_gradients=True), ddp")


def make_module(args: argparse.Namespace, pl):
    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            dims = [256] + [args.hidden] * args.layers
            layers: list[torch.nn.Module] = []
            for a, b in zip(dims, dims[1:]):
                layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
            self.net = torch.nn.Sequential(*layers, torch.nn.Linear(dims[-1], 10))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return MLP()


class Timer:
    """Times the steps after the warmup (callback hooks, so both strategies are timed alike)."""

    def __init__(self, warmup: int, pl) -> None:
        outer = self

        class _Callback(pl.Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_idx):
                if batch_idx == warmup:
                    outer.start = time.perf_counter()

            def on_train_end(self, trainer, module):
                outer.end = time.perf_counter()

        self.callback = _Callback()
        self.start = self.end = 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    args = parser.parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    # Lightning's DDP joins processes started by someone else through these variables.
    port = hvd.broadcast_object(_free_port() if rank == 0 else None, 0, name="bench.port")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(size), NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    torch.manual_seed(0)
    n = args.batch_size * size * (args.warmup + args.steps)
    data = TensorDataset(torch.randn(n, 256), torch.randint(0, 10, (n,)))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))

    def fit(mode: str) -> float:
        if mode.startswith("horovod"):
            strategy, devices = horovod.lightning.HorovodStrategy(flat_gradients=mode == "horovod-flat"), 1
        else:
            strategy = DDPStrategy(cluster_environment=LightningEnvironment(), process_group_backend="gloo")
            devices = size
        timer = Timer(args.warmup, pl)
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[timer.callback])
        trainer.fit(make_module(args, pl), DataLoader(data, batch_size=args.batch_size))
        assert trainer.global_step == args.warmup + args.steps, trainer.global_step
        seconds = hvd.allreduce(torch.tensor(timer.end - timer.start), op=hvd.Max, name="bench.time").item()
        return args.steps * args.batch_size * size / seconds

    modes = args.modes.split(",")
    results: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            results[mode].append(fit(mode))
        if rank == 0:
            print(json.dumps({"round": r, **{m: round(v[-1], 1) for m, v in results.items()}}), flush=True)
    if rank == 0:
        params = sum(p.numel() for p in make_module(args, pl).parameters())
        med = {m: statistics.median(v) for m, v in results.items()}
        summary = {"np": size, "params": params, "batch_per_rank": args.batch_size}
        summary.update({f"{m}_samples_per_s": round(v, 1) for m, v in med.items()})
        if "ddp" in med:
            summary.update({f"{m}/ddp": round(v / med["ddp"], 3) for m, v in med.items() if m != "ddp"})
        print(json.dumps(summary), flush=True)

if __name__ == "__main__":
    main()
