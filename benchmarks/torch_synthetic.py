"""Synthetic training throughput: horovod.torch DistributedOptimizer vs torch DDP (Gloo), same run.

Run under mpirun, horovodrun or torchrun; rank 0 prints one JSON line per mode:

    mpirun -np 1 python benchmarks/torch_synthetic.py     # single-process baseline
    mpirun -np 2 python benchmarks/torch_synthetic.py

Modes, each with its own copy of the same model and batch (every iteration runs each mode for
``--batches`` steps, in turn, so machine noise hits them alike):
  hvd    hvd.DistributedOptimizer (allreduce from gradient hooks during backward), default settings
         (CPU gradients as views of one flat buffer, reduced in buckets: HOROVOD_FLAT_GRADIENTS=1)
  hvd-separate  the same with every gradient its own tensor and allreduce (HOROVOD_FLAT_GRADIENTS=0)
  hvd-overlap / hvd-held  the same with Tunables.overlap forced on / off (HOROVOD_OVERLAP_GRADIENTS=1 / 0)
  ddp    torch.nn.parallel.DistributedDataParallel on a Gloo process group
  local  the same step without any communication (each rank's compute-only speed)

Models: the small ResNet of ``examples/pytorch/pytorch_synthetic_benchmark.py`` (default), any
model name of that example, or ``transformer``: a stack of BERT-base-sized encoder blocks (hidden
768, 12 heads, feed-forward 3072; ``--layers``, default 4, ~35 M parameters, 135 MiB of gradients)
over token sequences of ``--seq-len`` (default 32), where communication weighs more.

    mpirun -np 2 python benchmarks/torch_synthetic.py --model transformer --batch-size 4
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "pytorch"))
from pytorch_synthetic_benchmark import make_model  # noqa: E402

import horovod.torch as hvd  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default="resnet_small")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--batches", type=int, default=3, help="steps per mode per iteration")
parser.add_argument("--iters", type=int, default=9)
parser.add_argument("--warmup", type=int, default=2)
parser.add_argument("--modes", default="hvd,ddp,local")
parser.add_argument("--layers", type=int, default=4, help="encoder blocks of --model transformer")
parser.add_argument("--seq-len", type=int, default=32, help="tokens per sample of --model transformer")
parser.add_argument("--breakdown", action="store_true",
                    help="also time each step's phases per mode (zero_grad, forward, backward, step; for hvd "
                         "the hooks and the gradient sync inside them) and the process's CPU seconds per step "
                         "(every thread: compute, engine, Gloo), one more JSON line per mode")

VOCAB = 8192


class TransformerStack(torch.nn.Module):
    """BERT-base-sized encoder blocks over token ids, mean-pooled into 1000 classes."""

    def __init__(self, layers: int, hidden: int = 768, heads: int = 12, ff: int = 3072) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        block = torch.nn.TransformerEncoderLayer(hidden, heads, ff, dropout=0.0, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(hidden, 1000)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)).mean(dim=1))


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    if args.model == "transformer":
        return TransformerStack(args.layers)
    return make_model(args.model)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    args = parser.parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    modes = args.modes.split(",")
    torch.manual_seed(0)
    if args.model == "transformer":
        data = torch.randint(0, VOCAB, (args.batch_size, args.seq_len))
    else:
        data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch_size,))

    steps = {}
    # Per mode: phase -> seconds summed over the timed steps (``--breakdown``), and the step count.
    phases: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    timing = [False]

    def make_step(key: str, model: torch.nn.Module, opt: Any, reducer: Any = None) -> Callable[[], None]:
        """One training step of ``model``; with ``--breakdown`` each phase timed into ``phases[key]``."""
        if reducer is not None and args.breakdown:
            acc = phases[key]
            for attr, label in (("_synchronize", "bwd: gradient sync"), ("_submit_collected", "bwd: submit")):
                inner = getattr(reducer, attr)

                def timed(*a: Any, _inner: Any = inner, _label: str = label) -> Any:
                    t, c = time.perf_counter(), time.thread_time()
                    try:
                        return _inner(*a)
                    finally:
                        if timing[0]:
                            acc[_label] += time.perf_counter() - t
                            acc[_label + " (its CPU)"] += time.thread_time() - c
                setattr(reducer, attr, timed)

        def step() -> None:
            if not (args.breakdown and timing[0]):
                opt.zero_grad()
                F.cross_entropy(model(data), target).backward()
                opt.step()
                return
            acc = phases[key]
            c0, t0 = time.process_time(), time.perf_counter()
            opt.zero_grad()
            t1 = time.perf_counter()
            loss = F.cross_entropy(model(data), target)
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            opt.step()
            t4 = time.perf_counter()
            acc["zero_grad"] += t1 - t0
            acc["forward"] += t2 - t1
            acc["backward"] += t3 - t2
            acc["step"] += t4 - t3
            acc["total"] += t4 - t0
            acc["cpu (all threads)"] += time.process_time() - c0
            acc["steps"] += 1
        return step

    if args.breakdown:
        from horovod.torch import _dense_reducer

        hook_time = phases["hvd"]
        plain_make_hook = _dense_reducer.DenseReducer._make_hook

        def timed_make_hook(self: Any, p: torch.Tensor) -> Any:
            hook = plain_make_hook(self, p)

            def timed_hook(param: torch.Tensor) -> None:
                t = time.perf_counter()
                try:
                    hook(param)
                finally:
                    if timing[0]:
                        hook_time["bwd: hooks"] += time.perf_counter() - t
            return timed_hook
        _dense_reducer.DenseReducer._make_hook = timed_make_hook  # type: ignore[method-assign]
    if "hvd" in modes:
        torch.manual_seed(0)
        m_hvd = build_model(args)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m_hvd.parameters(), lr=0.01),
                                       named_parameters=m_hvd.named_parameters())
        hvd.broadcast_parameters(m_hvd.state_dict(), 0)
        steps["hvd"] = make_step("hvd", m_hvd, opt, opt.reducer)
    if "hvd-separate" in modes:
        from horovod.torch import _dense_reducer as _dr

        torch.manual_seed(0)
        m_sep = build_model(args)
        flat_setting, _dr._flat_gradients_enabled = _dr._flat_gradients_enabled, lambda: False
        try:  # as with HOROVOD_FLAT_GRADIENTS=0: every gradient its own tensor and allreduce
            opt_sep = hvd.DistributedOptimizer(torch.optim.SGD(m_sep.parameters(), lr=0.01),
                                               named_parameters=m_sep.named_parameters())
        finally:
            _dr._flat_gradients_enabled = flat_setting
        hvd.broadcast_parameters(m_sep.state_dict(), 0)
        steps["hvd-separate"] = make_step("hvd-separate", m_sep, opt_sep, opt_sep.reducer)
    if args.breakdown:
        _dense_reducer.DenseReducer._make_hook = plain_make_hook  # type: ignore[method-assign]
    if "hvd-overlap" in modes or "hvd-held" in modes:
        from horovod.common.context import get_context

        tunables = get_context().engine.tunables
        torch.manual_seed(0)
        m_ov = build_model(args)
        opt_ov = hvd.DistributedOptimizer(torch.optim.SGD(m_ov.parameters(), lr=0.01),
                                          named_parameters=m_ov.named_parameters())
        hvd.broadcast_parameters(m_ov.state_dict(), 0)

        def forced_step(key: str, overlap: bool) -> Callable[[], None]:
            inner = make_step(key, m_ov, opt_ov)

            def step() -> None:
                # Every rank switches at the same point (the timing loop's barrier precedes the mode).
                saved, tunables.overlap = tunables.overlap, overlap
                try:
                    inner()
                finally:
                    tunables.overlap = saved
            return step
        if "hvd-overlap" in modes:
            steps["hvd-overlap"] = forced_step("hvd-overlap", True)
        if "hvd-held" in modes:
            steps["hvd-held"] = forced_step("hvd-held", False)
    if "ddp" in modes:
        import torch.distributed as dist

        if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: its store, as a DDP script has
            dist.init_process_group("gloo")
        else:
            port = hvd.broadcast_object(_free_port() if rank == 0 else None, 0, name="gloo.port")
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        torch.manual_seed(0)
        m_ddp = torch.nn.parallel.DistributedDataParallel(build_model(args))
        opt_ddp = torch.optim.SGD(m_ddp.parameters(), lr=0.01)
        steps["ddp"] = make_step("ddp", m_ddp, opt_ddp)
    if "local" in modes:
        torch.manual_seed(0)
        m_loc = build_model(args)
        opt_loc = torch.optim.SGD(m_loc.parameters(), lr=0.01)
        steps["local"] = make_step("local", m_loc, opt_loc)

    for fn in steps.values():
        for _ in range(args.warmup):
            fn()
    timing[0] = True
    rates: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    for it in range(args.iters):
        # Rotate the order every iteration so that no mode always runs first after the others.
        for k in names[it % len(names):] + names[:it % len(names)]:
            fn = steps[k]
            hvd.barrier()
            t0 = time.perf_counter()
            for _ in range(args.batches):
                fn()
            rates[k].append(args.batch_size * args.batches / (time.perf_counter() - t0))
    model = build_model(args)
    if rank == 0:
        for k, r in rates.items():
            med = statistics.median(r)
            print(json.dumps({"bench": "torch_synthetic", "model": args.model,
                              "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
                              "batch": args.batch_size, "image": args.image_size, "np": size, "mode": k,
                              "img_per_sec_per_rank": round(med, 2), "img_per_sec_total": round(med * size, 2),
                              "img_per_sec_iters": [round(x, 2) for x in r]}),
                  flush=True)
    if args.breakdown:
        # Every rank's phases (ms per step), printed by rank 0.
        mine = {k: {ph: round(v * 1000 / max(acc["steps"], 1), 2) for ph, v in acc.items() if ph != "steps"}
                for k, acc in phases.items() if acc["steps"]}
        everyone = hvd.allgather_object(mine, name="torch_synthetic.breakdown")
        if rank == 0:
            for k in steps:
                print(json.dumps({"bench": "torch_synthetic.breakdown", "mode": k, "np": size,
                                  "ms_per_step_per_rank": [r.get(k, {}) for r in everyone]}), flush=True)
    if "ddp" in steps:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
