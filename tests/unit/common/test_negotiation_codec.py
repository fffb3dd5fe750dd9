"""The negotiation wire format and the array coordinator: every field survives the trip, equal
requests encode to equal bytes, and the coordinator's answers (orders, errors, joins, stall
reports) are those of the request-by-request rules in ``validate`` at many ranks."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from horovod.common.engine.negotiation import Coordinator, validate
from horovod.common.engine.negotiation_codec import (
    Message,
    decode_requests,
    decode_responses,
    digest,
    encode_requests,
    encode_responses,
)
from horovod.common.types import ArgumentError, ReduceOp, Request, RequestType, Response

A, G = RequestType.ALLREDUCE, RequestType.ALLGATHER


def _fields(r: Request) -> tuple:
    return (r.name, r.kind, r.dtype, r.shapes, r.reduce_op, type(r.reduce_op), r.prescale,
            r.postscale, r.root_rank, r.process_set_id, r.device, r.payload, r.rank, r.flat)


SAMPLES = [
    Request("allreduce.w", A, "float32", ((4, 2),), ReduceOp.AVERAGE, 0.5, 2.0, rank=3, flat=True),
    Request("grouped.é/ü", A, "bfloat16", ((3,), (2, 2), ()), ReduceOp.MAX, process_set_id=2, rank=3),
    Request("allgather.x", G, "int64", ((5, 2, 3), (0, 1)), device="cuda", rank=3),
    Request("allgather.scalar", G, "float64", ((),), rank=3),
    Request("broadcast.b", RequestType.BROADCAST, "uint8", ((7,),), root_rank=1, rank=3),
    Request("alltoall.a", RequestType.ALLTOALL, "int32", ((6, 2),), payload=(1, 2, 3), rank=3),
    Request("ps.add", RequestType.ADD_PROCESS_SET, shapes=(), payload=(0, 2), rank=3),
    Request("bad", RequestType.REDUCESCATTER, "uint8", payload=ArgumentError("ValueError", "no"), rank=3),
    Request("join.noname", RequestType.JOIN, rank=3),
]


def test_every_request_field_round_trips():
    data = encode_requests(SAMPLES)
    assert isinstance(data, bytes)
    assert [_fields(r) for r in decode_requests(data, 3)] == [_fields(r) for r in SAMPLES]
    assert encode_requests([]) == b"" and decode_requests(b"", 0) == []


def test_equal_requests_encode_to_equal_keys_whatever_objects_hold_them():
    shape = (4, 2)
    a = [Request("x", A, "float32", (shape, shape)), Request("y", A, "float32", (shape,))]
    b = [Request("x", A, "".join(["float", "32"]), ((4, 2), (2 * 2, 2))),
         Request("y", A, "float32", ((4, 2),))]
    assert encode_requests(a) == encode_requests(b)
    # A ragged first dimension is outside the key: ranks gathering different counts share one parse.
    g1, g2 = encode_requests([Request("g", G, shapes=((3, 2),))]), encode_requests([Request("g", G, shapes=((9, 2),))])
    assert g1 != g2 and g1[:Message.key_length(g1)] == g2[:Message.key_length(g2)]


def test_digest_is_the_signature_and_is_stable():
    r = Request("x", A, "float32", ((4, 2),), ReduceOp.SUM)
    assert digest(r) == digest(Request("x", A, "float32", ((4, 2),), ReduceOp.SUM)) != 0
    assert digest(r) != digest(Request("x", A, "float32", ((4, 3),)))
    assert digest(Request("g", G, shapes=((3, 2),))) == digest(Request("g", G, shapes=((7, 2),)))
    assert digest(r) != digest(Request("x", A, "float32", ((4, 2),), ReduceOp.SUM, prescale=2.0))
    # The flat hint is no argument: it does not change the digest.
    assert digest(r) == digest(Request("x", A, "float32", ((4, 2),), flat=True))


def test_responses_round_trip():
    responses = [Response(SAMPLES[0], joined=(1, 2)), Response(SAMPLES[6], result=4),
                 Response(SAMPLES[4], error="Mismatched", error_fields={"ranks": [0, 1]})]
    got = decode_responses(pickle.loads(pickle.dumps(encode_responses(responses))))
    assert [(_fields(r.request), r.error, r.error_fields, r.joined, r.result) for r in got] == \
           [(_fields(r.request), r.error, r.error_fields, r.joined, r.result) for r in responses]


def test_a_nul_in_a_name_is_refused():
    with pytest.raises(ValueError, match="NUL"):
        encode_requests([Request("a\0b", A)])


@pytest.fixture(params=["auto", "few", "many"])
def path(request, monkeypatch):
    """Run a coordinator test with small messages recorded element by element or by arrays, or
    each path forced for every message: all three must give the same answers."""
    if request.param == "few":
        monkeypatch.setattr(Coordinator, "_record_many", Coordinator._record_few)
    elif request.param == "many":
        monkeypatch.setattr(Coordinator, "_record_few", Coordinator._record_many)
    return request.param


def _coord(size, sets=None, now=None):
    return Coordinator(size, (sets or {0: list(range(size))}).get, now or (lambda: 0.0))


def _req(rank, name, **kw):
    kw.setdefault("shapes", ((4,),))
    return Request(name, kw.pop("kind", A), kw.pop("dtype", "float32"), rank=rank, **kw)


def test_many_ranks_many_names_in_different_orders_and_rounds(path):
    size, names = 97, [f"t{i}" for i in range(150)]  # more names than the first array rows
    c = _coord(size)
    rng = np.random.default_rng(0)
    first_round = {}
    for rank in range(size):
        cut = int(rng.integers(20, len(names)))
        order = list(rng.permutation(names[:cut]))
        first_round[rank] = order
        c.submit([_req(rank, n) for n in order])
    everywhere = set.intersection(*(set(v) for v in first_round.values()))
    early = c.ready()
    # Ready exactly when every rank has submitted, in first-seen order (rank 0's order).
    assert [r.name for r in early] == [n for n in first_round[0] if n in everywhere]
    for rank in range(size):
        rest = [n for n in names if n not in first_round[rank]]
        c.submit([_req(rank, n) for n in rest])
    late = c.ready()
    assert sorted(r.name for r in early + late) == sorted(names)
    assert all(r.error is None and r.request.rank == 0 for r in early + late)
    assert c.table == {} and len(c._sent) < 200


@pytest.mark.parametrize("change, field", [
    ({"dtype": "float64"}, "dtype"), ({"shapes": ((5,),)}, "shape"), ({"reduce_op": ReduceOp.MAX}, "reduce_op"),
    ({"prescale": 3.0}, "scale"), ({"kind": G, "shapes": ((4,),)}, "op"), ({"device": "cuda"}, "device"),
])
def test_mismatch_text_at_many_ranks_is_the_one_validate_gives(change, field, path):
    size = 40
    odd = {7, 31}
    reqs = [_req(r, "w", **(change if r in odd else {})) for r in range(size)]
    c = _coord(size)
    for start in range(0, size, 9):  # in several rounds
        c.submit(reqs[start:start + 9])
    (resp,) = c.ready()
    want = validate({r.rank: r for r in reqs})
    assert want is not None and resp.error == want[0] and resp.error_fields == want[1]
    assert resp.error_fields["field"] == field
    assert [7, 31] in resp.error_fields["values"].values()


def test_allgather_counts_may_differ_and_the_response_keeps_the_lowest_ranks(path):
    c = _coord(5)
    c.submit([_req(r, "g", kind=G, shapes=((r + 1, 3),)) for r in (4, 2, 3)])
    c.submit([_req(r, "g", kind=G, shapes=((r + 1, 3),)) for r in (1, 0)])
    (resp,) = c.ready()
    assert resp.error is None and resp.request.rank == 0 and resp.request.shapes == ((1, 3),)
    c.submit([_req(r, "h", kind=G, shapes=((r, 3 + (r == 3)),)) for r in range(5)])
    (resp,) = c.ready()
    assert resp.error.startswith("Mismatched ALLGATHER tensor shapes")
    assert resp.error_fields["values"] == {"(0, 3)": [0], "(1, 3)": [1], "(2, 3)": [2], "(3, 4)": [3],
                                           "(4, 3)": [4]}


def test_join_process_sets_stalls_and_argument_errors_at_many_ranks(path):
    t = [0.0]
    size = 33
    c = _coord(size, sets={0: list(range(size)), 1: list(range(0, size, 2))}, now=lambda: t[0])
    c.submit([_req(r, "join.noname", kind=RequestType.JOIN, shapes=()) for r in (5, 9)])
    c.submit([_req(r, "w") for r in range(size) if r not in (5, 9, 20)])
    c.submit([_req(r, "p", process_set_id=1) for r in range(0, size, 2) if r != 12])
    assert c.ready() == []
    t[0] = 70.0
    assert sorted((s.name, s.submitted, s.missing, s.age) for s in c.stalled(60.0)) == sorted([
        ("join.noname", [5, 9], [r for r in range(size) if r not in (5, 9)], 70.0),
        ("p", [r for r in range(0, size, 2) if r != 12], [12], 70.0),
        ("w", [r for r in range(size) if r not in (5, 9, 20)], [20], 70.0)])
    c.submit([_req(20, "w"), _req(12, "p", process_set_id=1)])
    got = {r.name: r for r in c.ready()}
    assert got["w"].error is None and got["w"].joined == (5, 9)
    assert got["p"].error is None and got["p"].joined == ()
    err = ArgumentError("ValueError", "splits")
    c.submit([_req(r, "a2a", kind=RequestType.ALLTOALL, payload=err if r == 3 else None) for r in range(size)])
    (resp,) = c.ready()
    assert resp.error_fields["field"] == "argument" and resp.error_fields["values"][str(err)] == [3]


def test_job_secret_from_the_environment_or_the_transport():
    from types import SimpleNamespace

    from horovod.common.protocol import job_secret

    assert job_secret(None, {}) is None
    assert job_secret(SimpleNamespace(), {}) is None  # MPI: no secret, the plane draws a key
    assert job_secret(SimpleNamespace(job_secret="ab" * 32), {}) == "ab" * 32  # an srun step's
    assert job_secret(SimpleNamespace(job_secret="ab" * 32), {"HOROVOD_SECRET_KEY": "cd" * 32}) == "cd" * 32
