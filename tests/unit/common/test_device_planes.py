"""The engine's device-plane hook: batches of a registered plane's device go to that plane. PURE."""

from __future__ import annotations

import contextlib

import numpy as np

from horovod.common.backends.base import Group
from horovod.common.engine import device
from horovod.common.engine.executor import Entry, Executor
from horovod.common.engine.host_buffers import NumpyBuffers
from horovod.common.engine.placement import DevicePlacement
from horovod.common.engine.transport import Lane
from horovod.common.engine.tunables import Tunables
from horovod.common.types import Request, RequestType, Response


class _Backend:
    name = "fake"

    def reduce_dtypes(self):
        return frozenset({"float32"})

    def allreduce(self, buf, op, group, src=None):  # a set of one
        if src is not None:
            np.copyto(buf, src)


class _Transport:
    """A plane's transport whose "reduction" multiplies by 7 (so results show which lane ran)."""

    name = "FAKE"
    native = frozenset({"float32"})

    def __init__(self, group):
        self.group = group

    def reducer(self, op):
        return lambda buf: np.multiply(buf, 7, out=buf)


class _Plane:
    def __init__(self, services):
        self.services, self.batches, self.closed = services, [], False

    @contextlib.contextmanager
    def lane(self, batch, entries, group):
        self.batches.append(([r.name for r in batch], group.ranks))
        yield Lane(NumpyBuffers(lambda n: np.empty(n, np.uint8)), _Transport(group), DevicePlacement(), 0, False)

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
    ex = Executor(_Backend(), {0: Group([0], 0, None)}, 0, Tunables())
    resp, entry = _entry("allreduce.a", "fakeplane:gpu")
    ex.run([resp], [entry])
    # the executor ran the operation on the plane's lane (its transport multiplied by 7)
    assert np.array_equal(entry.outputs[0], np.full(2, 7, np.float32)), entry.outputs
    # the plane gets the engine's services (transport, tunables, timeout, hosts), not the executor
    assert made[0].services is ex.planes.services and made[0].services.backend is ex.backend
    assert made[0].batches == [(["allreduce.a"], [0])]
    resp, entry = _entry("allreduce.b", "cpu")
    ex.run([resp], [entry])
    assert np.array_equal(entry.outputs[0], np.ones(2, np.float32)) and len(made[0].batches) == 1
    resp, entry = _entry("allreduce.c", "fakeplane:gpu")
    ex.run([resp], [entry])
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
