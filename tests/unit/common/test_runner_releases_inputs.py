"""A finished collective's inputs are the submitter's buffers: the engine drops them before the
waiter wakes (``BatchRunner.complete``).

The round that completes an entry still holds it (the list ``take`` returned, the queue's list of
new entries) until it returns; a waiter on another thread wakes at ``set_result`` and may free its
tensors at once. Before, an entry kept its inputs until the round returned, so a fully sharded
module's gradients outlived their reduce-scatter by however long the engine thread took to end
the round: tests/torch/test_fully_shard_memory.py's backward peak then counted one block's
gradients more, now and then (a load-dependent failure).
"""

from __future__ import annotations

import threading
import types
import weakref

import numpy as np

from horovod.common.engine.executor import Entry
from horovod.common.engine.handles import Handle
from horovod.common.engine.runner import BatchRunner
from horovod.common.types import Request, RequestType


class _Watching(Handle):
    """A handle that, when completed, records whether its input array is still alive."""

    __slots__ = ("seen",)

    def __init__(self, hid: int, name: str, ref: weakref.ref) -> None:
        super().__init__(hid, name)
        self.seen = {"ref": ref}

    def set_result(self, result):
        # No gc.collect(): the arrays are in no reference cycle, so CPython frees one at its last
        # reference, as a waiter's tensors are freed (a collection of the suite's whole heap took
        # seconds per entry, and could only hide a release that waits for the cycle collector).
        self.seen["alive_at_wake"] = self.seen["ref"]() is not None
        super().set_result(result)


def _runner_state() -> types.SimpleNamespace:
    # what ``complete`` reads of its runner
    return types.SimpleNamespace(round_done=False, _in_flight={}, _lock=threading.Lock(),
                                 _step_done=lambda: None)


def _entry(i: int, in_place: bool) -> tuple[Entry, weakref.ref]:
    arr = np.arange(8, dtype=np.float32) + i
    ref = weakref.ref(arr)
    req = Request(f"t{i}", RequestType.REDUCESCATTER, "float32", ((8,),))
    inputs = [arr]
    outputs = inputs if in_place else [np.zeros(8 // 2, dtype=np.float32)]
    return Entry(req, inputs, outputs, _Watching(i, f"t{i}", ref)), ref


def test_complete_drops_each_entrys_inputs_before_its_waiter_wakes():
    runner = _runner_state()
    made = [_entry(i, in_place=False) for i in range(3)]
    entries = [e for e, _ in made]  # the round's list: it holds the entries past completion
    del made
    BatchRunner.complete(runner, entries)
    for e in entries:
        assert e.handle.done()
        assert e.handle.seen["alive_at_wake"] is False, e.request.name  # freed at set_result
        assert e.inputs == []
        assert e.handle.result is e.outputs  # the outputs are the waiter's
    assert runner.round_done


def test_in_place_results_stay_with_the_waiter():
    """An in-place operation's outputs are its inputs: the waiter still receives them."""
    runner = _runner_state()
    e, ref = _entry(0, in_place=True)
    outputs = e.outputs
    BatchRunner.complete(runner, [e])
    assert e.handle.result is outputs and ref() is outputs[0]
    assert e.handle.seen["alive_at_wake"] is True  # the result itself
