"""``Trainer(strategy="horovod", accelerator="gpu")`` on a CUDA GPU: np=1 on NCCL, np=2 sharing one GPU
host-staged, in full and mixed precision."""

from __future__ import annotations

import pytest

from horovod.testing import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


def _train_on_gpu(precision: str):
    import importlib

    import torch

    import horovod.torch as hvd
    from horovod.lightning import HorovodStrategy

    pl = importlib.import_module("lightning.pytorch" if importlib.util.find_spec("lightning")
                                 else "pytorch_lightning")
    hvd.init()

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(hvd.rank())  # different starts: the strategy's broadcast aligns them
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
            self.losses: list[float] = []
            self.devices: set[str] = set()

        def training_step(self, batch, _):
            x, y = batch
            # where training runs (Lightning moves the module back to the CPU in teardown after fit)
            self.devices |= {str(p.device) for p in self.parameters()} | {str(x.device)}
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss.detach()))
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(1, keepdim=True) * 0.5
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    model = Regression()
    trainer = pl.Trainer(strategy=HorovodStrategy(), accelerator="gpu", devices=1, precision=precision,
                         max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, loader)
    device = model.devices
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()]).cuda()
    spread = (hvd.allreduce(flat, op=hvd.Max, name="chk.max") - hvd.allreduce(flat, op=hvd.Min, name="chk.min"))
    out = {"device": sorted(device), "first": model.losses[0], "last": model.losses[-1],
           "spread": float(spread.abs().max()), "root": str(trainer.strategy.root_device)}
    hvd.shutdown()
    return out


@pytest.mark.parametrize("np_,env", [(1, {}), (2, {"HOROVOD_GPU_OPERATIONS": "MPI"})])
@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed"])
def test_lightning_trains_on_the_gpu(np_, env, precision):
    pytest.importorskip("lightning.pytorch" if __import__("importlib").util.find_spec("lightning")
                        else "pytorch_lightning", reason="Lightning is not installed on this GPU machine")
    res = run_ranks(_train_on_gpu, np=np_, timeout=300, env=env, args=(precision,))
    for r in res:
        assert r["device"] == ["cuda:0"] and r["root"] == "cuda:0", res
        assert r["last"] < r["first"], res
        assert r["spread"] == 0.0, res
