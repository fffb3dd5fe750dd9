"""``Trainer(strategy="horovod")`` on real ranks, for both Lightning 2 packages.

Each launched job runs every behaviour check in one process per rank (Lightning imports are slow):
equivalence with one process on the whole batch (SGD, mean loss, StepLR, gradient clipping),
the distributed sampler, ``sync_dist`` values, validate/test/predict, collectives, checkpoints
written once and resumed, early stopping, several optimizers, gradient accumulation, bf16-mixed.
np=2 runs ``lightning.pytorch``, np=3 the standalone ``pytorch_lightning``."""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest

from horovod.testing import RanksFailed, run_ranks
from tests._shared_launch import JOINT_TIMEOUT, in_a_directory, joint_launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lightning_jobs  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

_LIGHTNING = importlib.util.find_spec("lightning") is not None
_PL = importlib.util.find_spec("pytorch_lightning") is not None

B = 4  # samples per rank per step
STEPS = 3  # optimizer steps per epoch
TOL = dict(rtol=1e-5, atol=1e-6)


def _all_checks(package: str, tmp: str) -> dict:
    import copy
    import os

    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset

    import horovod.torch as hvd
    from horovod.lightning import HorovodStrategy

    L = importlib.import_module(package)  # noqa: N806
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict = {"rank": rank}

    class Indexed(Dataset):
        def __init__(self, n: int, seed: int = 0) -> None:
            g = torch.Generator().manual_seed(seed)
            self.x = torch.randn(n, 4, generator=g)
            self.y = torch.randn(n, 1, generator=g)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int):
            return self.x[i], self.y[i], i

    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    class Model(L.LightningModule):
        def __init__(self, lr: float = 0.2, scheduler: bool = True) -> None:
            super().__init__()
            self.net = net()
            self.lr, self.scheduler = lr, scheduler
            self.seen: list[int] = []
            self.val_seen: list[int] = []

        def training_step(self, batch, batch_idx):
            x, y, idx = batch
            self.seen.append((self.current_epoch, idx.tolist()))
            self.log("rank_mean", float(rank), sync_dist=True)
            self.log("rank_sum", torch.tensor(rank + 1.0), sync_dist=True, reduce_fx="sum")
            self.log("rank_max", torch.tensor(float(rank)), sync_dist=True, reduce_fx="max")
            return F.mse_loss(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y, idx = batch
            self.val_seen += idx.tolist()
            self.log("val_rank", float(rank), sync_dist=True)
            self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

        def test_step(self, batch, batch_idx):
            x, y, idx = batch
            self.log("test_count", float(len(idx)), sync_dist=True, reduce_fx="sum")

        def predict_step(self, batch, batch_idx):
            x, y, idx = batch
            return idx

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
            if not self.scheduler:
                return opt
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)}

    def quiet(**kw):
        base = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0)
        base.update(kw)
        return L.Trainer(**base)

    def flat(module: torch.nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in module.parameters()])

    def seeded_model(**kw) -> Model:
        torch.manual_seed(100 + rank)  # every rank starts elsewhere: setup() broadcasts rank 0's
        return Model(**kw)

    def order(n: int, epoch: int) -> list[int]:
        """The training order of Lightning's sampler (shuffled, seed 0) over all ranks at once."""
        sampler = torch.utils.data.DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        return list(sampler)

    def reference(init: dict, data: Indexed, epochs: int, per_step: int, clip: float | None,
                  scheduler: bool) -> torch.Tensor:
        """One process on the whole batch of every step (the union of the ranks' shards)."""
        m = net()
        m.load_state_dict(init)
        opt = torch.optim.SGD(m.parameters(), lr=0.2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if scheduler else None
        n = per_step * size
        for epoch in range(epochs):
            perm = order(len(data), epoch)
            for s in range(len(data) // n):
                idx = perm[s * n:(s + 1) * n]  # rank r's j-th sample is perm[r + size * j]
                opt.zero_grad()
                F.mse_loss(m(data.x[idx]), data.y[idx]).backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
                opt.step()
            if sched is not None:
                sched.step()
        return flat(m)

    data = Indexed(B * STEPS * size)

    # 1. Equivalence, sampler, sync_dist, StepLR, clipping after synchronize(), broadcast at setup.
    model = seeded_model()
    init0 = hvd.broadcast_object(copy.deepcopy(model.net.state_dict()), root_rank=0)
    trainer = quiet(strategy="horovod", max_epochs=2, gradient_clip_val=0.05)
    trainer.fit(model, DataLoader(data, batch_size=B), DataLoader(data, batch_size=B))
    expected = reference(init0, data, epochs=2, per_step=B, clip=0.05, scheduler=True)
    out["weights"] = flat(model).tolist()
    out["equivalence_max_err"] = float((flat(model) - expected).abs().max())
    torch.testing.assert_close(flat(model), expected, **TOL)
    out["seen"] = [sum((i for e, i in model.seen if e == epoch), []) for epoch in range(2)]
    out["order"] = [order(len(data), epoch) for epoch in range(2)]
    out["val_seen"] = sorted(set(model.val_seen))
    out["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    out["lr_after"] = trainer.optimizers[0].param_groups[0]["lr"]
    out["wrapped"] = type(trainer.strategy.optimizers[0]).__mro__[1].__name__

    # 2. validate / test / predict, distributed.
    val = trainer.validate(model, DataLoader(data, batch_size=B), verbose=False)
    out["validate"] = {k: float(v) for k, v in val[0].items()}
    tst = trainer.test(model, DataLoader(data, batch_size=B), verbose=False)
    out["test_count"] = float(tst[0]["test_count"])
    preds = trainer.predict(model, DataLoader(data, batch_size=B))
    out["predicted"] = sorted(int(i) for p in preds for i in p)

    # 3. Collectives from the strategy and the LightningModule.
    s = trainer.strategy
    out["all_gather"] = s.all_gather(torch.tensor([rank, 10.0 * rank])).tolist()
    out["module_all_gather"] = model.all_gather(torch.tensor(float(rank))).tolist()
    out["broadcast"] = s.broadcast({"from": rank}, src=size - 1)
    out["any"] = s.reduce_boolean_decision(rank == 0, all=False)
    out["all"] = s.reduce_boolean_decision(rank == 0, all=True)
    out["reduce_sum"] = float(s.reduce(torch.tensor(float(rank)), reduce_op="sum"))
    out["reduce_mean"] = float(s.reduce(torch.tensor(float(rank))))
    s.barrier()

    # 4. Checkpoints: written by rank 0 only, once per epoch; resume gives the continuous run's weights.
    ckpt_dir = os.path.join(tmp, f"ckpt-{package}")
    saves = []
    io_cls = importlib.import_module(package + ".plugins").TorchCheckpointIO

    class CountingIO(io_cls):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            saves.append(os.path.basename(path))
            return super().save_checkpoint(checkpoint, path, storage_options)

    model = seeded_model()
    cb = importlib.import_module(package + ".callbacks").ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1)
    trainer = quiet(strategy=HorovodStrategy(), max_epochs=1, gradient_clip_val=0.05, callbacks=[cb],
                    enable_checkpointing=True, plugins=[CountingIO()])
    trainer.fit(model, DataLoader(data, batch_size=B))
    out["saves"] = list(saves)
    trainer.strategy.barrier()
    files = sorted(os.listdir(ckpt_dir))
    out["ckpt_files"] = files
    torch.manual_seed(999 + rank)
    resumed = Model()
    trainer = quiet(strategy="horovod", max_epochs=2, gradient_clip_val=0.05)
    trainer.fit(resumed, DataLoader(data, batch_size=B), ckpt_path=os.path.join(ckpt_dir, files[-1]))
    torch.testing.assert_close(flat(resumed), expected, **TOL)
    out["resumed"] = flat(resumed).tolist()

    # 5. Early stopping: only rank 0's (unsynced) metric says stop; every rank must stop with it.
    es_cls = importlib.import_module(package + ".callbacks").EarlyStopping

    class Stopper(Model):
        def on_train_epoch_end(self):
            epoch = self.current_epoch
            value = float(epoch) if rank == 0 else -float(epoch)  # rank 0 gets worse from epoch 1
            self.log("watched", value, sync_dist=False, rank_zero_only=False)

    model = Stopper(scheduler=False)
    trainer = quiet(strategy="horovod", max_epochs=6,
                    callbacks=[es_cls(monitor="watched", mode="min", patience=0, check_on_train_epoch_end=True)])
    trainer.fit(model, DataLoader(data, batch_size=B))
    out["stopped_epoch"] = trainer.current_epoch
    out["should_stop"] = trainer.should_stop

    # 6. Several optimizers (manual optimization), each wrapped with its own parameters.
    class TwoOpt(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = net(), net()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            x, y, _ = batch
            opt_a, opt_b = self.optimizers()
            for module, opt in ((self.a, opt_a), (self.b, opt_b)):
                opt.zero_grad()
                self.manual_backward(F.mse_loss(module(x), y))
                opt.step()

        def configure_optimizers(self):
            return [torch.optim.SGD(self.a.parameters(), lr=0.2), torch.optim.SGD(self.b.parameters(), lr=0.2)]

    torch.manual_seed(7 + rank)
    two = TwoOpt()
    init_a = hvd.broadcast_object(copy.deepcopy(two.a.state_dict()), root_rank=0)
    init_b = hvd.broadcast_object(copy.deepcopy(two.b.state_dict()), root_rank=0)
    trainer = quiet(strategy="horovod", max_epochs=1)
    trainer.fit(two, DataLoader(data, batch_size=B))
    torch.testing.assert_close(flat(two.a), reference(init_a, data, 1, B, None, False), **TOL)
    torch.testing.assert_close(flat(two.b), reference(init_b, data, 1, B, None, False), **TOL)
    out["two_opt"] = [flat(two.a).tolist(), flat(two.b).tolist()]
    out["two_opt_names"] = [sorted(o.reducer._parameter_names.values()) for o in trainer.strategy.optimizers]

    # 7. Gradient accumulation: 2 micro-batches per step = one process on both micro-batches.
    acc_data = Indexed(B * 4 * size, seed=1)
    model = seeded_model(scheduler=False)
    init0 = hvd.broadcast_object(copy.deepcopy(model.net.state_dict()), root_rank=0)
    trainer = quiet(strategy="horovod", max_epochs=1, accumulate_grad_batches=2)
    trainer.fit(model, DataLoader(acc_data, batch_size=B))
    acc_expected = reference(init0, acc_data, epochs=1, per_step=2 * B, clip=None, scheduler=False)
    torch.testing.assert_close(flat(model), acc_expected, **TOL)
    out["accumulated"] = flat(model).tolist()
    out["passes"] = trainer.strategy.optimizers[0].backward_passes_per_step
    model = seeded_model(scheduler=False)  # the same with the gradients as views of one flat buffer
    trainer = quiet(strategy=HorovodStrategy(flat_gradients=True), max_epochs=1, accumulate_grad_batches=2)
    trainer.fit(model, DataLoader(acc_data, batch_size=B))
    torch.testing.assert_close(flat(model), acc_expected, **TOL)
    grads = [p.grad for p in model.parameters()]
    out["flat_views"] = all(g is not None and g.untyped_storage().data_ptr() == grads[0].untyped_storage().data_ptr()
                            for g in grads)
    out["acc_steps"] = trainer.global_step
    sched_cls = importlib.import_module(package + ".callbacks").GradientAccumulationScheduler
    model = seeded_model(scheduler=False)
    trainer = quiet(strategy="horovod", max_epochs=2, callbacks=[sched_cls({0: 1, 1: 2})])
    trainer.fit(model, DataLoader(acc_data, batch_size=B))
    out["acc_scheduled"] = flat(model).tolist()
    out["acc_scheduled_steps"] = (trainer.global_step, trainer.strategy.optimizers[0].backward_passes_per_step)

    # 8. bf16-mixed on CPU.
    model = seeded_model(scheduler=False)
    trainer = quiet(strategy="horovod", max_epochs=1, precision="bf16-mixed")
    trainer.fit(model, DataLoader(data, batch_size=B))
    out["bf16"] = flat(model).tolist()
    out["bf16_finite"] = bool(torch.isfinite(flat(model)).all())
    return out


def _check(results: list[dict], size: int) -> None:
    n = B * STEPS * size
    r0 = results[0]
    for epoch in range(2):  # the shards of an epoch split the data
        assert sorted(i for r in results for i in r["seen"][epoch]) == list(range(n))
    for r in results:
        rank = r["rank"]
        # identical weights everywhere, after every kind of run
        for key in ("weights", "resumed", "two_opt", "accumulated", "acc_scheduled", "bf16"):
            assert r[key] == r0[key], f"{key}: rank {rank} differs from rank 0"
        assert r["equivalence_max_err"] < 1e-5
        # sampler: shuffled per epoch, rank r takes every size-th sample of the order; validation
        # is not shuffled
        for epoch in range(2):
            assert r["seen"][epoch] == r["order"][epoch][rank::size], (rank, epoch, r["seen"][epoch])
        assert r["seen"][0] != r["seen"][1], "the sampler must reshuffle every epoch"
        assert r["val_seen"] == list(range(rank, n, size))
        # sync_dist values
        assert r["metrics"]["rank_mean"] == pytest.approx((size - 1) / 2)
        assert r["metrics"]["rank_sum"] == pytest.approx(size * (size + 1) / 2)
        assert r["metrics"]["rank_max"] == pytest.approx(size - 1)
        assert r["metrics"]["val_rank"] == pytest.approx((size - 1) / 2)
        assert r["validate"]["val_rank"] == pytest.approx((size - 1) / 2)
        assert r["validate"]["val_loss"] == pytest.approx(r0["validate"]["val_loss"])
        assert r["test_count"] == n
        assert r["predicted"] == list(range(rank, n, size))
        assert r["lr_after"] == pytest.approx(0.2 * 0.25)  # StepLR stepped twice on the wrapped optimizer
        assert r["wrapped"] == "_DistributedOptimizer"
        # collectives
        assert r["all_gather"] == [[float(i), 10.0 * i] for i in range(size)]
        assert r["module_all_gather"] == [float(i) for i in range(size)]
        assert r["broadcast"] == {"from": size - 1}
        assert r["any"] is True and r["all"] is False
        assert r["reduce_sum"] == sum(range(size)) and r["reduce_mean"] == pytest.approx((size - 1) / 2)
        # checkpoints: one file per epoch, written by rank 0 only
        assert r["ckpt_files"] == [f"epoch=0-step={STEPS}.ckpt"]
        assert r["saves"] == ([f"epoch=0-step={STEPS}.ckpt"] if rank == 0 else []), (rank, r["saves"])
        # early stopping agreed: rank 0 wanted to stop after epoch 1
        assert r["should_stop"] is True and r["stopped_epoch"] == 2, (rank, r["stopped_epoch"])
        # several optimizers: each wraps only its own parameters, by name
        assert r["two_opt_names"] == [[f"a.{k}" for k in ("0.bias", "0.weight", "2.bias", "2.weight")],
                                      [f"b.{k}" for k in ("0.bias", "0.weight", "2.bias", "2.weight")]]
        # accumulation: backward_passes_per_step = accumulate_grad_batches, 2 steps of 2 micro-batches
        assert r["passes"] == 2 and r["acc_steps"] == 2
        assert r["flat_views"], "flat_gradients=True: every gradient must stay a view of one buffer"
        assert r["acc_scheduled_steps"] == (4 + 2, 2)  # GradientAccumulationScheduler: 1, then 2
        assert r["bf16_finite"]


# A part of the Lightning launch at np=2 that tests/lightning/test_lightning_zero.py shares
# (tests/_shared_launch.py): the ranks start and import Lightning once for both modules.
_NP2 = joint_launch("lightning", 2, {"all_checks": in_a_directory(_all_checks, "lightning.pytorch")}, timeout=240)


@pytest.mark.skipif(not _LIGHTNING, reason="the unified `lightning` package is not installed")
@JOINT_TIMEOUT
def test_lightning_pytorch_np2():
    _check(_NP2.results("all_checks"), 2)


@pytest.mark.skipif(not _PL, reason="the standalone `pytorch_lightning` package is not installed")
def test_pytorch_lightning_np3(tmp_path):
    _check(run_ranks(_all_checks, np=3, args=("pytorch_lightning", str(tmp_path)), timeout=300), 3)


def _raise_on_rank_1() -> None:
    import lightning.pytorch as L  # noqa: N812
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import horovod.lightning  # noqa: F401
    import horovod.torch as hvd

    hvd.init()

    class Boom(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            if hvd.rank() == 1 and batch_idx == 2:
                raise ValueError("boom on rank 1 at batch 2")
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = TensorDataset(torch.randn(64, 2))
    L.Trainer(strategy="horovod", accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False).fit(Boom(), DataLoader(data, batch_size=2))


@pytest.mark.skipif(not _LIGHTNING, reason="the unified `lightning` package is not installed")
def test_one_rank_raising_ends_the_job():
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_raise_on_rank_1, np=2, timeout=120,
                  launcher=[sys.executable, "-m", "horovod.runner", "-np", "2"])  # horovodrun
    msg = str(info.value)
    assert "did not finish" not in msg, "the job hung instead of ending"
    assert "rank 1 raised" in msg and "boom on rank 1 at batch 2" in msg, msg[-3000:]
    assert "rank 0 raised" not in msg, "rank 0 is not the culprit"
    # horovodrun's failure report names the culprit
    assert "The first process to do so was:\n  rank 1 (host" in msg, msg[-3000:]
    assert time.monotonic() - start < 120


def test_horovod_run_launches_lightning():
    import cloudpickle

    import horovod

    cloudpickle.register_pickle_by_value(lightning_jobs)
    results = horovod.run(lightning_jobs.tiny_fit, np=2)
    lightning_jobs.check_tiny_fit(results, 2)
