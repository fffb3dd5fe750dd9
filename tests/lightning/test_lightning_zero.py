"""``HorovodStrategy(zero_stage=...)`` and ``Trainer(strategy="horovod_zero")`` on real ranks:
the same weights as ``strategy="horovod"`` (AdamW, StepLR, gradient clipping); Lightning's
checkpoints (ModelCheckpoint, ``trainer.save_checkpoint``) sharded, one file per rank, loadable
by ``hvd.checkpoint.load`` into a plain AdamW, and resuming a fit from them (stage 1 and 2) equal
to the uninterrupted fit."""

from __future__ import annotations

import importlib.util

import pytest

from horovod.testing import run_ranks
from tests._shared_launch import JOINT_TIMEOUT, in_a_directory, joint_launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, JOINT_TIMEOUT,
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                 reason="the `lightning` package is not installed")]


def _zero_fits(tmp: str) -> dict:
    import os

    import lightning.pytorch as L  # noqa: N812
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import horovod.lightning  # noqa: F401  (registers "horovod" and "horovod_zero")
    import horovod.torch as hvd
    from horovod.lightning import HorovodStrategy

    hvd.init()
    r = hvd.rank()

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(5, 17), torch.nn.Tanh(), torch.nn.Linear(17, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.05)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]

    g = torch.Generator().manual_seed(3)
    n = 8 * hvd.size()
    data = TensorDataset(torch.randn(n, 5, generator=g), torch.randn(n, 1, generator=g))

    def fit(strategy, epochs=3, ckpt=None, callbacks=None):
        model = Net()
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_epochs=epochs, logger=False,
                            enable_checkpointing=bool(callbacks), callbacks=callbacks,
                            enable_progress_bar=False, enable_model_summary=False,
                            gradient_clip_val=0.3)
        trainer.fit(model, DataLoader(data, batch_size=2), ckpt_path=ckpt)
        return trainer, model

    out = {"rank": r}
    _, ref = fit("horovod")
    want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    for label, strategy in (("horovod_zero", "horovod_zero"),
                            ("zero_stage=2", HorovodStrategy(zero_stage=2))):
        trainer, model = fit(strategy)
        got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[label] = float((got - want).abs().max() / want.abs().max())
        opt = trainer.strategy.optimizers[0]
        out[label + " type"] = type(getattr(opt, "_optimizer", opt)).__name__
    # ModelCheckpoint (stage 1) writes sharded checkpoints: a directory, one data file per rank
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt_dir = os.path.join(tmp, "zero1")
    fit("horovod_zero", epochs=2, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1)])
    hvd.barrier()
    path = os.path.join(ckpt_dir, sorted(os.listdir(ckpt_dir))[-1])  # epoch=1-...
    out["ckpt_files"] = (sorted(os.listdir(path)), sorted(os.listdir(hvd.checkpoint.latest(path)))) \
        if os.path.isdir(path) else "not a directory"
    # loadable without Lightning, into a plain AdamW
    plain_model = Net()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=0.02)
    extra = hvd.checkpoint.load(path, model=plain_model, optimizer=plain)
    out["ckpt_epoch"] = extra["lightning"]["epoch"]
    out["ckpt_state_entries"] = len(plain.state_dict()["state"])
    # resume for one more epoch == three epochs uninterrupted (stage 1, then stage 2 from a
    # checkpoint written by trainer.save_checkpoint)
    _, resumed = fit("horovod_zero", epochs=3, ckpt=path)
    got = torch.cat([p.detach().reshape(-1) for p in resumed.parameters()])
    out["resumed"] = float((got - want).abs().max() / want.abs().max())
    trainer, _ = fit(HorovodStrategy(zero_stage=2), epochs=2)
    path2 = os.path.join(tmp, "zero2.ckpt")
    trainer.save_checkpoint(path2)
    _, resumed = fit(HorovodStrategy(zero_stage=2), epochs=3, ckpt=path2)
    got = torch.cat([p.detach().reshape(-1) for p in resumed.parameters()])
    out["resumed stage 2"] = float((got - want).abs().max() / want.abs().max())
    # PowerSGD through the strategy: plain and ZeRO stage 1 apply the same compressed averages
    # (identical weights), which differ from the uncompressed run's; stage 2 refuses it
    _, plain_psgd = fit(HorovodStrategy(compression=hvd.PowerSGD(rank=1, start_iter=2)))
    _, zero_psgd = fit(HorovodStrategy(zero_stage=1, compression=hvd.PowerSGD(rank=1, start_iter=2)))
    a = torch.cat([p.detach().reshape(-1) for p in plain_psgd.parameters()])
    b = torch.cat([p.detach().reshape(-1) for p in zero_psgd.parameters()])
    out["powersgd_zero1_vs_plain"] = float((a - b).abs().max())
    out["powersgd_vs_uncompressed"] = float((a - want).abs().max())
    out["powersgd_ranks_agree"] = len({tuple(w.tolist()) for w in hvd.allgather_object(a)}) == 1
    try:
        hvd.ZeroRedundancyOptimizer(Net().parameters(), torch.optim.AdamW, stage=2,
                                    compression=hvd.PowerSGD(rank=1), lr=0.02)
        out["powersgd_stage2"] = "accepted"
    except ValueError as exc:
        out["powersgd_stage2"] = str(exc)
    return out


def test_lightning_zero_strategy():
    results = _NP2.results("zero")
    for res in results:
        assert res["horovod_zero type"] == "ZeroRedundancyOptimizer", res
        assert res["zero_stage=2 type"] == "ZeroRedundancyOptimizer", res
        assert res["horovod_zero"] <= 1e-5 and res["zero_stage=2"] <= 1e-5, res
        assert res["ckpt_files"] == (["horovod_checkpoint.json", "v000001"],
                                     [".metadata", "__0_0.distcp", "__1_0.distcp"]), res
        assert res["ckpt_epoch"] == 1 and res["ckpt_state_entries"] == 4, res
        assert res["resumed"] <= 1e-5 and res["resumed stage 2"] <= 1e-5, res
        assert res["powersgd_ranks_agree"], res
        assert res["powersgd_zero1_vs_plain"] <= 1e-6, res
        assert res["powersgd_vs_uncompressed"] > 1e-4, res  # the compression took effect
        assert "use stage=1" in res["powersgd_stage2"], res


def _zero3_fits(tmp: str) -> dict:
    import os

    import lightning.pytorch as L  # noqa: N812
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    import horovod.lightning  # noqa: F401
    import horovod.torch as hvd
    from horovod.lightning import HorovodStrategy

    hvd.init()
    r = hvd.rank()

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(5, 17), torch.nn.Tanh(), torch.nn.Linear(17, 1))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.05)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]

    g = torch.Generator().manual_seed(3)
    n = 8 * hvd.size()
    data = TensorDataset(torch.randn(n, 5, generator=g), torch.randn(n, 1, generator=g))

    def fit(strategy, epochs=3, ckpt=None, callbacks=None, accumulate=1):
        model = Net()
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_epochs=epochs, logger=False,
                            enable_checkpointing=bool(callbacks), callbacks=callbacks,
                            enable_progress_bar=False, enable_model_summary=False,
                            gradient_clip_val=0.3, accumulate_grad_batches=accumulate)
        trainer.fit(model, DataLoader(data, batch_size=2), ckpt_path=ckpt)
        return trainer, model

    def weights(model):
        sd = model.full_state_dict() if isinstance(model, hvd.FullyShardedModule) else model.state_dict()
        return torch.cat([sd[k].detach().reshape(-1) for k in sorted(sd)])

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    out = {"rank": r}
    for accumulate in (1, 2):
        _, ref = fit("horovod", accumulate=accumulate)
        trainer, model = fit(HorovodStrategy(zero_stage=3, fully_shard_modules=torch.nn.Linear),
                             accumulate=accumulate)
        out[f"stage3 acc{accumulate}"] = rel(weights(model), weights(ref))
        if accumulate == 1:
            want = weights(ref)
            opt = trainer.strategy.optimizers[0]
            opt = getattr(opt, "_optimizer", opt)
            out["type"] = type(opt).__name__
            out["shards"] = [tuple(p.shape) for p in opt.param_groups[0]["params"]]
            out["wrapped"] = sorted(type(m).__name__ for m in model.modules()
                                    if isinstance(m, hvd.FullyShardedModule))
            out["callbacks_left"] = [type(c).__name__ for c in trainer.callbacks
                                     if type(c).__name__ == "ClipAcrossRanks"]
    # a sharded checkpoint (ModelCheckpoint) after 2 epochs, resumed for the third
    ckpt_dir = os.path.join(tmp, "zero3")
    fit(HorovodStrategy(zero_stage=3, fully_shard_modules=torch.nn.Linear), epochs=2,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1)])
    hvd.barrier()
    path = os.path.join(ckpt_dir, sorted(os.listdir(ckpt_dir))[-1])
    out["ckpt_is_dir"] = os.path.isdir(path)
    _, resumed = fit(HorovodStrategy(zero_stage=3, fully_shard_modules=torch.nn.Linear), epochs=3, ckpt=path)
    out["resumed"] = rel(weights(resumed), want)
    # the same checkpoint read by an unsharded model in this process's view (no strategy)
    plain = Net()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.02)
    extra = hvd.checkpoint.load(path, model=plain, optimizer=plain_opt)
    out["plain_epoch"] = extra["lightning"]["epoch"]
    out["plain_state_entries"] = len(plain_opt.state_dict()["state"])
    return out


def test_lightning_zero3_strategy():
    """zero_stage=3 (hvd.fully_shard): the same weights as strategy="horovod" with gradient
    clipping (the norm across the shards) and with accumulate_grad_batches=2; the optimizer is a
    plain AdamW over the shards; a sharded ModelCheckpoint resumes to the uninterrupted weights
    and loads into an unsharded model."""
    results = _NP2.results("zero3")
    for res in results:
        assert res["stage3 acc1"] <= 1e-5 and res["stage3 acc2"] <= 1e-5, res
        assert res["type"] == "AdamW", res
        assert res["wrapped"] == ["FullyShardLinear", "FullyShardLinear", "FullyShardNet"], res
        assert res["callbacks_left"] == [], res  # taken off at teardown
        assert res["ckpt_is_dir"] and res["resumed"] <= 1e-5, res
        assert res["plain_epoch"] == 1 and res["plain_state_entries"] == 4, res
    # rank 0 holds rows 0..8 of the (17, 5) weight, rank 1 rows 9..16
    assert results[0]["shards"][0] == (9, 5) and results[1]["shards"][0] == (8, 5), results


# Parts of the Lightning launch at np=2 that tests/lightning/test_lightning_strategy.py shares
# (tests/_shared_launch.py): the ranks start and import Lightning once for all of them.
_NP2 = joint_launch("lightning", 2, {"zero": in_a_directory(_zero_fits), "zero3": in_a_directory(_zero3_fits)},
                    timeout=700)


def _zero3_two_optimizers(tmp: str, phase: str, want: list | None = None) -> dict:
    """Manual optimization with two optimizers (AdamW over one part of the module, SGD with
    momentum over the other) under ``zero_stage=3``. ``phase`` "np2": the uninterrupted 3-epoch
    fit, a 2-epoch fit whose ModelCheckpoint writes a sharded directory, and the third epoch
    resumed from it; "np1": the same checkpoint resumed in one rank with the same global batches
    (batch 4 here, 2 per rank at np=2)."""
    import os

    import lightning.pytorch as L  # noqa: N812
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    import horovod.lightning  # noqa: F401
    import horovod.torch as hvd
    from horovod.lightning import HorovodStrategy

    hvd.init()

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.body = torch.nn.Sequential(torch.nn.Linear(5, 17), torch.nn.Tanh(), torch.nn.Linear(17, 1))
            self.head = torch.nn.Linear(5, 1)

        def forward(self, x):
            return self.body(x) + self.head(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            opts = self.optimizers()
            self.manual_backward(torch.nn.functional.mse_loss(self(x), y))
            for o in opts:
                o.step()
                o.zero_grad()

        def configure_optimizers(self):
            return [torch.optim.AdamW(self.body.parameters(), lr=0.02, weight_decay=0.05),
                    torch.optim.SGD(self.head.parameters(), lr=0.05, momentum=0.9)]

    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(16, 5, generator=g), torch.randn(16, 1, generator=g))
    batch = 4 // hvd.size()

    def fit(epochs, ckpt=None, callbacks=None):
        model = Net()
        trainer = L.Trainer(strategy=HorovodStrategy(zero_stage=3, fully_shard_modules=torch.nn.Linear),
                            accelerator="cpu", max_epochs=epochs, logger=False,
                            enable_checkpointing=bool(callbacks), callbacks=callbacks,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, DataLoader(data, batch_size=batch), ckpt_path=ckpt)
        return trainer, model

    def weights(model):
        sd = model.full_state_dict()
        return torch.cat([sd[k].detach().reshape(-1) for k in sorted(sd)])

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    ckpt_dir = os.path.join(tmp, "zero3_two")
    out: dict = {"rank": hvd.rank()}
    if phase == "np2":
        _, ref = fit(3)
        want = weights(ref).tolist()
        out["want"] = want
        fit(2, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1)])
        hvd.barrier()
    path = os.path.join(ckpt_dir, sorted(os.listdir(ckpt_dir))[-1])
    out["path"] = path
    trainer, resumed = fit(3, ckpt=path)
    assert want is not None
    out["resumed"] = rel(weights(resumed), torch.tensor(want))
    opts = [getattr(o, "_optimizer", o) for o in trainer.strategy.optimizers]
    out["types"] = [type(o).__name__ for o in opts]
    out["state_entries"] = [len(o.state) for o in opts]
    return out


def test_lightning_zero3_two_optimizers_checkpoint_resumes_at_np2_and_np1(tmp_path):
    """zero_stage=3 with two optimizers (manual optimization): ModelCheckpoint writes every
    optimizer's rows (a sharded hvd.checkpoint directory, each optimizer under its index);
    resuming at np=2 and at np=1 ends at the uninterrupted fit's weights; an unsharded model
    with the two optimizers reads it in this process, and one optimizer alone is refused."""
    import torch

    import horovod.torch as hvd

    first = run_ranks(_zero3_two_optimizers, np=2, args=(str(tmp_path), "np2"), timeout=400)
    want = first[0]["want"]
    for res in first:
        assert res["resumed"] <= 1e-5, res
        assert res["types"] == ["AdamW", "SGD"] and all(res["state_entries"]), res
    (single,) = run_ranks(_zero3_two_optimizers, np=1, args=(str(tmp_path), "np1", want), timeout=300)
    assert single["resumed"] <= 1e-5 and single["state_entries"] == [4, 2], single
    # the same directory in a plain process: an unsharded model and its two optimizers
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(5, 17), torch.nn.Tanh(), torch.nn.Linear(17, 1))
    head = torch.nn.Linear(5, 1)
    model = torch.nn.ModuleDict({"body": body, "head": head})
    opts = [torch.optim.AdamW(body.parameters(), lr=0.02, weight_decay=0.05),
            torch.optim.SGD(head.parameters(), lr=0.05, momentum=0.9)]
    extra = hvd.checkpoint.load(first[0]["path"], model=model, optimizer=opts)
    assert extra["lightning"]["epoch"] == 1
    assert [len(o.state_dict()["state"]) for o in opts] == [4, 2]
    assert set(opts[1].state_dict()["state"][0]) == {"momentum_buffer"}
    with pytest.raises(ValueError, match="2 optimizers"):
        hvd.checkpoint.load(first[0]["path"], model=model, optimizer=opts[0])
