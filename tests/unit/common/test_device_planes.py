"""The engine's device-plane hook: batches of a registered plane's device go to that plane. PURE."""

from __future__ import annotations

import numpy as np

from horovod.common.backends.base import Group
from horovod.common.engine import device
from horovod.common.engine.executor import Entry, Executor
from horovod.common.engine.tunables import Tunables
from horovod.common.types import Request, RequestType, Response


class _Backend:
    name = "fake"

    def reduce_dtypes(self):
        return frozenset({"float32"})

    def allreduce(self, buf, op, group, src=None):  # a set of one
        if src is not None:
            np.copyto(buf, src)


class _Plane:
    def __init__(self, executor):
        self.executor, self.batches, self.closed = executor, [], False

    def run(self, batch, entries, group):
        self.batches.append(([r.name for r in batch], group.ranks))
        for e in entries:
            e.outputs = ["from the plane"]

    def free_group(self, group):
        self.freed = group

    def close(self):
        self.closed = True


def _entry(name, dev):
    req = Request(name=name, kind=RequestType.ALLREDUCE, dtype="float32", shapes=((2,),), device=dev)
    return Response(req), Entry(req, [np.ones(2, np.float32)], None, None)


def test_executor_sends_plane_batches_to_their_plane_and_host_batches_to_the_backend(monkeypatch):
    made = []
    monkeypatch.setitem(device._FACTORIES, "fakeplane", lambda ex: made.append(_Plane(ex)) or made[-1])
    ex = Executor(_Backend(), {0: Group([0], 0, None)}, 0, Tunables(), lambda: None)
    resp, entry = _entry("allreduce.a", "fakeplane:gpu")
    ex.run([resp], [entry], False)
    assert entry.outputs == ["from the plane"]
    # the plane gets the engine's services (transport, tunables, timeline), not the executor
    assert made[0].executor is ex.planes.services and made[0].executor.backend is ex.backend
    assert made[0].batches == [(["allreduce.a"], [0])]
    resp, entry = _entry("allreduce.b", "cpu")
    ex.run([resp], [entry], False)
    assert np.array_equal(entry.outputs[0], np.ones(2, np.float32)) and len(made[0].batches) == 1
    resp, entry = _entry("allreduce.c", "fakeplane:gpu")
    ex.run([resp], [entry], False)
    assert len(made) == 1 and len(made[0].batches) == 2  # one plane per executor, made once
    g = Group([0], 0, None)
    ex.planes.free_group(g)
    assert made[0].freed is g
    ex.planes.close()
    assert made[0].closed


def test_device_tags():
    assert not device.is_plane("cpu") and not device.is_plane("host:cuda")
    assert not device.is_plane("nosuchplane:cuda")
    assert device.plane_name("torch:cuda") == "torch"
