"""The Lightning TorchEstimator given a plain ``torch.nn.Module`` with ``optimizer=`` and ``loss=``
(upstream's older way): the wrapper trains it in one process with Lightning's Trainer, keeps the
optimizer's class, hyperparameters and state, reshapes features to ``input_shapes``, and the
estimator chooses it only for plain modules."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None
                                 and importlib.util.find_spec("pytorch_lightning") is None,
                                 reason="needs lightning or pytorch_lightning")]
torch = pytest.importorskip("torch")
pytest.importorskip("pyspark")


def _batches(n: int = 8) -> list[dict[str, object]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        x = rng.normal(size=(16, 4))
        y = (x[:, 0] > 0).astype(np.float64)
        out.append({"features": torch.from_numpy(x.reshape(16, 4)).float(), "label": torch.from_numpy(y)})
    return out


class Loader:
    """Batches as the estimator's loader gives them (an iterable of dicts, not a list of loaders)."""

    def __init__(self, batches: list[dict[str, object]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, features):  # features arrive as input_shapes says: (-1, 2, 2)
        assert features.shape[1:] == (2, 2)
        return torch.log_softmax(self.fc(features.reshape(-1, 4)), -1)


def test_a_plain_module_trains_through_the_wrapper() -> None:
    from horovod.spark.lightning.legacy import lightning_base, to_lightning_module

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.25)
    nll = torch.nn.NLLLoss()
    module = to_lightning_module(model, opt, lambda out, y: nll(out, y.long()), None, ["features"], ["label"],
                                 None, 0.1, [[-1, 2, 2]])
    assert isinstance(module, lightning_base()) and type(module).__name__ == "LightningNet"
    built = module.configure_optimizers()
    assert type(built) is torch.optim.SGD and built.param_groups[0]["lr"] == 0.5
    assert built.param_groups[0]["momentum"] == 0.25
    batches = _batches()
    before = float(module._loss(batches[0]).detach())
    pl = importlib.import_module(lightning_base().__module__.split(".core")[0])
    trainer = pl.Trainer(max_epochs=6, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=Loader(batches), val_dataloaders=Loader(batches[:2]))
    assert float(module._loss(batches[0]).detach()) < before * 0.7
    assert set(module.state_dict()) == {"model.fc.weight", "model.fc.bias"}
    assert "val_loss" in trainer.callback_metrics


def test_errors_name_the_fix() -> None:
    from horovod.spark.lightning.legacy import to_lightning_module

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="2 label columns .* but 3 loss functions"):
        to_lightning_module(model, opt, [torch.nn.MSELoss()] * 3, None, ["f"], ["a", "b"], None, None)
    with pytest.raises(ValueError, match="needs optimizer= and loss="):
        to_lightning_module(model, None, torch.nn.MSELoss(), None, ["f"], ["a"], None, None)


def test_the_estimator_wraps_only_plain_modules() -> None:
    from horovod.spark.lightning import TorchEstimator
    from horovod.spark.lightning.legacy import lightning_base

    plain = TorchEstimator(model=Net(), optimizer=torch.optim.SGD(Net().parameters(), lr=0.1),
                           loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["label"])
    assert plain._is_plain_module() and isinstance(plain._lightning_module(), lightning_base())

    class Module(lightning_base()):
        pass

    own = Module()
    est = TorchEstimator(model=own, feature_cols=["features"], label_cols=["label"])
    assert not est._is_plain_module() and est._lightning_module() is own
    with pytest.raises(TypeError, match="needs a LightningModule"):
        TorchEstimator(model=object(), feature_cols=["f"], label_cols=["l"])._check_model()
