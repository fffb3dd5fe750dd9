"""horovod.keras with Keras 3 on the TensorFlow, PyTorch and JAX backends, on real ranks.

For each backend (KERAS_BACKEND is fixed per process) a body at np=3, in the launch that the
backend's own modules share (tests/_shared_launch.py), checks:
``fit`` with ``hvd.DistributedOptimizer`` (SGD, mean loss) gives the same weights on every rank and
the same weights as one process trained on the whole batch, compiled (jit) and eager
(``run_eagerly=True``), with ``backward_passes_per_step=2``; ``BroadcastGlobalVariablesCallback``
makes differently initialised ranks equal; ``MetricAverageCallback``; elastic ``KerasState``
(sync, commit, restore); the value helpers; a model that differs between ranks raises on every
rank (compiled step included), never hangs.

One world size per backend: the body costs more than the JAX launch's own checks (at load 25,
75-130 s at np=2 and 110-370 s at np=3, the seed recipe included), and np=2 adds nothing that
np=3 does not check here (Keras 3 on TensorFlow also trains at np=2 in tests/tensorflow/
test_tf_training_mp.py, "keras3-fit").
"""

from __future__ import annotations

import os

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _seed_recipe(tmp: str) -> str:
    """Run examples/keras/keras_mnist.py (the seed Keras recipe, today's spellings) in this rank;
    return its weights digest."""
    import contextlib
    import io
    import os
    import re
    import runpy
    import sys

    root = os.environ["HVD_REPO"]
    argv, out = sys.argv, io.StringIO()
    sys.argv = ["keras_mnist.py", "--epochs", "1", "--steps-per-epoch", "30", "--checkpoint-dir",
                os.path.join(tmp, "ck{rank}")]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(os.path.join(root, "examples", "keras", "keras_mnist.py"), run_name="__main__")
    finally:
        sys.argv = argv
    found = re.search(r"RESULT rank=\d+ accuracy=[\d.]+ weights=(\w+)", out.getvalue())
    return found.group(1) if found else "no RESULT line: " + out.getvalue()[-500:]


def _keras_checks(recipe_dir=None):
    import numpy as np

    import horovod.keras as hvd

    hvd.init()
    import keras

    r, n = hvd.rank(), hvd.size()
    backend = keras.backend.backend()
    bad: list[str] = []
    B, steps = 4, 3
    rng = np.random.default_rng(0)
    x_all = rng.normal(size=(n, steps * B, 5)).astype("float32")
    y_all = rng.normal(size=(n, steps * B, 2)).astype("float32")

    def make(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, activation="tanh"),
                                 keras.layers.Dense(2)])

    def weights(m):
        return [np.asarray(w) for w in m.get_weights()]

    # one process, whole batch: global batch k = every rank's batch k
    ref = make(1)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    xg = np.concatenate([x_all[:, k * B:(k + 1) * B].reshape(n * B, 5) for k in range(steps)])
    yg = np.concatenate([y_all[:, k * B:(k + 1) * B].reshape(n * B, 2) for k in range(steps)])
    ref.fit(xg, yg, batch_size=n * B, epochs=1, shuffle=False, verbose=0)
    want = weights(ref)
    ref2 = make(1)  # backward_passes_per_step=2: one update per two local batches
    ref2.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref2.fit(np.concatenate([xg[: 2 * n * B]]), np.concatenate([yg[: 2 * n * B]]), batch_size=2 * n * B,
             epochs=1, shuffle=False, verbose=0)

    for label, kwargs, bpps, expect in [("jit", {}, 1, want), ("eager", {"run_eagerly": True}, 1, want),
                                        ("bpps=2", {}, 2, weights(ref2))]:
        model = make(1)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=bpps,
                                       average_aggregated_gradients=True)
        model.compile(optimizer=opt, loss="mse", **kwargs)
        nb = steps if bpps == 1 else 2
        hist = model.fit(x_all[r][: nb * B], y_all[r][: nb * B], batch_size=B, epochs=1, shuffle=False, verbose=0,
                         callbacks=[hvd.callbacks.MetricAverageCallback()])
        got = weights(model)
        every = hvd.allgather_object(got) if hasattr(hvd, "allgather_object") else None
        if every is None:
            import horovod.numpy as hnp

            every = hnp.allgather_object(got)
        if not all(all(np.array_equal(a, b) for a, b in zip(e, every[0])) for e in every):
            bad.append(f"{backend} rank {r}: {label}: weights differ between ranks")
        if not all(np.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in zip(got, expect)):
            bad.append(f"{backend} rank {r}: {label}: weights {got} != one process on the whole batch {expect}")
        import horovod.numpy as hnp

        losses = hnp.allgather_object(float(hist.history["loss"][-1]))
        if max(losses) - min(losses) > 1e-6:
            bad.append(f"{backend} rank {r}: {label}: MetricAverageCallback left {losses}")

    # broadcast of differently initialised ranks
    model = make(100 + r)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(x_all[r], y_all[r], batch_size=B, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    import horovod.numpy as hnp

    every = hnp.allgather_object(weights(model))
    if not all(all(np.array_equal(a, b) for a, b in zip(e, every[0])) for e in every):
        bad.append(f"{backend} rank {r}: BroadcastGlobalVariablesCallback left different weights")
    # elastic KerasState: sync takes rank 0's weights and values, restore goes back to the commit
    model = make(200 + r)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    model.fit(x_all[r][:B], y_all[r][:B], batch_size=B, epochs=1, verbose=0)
    state = hvd.elastic.KerasState(model, epoch=r, batch=0)
    state.sync()
    synced = weights(model)
    every = hnp.allgather_object(synced)
    if state.epoch != 0 or not all(all(np.array_equal(a, b) for a, b in zip(e, every[0])) for e in every):
        bad.append(f"{backend} rank {r}: KerasState.sync did not take rank 0's state (epoch {state.epoch})")
    state.commit()
    model.fit(x_all[r][:B], y_all[r][:B], batch_size=B, epochs=1, verbose=0)
    state.epoch = 9
    state.restore()
    if state.epoch != 0 or not all(np.array_equal(a, b) for a, b in zip(weights(model), synced)):
        bad.append(f"{backend} rank {r}: KerasState.restore did not return to the commit")
    # value helpers
    if not np.allclose(hvd.allreduce(np.full(3, float(r)), op=hvd.Sum), sum(range(n))):
        bad.append(f"{backend} rank {r}: allreduce helper")
    if not np.allclose(hvd.allgather(np.full((1, 2), float(r))), np.repeat(np.arange(n), 2).reshape(n, 2)):
        bad.append(f"{backend} rank {r}: allgather helper")
    if not np.allclose(hvd.broadcast(np.full(2, float(r)), 0), 0.0):
        bad.append(f"{backend} rank {r}: broadcast helper")
    # a rank-dependent model (other gradient shapes on rank 0), compiled: raises on every rank
    keras.utils.set_random_seed(0)
    odd = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3 + (r == 0)), keras.layers.Dense(2)])
    odd.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    try:
        odd.fit(x_all[r][:B], y_all[r][:B], batch_size=B, epochs=1, verbose=0)
        bad.append(f"{backend} rank {r}: a rank-dependent model trained without an error")
    except Exception as exc:  # noqa: BLE001 - each backend wraps Horovod's error in its own type
        if "shape" not in str(exc).lower():
            bad.append(f"{backend} rank {r}: rank-dependent model raised {type(exc).__name__}: {str(exc)[-300:]}")
    if recipe_dir is not None:
        digests = hnp.allgather_object(_seed_recipe(recipe_dir))
        if len(set(digests)) != 1 or any(len(d) != 16 for d in digests):
            bad.append(f"{backend} rank {r}: the seed recipe ended with different weights: {digests}")
    return bad


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _keras_checks_on(backend: str, recipe: bool):
    """``_keras_checks`` as a body of the launch that ``backend``'s modules share: Keras on that
    backend (imported first here on torch and JAX; TensorFlow's bodies import Keras on its default
    backend), the seed recipe in a directory of the rank's own if ``recipe``."""

    def body():
        import os
        import shutil
        import tempfile

        os.environ["KERAS_BACKEND"] = backend
        os.environ["HVD_REPO"] = _ROOT
        import keras

        if keras.backend.backend() != backend:
            return [f"the {backend} launch runs Keras on the {keras.backend.backend()} backend"]
        if not recipe:
            return _keras_checks()
        tmp = tempfile.mkdtemp(prefix="keras-recipe-")
        try:
            return _keras_checks(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    return body


# One body per backend, a part of the np=3 launch that the backend's own modules share
# (tests/_shared_launch.py; JAX_PLATFORMS=cpu as tests/jax); among the last bodies, since it ends
# with an error on purpose. On torch and JAX it also runs the seed Keras recipe.
_LAUNCHES = {backend: joint_launch(backend, 3, {"keras3": _keras_checks_on(backend, backend != "tensorflow")},
                                   timeout=300, env={"JAX_PLATFORMS": "cpu"} if backend == "jax" else None,
                                   late=True)
             for backend in ("tensorflow", "torch", "jax")}


@pytest.mark.parametrize("backend", ["tensorflow", "torch", "jax"])
def test_keras3_fit_on_every_backend(backend):
    """At np=3; on torch and JAX it also runs the seed Keras recipe unchanged (examples/keras/keras_mnist.py)."""
    results = _LAUNCHES[backend].results("keras3")
    problems = [p for rank_bad in results for p in rank_bad]
    assert not problems, "\n".join(problems)
