"""What every rank of a ``TorchEstimator.fit`` runs (shipped to the Spark tasks)."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import io
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

# upstream's module constants, imported from here by user code
from horovod.spark.common.constants import (  # noqa: F401
    BYTES_PER_GIB,
    CUSTOM_SPARSE,
    METRIC_PRINT_FREQUENCY,
    PETASTORM_HDFS_DRIVER,
    TOTAL_BUFFER_MEMORY_CAP_GIB,
)
from horovod.spark.common.training import TrainingSpec

__all__ = ["make_train_fn", "load_checkpoint", "save_checkpoint", "trained_result"]


def load_checkpoint(spec: TrainingSpec) -> dict[str, Any] | None:
    """The run's last completed epoch (written atomically by rank 0), or None."""
    import torch

    store, path = spec["store"], spec["checkpoint_path"]
    if not store.exists(path):
        return None
    return dict(torch.load(io.BytesIO(store.read_bytes(path)), weights_only=False))


def save_checkpoint(spec: TrainingSpec, state: dict[str, Any]) -> None:
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    store = spec["store"]
    store.write_bytes(spec["checkpoint_path"], buf.getvalue())
    store.write_json(store.join(store.get_logs_path(spec["run_id"]), "history.json"),
                     state["history"])


def trained_result(model: Any, history: dict[str, list[float]]) -> dict[str, Any]:
    """What rank 0's training returns to the driver: the weights (on the CPU, as the bytes
    ``torch.save`` writes) and the per-epoch history."""
    import torch

    buf = io.BytesIO()
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, buf)
    return {"state": buf.getvalue(), "history": history}


def _losses(spec: TrainingSpec) -> list[Callable[..., Any]]:
    if spec["loss_constructors"]:
        return [c() for c in spec["loss_constructors"]]
    loss = spec["loss"]
    return list(loss) if isinstance(loss, (list, tuple)) else [loss]


def _tensors(batch: dict[str, np.ndarray], spec: TrainingSpec, device: Any) -> tuple[Any, Any, Any]:
    import torch

    from horovod.spark.torch.util import _to_tensor

    shapes = spec["input_shapes"]
    inputs = [_to_tensor(batch[c], shapes[i] if shapes else None).to(device)
              for i, c in enumerate(spec["feature_cols"])]
    labels = []
    for c in spec["label_cols"]:
        t = torch.from_numpy(np.ascontiguousarray(batch[c]))
        if t.dtype == torch.float64 or t.dtype == torch.bool:
            t = t.float()
        elif t.dtype in (torch.int32, torch.int16, torch.int8):
            t = t.long()
        labels.append(t.to(device))
    weights = None
    if spec["sample_weight_col"]:
        weights = torch.from_numpy(np.ascontiguousarray(batch[spec["sample_weight_col"]])).float()
        weights = weights.to(device)
    return inputs, labels, weights


def _row_loss_of(fn: Any) -> Callable[[Any, Any], Any]:
    """How ``fn`` gives the loss of every row, for sample weights: a ``torch.nn`` loss module runs
    as a copy with ``reduction='none'``; a function that takes ``reduction`` is called with
    ``reduction='none'`` (upstream's call: ``torch.nn.functional``'s losses); any other function
    must return the rows' losses itself. Worked out once per loss (``_ROW_LOSSES``), not per batch."""
    try:
        made = _ROW_LOSSES.get(fn)
    except TypeError:  # not weakly referenceable: worked out each time
        made = None
    if made is not None:
        return made
    if isinstance(getattr(fn, "reduction", None), str):
        module = copy.copy(fn)
        module.reduction = "none"
        made = module
    else:
        try:
            params = inspect.signature(fn).parameters.values()
            takes_reduction = any(p.name == "reduction" or p.kind is p.VAR_KEYWORD for p in params)
        except (TypeError, ValueError):  # a builtin without a signature
            takes_reduction = False
        made = functools.partial(fn, reduction="none") if takes_reduction else fn
    with contextlib.suppress(TypeError):
        _ROW_LOSSES[fn] = made
    return made


# loss -> its rows' loss (``_row_loss_of``); weak keys, so a loss module the caller drops is not
# kept (a function stays: its ``partial`` refers to it)
_ROW_LOSSES: weakref.WeakKeyDictionary[Any, Callable[[Any, Any], Any]] = weakref.WeakKeyDictionary()


def _loss(loss_fns: list[Any], weights: list[float] | None, outputs: list[Any], labels: list[Any],
          sample_weights: Any) -> Any:
    """The weighted sum of the label columns' losses. With sample weights, a column's loss is
    upstream's: the mean over the batch of each row's loss times the row's weight."""
    total = 0
    for i, (fn, out, lab) in enumerate(zip(loss_fns, outputs, labels)):
        if out.dim() == lab.dim() + 1 and out.shape[-1] == 1 and lab.is_floating_point():
            out = out.squeeze(-1)
        if sample_weights is None:
            value = fn(out, lab)
        else:
            rows, n = _row_loss_of(fn)(out, lab), sample_weights.shape[0]
            if rows.dim() == 0 or rows.shape[0] != n:
                name = getattr(fn, "__name__", type(fn).__name__)
                raise ValueError(
                    f"sample_weight_col: the loss {name} of label column {i} gave a value of shape "
                    f"{tuple(rows.shape)} for a batch of {n} rows, but sample weights need one loss "
                    "per row: give a loss that takes reduction='none' (torch.nn.functional's "
                    "losses, torch.nn's loss modules) or returns the rows' losses.")
            if rows.dim() > 1:
                rows = rows.reshape(n, -1).mean(1)
            value = (rows * sample_weights).mean()
        total = total + (weights[i] if weights else 1.0) * value
    return total


def _transform_outputs(outputs: Any, labels: list[Any]) -> tuple[list[Any], list[Any]]:
    """What a ``train_minibatch_fn`` gets as ``transform_outputs`` (upstream's signature): the
    model's output as a list, and the labels (the loss matches their shapes)."""
    return (list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]), labels


def make_train_fn(spec: TrainingSpec) -> Callable[[], Any]:
    def train() -> dict[str, Any] | None:
        import torch

        import horovod.torch as hvd
        from horovod.spark.common.training import data_module_for
        from horovod.spark.torch.util import _module_from_bytes

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        torch.set_num_threads(1)
        if spec["random_seed"] is not None:
            torch.manual_seed(spec["random_seed"])
        use_cuda = spec["use_gpu"] and torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda" if use_cuda else "cpu")
        model = _module_from_bytes(spec["model_bytes"]).to(device)
        opt = spec["optimizer_cls"](model.parameters(), **spec["optimizer_defaults"])
        history: dict[str, list[float]] = {}
        start = 0
        ckpt = load_checkpoint(spec)
        if ckpt is not None:
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            history, start = ckpt["history"], ckpt["epoch"] + 1
            if rank == 0 and spec["verbose"]:
                print(f"resuming run {spec['run_id']} after epoch {ckpt['epoch']}", flush=True)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        compression = spec["gradient_compression"] or hvd.Compression.none
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression,
                                       backward_passes_per_step=spec["backward_passes_per_step"])
        loss_fns, metrics = _losses(spec), list(spec["metrics"] or [])
        minibatch = spec["train_minibatch_fn"]() if spec["train_minibatch_fn"] else None

        def loss_fn(outputs: list[Any], labels: list[Any], sample_weights: Any) -> Any:
            """``train_minibatch``'s loss (upstream's signature): the estimator's weighted losses."""
            return _loss(loss_fns, spec["loss_weights"], outputs, labels, sample_weights)

        passes = spec["backward_passes_per_step"]

        def run_epoch(reader: Any, steps: int, train: bool) -> dict[str, float]:
            """One epoch. Training without a ``train_minibatch_fn`` steps as upstream: every
            ``passes`` batches form one optimizer step (the gradients of the loss divided by
            ``passes``, summed over the batches, then averaged over the ranks), and the epoch's
            last, possibly shorter, group is stepped at its end."""
            model.train(train)
            sums = np.zeros(1 + len(metrics))
            for i in range(steps):
                inputs, labels, sw = _tensors(next(reader), spec, device)
                with torch.set_grad_enabled(train):
                    if train and minibatch is not None:
                        # upstream's train_minibatch(model, optimizer, transform_outputs,
                        # loss_fn, inputs, labels, sample_weights) -> (outputs, loss)
                        outputs, loss = minibatch(model, opt, _transform_outputs, loss_fn, inputs,
                                                  labels, sw)
                    else:
                        if train and i % passes == 0:
                            if i:
                                opt.step()
                            opt.zero_grad()
                        out = model(*inputs)
                        outputs = list(out) if isinstance(out, (list, tuple)) else [out]
                        loss = loss_fn(outputs, labels, sw)
                        if train:
                            (loss / passes if passes > 1 else loss).backward()
                sums[0] += float(loss.detach())
                for j, m in enumerate(metrics):
                    sums[1 + j] += float(m(outputs[0], labels[0]))
            if train and minibatch is None and steps:
                opt.step()
            avg = hvd.allreduce(torch.tensor(sums / max(steps, 1)), name=f"metrics.{train}")
            names = ["loss"] + [getattr(m, "__name__", f"metric{j}") for j, m in enumerate(metrics)]
            return {n: float(v) for n, v in zip(names, avg.tolist())}

        with data_module_for(spec, rank, size) as dm:
            train_reader = iter(dm.train_data())
            val_reader = iter(dm.val_data()) if spec["val_path"] else None
            for epoch in range(start, spec["epochs"]):
                logs = run_epoch(train_reader, spec["train_steps"], True)
                if val_reader is not None:
                    logs.update({f"val_{k}": v for k, v in
                                 run_epoch(val_reader, spec["val_steps"], False).items()})
                for k, v in logs.items():
                    history.setdefault(k, []).append(v)
                for cb in spec["callbacks"] or []:
                    cb(epoch, logs) if callable(cb) else None
                if rank == 0:
                    if spec["verbose"]:
                        print(f"epoch {epoch}: " + " ".join(f"{k}={v:.4f}" for k, v in logs.items()),
                              flush=True)
                    save_checkpoint(spec, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                           "epoch": epoch, "history": history})
        return trained_result(model, history) if rank == 0 else None
    return train
