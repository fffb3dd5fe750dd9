from __future__ import annotations

import pytest

from horovod.common.engine.negotiation import Coordinator, validate
from horovod.common.engine.stall import Stalled
from horovod.common.types import ReduceOp, Request, RequestType

A = RequestType.ALLREDUCE


def req(rank, name="allreduce.w", kind=A, dtype="float32", shapes=((4, 2),), **kw):
    return Request(name=name, kind=kind, dtype=dtype, shapes=shapes, rank=rank, **kw)


def coordinator(size=2, sets=None, now=None):
    sets = sets or {0: list(range(size))}
    clock = now or (lambda: 0.0)
    return Coordinator(size, sets.get, clock)


def test_negotiation_ready_only_when_every_rank_submitted():
    c = coordinator(3)
    c.submit([req(0)])
    c.submit([req(2)])
    assert c.ready() == []
    c.submit([req(1)])
    (resp,) = c.ready()
    assert resp.error is None and resp.name == "allreduce.w"
    assert c.table == {}


def test_negotiation_order_is_first_seen_order_whatever_the_submission_order():
    c = coordinator(2)
    c.submit([req(0, "a"), req(0, "b"), req(0, "c")])
    c.submit([req(1, "c"), req(1, "a"), req(1, "b")])
    assert [r.name for r in c.ready()] == ["a", "b", "c"]


def test_negotiation_rejects_shape_mismatch_naming_ranks_and_shapes():
    c = coordinator(4)
    c.submit([req(0), req(1), req(2), req(3, shapes=((4, 3),))])
    (resp,) = c.ready()
    assert resp.error.startswith("Mismatched ALLREDUCE tensor shapes")
    f = resp.error_fields
    assert f["tensor_name"] == "allreduce.w" and f["field"] == "shape"
    assert f["values"] == {"(4, 2) float32": [0, 1, 2], "(4, 3) float32": [3]}
    assert "ranks [0, 1, 2]: (4, 2) float32; rank 3: (4, 3) float32" in resp.error


@pytest.mark.parametrize(
    "change, prefix, field",
    [
        ({"dtype": "float64"}, "Mismatched data types", "dtype"),
        ({"kind": RequestType.ALLGATHER}, "Mismatched operations", "op"),
        ({"reduce_op": ReduceOp.MAX}, "Mismatched reduction operation", "reduce_op"),
        ({"prescale": 2.0}, "Mismatched prescale and/or postscale factors", "scale"),
        ({"postscale": 0.5}, "Mismatched prescale and/or postscale factors", "scale"),
        ({"device": "cuda"}, "Mismatched ALLREDUCE CPU/GPU device selection", "device"),
        ({"shapes": ((4, 2), (1,))}, "Mismatched number of tensors", "group_size"),
    ],
)
def test_negotiation_rejects_each_kind_of_disagreement(change, prefix, field):
    problem = validate({0: req(0), 1: req(1, **change)})
    assert problem is not None
    msg, fields = problem
    assert msg.startswith(prefix), msg
    assert fields["field"] == field and fields["ranks"] == [0, 1]


def test_negotiation_broadcast_root_mismatch():
    b = RequestType.BROADCAST
    msg, fields = validate({0: req(0, kind=b, root_rank=0), 1: req(1, kind=b, root_rank=1)})
    assert msg.startswith("Mismatched BROADCAST root ranks")
    assert fields["values"] == {"root 0": [0], "root 1": [1]}


def test_negotiation_allgather_allows_different_first_dimension_only():
    g = RequestType.ALLGATHER
    assert validate({0: req(0, kind=g, shapes=((3, 2),)), 1: req(1, kind=g, shapes=((5, 2),))}) is None
    msg, _ = validate({0: req(0, kind=g, shapes=((3, 2),)), 1: req(1, kind=g, shapes=((3, 4),))})
    assert msg.startswith("Mismatched ALLGATHER tensor shapes")
    msg, _ = validate({0: req(0, kind=g, shapes=((3, 2),)), 1: req(1, kind=g, shapes=((3,),))})
    assert msg.startswith("Mismatched ALLGATHER tensor shapes")


def test_negotiation_process_set_waits_only_for_members():
    c = coordinator(3, sets={0: [0, 1, 2], 1: [0, 2]})
    c.submit([req(0, process_set_id=1), req(2, process_set_id=1)])
    (resp,) = c.ready()
    assert resp.error is None


def test_negotiation_unknown_process_set_is_an_error():
    c = coordinator(2)
    c.submit([req(0, process_set_id=7)])
    (resp,) = c.ready()
    assert "does not exist" in resp.error


def test_negotiation_join_counts_joined_ranks_for_allreduce_and_returns_last_joiner():
    c = coordinator(3)
    c.submit([req(2, name="join.noname", kind=RequestType.JOIN, shapes=())])
    c.submit([req(0), req(1)])
    (resp,) = c.ready()
    assert resp.error is None and resp.joined == (2,)
    c.submit([req(0, name="join.noname", kind=RequestType.JOIN, shapes=())])
    assert c.ready() == []
    c.submit([req(1, name="join.noname", kind=RequestType.JOIN, shapes=())])
    (join,) = c.ready()
    assert join.result == 1
    assert c.joined == []


def test_negotiation_allgather_with_joined_rank_is_an_error():
    c = coordinator(2)
    c.submit([req(1, name="join.noname", kind=RequestType.JOIN, shapes=())])
    c.submit([req(0, kind=RequestType.ALLGATHER)])
    (resp,) = c.ready()
    assert resp.error.startswith("Allgather is not supported with Join")


def test_negotiation_stalled_lists_missing_ranks():
    t = [0.0]
    c = coordinator(3, now=lambda: t[0])
    c.submit([req(0), req(2)])
    t[0] = 61.0
    assert c.stalled(60.0) == [Stalled("allreduce.w", "allreduce", 0, [0, 2], [1], 61.0)]
    assert c.stalled(100.0) == []


def test_negotiation_add_process_set_assigns_increasing_ids():
    c = coordinator(2)
    c.reserve_process_set_ids(3)
    for r in (0, 1):
        c.submit([req(r, name="ps.add", kind=RequestType.ADD_PROCESS_SET, shapes=(), payload=(0, 1))])
    (resp,) = c.ready()
    assert resp.result == 3


def test_a_rank_whose_arguments_failed_fails_the_name_on_every_rank():
    from horovod.common.engine.negotiation import ArgumentError

    c = coordinator(3)
    err = ArgumentError("ValueError", "alltoall: splits has 4 entries but the process set has 3 ranks")
    c.submit([req(0, "alltoall.noname.0", kind=RequestType.ALLTOALL)])
    c.submit([Request(name="alltoall.noname.0", kind=RequestType.ALLTOALL, dtype="uint8", payload=err, rank=1)])
    assert c.ready() == []  # still waits for rank 2: every member must hear the answer
    c.submit([req(2, "alltoall.noname.0", kind=RequestType.ALLTOALL)])
    (resp,) = c.ready()
    assert resp.error is not None and resp.error_fields["field"] == "argument"
    assert resp.error_fields["ranks"] == [0, 1, 2]
    assert resp.error_fields["values"] == {"valid arguments": [0, 2], str(err): [1]}
    assert "rank 1: ValueError: alltoall: splits has 4 entries" in resp.error


def test_the_same_argument_error_on_every_rank_is_still_an_error():
    from horovod.common.engine.negotiation import ArgumentError

    err = ArgumentError("NotImplementedError", "Reducescatter currently only supports AVERAGE and SUM")
    reqs = {r: Request(name="reducescatter.noname.3", kind=RequestType.REDUCESCATTER, dtype="uint8",
                       payload=err, rank=r) for r in range(2)}
    problem = validate(reqs)
    assert problem is not None and problem[1]["field"] == "argument"
    assert problem[1]["values"] == {str(err): [0, 1]}


def test_unnamed_operations_are_numbered_per_process_set():
    from horovod.common.engine.handles import HandleCounter

    c = HandleCounter()
    assert [c.unnamed(0), c.unnamed(1), c.unnamed(1), c.unnamed(0), c.unnamed(2)] == [0, 0, 1, 1, 0]
    assert [c.next(), c.next()] == [0, 1]  # handles are a separate count
