"""horovod.tensorflow / keras in one process (size 1): argument checks, wrappers, callbacks.

Multi-rank behaviour is in the ``*_mp.py`` files of this directory.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.keras as hvdk  # noqa: E402
from tests.tensorflow._fresh_import import fresh_import  # noqa: E402


@pytest.fixture(autouse=True)
def _init():
    hvd.init()
    yield


def test_import_does_not_import_torch():
    # the fresh interpreter that test_tf_side_effects_unit.py reads as well (one TensorFlow import)
    res = fresh_import()
    torch = [ln for ln in res.stdout.splitlines() if ln.startswith("TORCH ")]
    assert res.returncode == 0 and torch == ["TORCH False"], (res.stdout, res.stderr[-3000:])


def test_exports_match_api():
    for name in ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
                 "alltoall", "reducescatter", "grouped_reducescatter", "join", "size_op", "rank_op",
                 "local_size_op", "local_rank_op", "process_set_included_op", "DistributedGradientTape",
                 "PartialDistributedGradientTape", "DistributedOptimizer", "broadcast_variables",
                 "broadcast_global_variables", "BroadcastGlobalVariablesHook", "broadcast_object",
                 "broadcast_object_fn", "allgather_object", "Compression", "SyncBatchNormalization",
                 "init", "rank", "size", "Average", "Sum", "ProcessSet", "global_process_set"]:
        assert hasattr(hvd, name), name
    for name in ["DistributedOptimizer", "broadcast_global_variables", "allreduce", "allgather", "broadcast",
                 "reducescatter", "load_model", "callbacks", "Average", "Sum", "Compression"]:
        assert hasattr(hvdk, name), name
    for name in ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
                 "LearningRateWarmupCallback", "BestModelCheckpoint"]:
        assert hasattr(hvdk.callbacks, name), name


def test_ops_at_size_one_eager_and_function():
    x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_allclose(hvd.allreduce(x).numpy(), x.numpy())
    np.testing.assert_allclose(hvd.allgather(x).numpy(), x.numpy())
    np.testing.assert_allclose(hvd.broadcast(x, 0).numpy(), x.numpy())
    assert int(hvd.size_op()) == 1 and int(hvd.rank_op()) == 0 and int(hvd.process_set_included_op()) == 1

    @tf.function
    def f(t):
        a = hvd.allreduce(t, op=hvd.Sum)
        b = hvd.allgather(t)
        c, s = hvd.alltoall(t, splits=[2])
        return a, b, c, s

    a, b, c, s = f(x)
    assert a.shape == (2, 2) and b.shape == (2, 2) and c.shape == (2, 2) and s.numpy().tolist() == [2]


def test_allreduce_scalar_and_bfloat16_keep_shape_and_dtype():
    s = hvd.allreduce(tf.constant(3.0))
    assert s.shape == () and float(s) == 3.0
    b = hvd.allreduce(tf.constant([1.5, 2.5], dtype=tf.bfloat16))
    assert b.dtype == tf.bfloat16 and b.numpy().astype(np.float32).tolist() == [1.5, 2.5]


def test_indexed_slices_rejects_ops_other_than_sum_and_average():
    s = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 2]), dense_shape=tf.constant([4, 3]))
    for op in (hvd.Min, hvd.Max, hvd.Product):
        with pytest.raises(NotImplementedError, match="Only Sum and Average"):
            hvd.allreduce(s, op=op)
    with pytest.raises(NotImplementedError, match="sparse_as_dense"):
        hvd.allreduce(s, op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="Pre/postscale"):
        hvd.allreduce(s, prescale_factor=2.0)
    out = hvd.allreduce(s, op=hvd.Sum)
    assert isinstance(out, tf.IndexedSlices) and out.indices.numpy().tolist() == [0, 2]


def test_broadcast_of_non_variable_in_eager_mode_is_a_clear_error():
    with pytest.raises(TypeError, match="expects variables.*hvd.broadcast"):
        hvd.broadcast_variables([tf.constant(1.0)], root_rank=0)
    with pytest.raises(TypeError, match="broadcast_ expects tf.Variable"):
        hvd.broadcast_(tf.constant([1.0]), root_rank=0)
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        hvd.broadcast_global_variables(0)


def test_broadcast_variables_accepts_keras_variables():
    layer = tf.keras.layers.Dense(2)
    layer.build((None, 3))
    before = [np.asarray(w) for w in layer.weights]
    hvd.broadcast_variables(layer.weights, root_rank=0)
    for b, w in zip(before, layer.weights):
        np.testing.assert_array_equal(b, np.asarray(w))


def test_distributed_optimizer_argument_checks():
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="op == Adasum is not supported yet with Keras"):
        hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), op=hvd.Adasum)
    with pytest.raises(ValueError, match="only supports Average and Sum"):
        hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), op=hvd.Min)
    with pytest.raises(ValueError, match="eager"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), backward_passes_per_step=2)
    with pytest.raises(ValueError, match="doesn't inherit"):
        hvd.DistributedOptimizer(object())
    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedGradientTape(tf.GradientTape(), groups="x")


def test_keras_distributed_optimizer_keeps_class_name_and_hyperparameters():
    base = tf.keras.optimizers.SGD(learning_rate=0.25, momentum=0.5)
    opt = hvdk.DistributedOptimizer(base)
    assert type(opt).__name__ == "SGD" and isinstance(opt, type(base)) and opt is not base
    assert opt.get_config()["momentum"] == 0.5
    assert abs(float(np.asarray(opt.learning_rate)) - 0.25) < 1e-7
    assert hvd.DistributedOptimizer(base).__class__.__name__ == "SGD"  # delegation from horovod.tensorflow


def test_keras_fit_at_size_one_and_load_model(tmp_path):
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3)])
    model.compile(optimizer=hvdk.DistributedOptimizer(tf.keras.optimizers.Adam(0.01)), loss="mse")
    x, y = np.random.rand(16, 4).astype(np.float32), np.random.rand(16, 3).astype(np.float32)
    model.fit(x, y, epochs=1, verbose=0, callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                                                    hvdk.callbacks.MetricAverageCallback()])
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = hvdk.load_model(path)
    assert type(loaded.optimizer).__name__ == "Adam"
    assert getattr(type(loaded.optimizer), "_hvd_distributed", False)
    loaded.fit(x, y, epochs=1, verbose=0)
    plain = tf.keras.models.load_model(path)  # loads without Horovod's classes
    assert not getattr(type(plain.optimizer), "_hvd_distributed", False)


def test_xla_compiled_step_gets_a_clear_error():
    @tf.function(jit_compile=True)
    def f(t):
        return hvd.allreduce(t)

    with pytest.raises(Exception, match="jit_compile=False"):
        f(tf.ones(2))


def test_keras_jit_compile_true_is_turned_off_by_the_optimizer():
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=True)
    model.fit(np.ones((8, 4), np.float32), np.ones((8, 1), np.float32), epochs=1, verbose=0)
    assert model.jit_compile is False


def test_sync_batch_norm_rejects_fused_and_matches_batch_norm_at_size_one():
    with pytest.raises(ValueError, match="does not support fused=True"):
        hvd.SyncBatchNormalization(fused=True)
    sbn = hvd.SyncBatchNormalization()
    assert sbn.name.startswith("sync_batch_normalization")
    x = tf.random.normal([8, 3])
    bn = tf.keras.layers.BatchNormalization()
    np.testing.assert_allclose(sbn(x, training=True).numpy(), bn(x, training=True).numpy(), atol=1e-5)


def test_compression_fp16_round_trip():
    x = tf.constant([1.0, 2.0], dtype=tf.float32)
    c, ctx = hvd.Compression.fp16.compress(x)
    assert c.dtype == tf.float16
    assert hvd.Compression.fp16.decompress(c, ctx).dtype == tf.float32
    i = tf.constant([1, 2])
    assert hvd.Compression.fp16.compress(i)[0].dtype == tf.int32
    out = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert out.dtype == tf.float32


def test_compression_bf16_round_trip():
    x = tf.constant([1.0 + 2.0**-12, 3.0], dtype=tf.float32)
    c, ctx = hvd.Compression.bf16.compress(x)
    assert c.dtype == tf.bfloat16
    back = hvd.Compression.bf16.decompress(c, ctx)
    assert back.dtype == tf.float32 and back.numpy().tolist() == [1.0, 3.0]
    assert hvd.Compression.bf16.compress(tf.constant([1, 2]))[0].dtype == tf.int32
    out = hvd.allreduce(x, compression=hvd.Compression.bf16)
    assert out.dtype == tf.float32 and out.numpy().tolist() == [1.0, 3.0]


def test_learning_rate_callbacks_at_size_one():
    with pytest.raises(ValueError, match="initial_lr"):
        hvdk.callbacks.LearningRateScheduleCallback(initial_lr=None, multiplier=0.5)
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(1.0)), loss="mse")
    seen = []
    record = tf.keras.callbacks.LambdaCallback(
        on_epoch_end=lambda e, logs: seen.append(round(float(np.asarray(model.optimizer.learning_rate)), 6)))
    sched = hvdk.callbacks.LearningRateScheduleCallback(initial_lr=1.0, multiplier=0.5, start_epoch=1)
    x, y = np.ones((4, 2), np.float32), np.ones((4, 1), np.float32)
    hist = model.fit(x, y, batch_size=2, epochs=3, verbose=0, callbacks=[sched, record])
    assert seen == [1.0, 1.0, 0.5]  # multiplier ** (epoch - start_epoch) from start_epoch on
    assert hist.history["lr"][-1] == pytest.approx(0.5)
    warm = hvdk.callbacks.LearningRateWarmupCallback(initial_lr=0.8, warmup_epochs=2)
    model.fit(x, y, batch_size=2, epochs=2, verbose=0, callbacks=[warm])
    assert float(np.asarray(model.optimizer.learning_rate)) == pytest.approx(0.8)  # size 1: flat
    best = hvdk.callbacks.BestModelCheckpoint(monitor="loss")
    assert best.filepath is None and best.save_best_only


def test_tf1_graph_ops_and_broadcast_hook():
    g = tf.Graph()
    with g.as_default():
        v = tf.compat.v1.get_variable("v", initializer=tf.constant([1.0, 2.0]))
        step = tf.compat.v1.train.get_or_create_global_step()
        red = hvd.allreduce(v.read_value() * 2)
        assert any(op.name.startswith("HorovodAllreduce_") for op in g.get_operations())
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5))
        train = opt.minimize(tf.reduce_sum(v * v), global_step=step)
        hook = hvd.BroadcastGlobalVariablesHook(0)
        with tf.compat.v1.train.MonitoredSession(hooks=[hook]) as sess:
            assert sess.run(red).tolist() == [2.0, 4.0]
            sess.run(train)
            np.testing.assert_allclose(sess.run(v), [0.0, 0.0])
        assert hvd.broadcast_object({"a": 1}) == {"a": 1}
        assert hvd.allgather_object(3) == [3]
        assert hvd.broadcast_object_fn()(5) == 5


# ------------------------------------------------------------------ output pool and packed outputs
def test_bridge_outputs_reuse_only_arrays_nobody_holds():
    from horovod.tensorflow import _bridge

    like = [np.empty(1031, np.float32)]  # a size no other test pools
    a = _bridge._outputs("op", like)[0]
    assert a.ctypes.data % 64 == 0 and a.shape == (1031,)
    b = _bridge._outputs("op", like)[0]
    assert not np.shares_memory(a, b)  # `a` is still held here
    view = a[10:]
    kept, freed = a.ctypes.data, b.ctypes.data
    del a, b
    c = _bridge._outputs("op", like)[0]
    assert c.ctypes.data == freed  # b's buffer is free; a's is still reached through `view`
    assert not np.shares_memory(c, view) and view.ctypes.data == kept + 40
    small = _bridge._outputs("op", [np.empty(4, np.float32)])[0]
    assert small.shape == (4,)
    assert _bridge._outputs(None, like) is None  # an op named by call order: no pooling


def test_output_pool_sees_references_tensorflow_holds():
    from horovod.tensorflow._bridge import pooled_empty

    box = [pooled_empty((4096,), np.dtype(np.float32))]
    box[0][:] = 1.0

    @tf.function
    def f():
        return tf.numpy_function(lambda: box[0], [], tf.float32, stateful=True)

    held = f()
    box.clear()
    again = pooled_empty((4096,), np.dtype(np.float32))
    again[:] = 2.0
    assert float(tf.reduce_min(held)) == 1.0  # TF's tensor still holds the first array


def test_packed_layout_aligns_every_piece():
    from horovod.tensorflow._bridge import _packed_layout

    layout = _packed_layout([tf.float32] * 3, [tf.TensorShape([3, 5]), [7], [2, 2]])
    assert layout is not None
    assert layout.offsets == [0, 16, 32] and layout.total == 48
    flat = np.arange(layout.total, dtype=np.float32)
    views = layout.views(flat)
    assert [v.shape for v in views] == [(3, 5), (7,), (2, 2)]
    assert views[1][0] == 16 and np.shares_memory(views[2], flat)
    assert _packed_layout([tf.float32, tf.float64], [[2], [2]]) is None
    assert _packed_layout([tf.float32] * 2, [[2], tf.TensorShape([None])]) is None
    assert _packed_layout([tf.bfloat16] * 2, [[2], [2]]).dtype.name == "bfloat16"  # reduced as bfloat16
    assert _packed_layout([tf.float32], [[2]]) is None


def test_bfloat16_and_bool_reach_the_engine_in_their_own_dtype(monkeypatch):
    """The binding widens nothing: bfloat16 and bool arrays go to the engine as they are (what
    crosses the wire is the engine's rule per transport, ``horovod.common.dtypes``), in eager
    calls and in graphs, grouped or not."""
    from horovod.common import collectives
    from horovod.tensorflow import _bridge

    seen = []
    real = collectives.allreduce_async

    def spy(arrays, *args, **kwargs):
        seen.extend(a.dtype.name for a in arrays)
        return real(arrays, *args, **kwargs)

    monkeypatch.setattr(_bridge.C, "allreduce_async", spy)
    b = hvd.allreduce(tf.constant([1.5, 2.5], dtype=tf.bfloat16), op=hvd.Sum)
    g = hvd.grouped_allreduce([tf.constant([True, False]), tf.constant([False])], op=hvd.Max)
    f = tf.function(lambda x: hvd.grouped_allreduce([x, x], op=hvd.Sum))(tf.constant([0.5], dtype=tf.bfloat16))
    assert seen == ["bfloat16", "bool", "bool", "bfloat16", "bfloat16"]
    assert b.dtype == tf.bfloat16 and b.numpy().astype(np.float32).tolist() == [1.5, 2.5]
    assert [t.numpy().tolist() for t in g] == [[True, False], [False]]
    assert [t.dtype for t in f] == [tf.bfloat16, tf.bfloat16]
