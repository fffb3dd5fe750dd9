"""Rank functions for the Lightning tests (imported by the tests of tests/lightning, tests/spark and
tests/ray; shipped to the ranks by value)."""

from __future__ import annotations

import importlib
from typing import Any


def tiny_fit(package: str = "lightning.pytorch") -> dict[str, Any]:
    """Two epochs of a small regression under ``Trainer(strategy="horovod")`` on this rank's shard;
    returns the rank, the size, the indices it saw in epoch 0 and its final weights."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import horovod.lightning  # noqa: F401  (registers "horovod")
    import horovod.torch as hvd

    L = importlib.import_module(package)  # noqa: N806
    hvd.init()
    torch.manual_seed(1234 + hvd.rank())  # different on every rank: the broadcast must fix it

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.seen: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y, idx = batch
            if self.current_epoch == 0:
                self.seen += idx.tolist()
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    n = 8 * hvd.size()
    data = TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g), torch.arange(n))
    model = Net()
    trainer = L.Trainer(strategy="horovod", accelerator="cpu", max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=2))
    return {"rank": trainer.global_rank, "size": trainer.world_size, "seen": model.seen,
            "weights": [p.detach().reshape(-1).tolist() for p in model.parameters()]}


def check_tiny_fit(results: list[dict[str, Any]], size: int) -> None:
    assert [r["rank"] for r in results] == list(range(size)), results
    assert all(r["size"] == size for r in results)
    assert all(r["weights"] == results[0]["weights"] for r in results), "weights differ between ranks"
    seen = sorted(i for r in results for i in r["seen"])
    assert seen == list(range(8 * size)), f"the shards of an epoch must split the data: {seen}"
