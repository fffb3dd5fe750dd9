"""Bad input on real ranks: a clear error on every rank, no hang, and Horovod keeps working after."""

from __future__ import annotations

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _errors_body():
    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r = hvd.rank()
    seen = {}

    def expect(case, fn, exc_type, *fragments):
        try:
            fn()
        except exc_type as e:
            text = str(e)
            missing = [f for f in fragments if f not in text]
            seen[case] = "ok" if not missing else f"message lacks {missing}: {text[:300]}"
        except Exception as e:  # noqa: BLE001
            seen[case] = f"wrong type {type(e).__name__}: {str(e)[:300]}"
        else:
            seen[case] = "no error"
        # The engine must still work after the error (on every rank).
        got = hvd.allreduce(tf.ones([2]), op=hvd.Sum, name=f"after.{case}").numpy()
        if not np.allclose(got, hvd.size()):
            seen[case + ".after"] = f"allreduce after error -> {got}"

    expect("eager shape", lambda: hvd.allreduce(tf.ones([r + 1]), name="shape"),
           tf.errors.FailedPreconditionError, "HorovodAllreduce", "Mismatched", "rank 0", "rank 1")
    expect("eager dtype", lambda: hvd.allreduce(tf.ones([2], dtype=tf.float32 if r else tf.float64),
                                                name="dtype"),
           tf.errors.FailedPreconditionError, "Mismatched", "float")
    expect("eager root", lambda: hvd.broadcast(tf.ones([2]), root_rank=r, name="root"),
           tf.errors.FailedPreconditionError, "root")
    expect("eager allgather dims", lambda: hvd.allgather(tf.ones([2, r + 1]), name="agdims"),
           tf.errors.FailedPreconditionError, "Mismatched")

    @tf.function
    def in_function(t):
        return hvd.allreduce(t, name="fn_shape")

    expect("tf.function shape", lambda: in_function(tf.ones([r + 2])), tf.errors.OpError, "HorovodAllreduce",
           "Mismatched")

    def tf1():
        with tf.Graph().as_default():
            out = hvd.allreduce(tf.ones([3 + r]), name="tf1_shape")
            with tf.compat.v1.Session() as sess:
                sess.run(out)

    expect("tf1 shape", tf1, tf.errors.OpError, "Mismatched")

    def tape_mismatch():
        w = tf.Variable(tf.ones([2 + r]))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w)
        hvd.DistributedGradientTape(tape).gradient(loss, [w])

    expect("tape shape", tape_mismatch, tf.errors.FailedPreconditionError, "Mismatched")
    sl = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), dense_shape=tf.constant([2, 2]))
    expect("indexed slices Max", lambda: hvd.allreduce(sl, op=hvd.Max), NotImplementedError, "Sum and Average")
    expect("broadcast non-variable", lambda: hvd.broadcast_variables([tf.ones([2])], 0), TypeError,
           "hvd.broadcast")
    return seen


# Part of the launch every TensorFlow module's np=2 bodies share; errors on purpose, so it runs last.
_LAUNCH = {n: joint_launch("tensorflow", n, {"errors": _errors_body}, timeout=240, late=True) for n in (2,)}


@pytest.mark.parametrize("np_", [2])
def test_tf_bad_input_raises_on_every_rank_and_engine_survives(np_):
    results = _LAUNCH[np_].results("errors")
    problems = [f"rank {r}: {case}: {res}" for r, seen in enumerate(results) for case, res in seen.items()
                if res != "ok"]
    assert not problems, "\n".join(problems)
