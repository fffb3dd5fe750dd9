"""TensorFlow elastic: which TF errors of Horovod's ops mean "a peer is gone" (reset) and which
are the program's own (raised at once). One process; the errors are built as the ops build them."""

from __future__ import annotations

from collections.abc import Callable

import pytest

tf = pytest.importorskip("tensorflow")

import horovod.tensorflow as hvd  # noqa: E402
from horovod.common.exceptions import (  # noqa: E402
    CollectiveMismatchError,
    HorovodInternalError,
    HorovodShutdownError,
)
from horovod.tensorflow import _errors  # noqa: E402
from horovod.tensorflow._bridge import engine_call  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _init():
    hvd.init()
    yield
    hvd.shutdown()


def _eager(exc: BaseException) -> Callable[[], None]:
    def fail() -> None:
        raise _errors.eager_error("HorovodAllreduce", "grads", exc) from exc
    return fail


def _graph(exc: BaseException) -> Callable[[], None]:
    def boom(_key: object, _arrays: object) -> None:
        raise exc

    @tf.function
    def step() -> tf.Tensor:
        return engine_call("HorovodAllreduce", boom, [tf.ones([1])], [tf.float32], name="grads")[0]

    return lambda: step()  # noqa: PLW0108 - a fresh call each time


def _calls_until_done(fail: Callable[[], None]) -> tuple[int, BaseException | None]:
    """Run ``fail`` in hvd.elastic.run: it fails the first time, succeeds after a reset."""
    calls = []
    state = hvd.elastic.TensorFlowState([tf.Variable(1.0)], epoch=0)

    @hvd.elastic.run
    def train(state: object) -> str:
        calls.append(1)
        if len(calls) == 1:
            fail()
        return "done"

    try:
        train(state)
    except Exception as exc:  # noqa: BLE001 - returned for the assertions
        return len(calls), exc
    return len(calls), None


MISMATCH = CollectiveMismatchError("Mismatched allreduce tensor shapes: rank 0 has (3,), rank 1 has (4,)")


@pytest.mark.parametrize("make", [_eager, _graph], ids=["eager", "tf.function"])
def test_a_mismatch_is_raised_not_retried(make: Callable[[BaseException], Callable[[], None]]) -> None:
    calls, exc = _calls_until_done(make(MISMATCH))
    assert calls == 1, f"a deterministic mismatch was retried by a reset ({calls} calls)"
    assert isinstance(exc, tf.errors.FailedPreconditionError), repr(exc)


def test_other_errors_naming_a_horovod_op_are_raised() -> None:
    calls, exc = _calls_until_done(_eager(ValueError("splits must sum to the first dimension")))
    assert calls == 1 and isinstance(exc, tf.errors.InvalidArgumentError), (calls, repr(exc))

    def program_error() -> None:
        raise tf.errors.UnknownError(None, None, "HorovodAllreduce in my own message")

    calls, exc = _calls_until_done(program_error)
    assert calls == 1 and isinstance(exc, tf.errors.UnknownError), (calls, repr(exc))


@pytest.mark.parametrize("make", [_eager, _graph], ids=["eager", "tf.function"])
@pytest.mark.parametrize("lost", [HorovodShutdownError("Horovod has been shut down."),
                                  HorovodInternalError("Gloo: connection closed by peer")],
                         ids=["shutdown", "transport"])
def test_a_lost_peer_resets(make: Callable[[BaseException], Callable[[], None]],
                            lost: BaseException) -> None:
    calls, exc = _calls_until_done(make(lost))
    assert (calls, exc) == (2, None), (calls, repr(exc))
