"""Gradient bundles (issue 25): many single-tensor requests submitted in one call with one handle.

* ``GroupHandle`` completes when its last part does, with the first error;
* a ``Handle``'s latch, made only by a waiter that must block, releases every waiter whether
  completion comes before, while or after it is made;
* ``Engine.submit_many`` refuses a bundle with a name in flight and submits nothing of it;
* ``ResponseCache.lookup`` matches a resubmitted request object without comparing signatures,
  and never after its slot was refilled;
* ``Prepared.submit_all`` / ``mpi_ops._resubmit_many`` reduce in place, equal to one by one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from horovod.common.engine.cache import ResponseCache
from horovod.common.engine.handles import GroupHandle, Handle
from horovod.common.types import Request, RequestType, Response


def test_group_handle_completes_with_its_last_part_and_keeps_the_first_error():
    h = GroupHandle(7, "g", 3)
    h.set_result(None)
    assert not h.done() and not h.wait_event(0.01)
    h.set_error(ValueError("first"))
    h.set_error(ValueError("second"))  # a part past the error still counts
    assert h.done()
    with pytest.raises(ValueError, match="first"):
        h.wait()
    ok = GroupHandle(8, "ok", 2)
    ok.set_result([1])
    ok.set_result([2])
    assert ok.wait() is None


def test_a_handle_makes_its_latch_only_for_a_blocked_waiter_and_releases_every_waiter():
    import threading

    done_first = Handle(1, "a")
    done_first.set_result([1])
    assert done_first._latch is None and done_first.wait() == [1]  # never blocked: no latch
    assert done_first._latch is None
    timed_out = Handle(2, "b")
    assert not timed_out.wait_event(0.01) and timed_out._latch is not None
    with pytest.raises(TimeoutError, match="'b' did not finish"):
        timed_out.wait(timeout=0.01)
    timed_out.set_error(ValueError("boom"))  # completion after a waiter gave up: later waits see it
    with pytest.raises(ValueError, match="boom"):
        timed_out.wait()
    for _ in range(50):  # completion racing with several blocked waiters
        h = Handle(3, "c")
        got: list = []

        def wait(h: Handle = h, got: list = got) -> None:
            got.append(h.wait())

        waiters = [threading.Thread(target=wait) for _ in range(3)]
        for t in waiters:
            t.start()
        h.set_result(["r"])
        for t in waiters:
            t.join(10)
        assert got == [["r"]] * 3 and not any(t.is_alive() for t in waiters)
    group = GroupHandle(4, "g", 2)
    waiter = threading.Thread(target=group.wait)
    waiter.start()
    group.set_result(None)
    group.set_result(None)
    waiter.join(10)
    assert not waiter.is_alive()


def _req(name: str, shape: tuple[int, ...]) -> Request:
    return Request(name=name, kind=RequestType.ALLREDUCE, shapes=(shape,))


def test_cache_lookup_remembers_the_matching_request_object_until_the_slot_changes():
    cache = ResponseCache(4)
    first = _req("a", (4,))
    cache.put(Response(first))
    slot, match = cache.lookup(first)
    assert match and cache._matched[slot] is first
    again = _req("a", (4,))  # a new object, same signature: matches and is remembered
    assert cache.lookup(again) == (slot, True) and cache._matched[slot] is again
    # Renegotiated with another shape: the remembered object no longer matches.
    cache.put(Response(_req("a", (5,))))
    slot2, match = cache.lookup(again)
    assert slot2 >= 0 and not match
    cache.evict(slot2)
    assert cache.lookup(again) == (-1, False)


_CODE = r"""
import numpy as np
import torch
import horovod.torch as hvd
from horovod.common import collectives as C
from horovod.common.context import get_context
from horovod.torch import mpi_ops
hvd.init()
ctx = get_context()
ts = [torch.full((3, 2), float(i + 1)) for i in range(5)]
first = [hvd.allreduce_async_(t, name=f"b.{i}", op=hvd.Sum, postscale_factor=0.5) for i, t in enumerate(ts)]
sigs = [mpi_ops._repeat_signature(t, ctx.handles[h][0].request) for t, h in zip(ts, first)]
for h in first:
    hvd.synchronize(h)
assert [t[0, 0].item() for t in ts] == [0.5, 1.0, 1.5, 2.0, 2.5]
# One bundle, one handle: the same values as one by one, in place.
h = mpi_ops._resubmit_many(ts, sigs, defer=True)
out = hvd.synchronize(h)
assert all(o is t for o, t in zip(out, ts))
assert [t[0, 0].item() for t in ts] == [0.25, 0.5, 0.75, 1.0, 1.25], [t[0, 0].item() for t in ts]
# A tensor that no longer matches its signature: nothing is submitted, the caller falls back.
wrong = ts[:4] + [torch.ones(4)]
assert mpi_ops._resubmit_many(wrong, sigs) is None
assert mpi_ops._resubmit_many([ts[0].double()] + ts[1:], sigs) is None
assert not ctx.engine._in_flight, ctx.engine._in_flight
# A name still in flight: ValueError, and none of the bundle is submitted. (No round runs while
# this thread holds the driver lock, so "b.3" stays in flight.)
ctx.engine._driver.acquire()
pending = hvd.allreduce_async_(torch.ones(2), name="b.3", op=hvd.Sum)
try:
    mpi_ops._resubmit_many(ts, sigs)
except ValueError as exc:
    assert "b.3" in str(exc), exc
else:
    raise AssertionError("a bundle with a name in flight was accepted")
assert sorted(ctx.engine._in_flight) == ["allreduce.b.3"], sorted(ctx.engine._in_flight)
ctx.engine._driver.release()
hvd.synchronize(pending)
h = mpi_ops._resubmit_many(ts, sigs)
hvd.synchronize(h)
assert [t[0, 0].item() for t in ts] == [0.125, 0.25, 0.375, 0.5, 0.625]
print("OK")
"""


def test_resubmit_many_reduces_in_place_and_submits_all_or_nothing():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("OK"), out.stdout
