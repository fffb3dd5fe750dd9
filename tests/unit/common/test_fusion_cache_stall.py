from __future__ import annotations

import pytest

from horovod.common.engine.cache import ResponseCache
from horovod.common.engine.fusion import plan_batches
from horovod.common.engine.stall import StallInspector
from horovod.common.types import ReduceOp, Request, RequestType, Response

A = RequestType.ALLREDUCE


def resp(name, numel=4, kind=A, dtype="float32", error=None, **kw):
    return Response(Request(name=name, kind=kind, dtype=dtype, shapes=((numel,),), **kw), error=error)


def names(batches):
    return [[r.name for r in b] for b in batches]


def test_fusion_packs_same_kind_up_to_threshold():
    rs = [resp(f"t{i}", numel=64) for i in range(5)]  # 256 bytes each
    assert names(plan_batches(rs, threshold=512, max_tensor_bytes=1 << 20)) == [
        ["t0", "t1"], ["t2", "t3"], ["t4"]]


def test_fusion_disabled_by_zero_threshold():
    rs = [resp(f"t{i}") for i in range(3)]
    assert names(plan_batches(rs, 0, 1 << 20)) == [["t0"], ["t1"], ["t2"]]


def test_fusion_separates_dtypes_ops_and_kinds_but_keeps_order_deterministic():
    rs = [resp("a"), resp("b", dtype="float64"), resp("c"), resp("d", reduce_op=ReduceOp.MAX),
          resp("e", kind=RequestType.ALLGATHER), resp("f", dtype="float64")]
    assert names(plan_batches(rs, 1 << 20, 1 << 20)) == [["a", "c"], ["b", "f"], ["d"], ["e"]]


def test_fusion_large_tensors_do_not_count_towards_threshold():
    rs = [resp("big", numel=1 << 20), resp("s1"), resp("s2")]
    assert names(plan_batches(rs, 64, max_tensor_bytes=1024)) == [["big", "s1", "s2"]]


def test_fusion_error_responses_run_alone():
    rs = [resp("a"), resp("b", error="bad"), resp("c")]
    assert names(plan_batches(rs, 1 << 20, 1 << 20)) == [["a", "c"], ["b"]]


def test_fusion_group_fusion_can_be_disabled():
    g = Response(Request(name="g", kind=A, shapes=((2,), (3,))))
    assert names(plan_batches([resp("a"), g], 1 << 20, 1 << 20, group_fusion=False)) == [["a"], ["g"]]


def test_cache_slots_are_deterministic_and_lru_evicts_oldest():
    c1, c2 = ResponseCache(2), ResponseCache(2)
    for c in (c1, c2):
        c.put(resp("a"))
        c.put(resp("b"))
        c.touch_all([c.lookup(resp("a").request)[0]])
        c.put(resp("c"))  # evicts b, the least recently used
    assert c1.occupied() == c2.occupied()
    assert c1.lookup(resp("b").request) == (-1, False)
    assert c1.lookup(resp("a").request)[1] and c1.lookup(resp("c").request)[1]


def test_cache_signature_mismatch_is_reported():
    c = ResponseCache(4)
    c.put(resp("a", numel=4))
    slot, match = c.lookup(Request(name="a", kind=A, shapes=((5,),)))
    assert slot >= 0 and not match


def test_cache_allgather_signature_ignores_first_dimension():
    c = ResponseCache(4)
    c.put(Response(Request(name="g", kind=RequestType.ALLGATHER, shapes=((3, 2),))))
    assert c.lookup(Request(name="g", kind=RequestType.ALLGATHER, shapes=((7, 2),)))[1]
    assert not c.lookup(Request(name="g", kind=RequestType.ALLGATHER, shapes=((7, 3),)))[1]


def test_cache_zero_capacity_and_errors_are_not_cached():
    c = ResponseCache(0)
    c.put(resp("a"))
    assert len(c) == 0
    c = ResponseCache(4)
    c.put(resp("a", error="mismatch"))
    assert len(c) == 0


@pytest.mark.parametrize("shutdown_after, expect", [(0, 0.0), (30, 0.0), (120, 120.0)])
def test_stall_shutdown_only_when_longer_than_warning(shutdown_after, expect):
    s = StallInspector(60, shutdown_after, clock=lambda: 0.0)
    assert s.shutdown_after == expect


def test_cache_reports_every_eviction_including_lru_ones():
    seen = []
    c = ResponseCache(2, on_evict=lambda slot, name: seen.append((slot, name)))
    c.put(resp("a"))
    c.put(resp("b"))
    c.put(resp("c"))  # LRU eviction of "a", inside put()
    c.put(resp("b"))  # replacing a cached name evicts its old slot first
    c.evict(c.lookup(resp("c").request)[0])
    assert [n for _, n in seen] == ["a", "b", "c"]
