"""What each rank of a Spark estimator trains on, rebuilt in the test process from the prepared
Parquet, and a Keras reference of averaged training (``tests/_averaging.py`` has the torch one).

The estimators' split, as their reader documents it: the row groups of the prepared data's
Parquet files (files in sorted order, row groups in file order), every ``size``-th of them to a
rank starting at its rank (a rank left without one reads the ``rank % count``-th); with
``shuffle=False`` a rank reads its rows in that order, pass after pass, and cuts batches across
row-group and pass ends. ``rank_rows`` reads that share with
pyarrow alone (not the estimators' reader), ``rank_batches`` cuts the batches of the first steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["rank_rows", "rank_batches", "step_batches", "accumulated_steps", "keras_averaged_weights",
           "keras_loss"]

_SPARSE = ("__sparse_indices", "__sparse_values")


def _column(table: Any, name: str, width: int | None) -> np.ndarray:
    names = table.column_names
    if name + _SPARSE[0] in names:  # compress_sparse_cols: (indices, values) per row
        assert width is not None, f"the width of sparse column {name!r} is needed"
        out = np.zeros((table.num_rows, width))
        idx = table.column(name + _SPARSE[0]).to_pylist()
        val = table.column(name + _SPARSE[1]).to_pylist()
        for row, (i, v) in enumerate(zip(idx, val)):
            out[row, i] = v
        return out
    values = table.column(name).to_pylist()
    return np.array(values)


def rank_rows(store: Any, path: str, rank: int, size: int, columns: Sequence[str],
              widths: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Rank ``rank``'s rows of the prepared data at ``path`` (``{column: array}``), in the order
    it reads them without shuffling; ``widths`` gives the width of each sparse vector column."""
    import pyarrow.parquet as pq

    groups = []
    for f in sorted(store.list_parquet_files(path)):
        with store.fs.open_input_file(f) as fh:
            pf = pq.ParquetFile(fh)
            groups += [pf.read_row_group(i) for i in range(pf.num_row_groups)]
    mine = groups[rank::size] or [groups[rank % len(groups)]]
    return {c: np.concatenate([_column(t, c, (widths or {}).get(c)) for t in mine])
            for c in columns}


def rank_batches(rows: dict[str, np.ndarray], batch_size: int, steps: int) -> list[dict[str, np.ndarray]]:
    """The first ``steps`` batches of the endless unshuffled stream of ``rows``."""
    n = len(next(iter(rows.values())))
    order = np.arange(steps * batch_size) % n
    return [{c: v[order[s * batch_size:(s + 1) * batch_size]] for c, v in rows.items()}
            for s in range(steps)]


def step_batches(store: Any, path: str, size: int, columns: Sequence[str], batch_size: int,
                 steps: int, widths: dict[str, int] | None = None) -> list[list[dict[str, np.ndarray]]]:
    """For each of the first ``steps`` steps, the ranks' batches in rank order (what
    ``averaged_steps`` and ``keras_averaged_weights`` take)."""
    per_rank = [rank_batches(rank_rows(store, path, r, size, columns, widths), batch_size, steps)
                for r in range(size)]
    return [list(step) for step in zip(*per_rank)]


def accumulated_steps(steps: Sequence[Sequence[Any]], passes: int,
                      per_epoch: int) -> list[list[list[Any]]]:
    """Upstream's torch estimator's optimizer steps with ``backward_passes_per_step=passes``:
    within each epoch of ``per_epoch`` batches, every ``passes`` consecutive batches form one
    step, and the epoch's last group (shorter when ``passes`` does not divide ``per_epoch``) is
    stepped at the epoch's end. Each entry holds, in rank order, a rank's batches of that step
    (its gradient is the sum of the batches' gradients of the loss divided by ``passes``)."""
    out = []
    for start in range(0, len(steps), per_epoch):
        epoch = steps[start:start + per_epoch]
        for g in range(0, len(epoch), passes):
            group = epoch[g:g + passes]
            out.append([[step[r] for step in group] for r in range(len(group[0]))])
    return out


def keras_averaged_weights(keras: Any, model: Any, lr: float, loss: Any,
                           steps: Sequence[Sequence[tuple[Any, ...]]]) -> list[np.ndarray]:
    """The weights of a clone of ``model`` (with its current weights) after plain SGD steps on
    the ranks' gradients of the mean ``loss`` (a Keras loss name), averaged in rank order. A
    batch is ``(x, y)`` or ``(x, y, sample_weight)``: the loss is then the mean of the rows'
    losses times their weights, as Keras weighs them."""
    import tensorflow as tf

    ref = keras.models.clone_model(model)
    ref.set_weights(model.get_weights())
    loss_fn = keras.losses.get(loss)
    opt = keras.optimizers.SGD(lr)
    variables = ref.trainable_variables
    for batches in steps:
        total = [tf.zeros_like(v) for v in variables]
        for x, y, *w in batches:
            with tf.GradientTape() as tape:
                per_row = loss_fn(y, ref(x, training=True))
                value = tf.reduce_mean(per_row * w[0] if w else per_row)
            total = [t + g for t, g in zip(total, tape.gradient(value, variables))]
        opt.apply_gradients(zip([t / len(batches) for t in total], variables))
    return [np.asarray(w) for w in ref.get_weights()]


def keras_loss(keras: Any, model: Any, weights: Sequence[np.ndarray], loss: Any,
               ranks: Sequence[Sequence[tuple[Any, ...]]]) -> float:
    """The loss ``model`` with ``weights`` reports on validation: each rank's mean over its
    batches (``(x, y, sample_weight)``, equal sizes) of the batch's mean weighted ``loss``, then
    the mean over the ranks (``MetricAverageCallback``)."""
    ref = keras.models.clone_model(model)
    ref.set_weights(list(weights))
    loss_fn = keras.losses.get(loss)
    per_rank = [np.mean([float(np.mean(np.asarray(loss_fn(y, ref(x, training=False))) * w))
                         for x, y, w in batches]) for batches in ranks]
    return float(np.mean(per_rank))
