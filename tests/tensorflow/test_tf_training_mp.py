"""Training at np=2 equals one process on both ranks' batches together (to float tolerance).

Each rank also trains a reference copy locally on the concatenated batches of all ranks (no
collectives) and compares weights after every step. Covered: DistributedGradientTape in a
tf.function, the TF1 DistributedOptimizer, the Keras DistributedOptimizer through model.fit
(Keras 3, and Keras 2 via TF_USE_LEGACY_KERAS=1), backward_passes_per_step=2.
"""

from __future__ import annotations

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _data(n, steps, batch):
    import numpy as np
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)[: n * steps * batch]
    y = d.target.astype(np.int64)[: n * steps * batch]
    # rank r's batch s is rows [(s * n + r) * batch, ...): the reference batch s is rows [s*n*batch, ...)
    return x, y


def _tape_and_tf1_body():
    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    steps, batch = 6, 16
    x, y = _data(n, steps, batch)
    bad = []

    def make():
        return tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(32, activation="tanh"),
                                    tf.keras.layers.Dense(10)])

    tf.random.set_seed(r)  # different initial weights on every rank
    model, ref = make(), make()
    hvd.broadcast_variables(model.weights, root_rank=0)
    for a, b in zip(ref.weights, model.weights):
        a.assign(b)
    lossf = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt, ref_opt = tf.keras.optimizers.SGD(0.5), tf.keras.optimizers.SGD(0.5)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = lossf(yb, model(xb))
        tape = hvd.DistributedGradientTape(tape)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    @tf.function
    def ref_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = lossf(yb, ref(xb))
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables))

    for s in range(steps):
        lo = (s * n + r) * batch
        step(x[lo:lo + batch], y[lo:lo + batch])
        ref_step(x[s * n * batch:(s + 1) * n * batch], y[s * n * batch:(s + 1) * n * batch])
        for a, b in zip(model.weights, ref.weights):
            if not np.allclose(np.asarray(a), np.asarray(b), atol=2e-5):
                bad.append(f"rank {r}: tape step {s}: max diff {np.abs(np.asarray(a) - np.asarray(b)).max()}")
                break
    digest = float(sum(np.asarray(w).sum() for w in model.weights))

    # TF1: DistributedOptimizer(GradientDescent) + broadcast_global_variables, same comparison.
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(r)
        xb = tf.compat.v1.placeholder(tf.float32, [None, 64])
        yb = tf.compat.v1.placeholder(tf.int64, [None])
        w = tf.compat.v1.get_variable("w", [64, 10])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=xb @ w))
        train = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5)).minimize(loss)
        grad = tf.gradients(loss, [w])[0]
        bcast = hvd.broadcast_global_variables(0)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(bcast)
            for s in range(steps):
                lo = (s * n + r) * batch
                full = slice(s * n * batch, (s + 1) * n * batch)
                # reference: a plain SGD step on the mean loss over all ranks' rows, computed locally
                w_ref = sess.run(w) - 0.5 * sess.run(grad, {xb: x[full], yb: y[full]})
                sess.run(train, {xb: x[lo:lo + batch], yb: y[lo:lo + batch]})
                if not np.allclose(sess.run(w), w_ref, atol=2e-5):
                    bad.append(f"rank {r}: TF1 step {s}: max diff {np.abs(sess.run(w) - w_ref).max()}")
                    break
    return bad, digest


def _keras_fit_body():
    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd_tf
    import horovod.tensorflow.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    steps, batch = 6, 16
    x, y = _data(n, steps, batch)
    bad = []

    def make():
        m = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(32, activation="tanh"),
                                 tf.keras.layers.Dense(10)])
        return m

    for k, comp in ((1, "none"), (2, "none"), (1, "bf16")):
        tf.random.set_seed(10 * k + r)
        model, ref = make(), make()
        hvd_tf.broadcast_variables(model.weights, root_rank=0)
        ref.set_weights([np.asarray(v) for v in model.weights])
        lossf = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), backward_passes_per_step=k,
                                       average_aggregated_gradients=True,
                                       compression=getattr(hvd.Compression, comp))
        model.compile(optimizer=opt, loss=lossf)  # Keras 3 defaults (jit_compile="auto")
        ref.compile(optimizer=tf.keras.optimizers.SGD(0.5), loss=lossf)
        mine = np.concatenate([np.arange((s * n + r) * batch, (s * n + r + 1) * batch) for s in range(steps)])
        model.fit(x[mine], y[mine], batch_size=batch, epochs=1, shuffle=False, verbose=0)
        # reference: k local steps of n ranks = one step on k*n*batch rows
        ref.fit(x, y, batch_size=k * n * batch, epochs=1, shuffle=False, verbose=0)
        for a, b in zip(model.get_weights(), ref.get_weights()):
            # bf16 gradients: within bfloat16's precision of full-precision training
            if not np.allclose(a, b, atol=1e-2 if comp == "bf16" else 3e-5):
                bad.append(f"rank {r}: keras fit backward_passes_per_step={k} compression={comp}: "
                           f"max diff {np.abs(a - b).max()}")
                break
        if int(np.asarray(opt.iterations)) != steps:
            bad.append(f"rank {r}: k={k}: optimizer.iterations {int(np.asarray(opt.iterations))} != {steps}")
    digest = float(sum(w.sum() for w in model.get_weights()))
    return bad, digest, tf.keras.__name__


# One launch runs both np=2 bodies, with the other TensorFlow modules' np=2 bodies (TensorFlow's
# start-up dominates their time); the Keras 2 body shares the launch with TF_USE_LEGACY_KERAS=1.
_NP2 = joint_launch("tensorflow", 2, {"tape+tf1": _tape_and_tf1_body, "keras3-fit": _keras_fit_body}, timeout=420)
_KERAS2 = joint_launch("tensorflow", 2, {"keras2-fit": _keras_fit_body}, timeout=240, env={"TF_USE_LEGACY_KERAS": "1"})


@pytest.mark.parametrize("body", ["tape+tf1", "keras3-fit"])
def test_np2_training_equals_single_process_on_all_batches(body):
    results = _NP2.results(body)
    failures = [m for res in results for m in res[0]]
    assert not failures, "\n".join(failures)
    assert results[0][1] == pytest.approx(results[1][1], abs=1e-6), "weights differ between ranks"


def test_np2_keras2_training_equals_single_process():
    results = _KERAS2.results("keras2-fit")
    failures = [m for res in results for m in res[0]]
    assert not failures, "\n".join(failures)
    assert results[0][2].startswith("tf_keras"), f"expected Keras 2 (tf_keras), ran {results[0][2]}"
