"""Spark ML estimators on a real local-cluster: the three examples fit the digits to >= 0.85 test
accuracy through transform(); save/load round trips; resume by run_id; sparse vectors and a
validation column; a raising rank; bad columns, types and shapes before training.

The torch, Keras and Lightning estimators' trained weights are checked against a reference
computed here: the same model and initial weights, each rank's share of the prepared Parquet as
the estimators split it (``tests/_reference_spark.py``), plain SGD on the ranks' gradients
averaged at each step (``tests/_averaging.py``; Keras: ``keras_averaged_weights``). Those fits run
with ``shuffle=False`` so that the reference can replay each rank's batches, and with plain SGD:
Adam is blind to gradients summed instead of averaged."""

from __future__ import annotations

import copy
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]

import cloudpickle  # noqa: E402

from tests._averaging import averaged_steps  # noqa: E402
from tests._reference_spark import (  # noqa: E402
    accumulated_steps,
    keras_averaged_weights,
    keras_loss,
    rank_batches,
    rank_rows,
    step_batches,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "spark"


def _example(name: str) -> Any:
    """Load an example as a module outside sys.modules (its classes ship by value)."""
    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"_ex_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _predictions(model: Any, df: Any, col: str) -> np.ndarray:
    from pyspark.ml.functions import vector_to_array

    rows = model.transform(df).select(vector_to_array(col).alias("p")).toPandas()
    return np.stack(rows["p"].to_numpy())


@pytest.fixture(scope="module")
def torch_fit(spark_session: Any, tmp_path_factory: Any) -> dict[str, Any]:
    ex = _example("pytorch_spark_mnist")
    work = str(tmp_path_factory.mktemp("torch_store"))
    model, acc = ex.train_and_evaluate(spark_session, work, num_proc=2, epochs=3,
                                       run_id="torch-run", partitions_per_process=2)
    return {"ex": ex, "work": work, "model": model, "acc": acc}


def test_torch_example_fits_digits(torch_fit: dict[str, Any]) -> None:
    assert torch_fit["acc"] >= 0.85, torch_fit["acc"]
    history = torch_fit["model"].getHistory()
    assert len(history["loss"]) == 3 and len(history["val_loss"]) == 3
    assert history["loss"][-1] < history["loss"][0]


def test_torch_save_load_and_resume(spark: Any, torch_fit: dict[str, Any], tmp_path: Path) -> None:
    import torch
    import torch.nn.functional as F

    from horovod.spark.common.store import Store
    from horovod.spark.torch import TorchEstimator, TorchModel

    ex, model = torch_fit["ex"], torch_fit["model"]
    _, test_df = ex.digits_dataframes(spark)
    model.write().overwrite().save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert loaded.uid == model.uid and loaded.getOutputCols() == ["label_prob"]
    np.testing.assert_allclose(_predictions(loaded, test_df, "label_prob"),
                               _predictions(model, test_df, "label_prob"), rtol=1e-5, atol=1e-6)
    with pytest.raises(FileExistsError):
        model.save(str(tmp_path / "model"))

    # Resume run "torch-run" (3 epochs done) to 4 epochs: one more epoch, history continues.
    net = ex.Net()
    est = TorchEstimator(num_proc=2, store=Store.create(torch_fit["work"]), model=net,
                         optimizer=torch.optim.Adam(net.parameters(), lr=0.01), loss=F.nll_loss,
                         input_shapes=[[-1, 1, 8, 8]], feature_cols=["features"],
                         label_cols=["label"], batch_size=32, epochs=4, validation=0.1,
                         random_seed=1, run_id="torch-run", verbose=0, partitions_per_process=2)
    est.save(str(tmp_path / "est"))
    est2 = TorchEstimator.load(str(tmp_path / "est"))
    assert est2.getEpochs() == 4 and est2.getRunId() == "torch-run"
    assert isinstance(est2.getModel(), torch.nn.Module)
    assert type(est2.getOptimizer()) is torch.optim.Adam
    # Train on the data the first fit prepared (fit_on_parquet), resuming the run.
    work = Path(torch_fit["work"])
    (idx,) = [p.name.split(".", 1)[1] for p in work.iterdir()
              if p.name.startswith("intermediate_train_data.")]
    resumed = est2.fit_on_parquet(dataset_idx=idx)
    before, after = model.getHistory(), resumed.getHistory()
    assert len(after["loss"]) == 4
    assert after["loss"][:3] == pytest.approx(before["loss"])
    acc = ex.accuracy(resumed.setOutputCols(["p"]).transform(test_df), "p")
    assert acc >= 0.85


def _sparse_digits(spark: Any) -> Any:
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits

    d = load_digits()
    rows = []
    for i, (x, y) in enumerate(zip(d.data, d.target)):
        nz = np.nonzero(x)[0]
        rows.append((Vectors.sparse(64, nz.tolist(), (x[nz] / 16.0).tolist()), int(y),
                     1 if i % 10 == 0 else 0, float(i % 7 != 0)))
    return spark.createDataFrame(rows, ["features", "label", "is_val", "weight"])



@pytest.fixture(scope="module")
def sparse_digits(spark_session: Any) -> Iterator[Any]:
    """``_sparse_digits``, built once for this module and cached on the executors (building it
    runs 1797 rows through Python; every Spark pass over it re-ran that)."""
    df = _sparse_digits(spark_session).cache()
    yield df
    df.unpersist()


@pytest.fixture(scope="module")
def shared_root(tmp_path_factory: Any) -> Any:
    """``shared_root(name)``: one store directory per name for this module. The fits below that
    prepare ``sparse_digits`` with the same columns and options give the same name: the first
    one writes the Parquet, the others train on it (``util.prepare_data`` reuses what this
    process prepared into that store). Each such directory holds that one dataset only."""
    made: dict[str, Path] = {}

    def root(name: str) -> Path:
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
        return made[name]

    return root


def _mlp() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


_TORCH_LR = 0.5  # plain SGD's: large enough that a summed or twice-applied gradient shows
_KERAS_LR = 0.5


def _fit_steps(store: Any, root: Path, columns: list[str], epochs: int | None = None,
               steps: int | None = None, widths: dict[str, int] | None = None) -> list[list[dict[str, np.ndarray]]]:
    """The two ranks' batches (32 rows) of each step of a fit on the one dataset prepared under
    ``root``: ``steps``, or ``epochs`` times the estimators' default steps per epoch. The ranks'
    batches differ at every step (a rank reading the other's shard would not match)."""
    from horovod.spark.common import util

    (idx,) = [p.name.split(".", 1)[1] for p in root.iterdir()
              if p.name.startswith("intermediate_train_data.")]
    if steps is None:
        assert epochs is not None
        steps = epochs * (util.get_dataset_properties(store, idx)[0] // (32 * 2))
    out = step_batches(store, store.get_train_data_path(idx), 2, columns, batch_size=32,
                       steps=steps, widths=widths)
    for s, (b0, b1) in enumerate(out):
        assert not np.array_equal(b0["features"], b1["features"]), f"step {s}: the same batch twice"
    return out


def _torch_reference(initial: Any, steps: list[list[Any]], feature: str,
                     label: str, lr: float, weight: str | None = None,
                     passes: int = 1, momentum: float = 0.0, loss: Any = None) -> dict[str, np.ndarray]:
    """The state of a copy of ``initial`` after SGD (plain, or with ``momentum``) on the mean
    cross-entropy, or on ``loss(output, label)`` (with a ``weight`` column: the mean of the rows'
    cross-entropies times their weights, as upstream weighs them), the ranks' gradients averaged
    at each step (``tests/_averaging.py``), one thread as on the ranks. A rank's batch may be a
    list of batches (``accumulated_steps``): its loss is then the sum of theirs divided by
    ``passes``."""
    import torch
    import torch.nn.functional as F

    model = copy.deepcopy(initial)
    model.train()

    def loss_of(m: Any, batch: Any) -> Any:
        if isinstance(batch, list):
            return sum(loss_of(m, b) for b in batch) / passes
        x = torch.from_numpy(np.ascontiguousarray(batch[feature])).float()
        y = torch.from_numpy(batch[label]).long()
        if loss is not None:
            return loss(m(x), y)
        if weight is None:
            return F.cross_entropy(m(x), y)
        w = torch.from_numpy(batch[weight]).float()
        return (F.cross_entropy(m(x), y, reduction="none") * w).mean()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        averaged_steps(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum), loss_of, steps)
    finally:
        torch.set_num_threads(threads)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _torch_val_losses(initial: Any, store: Any, idx: str, train_steps: list[list[Any]], epochs: int,
                      weight: str, widths: dict[str, int]) -> list[float]:
    """The ``val_loss`` history the reference expects: after each epoch (``train_steps`` split
    evenly into ``epochs``), the reference model's weighted cross-entropy on each rank's next
    ``ceil(val_rows / (32 * 2))`` validation batches (32 rows, the validation stream read as
    the training one, unshuffled, continuing across epochs), each rank's mean over its batches,
    then the mean over the ranks (the estimators' allreduce average)."""
    import math

    import torch
    import torch.nn.functional as F

    from horovod.spark.common import util
    val_steps = math.ceil(util.get_dataset_properties(store, idx)[1] / (32 * 2))
    rows = [rank_rows(store, store.get_val_data_path(idx), r, 2, ["features", "label", weight],
                      widths) for r in (0, 1)]
    streams = [rank_batches(r, 32, val_steps * epochs) for r in rows]
    per_epoch = len(train_steps) // epochs
    model, out = copy.deepcopy(initial), []
    for e in range(epochs):
        model.load_state_dict({k: torch.from_numpy(v) for k, v in _torch_reference(
            initial, train_steps[:per_epoch * (e + 1)], "features", "label", lr=_TORCH_LR,
            weight=weight).items()})
        model.eval()
        rank_means = []
        with torch.no_grad():
            for stream in streams:
                losses = []
                for b in stream[val_steps * e:val_steps * (e + 1)]:
                    x = torch.from_numpy(np.ascontiguousarray(b["features"])).float()
                    rows_loss = F.cross_entropy(model(x), torch.from_numpy(b["label"]).long(),
                                                reduction="none")
                    losses.append(float((rows_loss * torch.from_numpy(b[weight]).float()).mean()))
                rank_means.append(sum(losses) / val_steps)
        out.append(sum(rank_means) / 2)
    return out


class _RecordingMinibatch:
    """``train_minibatch_fn`` (upstream's signature) that also saves this rank's weights, its step
    count and the batch's labels after every step, under ``where``."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __call__(self) -> Any:
        steps = [0]

        def train_minibatch(model: Any, optimizer: Any, transform_outputs: Any, loss_fn: Any,
                            inputs: Any, labels: Any, sample_weights: Any) -> tuple[Any, Any]:
            import torch

            import horovod.torch as hvd

            optimizer.zero_grad()
            outputs, labels = transform_outputs(model(*inputs), labels)
            loss = loss_fn(outputs, labels, sample_weights)
            loss.backward()
            optimizer.step()
            steps[0] += 1
            torch.save({"steps": steps[0], "labels": labels[0].tolist(),
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}},
                       f"{self.where}/rank{hvd.rank()}.pt")
            return outputs, loss

        return train_minibatch


def test_sparse_vectors_and_validation_column(spark: Any, sparse_digits: Any, tmp_path: Path) -> None:
    import torch
    import torch.nn.functional as F

    from horovod.spark.common import util
    from horovod.spark.common.store import Store
    from horovod.spark.torch import TorchEstimator

    df = sparse_digits
    store = Store.create(str(tmp_path / "store"))
    net = _mlp()
    initial = copy.deepcopy(net)
    (tmp_path / "ranks").mkdir()
    # Plain SGD (Adam would hide gradients summed instead of averaged) and shuffle=False: the
    # reference below replays each rank's batches in the order the estimator reads them.
    est = TorchEstimator(num_proc=2, store=store, model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=_TORCH_LR),
                         loss=F.cross_entropy, feature_cols=["features"], label_cols=["label"],
                         validation="is_val", compress_sparse_cols=True, batch_size=32,
                         epochs=3, random_seed=3, verbose=0, partitions_per_process=2,
                         shuffle=False, sample_weight_col="weight",
                         train_minibatch_fn=_RecordingMinibatch(str(tmp_path / "ranks")))
    model = est.fit(df)
    # Two ranks trained one model: each on its own shard, the same number of steps, the same
    # weights after the last one (ranks whose gradients were not averaged would differ), and
    # those are the fitted model's.
    ranks = [torch.load(tmp_path / "ranks" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert ranks[0]["steps"] == ranks[1]["steps"] >= 3, [r["steps"] for r in ranks]
    assert ranks[0]["labels"] != ranks[1]["labels"]  # the last batches: two shards
    fitted = model.getModel().state_dict()
    for name, value in fitted.items():
        np.testing.assert_array_equal(ranks[1]["state"][name].numpy(), ranks[0]["state"][name].numpy())
        np.testing.assert_array_equal(value.numpy(), ranks[0]["state"][name].numpy())
    idx = next(p.name.split(".", 1)[1] for p in (tmp_path / "store").iterdir()
               if p.name.startswith("intermediate_train_data."))
    # ... and that model is the one plain SGD trains on the ranks' gradients averaged each step
    # (each row's loss weighted by its "weight", 0 for every 7th row).
    steps = _fit_steps(store, tmp_path / "store", ["features", "label", "weight"],
                       steps=ranks[0]["steps"], widths={"features": 64})
    assert [list(b["label"]) for b in steps[-1]] == [r["labels"] for r in ranks], \
        "the reference's split of the rows must be the estimator's (its last batches differ)"
    expected = _torch_reference(initial, steps, "features", "label", lr=_TORCH_LR, weight="weight")
    for name, value in fitted.items():
        np.testing.assert_allclose(value.numpy(), expected[name], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name}: not the averaged SGD of the ranks' batches")
    train_rows, val_rows, meta = util.get_dataset_properties(store, idx)
    assert (train_rows, val_rows) == (1797 - 180, 180)  # is_val marks every 10th row
    assert meta["features"]["kind"] == "vector" and meta["features"]["sparse"]
    assert meta["features"]["shape"] == [64]
    # The same DataFrame with the same options: the prepared data is reused, not rewritten.
    marker = tmp_path / "store" / f"intermediate_train_data.{idx}" / "_horovod_metadata.json"
    mtime = marker.stat().st_mtime_ns
    assert util.prepare_data(2, store, df, ["label"], ["features"], validation="is_val",
                             sample_weight_col="weight", compress_sparse=True,
                             partitions_per_process=2) == idx
    assert marker.stat().st_mtime_ns == mtime
    # The reported val_loss of each epoch is the reference model's (after that epoch's steps)
    # weighted loss on the ranks' validation batches, averaged as the estimators average it.
    assert len(steps) % 3 == 0, len(steps)
    expected_val = _torch_val_losses(initial, store, idx, steps, 3, "weight", {"features": 64})
    np.testing.assert_allclose(model.getHistory()["val_loss"], expected_val, rtol=1e-5,
                               err_msg="val_loss: not the reference model's loss on the "
                               "validation rows")
    pred = _predictions(model, df.where("is_val = 1"), "label__output").argmax(1)
    labels = df.where("is_val = 1").select("label").toPandas()["label"].to_numpy()
    assert (pred == labels).mean() >= 0.85


class _RaisesOnRank1:
    """A loss that raises on rank 1 at its first call."""

    def __call__(self, out: Any, label: Any) -> Any:
        import torch.nn.functional as F

        import horovod.torch as hvd

        if hvd.rank() == 1:
            raise ValueError("bad batch on rank 1")
        return F.cross_entropy(out, label)


def test_raising_rank_fails_fit(spark: Any, sparse_digits: Any, shared_root: Any) -> None:
    import torch

    from horovod.common.exceptions import WorkerFailedError
    from horovod.spark.common.store import Store
    from horovod.spark.torch import TorchEstimator

    df = sparse_digits  # prepared as the plain fits below prepare it: one write for them all
    store = Store.create(str(shared_root("plain")))
    net = _mlp()
    est = TorchEstimator(num_proc=2, store=store, model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                         loss=_RaisesOnRank1(), feature_cols=["features"], label_cols=["label"],
                         epochs=1, run_id="raising", verbose=0, partitions_per_process=2)
    with pytest.raises(WorkerFailedError, match="bad batch on rank 1") as info:
        est.fit(df)
    assert info.value.rank == 1
    assert not store.exists(store.get_checkpoint_path("raising"))  # no epoch was completed


def test_bad_columns_fail_before_training(spark: Any, sparse_digits: Any, tmp_path: Path) -> None:
    import torch

    from horovod.spark.common.store import Store
    from horovod.spark.common.util import DataPreparationError
    from horovod.spark.torch import TorchEstimator

    df = sparse_digits.limit(200)
    from pyspark.sql import functions as F
    df = df.withColumn("name", F.lit("x"))
    store = Store.create(str(tmp_path / "store"))
    net = _mlp()

    def est(**kw: Any) -> Any:
        base = dict(num_proc=2, store=store, model=net, loss=torch.nn.functional.cross_entropy,
                    optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                    feature_cols=["features"], label_cols=["label"], verbose=0)
        return TorchEstimator(**{**base, **kw})

    jobs_before = len(spark.sparkContext.statusTracker().getJobIdsForGroup())
    with pytest.raises(DataPreparationError, match=r"'featurez' \(feature\) not found.*features"):
        est(feature_cols=["featurez"]).fit(df)
    with pytest.raises(DataPreparationError, match="'name' is string"):
        est(feature_cols=["name"]).fit(df)
    assert len(spark.sparkContext.statusTracker().getJobIdsForGroup()) == jobs_before
    with pytest.raises(DataPreparationError, match=r"'features' has 64 value.*\[-1, 1, 7, 7\]"):
        est(input_shapes=[[-1, 1, 7, 7]]).fit(df)
    with pytest.raises(ValueError, match="num_proc or backend"):
        from horovod.spark.common.backend import SparkBackend
        est(backend=SparkBackend(2)).fit(df)
    with pytest.raises(TypeError, match="unknown parameter"):
        est(epochz=3)


@pytest.fixture(scope="module")
def keras_fit(spark_session: Any, tmp_path_factory: Any) -> dict[str, Any]:
    ex = _example("keras_spark_mnist")
    work = str(tmp_path_factory.mktemp("keras_store"))
    model, acc = ex.train_and_evaluate(spark_session, work, num_proc=2, epochs=3,
                                       run_id="keras-run", partitions_per_process=2)
    return {"ex": ex, "work": work, "model": model, "acc": acc}


def test_keras_example_fits_digits_save_load_resume(spark: Any, keras_fit: dict[str, Any],
                                                     tmp_path: Path) -> None:
    import keras

    from horovod.spark.common.store import Store
    from horovod.spark.keras import KerasEstimator, KerasModel

    assert keras_fit["acc"] >= 0.85, keras_fit["acc"]
    ex, model = keras_fit["ex"], keras_fit["model"]
    assert len(model.getHistory()["val_loss"]) == 3
    _, test_df = ex.digits_dataframes(spark)
    model.save(str(tmp_path / "kmodel"))
    loaded = KerasModel.load(str(tmp_path / "kmodel"))
    np.testing.assert_allclose(_predictions(loaded, test_df, "label_prob"),
                               _predictions(model, test_df, "label_prob"), rtol=1e-5, atol=1e-6)
    # The checkpoint keeps the optimizer's variables: Adam's step count is 3 epochs of steps.
    import pickle

    store = Store.create(keras_fit["work"])
    ckpt = pickle.loads(store.read_bytes(store.get_checkpoint_path("keras-run")))
    steps3 = int(ckpt["optimizer"][0])
    assert ckpt["epoch"] == 2 and steps3 > 0 and steps3 % 3 == 0, (ckpt["epoch"], steps3)
    # Resume by run_id: epochs 3 -> 4 trains one epoch from the checkpoint, with the optimizer's
    # state; a TensorBoard callback writes under the run's logs path in the store (rank 0 only).
    user_logs = tmp_path / "tb-user"
    est = KerasEstimator(num_proc=2, store=store, model=ex.build_model(),
                         optimizer=keras.optimizers.Adam(0.005), loss="categorical_crossentropy",
                         metrics=["accuracy"], feature_cols=["features"], label_cols=["label_vec"],
                         batch_size=32, epochs=4, validation=0.1, random_seed=1,
                         run_id="keras-run", verbose=0, partitions_per_process=2,
                         callbacks=[keras.callbacks.TensorBoard(log_dir=str(user_logs))])
    est.save(str(tmp_path / "kest"))
    est2 = KerasEstimator.load(str(tmp_path / "kest"))
    assert est2.getRunId() == "keras-run" and est2.getLoss() == "categorical_crossentropy"
    from pyspark.ml.feature import OneHotEncoder
    train_df, _ = ex.digits_dataframes(spark)
    train_df = OneHotEncoder(inputCols=["label"], outputCols=["label_vec"],
                             dropLast=False).fit(train_df).transform(train_df)
    resumed = est2.fit(train_df)
    hist = resumed.getHistory()
    assert len(hist["loss"]) == 4
    assert hist["loss"][:3] == pytest.approx(model.getHistory()["loss"])
    ckpt = pickle.loads(store.read_bytes(store.get_checkpoint_path("keras-run")))
    assert int(ckpt["optimizer"][0]) == steps3 // 3 * 4, "the optimizer's step count must continue"
    logs = Path(store.get_logs_path("keras-run"))
    events = sorted(p.relative_to(logs).parts[0] for p in logs.rglob("events.out.tfevents.*"))
    assert "train" in events and "validation" in events, sorted(logs.rglob("*"))
    assert not user_logs.exists(), "TensorBoard must write into the store, not its own log_dir"


def test_lightning_example_fits_digits_save_load(spark: Any, tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="the Lightning estimator needs lightning installed")
    import torch

    from horovod.spark.common.store import Store
    from horovod.spark.lightning import TorchModel

    ex = _example("pytorch_lightning_spark_mnist")
    work = str(tmp_path / "store")
    store = Store.create(work)

    def lightning_checkpoint() -> dict[str, Any]:
        import io

        ckpt = torch.load(io.BytesIO(store.read_bytes(store.get_checkpoint_path("pl-run"))), weights_only=False)
        return torch.load(io.BytesIO(ckpt["lightning"]), weights_only=False)

    # Two epochs, then a resume by run_id to three: Lightning's checkpoint brings back the epoch,
    # the step and Adam's state (its step count continues).
    ex.train_and_evaluate(spark, work, num_proc=2, epochs=2, partitions_per_process=2, run_id="pl-run")
    first = lightning_checkpoint()
    steps = first["global_step"]
    assert first["epoch"] == 1 and steps > 0 and steps % 2 == 0, (first["epoch"], steps)
    assert {int(s["step"]) for s in first["optimizer_states"][0]["state"].values()} == {steps}
    model, acc = ex.train_and_evaluate(spark, work, num_proc=2, epochs=3, partitions_per_process=2,
                                       run_id="pl-run")
    assert acc >= 0.85, acc
    assert len(model.getHistory()["val_loss"]) == 3
    last = lightning_checkpoint()
    assert last["epoch"] == 2 and last["global_step"] == steps // 2 * 3, (last["epoch"], last["global_step"])
    assert {int(s["step"]) for s in last["optimizer_states"][0]["state"].values()} == {steps // 2 * 3}
    model.save(str(tmp_path / "lmodel"))
    loaded = TorchModel.load(str(tmp_path / "lmodel"))
    _, test_df = ex.digits_dataframes(spark)
    np.testing.assert_allclose(_predictions(loaded, test_df, "label_prob"),
                               _predictions(model, test_df, "label_prob"), rtol=1e-5, atol=1e-6)


def _linear_lightning_module(lr: float) -> Any:
    """A softmax regression of the digits as a LightningModule (plain SGD), seeded."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    class LinearDigits(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(64, 10)

        def forward(self, x: Any) -> Any:
            return self.layer(x)

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            return F.cross_entropy(self(batch["features"]), batch["label"].long())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=lr)

    torch.manual_seed(0)
    return LinearDigits()


def _torch_fit_matches_reference(estimator_cls: Any, module: Any, df: Any, root: Path,
                                 **kwargs: Any) -> None:
    """Two epochs of ``module`` (plain SGD at ``_TORCH_LR``, mean cross-entropy) by
    ``estimator_cls`` on two ranks end where plain SGD on the ranks' gradients, averaged at each
    step, ends (``shuffle=False``: the reference replays each rank's batches in the order the
    estimator reads them)."""
    from horovod.spark.common.store import Store

    store = Store.create(str(root))
    initial = copy.deepcopy(module)
    est = estimator_cls(num_proc=2, store=store, model=module, feature_cols=["features"],
                        label_cols=["label"], batch_size=32, epochs=2, shuffle=False, verbose=0,
                        partitions_per_process=2, **kwargs)
    fitted = est.fit(df).getModel().state_dict()
    steps = _fit_steps(store, root, ["features", "label"], epochs=2)
    expected = _torch_reference(initial, steps, "features", "label", lr=_TORCH_LR)
    assert sorted(fitted) == sorted(expected)
    for name, value in fitted.items():
        np.testing.assert_allclose(value.numpy(), expected[name], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name}: not the averaged SGD of the ranks' batches")


def test_torch_estimator_accumulates_backward_passes(spark: Any, sparse_digits: Any,
                                                     shared_root: Any) -> None:
    """``backward_passes_per_step=3`` as upstream's torch estimator runs it: within an epoch,
    every 3 batches form one optimizer step on the sum of their gradients of the loss divided
    by 3, averaged over the ranks; an epoch's 28 batches end with a group of one, stepped at
    the epoch's end (``accumulated_steps``). Two epochs, ``shuffle=False``, plain SGD. With
    ``test_torch_estimator_trains_upstreams_example_shape`` (one pass per step, momentum) it is the
    check that the estimator's own training loop averages the ranks' gradients (the sparse test
    trains through a ``train_minibatch_fn``)."""
    import torch
    import torch.nn.functional as F

    from horovod.spark.common.store import Store
    from horovod.spark.torch import TorchEstimator

    torch.manual_seed(0)
    module = torch.nn.Linear(64, 10)
    initial = copy.deepcopy(module)
    root = shared_root("plain")
    store = Store.create(str(root))
    est = TorchEstimator(num_proc=2, store=store, model=module, loss=F.cross_entropy,
                         optimizer=torch.optim.SGD(module.parameters(), lr=_TORCH_LR),
                         feature_cols=["features"], label_cols=["label"], batch_size=32,
                         epochs=2, shuffle=False, verbose=0, partitions_per_process=2,
                         backward_passes_per_step=3)
    fitted = est.fit(sparse_digits).getModel().state_dict()
    steps = _fit_steps(store, root, ["features", "label"], epochs=2)
    per_epoch = len(steps) // 2
    assert per_epoch % 3 == 1, per_epoch  # the epoch's last group is one batch
    groups = accumulated_steps(steps, 3, per_epoch)
    assert len(groups) == 2 * (per_epoch // 3 + 1)
    expected = _torch_reference(initial, groups, "features", "label", lr=_TORCH_LR, passes=3)
    for name, value in fitted.items():
        np.testing.assert_allclose(value.numpy(), expected[name], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name}: not upstream's accumulation of 3 passes")


def _log_softmax_mlp() -> Any:
    """Upstream's example model's shape on the digits: layers, ReLU, ``log_softmax`` output (no
    dropout, so that the reference replays the same function)."""
    import torch
    import torch.nn.functional as F

    class LogSoftmaxMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(64, 32)
            self.fc2 = torch.nn.Linear(32, 10)

        def forward(self, features: Any) -> Any:
            return F.log_softmax(self.fc2(F.relu(self.fc1(features.float()))), dim=1)

    torch.manual_seed(0)
    return LogSoftmaxMLP()


def test_torch_estimator_trains_upstreams_example_shape(spark: Any, sparse_digits: Any,
                                                        tmp_path: Path) -> None:
    """Upstream's ``examples/spark/pytorch/pytorch_spark_mnist.py`` as its user writes it: the loss a
    ``lambda`` over an ``nn.NLLLoss()`` of the model's ``log_softmax`` (labels a double column,
    cast with ``.long()`` in the lambda), ``SGD(lr=0.01, momentum=0.5)``, a validation split. Three
    epochs on two ranks end where SGD with that momentum on the ranks' gradients, averaged at each
    step, ends (``shuffle=False``), and the model learns: the training loss falls every epoch (at
    this learning rate slowly: 2.31, 2.29, 2.26 on the digits; the validation batches differ from
    epoch to epoch, so their loss is not monotone)."""
    import torch
    from pyspark.sql.functions import col

    from horovod.spark.common.store import Store
    from horovod.spark.torch import TorchEstimator

    module = _log_softmax_mlp()
    initial = copy.deepcopy(module)
    nll = torch.nn.NLLLoss()
    store = Store.create(str(tmp_path / "store"))
    est = TorchEstimator(num_proc=2, store=store, model=module,
                         optimizer=torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.5),
                         loss=lambda input, target: nll(input, target.long()),
                         feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=3,
                         validation="is_val", shuffle=False, verbose=0, partitions_per_process=2)
    fitted_model = est.fit(sparse_digits.withColumn("label", col("label").cast("double")))
    fitted = fitted_model.getModel().state_dict()
    steps = _fit_steps(store, tmp_path / "store", ["features", "label"], epochs=3)
    expected = _torch_reference(initial, steps, "features", "label", lr=0.01, momentum=0.5,
                                loss=lambda out, y: torch.nn.functional.nll_loss(out, y))
    for name, value in fitted.items():
        np.testing.assert_allclose(value.numpy(), expected[name], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name}: not SGD(momentum=0.5) on the ranks' averaged gradients")
    history = fitted_model.getHistory()
    assert history["loss"][0] > history["loss"][1] > history["loss"][2], history
    assert len(history["val_loss"]) == 3, history


def test_lightning_estimator_averages_the_ranks_gradients(spark: Any, sparse_digits: Any,
                                                          shared_root: Any) -> None:
    pytest.importorskip("lightning", reason="the Lightning estimator needs lightning installed")
    from horovod.spark.lightning import TorchEstimator

    _torch_fit_matches_reference(TorchEstimator, _linear_lightning_module(_TORCH_LR), sparse_digits,
                                 shared_root("plain"))


def _keras_fit_matches_reference(k: Any, df: Any, root: Path) -> Any:
    """Fit a small model of Keras module ``k`` (``keras`` or ``tf_keras``) with plain SGD and
    sample weights for 3 epochs; check its weights against the reference; return the fit."""
    from horovod.spark.common import util
    from horovod.spark.common.store import Store
    from horovod.spark.keras import KerasEstimator

    model = k.Sequential([k.Input((64,)), k.layers.Dense(32, activation="relu"),
                          k.layers.Dense(10, activation="softmax")])
    store = Store.create(str(root))
    # Plain SGD (Adam would hide gradients summed instead of averaged) and shuffle=False: the
    # reference below replays each rank's batches in the order the estimator reads them.
    est = KerasEstimator(num_proc=2, store=store, model=model, optimizer=k.optimizers.SGD(_KERAS_LR),
                         loss="sparse_categorical_crossentropy", feature_cols=["features"],
                         label_cols=["label"], sample_weight_col="weight", batch_size=32,
                         epochs=3, verbose=0, partitions_per_process=2, shuffle=False,
                         validation="is_val")
    trained = est.fit(df)
    loss = trained.getHistory()["loss"]
    assert len(loss) == 3 and loss[-1] < loss[0] / 2
    # The trained weights are those of plain SGD on the ranks' gradients averaged each step,
    # from the model's weights (which fit leaves as they were), on each rank's share of rows,
    # each row's loss weighted by its "weight" (Keras: the mean of the weighted losses).
    cols = ["features", "label", "weight"]
    steps = [[(b["features"].astype(np.float32), b["label"], b["weight"].astype(np.float32))
              for b in step] for step in _fit_steps(store, root, cols, epochs=3)]
    per_epoch = len(steps) // 3
    after = [keras_averaged_weights(k, model, _KERAS_LR, "sparse_categorical_crossentropy",
                                    steps[:per_epoch * e]) for e in (1, 3)]
    got = trained.getModel().get_weights()
    assert len(got) == len(after[-1])
    for i, (g, e) in enumerate(zip(got, after[-1])):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6,
                                   err_msg=f"weight {i}: not the averaged SGD of the ranks' batches")
    # The first epoch's val_loss is the loss of the reference model after that epoch on each
    # rank's first validation batches, each row's loss weighted by its "weight" as in training
    # (upstream's validation data carries the weights), averaged over the ranks. Later epochs
    # are not checked: which validation batches Keras draws from the generator after the first
    # epoch is Keras's own (Keras 3 replays the batches it peeked at).
    (idx,) = [p.name.split(".", 1)[1] for p in root.iterdir()
              if p.name.startswith("intermediate_train_data.")]
    val_steps = -(-util.get_dataset_properties(store, idx)[1] // (32 * 2))
    val = [[(b["features"].astype(np.float32), b["label"], b["weight"].astype(np.float32))
            for b in rank_batches(rank_rows(store, store.get_val_data_path(idx), r, 2, cols,
                                            {"features": 64}), 32, val_steps)] for r in (0, 1)]
    np.testing.assert_allclose(
        trained.getHistory()["val_loss"][0],
        keras_loss(k, model, after[0], "sparse_categorical_crossentropy", val), rtol=1e-5,
        err_msg="val_loss: not the reference model's weighted loss on the validation rows")
    return trained


def test_keras_estimator_trains_a_tf_keras_model(spark: Any, sparse_digits: Any, shared_root: Any,
                                                  tmp_path: Path) -> None:
    """A Keras 2 (tf_keras) model: the ranks train it with TF_USE_LEGACY_KERAS=1."""
    tf_keras = pytest.importorskip("tf_keras")
    from horovod.spark.keras import KerasModel

    trained = _keras_fit_matches_reference(tf_keras, sparse_digits, shared_root("keras"))
    assert type(trained.getModel()).__module__.startswith("tf_keras")
    trained.save(str(tmp_path / "m"))
    assert type(KerasModel.load(str(tmp_path / "m")).getModel()).__module__.startswith("tf_keras")


def test_keras_estimator_averages_the_ranks_gradients(spark: Any, sparse_digits: Any,
                                                       shared_root: Any) -> None:
    """A Keras 3 model (the example's fit uses Adam, which the reference cannot check)."""
    keras = pytest.importorskip("keras")
    trained = _keras_fit_matches_reference(keras, sparse_digits, shared_root("keras"))
    assert not type(trained.getModel()).__module__.startswith("tf_keras")
