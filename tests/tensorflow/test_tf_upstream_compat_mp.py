"""Behaviour upstream Horovod's scripts rely on, on real ranks (np=2 and np=3).

- error types: ranks disagreeing raise ``tf.errors.FailedPreconditionError`` in eager mode, in
  ``tf.function`` and in TF1 sessions; a bad argument raises ``InvalidArgumentError`` in all three;
- reducescatter gradients as upstream defines them (Sum: allgather(dy) * size, Average: allgather(dy));
- Keras 2 (``tf_keras``) optimizers: ``_compute_gradients`` averages (with local aggregation over
  ``backward_passes_per_step`` inside a ``tf.function``), ``apply_gradients`` does not average those
  gradients again, ``_agg_helper.counter``; ``horovod.keras.PartialDistributedOptimizer`` with
  ``tf.keras`` layers.
"""

from __future__ import annotations

import pytest

from tests._shared_launch import JOINT_TIMEOUT, JointPart, joint_launch

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _failures(results):
    return [msg for per_rank in results for msg in per_rank]


def _errors_body():
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []

    def expect(case, fn, exc_type, *fragments):
        try:
            fn()
        except exc_type as e:
            missing = [f for f in fragments if f not in str(e)]
            if missing:
                bad.append(f"rank {r}: {case}: message lacks {missing}: {str(e)[:300]}")
        except Exception as e:  # noqa: BLE001
            bad.append(f"rank {r}: {case}: {type(e).__name__} instead of {exc_type.__name__}: {str(e)[:300]}")
        else:
            bad.append(f"rank {r}: {case}: no error")

    def in_function(make):
        return lambda: tf.function(make)()

    def in_session(make):
        def run():
            with tf.Graph().as_default():
                out = make()
                with tf.compat.v1.Session() as sess:
                    sess.run(out)
        return run

    fpe, iae = tf.errors.FailedPreconditionError, tf.errors.InvalidArgumentError
    cases = {
        "allreduce shape": (lambda: hvd.allreduce(tf.ones([r + 2]), name="c_shape"), fpe, "Mismatched"),
        "allreduce dtype": (lambda: hvd.allreduce(tf.ones([2], tf.float32 if r else tf.float64), name="c_dt"),
                            fpe, "Mismatched"),
        "broadcast root": (lambda: hvd.broadcast(tf.ones([2]), root_rank=r, name="c_root"), fpe, "root"),
        "allgather dims": (lambda: hvd.allgather(tf.ones([1, r + 1]), name="c_ag"), fpe, "Mismatched"),
        "alltoall dtype": (lambda: hvd.alltoall(tf.ones([n], tf.int32 if r else tf.float32), name="c_a2a"),
                           fpe, "Mismatched"),
        "reducescatter shape": (lambda: hvd.reducescatter(tf.ones([n, r + 1]), name="c_rs"), fpe, "Mismatched"),
        "alltoall length not a multiple of size": (lambda: hvd.alltoall(tf.ones([n + 1]), name="c_len"), iae),
    }
    for case, (make, exc, *frags) in cases.items():
        expect(f"eager {case}", make, exc, *frags)
        expect(f"tf.function {case}", in_function(make), exc, *frags)
        expect(f"tf1 {case}", in_session(make), exc, *frags)
    # The engine keeps working (every rank got the same errors and stays in step).
    got = hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="c_after").numpy().tolist()
    if got != [float(n)] * 2:
        bad.append(f"rank {r}: allreduce after the errors -> {got}")
    # TensorFlow's own InvalidArgumentError is untouched.
    expect("tf.reshape", lambda: tf.reshape(tf.ones([3]), [2]), iae)
    return bad


@pytest.mark.parametrize("np_", [2, 3])
def test_tf_error_types_match_upstream_in_every_mode(np_):
    failures = _failures(_ERRORS[np_].results("errors"))
    assert not failures, "\n".join(failures)


def _reducescatter_grad_body():
    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    rows = 2 * n
    mine = 2  # rows of the output on every rank
    dy = np.arange(mine * 3, dtype=np.float32).reshape(mine, 3) + 10 * r
    gathered = np.concatenate([np.arange(mine * 3, dtype=np.float32).reshape(mine, 3) + 10 * k
                               for k in range(n)])

    def check(case, got, want):
        if not np.allclose(np.asarray(got), want):
            bad.append(f"rank {r}: {case}: gradient {np.asarray(got).tolist()}, expected {want.tolist()}")

    for op, factor in ((hvd.Sum, n), (hvd.Average, 1)):
        name = "Sum" if op == hvd.Sum else "Average"
        x = tf.Variable(tf.ones([rows, 3]))
        with tf.GradientTape() as tape:
            y = hvd.reducescatter(x, op=op)
        check(f"eager {name}", tape.gradient(y, x, output_gradients=tf.constant(dy)), gathered * factor)

        @tf.function
        def grad(v, op=op):
            with tf.GradientTape() as tape:
                ys = hvd.grouped_reducescatter([v, 2 * v], op=op)
            return tape.gradient(ys, v, output_gradients=[tf.constant(dy), tf.constant(dy)])

        check(f"tf.function grouped {name}", grad(tf.Variable(tf.ones([rows, 3]))), 3 * gathered * factor)
    return bad


@pytest.mark.parametrize("np_", [2, 3])
def test_tf_reducescatter_gradient_is_upstreams(np_):
    failures = _failures(_launch(np_).results("reducescatter"))
    assert not failures, "\n".join(failures)


def _keras2_optimizer_body():
    import numpy as np
    import tensorflow as tf

    import horovod.keras as hvd_keras
    import horovod.tensorflow.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    if not tf.keras.__name__.startswith("tf_keras"):
        return [f"rank {r}: expected Keras 2 (tf_keras), got {tf.keras.__name__}"]
    g = float(r + 1)  # this rank's gradient of x
    mean, total = (n + 1) / 2, n * (n + 1) / 2

    # _compute_gradients + apply_gradients inside a tf.function, local aggregation over k steps.
    k = 2
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), backward_passes_per_step=k)
    x = tf.Variable([0.0])

    @tf.function
    def step():
        pairs = opt._compute_gradients(lambda: tf.reduce_sum(x * g), var_list=[x])
        opt.apply_gradients(pairs)

    for s in range(1, 6):
        step()
        want = -(s // k) * k * mean  # every k-th step applies the sum of k averaged gradients
        if not np.isclose(x.numpy()[0], want):
            bad.append(f"rank {r}: aggregation step {s}: x={x.numpy()[0]}, expected {want}")
        if int(opt.iterations.numpy()) != s:
            bad.append(f"rank {r}: aggregation step {s}: iterations={int(opt.iterations.numpy())}")
        if int(opt._agg_helper.counter.numpy()) != s % k:
            bad.append(f"rank {r}: aggregation step {s}: counter={int(opt._agg_helper.counter.numpy())}")

    # Gradients from _compute_gradients are reduced once, not again in apply_gradients (op=Sum
    # shows a second reduction), for the new and the legacy optimizers (legacy minimize()
    # calls _compute_gradients itself).
    for label, base in (("SGD", tf.keras.optimizers.SGD), ("legacy SGD", tf.keras.optimizers.legacy.SGD)):
        opt = hvd.DistributedOptimizer(base(1.0), op=hvd.Sum)
        x = tf.Variable([0.0])
        pairs = opt._compute_gradients(lambda x=x: tf.reduce_sum(x * g), var_list=[x])
        if not np.isclose(pairs[0][0].numpy()[0], total):
            bad.append(f"rank {r}: {label} _compute_gradients -> {pairs[0][0].numpy()}, expected {total}")
        opt.apply_gradients(pairs)
        if not np.isclose(x.numpy()[0], -total):
            bad.append(f"rank {r}: {label} _compute_gradients + apply_gradients: x={x.numpy()[0]}, "
                       f"expected {-total}")
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(1.0), op=hvd.Sum)
    x = tf.Variable([0.0])
    opt.minimize(lambda: tf.reduce_sum(x * g), var_list=[x])
    if not np.isclose(x.numpy()[0], -total):
        bad.append(f"rank {r}: legacy minimize: x={x.numpy()[0]}, expected {-total}")

    # horovod.keras.PartialDistributedOptimizer takes tf.keras (tf_keras) layers.
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1, use_bias=False),
                                 tf.keras.layers.Dense(1, use_bias=False)])
    for v in model.trainable_weights:
        v.assign(tf.ones_like(v))
    opt = hvd_keras.PartialDistributedOptimizer(tf.keras.optimizers.SGD(1.0), local_layers=model.layers[:1])
    xb = tf.constant([[g, g]])
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(xb))
    plain = [gr.numpy() for gr in tape.gradient(loss, model.trainable_weights)]
    pairs = opt._compute_gradients(loss, model.trainable_weights, tape=tape)
    local, shared = pairs[0][0].numpy(), pairs[1][0].numpy()
    if not np.allclose(local, plain[0] / n):  # local gradient, scaled by 1/size as upstream
        bad.append(f"rank {r}: partial local layer gradient {local.tolist()}, expected {(plain[0] / n).tolist()}")
    if not np.allclose(shared, np.full_like(plain[1], 2 * mean)):
        bad.append(f"rank {r}: partial shared layer gradient {shared.tolist()}, expected {2 * mean}")
    return bad


def test_keras2_compute_gradients_and_aggregation_np2():
    results = _launch(2, keras2=True).results("keras2_optimizer")
    failures = _failures(results)
    assert not failures, "\n".join(failures)


def _sync_batch_norm_body():
    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    full = np.arange(n * 4 * 3, dtype=np.float32).reshape(n * 4, 3) ** 1.5 / 7.0
    mine = full[r * 4:(r + 1) * 4]
    bad = []
    for kwargs in ({}, {"fused": False}):
        sbn = hvd.SyncBatchNormalization(axis=1, momentum=0.5, **kwargs)
        ref = tf.keras.layers.BatchNormalization(axis=1, momentum=0.5)
        got = sbn(tf.constant(mine), training=True).numpy()
        want = ref(tf.constant(full), training=True).numpy()[r * 4:(r + 1) * 4]
        if not np.allclose(got, want, atol=1e-4):
            bad.append(f"rank {r}: SyncBatchNormalization({kwargs}) output differs from BatchNormalization "
                       f"over every rank's batch by {np.abs(got - want).max()}")
        if not np.allclose(sbn.moving_mean.numpy(), ref.moving_mean.numpy(), atol=1e-4):
            bad.append(f"rank {r}: SyncBatchNormalization({kwargs}) moving mean {sbn.moving_mean.numpy()} != "
                       f"{ref.moving_mean.numpy()}")
    return bad, tf.keras.__name__


@pytest.mark.parametrize("keras2", [False, True], ids=["keras3", "keras2"])
def test_sync_batch_norm_uses_every_ranks_batch(keras2):
    results = _launch(2, keras2=keras2).results("sync_batch_norm")
    failures = [m for res in results for m in res[0]]
    assert not failures, "\n".join(failures)
    assert results[0][1].startswith("tf_keras") == keras2, results[0][1]


# One launch per (world size, Keras flavour) runs every body that needs it, with the other
# TensorFlow modules' bodies (TensorFlow's start-up dominates their time); the bodies that provoke
# errors on purpose run last.
_LAUNCHES = {
    (2, False): joint_launch("tensorflow", 2, {"reducescatter": _reducescatter_grad_body,
                                               "sync_batch_norm": _sync_batch_norm_body}, timeout=300),
    (3, False): joint_launch("tensorflow", 3, {"reducescatter": _reducescatter_grad_body}, timeout=300),
    (2, True): joint_launch("tensorflow", 2, {"sync_batch_norm": _sync_batch_norm_body,
                                              "keras2_optimizer": _keras2_optimizer_body}, timeout=600,
                            env={"TF_USE_LEGACY_KERAS": "1"}),
}
_ERRORS = {n: joint_launch("tensorflow", n, {"errors": _errors_body}, timeout=300, late=True) for n in (2, 3)}


def _launch(np_: int, keras2: bool = False) -> JointPart:
    return _LAUNCHES[(np_, keras2)]
