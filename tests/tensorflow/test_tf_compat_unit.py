"""Upstream-compatible details of horovod.tensorflow in one process (size 1).

- a graph op whose ranks disagree reports ``tf.errors.FailedPreconditionError`` in ``tf.function``,
  TF1 sessions and ``tf.data`` (``_errors``), while every other InvalidArgumentError stays one;
- ``hvd._executing_eagerly`` / ``horovod.tensorflow.util._executing_eagerly``;
- an unregistered process set raises ``ValueError`` when the op is built, in every mode.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import horovod.tensorflow as hvd  # noqa: E402
from horovod.common.exceptions import CollectiveMismatchError  # noqa: E402
from horovod.tensorflow._bridge import engine_call  # noqa: E402
from tests.tensorflow._fresh_import import fresh_import  # noqa: E402


@pytest.fixture(autouse=True)
def _init():
    hvd.init()
    yield


def _mismatch(x):
    raise CollectiveMismatchError("Mismatched shapes: rank 0: (2,); rank 1: (3,)")


def _bad_argument(x):
    raise ValueError("splits must sum to the first dimension")


def _graph_op(fn, x):
    """A Horovod graph op (built as the bindings build theirs) whose engine call raises ``fn``'s error."""
    return engine_call("HorovodAllreduce", lambda _key, arrays: fn(arrays[0]), [x], [tf.float32])[0]


def test_mismatch_in_tf_function_is_failed_precondition():
    f = tf.function(lambda x: _graph_op(_mismatch, x))
    with pytest.raises(tf.errors.FailedPreconditionError, match="Mismatched shapes: rank 0"):
        f(tf.ones([2]))


def test_mismatch_in_tf1_session_is_failed_precondition():
    with tf.Graph().as_default():
        out = _graph_op(_mismatch, tf.ones([2]))
        with tf.compat.v1.Session() as sess, pytest.raises(tf.errors.FailedPreconditionError,
                                                           match="HorovodAllreduce"):
            sess.run(out)


def test_mismatch_in_tf_data_map_is_failed_precondition():
    ds = tf.data.Dataset.range(2).map(lambda i: _graph_op(_mismatch, tf.cast(i, tf.float32)))
    with pytest.raises(tf.errors.FailedPreconditionError):
        list(ds)


def test_other_invalid_arguments_stay_invalid_argument():
    f = tf.function(lambda x: _graph_op(_bad_argument, x))
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        f(tf.ones([2]))
    assert type(info.value) is tf.errors.InvalidArgumentError
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        tf.reshape(tf.ones([3]), [2])
    assert type(info.value) is tf.errors.InvalidArgumentError
    e = tf.errors.InvalidArgumentError(None, None, "plain")
    assert type(e) is tf.errors.InvalidArgumentError and e.message == "plain"
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is tf.errors.InvalidArgumentError and again.message == "plain"


def test_executing_eagerly_helper():
    from horovod.tensorflow.util import _executing_eagerly

    assert hvd._executing_eagerly is _executing_eagerly
    assert _executing_eagerly() is True
    seen = []

    @tf.function
    def f(x):
        seen.append(_executing_eagerly())
        return x

    f(tf.ones([1]))
    assert seen == [False]


def test_unregistered_process_set_raises_value_error_when_built():
    fake = hvd.ProcessSet([0])
    fake.process_set_id = 1234
    with pytest.raises(ValueError, match="not been registered"):
        hvd.allreduce(tf.ones([2]), process_set=fake)
    with pytest.raises(ValueError, match="not been registered"):
        tf.function(lambda: hvd.allgather(tf.ones([2]), process_set=fake))()
    with tf.Graph().as_default(), pytest.raises(ValueError, match="not been registered"):
        hvd.broadcast(tf.ones([2]), 0, process_set=fake)
    np.testing.assert_allclose(hvd.allreduce(tf.ones([2])).numpy(), np.ones(2))


def test_graph_error_mapping_is_installed_by_the_first_graph_op_and_only_maps_horovods():
    # In a fresh interpreter (this process has built graph ops already): the one that
    # test_tf_side_effects_unit.py and test_tf_unit.py read as well (one TensorFlow import, see
    # tests/tensorflow/_fresh_import.py). After importing horovod.tensorflow (and its Keras modules),
    # hvd.init() and an eager allreduce, InvalidArgumentError is untouched; a tf.function's allreduce
    # installs the mapping, which turns only Horovod's errors into FailedPreconditionError.
    res = fresh_import()
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("GRAPH ERRORS ")]
    assert res.returncode == 0 and len(lines) == 1, (res.stdout, res.stderr[-3000:])
    assert lines[0].split()[2:] == ["True", "True", "True", "InvalidArgumentError",
                                     "FailedPreconditionError"], res.stdout
