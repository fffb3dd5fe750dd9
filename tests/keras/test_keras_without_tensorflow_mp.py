"""``horovod.keras`` on Keras 3's torch and JAX backends in ranks where TensorFlow cannot be imported.

In each rank (nothing had imported TensorFlow yet, checked) ``tensorflow`` is made unimportable, as if
not installed (``sys.modules["tensorflow"] = None``, before Keras or ``horovod.keras`` is imported), or
left installed, and the rank trains a small model with
``hvd.DistributedOptimizer`` and the callbacks, and checks on every rank: the weights are equal across
ranks (ranks start from different weights and train on different data); the epoch's loss is the
average of the ranks' own losses (``MetricAverageCallback``); the learning rates set by
``LearningRateWarmupCallback`` and ``LearningRateScheduleCallback``; the value helpers (with
``Compression.fp16`` too) and elastic ``KerasState.sync``; that no ``tensorflow`` module was loaded
(installed: ``"tensorflow" not in sys.modules``); then ``load_model`` (Keras's own ``save``
imports TensorFlow where it is installed, so it comes after that check). On the code before these modules
could run without TensorFlow, ``import horovod.keras`` raised ``ImportError`` (``tensorflow``) where it
was not importable, and imported it where it was.

Launches of their own at np=2 and np=3 on torch (the shared torch launches run bodies that use
TensorFlow); JAX at np=2 (its start-up costs more) as the last body of the JAX launch at np=2,
after tests/jax/test_jax_mp.py's MNIST example (no TensorFlow there: the body checks it).
"""

from __future__ import annotations

import pytest

from horovod.testing import run_ranks
from tests._shared_launch import JOINT_TIMEOUT, in_turn, joint_launch

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _train_without_tensorflow(backend: str, importable: bool) -> list[str]:
    import os
    import sys

    if "tensorflow" in sys.modules:
        return ["tensorflow was imported before the body started"]
    if not importable:
        # as if it were not installed: ``import tensorflow`` raises ModuleNotFoundError and
        # importlib.util.find_spec("tensorflow") is None (what libraries probing for it see)
        sys.modules["tensorflow"] = None  # type: ignore[assignment]
    os.environ["KERAS_BACKEND"] = backend
    import tempfile

    import keras
    import numpy as np

    import horovod.keras as hvd
    import horovod.numpy as hnp

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad: list[str] = []
    if keras.backend.backend() != backend:
        return [f"Keras runs on {keras.backend.backend()}, not {backend}"]

    def same_everywhere(value: list[np.ndarray]) -> bool:
        every = hnp.allgather_object(value)
        return all(all(np.array_equal(a, b) for a, b in zip(e, every[0])) for e in every)

    rng = np.random.default_rng(r)  # each rank its own data
    x = rng.normal(size=(24, 5)).astype("float32")
    y = rng.normal(size=(24, 2)).astype("float32")
    # and its own initial weights (not keras.utils.set_random_seed: it imports TensorFlow where installed)
    def own_weights(m: keras.Model) -> None:
        m.set_weights([rng.normal(size=w.shape).astype(w.dtype) for w in m.get_weights()])

    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])
    own_weights(model)
    lr = 0.05
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.5), compression=hvd.Compression.none)
    model.compile(optimizer=opt, loss="mse")

    local: list[float] = []

    class _Local(keras.callbacks.Callback):
        """Records the rank's own epoch loss (runs before MetricAverageCallback)."""

        def on_epoch_end(self, epoch, logs=None):  # noqa: ANN001, ANN202
            local.append(float(logs["loss"]))

    hist = model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0), _Local(), hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=1),
        hvd.callbacks.LearningRateScheduleCallback(lr, multiplier=0.5, start_epoch=1)])

    if not same_everywhere([np.asarray(w) for w in model.get_weights()]):
        bad.append(f"rank {r}: weights differ between ranks after fit")
    everyone = np.array(hnp.allgather_object(local))  # ranks x epochs
    if np.ptp(everyone[:, 0]) < 1e-4:
        bad.append(f"rank {r}: the ranks' own losses do not differ ({everyone[:, 0]}): the check would pass anyway")
    if not np.allclose(hist.history["loss"], everyone.mean(axis=0), rtol=1e-5, atol=1e-6):
        bad.append(f"rank {r}: MetricAverageCallback gave {hist.history['loss']}, not the ranks' average "
                   f"{everyone.mean(axis=0).tolist()}")
    if not np.allclose(hist.history["lr"][1:], [lr, lr * 0.5], rtol=1e-5):
        bad.append(f"rank {r}: learning rates {hist.history['lr']}, expected [.., {lr}, {lr * 0.5}]")

    # value helpers
    if not np.allclose(hvd.allreduce(np.full(3, float(r)), op=hvd.Sum), sum(range(n))):
        bad.append(f"rank {r}: allreduce helper")
    if not np.allclose(hvd.allreduce(np.full(3, float(r)), compression=hvd.Compression.fp16), (n - 1) / 2):
        bad.append(f"rank {r}: allreduce helper with Compression.fp16")
    if not np.allclose(hvd.allgather(np.full((1, 2), float(r))), np.repeat(np.arange(n), 2).reshape(n, 2)):
        bad.append(f"rank {r}: allgather helper")
    if not np.allclose(hvd.broadcast(np.full(2, float(r)), 0), 0.0):
        bad.append(f"rank {r}: broadcast helper")

    # elastic state: sync takes rank 0's values
    other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    own_weights(other)
    other.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvd.Compression.fp16),
                  loss="mse")
    other.fit(x[:4], y[:4], batch_size=4, epochs=1, verbose=0)
    state = hvd.elastic.KerasState(other, epoch=r)
    state.sync()
    if state.epoch != 0 or not same_everywhere([np.asarray(w) for w in other.get_weights()]):
        bad.append(f"rank {r}: KerasState.sync did not take rank 0's state")

    # checked before saving: Keras's own saving imports TensorFlow where it is installed
    loaded_tf = sorted(k for k in sys.modules if k.split(".")[0] == "tensorflow" and sys.modules[k] is not None)
    if loaded_tf or (importable and "tensorflow" in sys.modules):
        bad.append(f"rank {r}: tensorflow was imported: {loaded_tf[:5]}")

    # load_model: the optimizer comes back distributed
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        loaded = hvd.load_model(path)
        if not getattr(type(loaded.optimizer), "_hvd_distributed", False):
            bad.append(f"rank {r}: load_model's optimizer {type(loaded.optimizer)} is not distributed")

    return bad


# Late: TensorFlow stays unimportable in these ranks afterwards (in_turn: from a fresh hvd.init()).
_JAX_NP2 = joint_launch("jax", 2, {"without_tf": in_turn(_train_without_tensorflow, [("jax", False)])},
                        timeout=300, env={"JAX_PLATFORMS": "cpu"}, late=True)


@pytest.mark.parametrize(("backend", "np", "importable"), [("torch", 2, False), ("torch", 3, True),
                                                           ("jax", 2, False)])
def test_horovod_keras_trains_without_tensorflow(backend: str, np: int, importable: bool) -> None:
    """``importable``: TensorFlow stays installed (it must not be imported); else the ranks cannot import it."""
    if backend == "jax":
        results = [runs[0] for runs in _JAX_NP2.results("without_tf")]
    else:
        results = run_ranks(_train_without_tensorflow, np=np, timeout=300, args=(backend, importable))
    problems = [p for rank_bad in results for p in rank_bad]
    assert not problems, "\n".join(problems)
