"""One Lightning script, two strategies: the parity test's job (tests/lightning/test_lightning_parity.py).

    horovodrun -np 2 python parity_job.py --strategy horovod --out DIR
    torchrun --standalone --nproc_per_node 2 parity_job.py --strategy ddp --out DIR

Each launch fits the same LightningModule on the digits data set (rank-dependent batches from
Lightning's distributed sampler) in every configuration of ``CONFIGS``, one after the other, and
writes each rank's final weights to ``DIR/<strategy>-<config>-r<rank>.pt`` plus a summary
(``DIR/<strategy>-r<rank>.json``: epochs run, learning rates, test metrics, predictions). The
Horovod launch also resumes the Adam + StepLR run from its epoch-0 checkpoint
(``adam_steplr_resumed``), which must land on the same weights as the run that did not stop, and
runs the two-optimizer module once more with ``loss.backward()`` on odd batches in place of
``self.manual_backward`` (``manual_two_opt_loss_backward``).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

CONFIGS = ("plain", "accumulate", "clip", "bf16_mixed", "adam_steplr", "manual_two_opt", "early_stopping")
BATCH = 16  # per rank


def digits(n: int = 384) -> TensorDataset:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return TensorDataset(torch.tensor(x[:n] / 16.0, dtype=torch.float32), torch.tensor(y[:n]))


class Net(pl.LightningModule):
    def __init__(self, optim: str = "sgd") -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh())
        self.head = torch.nn.Linear(32, 10)
        self.optim = optim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y), sync_dist=True)
        self.log("test_acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch[0]).argmax(1)

    def configure_optimizers(self) -> Any:
        if self.optim == "adam_steplr":
            opt = torch.optim.Adam(self.parameters(), lr=0.01)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)}
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TwoOptimizers(Net):
    """The GAN pattern: two optimizers stepped on alternate batches. Even batches step ``opt_a``
    (the body) with the other optimizer toggled off; odd batches step ``opt_b`` (the head) without
    toggling, so that backward also fills the body's gradients, which ``opt_a`` leaves alone until
    its next ``zero_grad()``."""

    def __init__(self, plain_backward: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.plain_backward = plain_backward

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_a, opt_b = self.optimizers()
        if batch_idx % 2 == 0:
            self.toggle_optimizer(opt_a)
            opt_a.zero_grad()
            self.manual_backward(F.cross_entropy(self(x), y))
            opt_a.step()
            self.untoggle_optimizer(opt_a)
        else:
            opt_b.zero_grad()
            loss = F.cross_entropy(self(x), y)
            if self.plain_backward:
                loss.backward()  # not manual_backward: the strategy's step must still average
            else:
                self.manual_backward(loss)
            opt_b.step()

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.body.parameters(), lr=0.2, momentum=0.5),
                torch.optim.Adam(self.head.parameters(), lr=0.01)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=("horovod", "ddp"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    data = digits()
    if args.strategy == "horovod":
        import horovod.lightning  # noqa: F401  (registers strategy="horovod")
        import horovod.torch as hvd

        hvd.init()
        rank = hvd.rank()
    else:
        rank = int(os.environ["RANK"])
    summary: dict[str, Any] = {"rank": rank}

    def strategy(manual: bool = False) -> Any:
        if args.strategy == "horovod":
            return "horovod"
        from lightning.pytorch.strategies import DDPStrategy

        # toggle_optimizer leaves parameters without gradients: DDP must be told they may be unused
        return DDPStrategy(process_group_backend="gloo", find_unused_parameters=manual)

    def trainer(manual: bool = False, **kw: Any) -> pl.Trainer:
        base = dict(strategy=strategy(manual), accelerator="cpu", devices=1 if args.strategy == "horovod" else 2,
                    max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0)
        base.update(kw)
        return pl.Trainer(**base)

    def loader(shuffle: bool = True) -> DataLoader:
        return DataLoader(data, batch_size=BATCH, shuffle=shuffle)

    def save(name: str, model: torch.nn.Module) -> None:
        flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
        torch.save(flat, os.path.join(args.out, f"{args.strategy}-{name}-r{rank}.pt"))

    def model(cls: type = Net, **kw: Any) -> Net:
        torch.manual_seed(0)
        return cls(**kw)

    for name in args.configs.split(","):
        if name == "plain":
            m, t = model(), trainer()
            t.fit(m, loader())
            res = t.test(m, loader(False), verbose=False)[0]
            summary["test"] = {k: float(v) for k, v in res.items()}
            summary["predict"] = torch.cat(t.predict(m, loader(False))).tolist()
        elif name == "accumulate":
            m, t = model(), trainer(accumulate_grad_batches=2)
            t.fit(m, loader())
        elif name == "clip":
            m, t = model(), trainer(gradient_clip_val=0.1)
            t.fit(m, loader())
        elif name == "bf16_mixed":
            m, t = model(), trainer(precision="bf16-mixed")
            t.fit(m, loader())
        elif name == "adam_steplr":
            m, t = model(optim="adam_steplr"), trainer(max_epochs=3)
            t.fit(m, loader())
            summary["adam_lr"] = t.optimizers[0].param_groups[0]["lr"]
            if args.strategy == "horovod":
                ckpt_dir = os.path.join(args.out, "ckpt")
                first = trainer(max_epochs=1, enable_checkpointing=True,
                                callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1)])
                first.fit(model(optim="adam_steplr"), loader())
                torch.manual_seed(1)  # a different start: everything must come from the checkpoint
                resumed = Net(optim="adam_steplr")
                t2 = trainer(max_epochs=3)
                t2.fit(resumed, loader(), ckpt_path=os.path.join(ckpt_dir, sorted(os.listdir(ckpt_dir))[-1]))
                summary["resumed"] = {"epoch": t2.current_epoch, "step": t2.global_step,
                                      "lr": t2.optimizers[0].param_groups[0]["lr"],
                                      "adam_steps": [int(s["step"]) for s in t2.optimizers[0].state.values()]}
                summary["continuous"] = {"epoch": t.current_epoch, "step": t.global_step}
                save("adam_steplr_resumed", resumed)
        elif name == "manual_two_opt":
            m, t = model(TwoOptimizers), trainer(manual=True)
            t.fit(m, loader())
            if args.strategy == "horovod":
                plain = model(TwoOptimizers, plain_backward=True)
                trainer(manual=True).fit(plain, loader())
                save("manual_two_opt_loss_backward", plain)
        elif name == "early_stopping":
            m = model()
            t = trainer(max_epochs=6, callbacks=[EarlyStopping(monitor="val_loss", mode="max", patience=1)])
            t.fit(m, loader(), loader(False))
            summary["early_stopping_epoch"] = t.current_epoch
        else:
            raise ValueError(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
        save(name, m)
    with open(os.path.join(args.out, f"{args.strategy}-r{rank}.json"), "w") as f:
        json.dump(summary, f)
    if args.strategy == "ddp":
        # The reference run ends its process group itself: left to interpreter exit, Gloo's threads
        # can be torn down while one still runs (std::terminate, SIGABRT) after all work is done.
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
