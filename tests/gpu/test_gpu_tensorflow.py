"""horovod.tensorflow with GPU tensors (host-staged through tf.numpy_function), the seeds' pinning."""

from __future__ import annotations

import pytest

from horovod.testing import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


def _tf_on_gpu():
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    gpus = tf.config.experimental.list_physical_devices("GPU")
    if not gpus:
        return "skip: this TensorFlow sees no GPU (tensorflow-cpu?)"
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
    with tf.device("/GPU:0"):
        x = tf.fill([4], float(hvd.rank() + 1))
    got = hvd.allreduce(x, op=hvd.Sum)
    want = float(sum(range(1, hvd.size() + 1)))
    bad = [] if bool(tf.reduce_all(got == want)) else [f"allreduce -> {got.numpy()}"]
    v = tf.Variable([1.0, 2.0])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), device_dense="/gpu:0")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * float(hvd.rank() + 1))
    grads = tape.gradient(loss, [v])
    opt.apply_gradients(zip(grads, [v]))
    hvd.shutdown()
    return bad


def test_tensorflow_gpu_tensors_np1():
    # The GPU tier runs where a GPU is lent, which may have no TensorFlow (a GPU build of TensorFlow
    # is a separate, large install): then this one test cannot run there, and says so.
    # (a submodule: tests/tensorflow would pass for a namespace package "tensorflow")
    pytest.importorskip("tensorflow.python", reason="TensorFlow is not installed on this GPU machine")
    [res] = run_ranks(_tf_on_gpu, np=1, timeout=300)
    if isinstance(res, str):
        pytest.skip(res)
    assert res == []
