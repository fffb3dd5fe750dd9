"""A small transformer-style model trained with fully sharded parameters (``hvd.fully_shard``).

    horovodrun -np 2 python examples/pytorch/pytorch_fully_shard.py
    horovodrun -np 2 python examples/pytorch/pytorch_fully_shard.py --bf16 --steps 50

Each rank holds its rows of every parameter; each block is gathered just in time for its forward
and backward. Prints the loss (rank 0) and the parameter bytes this rank holds against the model's.
Saves the full model and optimizer state with ``--checkpoint PATH`` (rank 0 writes; loads at any
world size with ``load_full_state_dict``).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd
from horovod.torch.fully_shard import full_optim_state_dict


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):  # each block wrapped as it is built: no rank holds the whole model
            self.blocks.append(hvd.fully_shard(Block(d), reshard_after_forward=True, mp_policy=POLICY))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


POLICY: hvd.MixedPrecisionPolicy | None = None


def main() -> None:
    global POLICY
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--bf16", action="store_true", help="compute in bfloat16, reduce in float32")
    parser.add_argument("--checkpoint", default=None)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)  # the same initial weights on every rank
    if args.bf16:
        POLICY = hvd.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = Model(args.vocab, args.dim, args.layers)
    hvd.fully_shard(model, mp_policy=POLICY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    gen = torch.Generator().manual_seed(1 + hvd.rank())  # each rank its own data
    for step in range(args.steps):
        tokens = torch.randint(0, args.vocab, (8, 33), generator=gen)
        tokens[:, 1::2] = tokens[:, 0:-1:2]  # a learnable pattern: every odd token repeats the last
        opt.zero_grad()
        logits = model(tokens[:, :-1]).float()
        loss = F.cross_entropy(logits[:, 1::2].reshape(-1, args.vocab), tokens[:, 2::2].reshape(-1))
        loss.backward()
        norm = model.clip_grad_norm_(1.0)
        opt.step()
        avg = hvd.allreduce(loss.detach(), name="loss")
        if hvd.rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {avg.item():.4f}, gradient norm {norm.item():.3f}", flush=True)

    mine = sum(p.numel() * p.element_size() for p in model.parameters())
    total = hvd.allreduce(torch.tensor(float(mine)), op=hvd.Sum, name="bytes").item()
    print(f"rank {hvd.rank()}: holds {mine} of {int(total)} parameter bytes ({mine / total:.1%})", flush=True)
    if args.checkpoint:
        sd, osd = model.full_state_dict(to=0), full_optim_state_dict(model, opt, to=0)
        if hvd.rank() == 0:
            torch.save({"model": sd, "optim": osd}, args.checkpoint)
            print(f"saved {args.checkpoint}", flush=True)


if __name__ == "__main__":
    main()
