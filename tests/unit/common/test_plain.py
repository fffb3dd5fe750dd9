"""The plain-value format of Horovod's own messages, and where horovod.common may unpickle."""

from __future__ import annotations

import ast
import math
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from horovod.common import plain
from horovod.common.engine import negotiation_codec as codec
from horovod.common.types import ArgumentError, ReduceOp, Request, RequestType, Response

COMMON = Path(__file__).resolve().parents[3] / "horovod" / "common"

VALUES = [None, True, False, 0, -1, 2**63 - 1, -2**63, 2**70, -2**90, 1.5, -0.0, math.inf, "",
          "r\u00e9sum\u00e9 \ud800", b"", b"\x00\xff", (), [], {}, (1, (2, (3,))), [[1], [2, 3]],
          {"values": {"rank 0: x": [0, 2]}, "ranks": [0, 1]}, ArgumentError("TypeError", "bad"),
          ("float32", ((4, 5), ()), 0, 1.0, 1.0, -1, "cpu", None)]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_round_trip(value):
    out = plain.loads(plain.dumps(value))
    assert out == value and type(out) is type(value)


def test_numpy_scalars_travel_as_python_values_and_nan_survives():
    assert plain.loads(plain.dumps([np.int64(3), np.float32(0.5), np.bool_(True)])) == [3, 0.5, True]
    assert math.isnan(plain.loads(plain.dumps(float("nan"))))
    assert plain.loads(plain.dumps(ReduceOp.SUM)) == int(ReduceOp.SUM)


def test_equal_values_encode_alike():
    a = ("float32", ((4, 5),), 0, 1.0, 1.0, -1, "cpu", None)
    b = ("float32", tuple([tuple([4, 5])]), 0, 1.0, 1.0, -1, "cpu", None)
    assert a is not b and plain.dumps(a) == plain.dumps(b)


@pytest.mark.parametrize("value", [{1, 2}, object(), np.zeros(2), Path("/"), [1, {2}]])
def test_anything_else_is_refused_when_sending(value):
    with pytest.raises(TypeError, match="not a plain value"):
        plain.dumps(value)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def test_a_pickle_never_runs_in_the_engine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    evil = pickle.dumps([_Exploit()])
    for decode in (plain.loads, codec.decode_responses):
        with pytest.raises(ValueError, match="malformed"):
            decode(evil)
    # A request message whose detail blob is a pickle: refused when the details are read.
    req = Request("t", RequestType.ALLREDUCE, "float32", ((2,),), rank=0)
    good = codec.encode_requests([req])
    head = codec._HEAD.unpack_from(good)
    detail_at = codec._HEAD.size + codec.RECORD.itemsize * head[1] + head[2]
    forged = (codec._HEAD.pack(head[0], head[1], head[2], len(evil)) + good[codec._HEAD.size:detail_at]
              + evil)
    with pytest.raises(ValueError, match="malformed"):
        codec.decode_requests(forged, 0)
    assert not (tmp_path / "pwned.txt").exists()


def test_messages_round_trip_without_pickle():
    reqs = [Request("a", RequestType.ALLREDUCE, "float32", ((2, 3),), ReduceOp.SUM, 0.5, 2.0, -1, 0,
                    "cpu", None, 1),
            Request("b", RequestType.ALLGATHER, "int64", ((7, 2), (3,)), rank=1),
            Request("c", RequestType.BROADCAST, "uint8", ((1,),), payload=ArgumentError("E", "m"),
                    rank=1)]
    back = codec.decode_requests(codec.encode_requests(reqs), 1)
    assert [(r.name, r.kind, r.shapes, r.payload, r.prescale) for r in back] == [
        (r.name, r.kind, r.shapes, r.payload, r.prescale) for r in reqs]
    resp = [Response(reqs[0], None, {}, (1,), 7), Response(reqs[2], "bad", {"ranks": [1]})]
    out = codec.decode_responses(codec.encode_responses(resp))
    assert [(r.name, r.error, r.error_fields, r.joined, r.result) for r in out] == [
        ("a", None, {}, (1,), 7), ("c", "bad", {"ranks": [1]}, (), None)]


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(value=st.sampled_from(VALUES), cut=st.integers(0, 200), flip=st.integers(0, 255),
       junk=st.binary(max_size=64))
def test_damaged_input_raises_only_value_error(value, cut, flip, junk):
    data = bytearray(plain.dumps(value))
    for damaged in (bytes(data[:cut % (len(data) + 1)]), junk,
                    bytes(data[:cut % len(data)]) + bytes([flip]) + bytes(data[cut % len(data) + 1:])):
        try:
            plain.loads(damaged)
        except ValueError:
            pass


def test_deep_nesting_is_refused_not_a_recursion_error():
    with pytest.raises(ValueError, match="nesting"):
        plain.loads(b"l\x01\x00\x00\x00" * 10_000 + b"N")
    with pytest.raises(ValueError, match="malformed"):
        codec.decode_responses(b"[" * 100_000)


# ------------------------------------------------------------------ where unpickling is allowed
# horovod.common unpickles only what the user asked to send as an object (objects.py:
# broadcast_object/allgather_object). Everything else Horovod sends itself is plain values.
ALLOWED = {"objects.py": 2}
_UNPICKLERS = {"loads", "load", "Unpickler"}
_PICKLE_MODULES = {"pickle", "cloudpickle", "dill", "_pickle", "cPickle"}


def _unpickle_sites(tree: ast.AST) -> int:
    names = set(_PICKLE_MODULES)
    for node in ast.walk(tree):  # import cloudpickle as cp
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name in _PICKLE_MODULES and a.asname}
    found = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in _PICKLE_MODULES:
            found += sum(a.name in _UNPICKLERS for a in node.names)
        if isinstance(node, ast.Attribute) and node.attr in _UNPICKLERS and isinstance(
                node.value, ast.Name) and node.value.id in names:
            found += 1
    return found


def test_horovod_common_unpickles_only_user_objects():
    sites = {}
    for path in sorted(COMMON.rglob("*.py")):
        n = _unpickle_sites(ast.parse(path.read_text(), str(path)))
        if n:
            sites[str(path.relative_to(COMMON))] = n
    assert sites == ALLOWED, (
        f"unpickling in horovod/common outside the object broadcast: {sites}. Send Horovod's own "
        "messages with horovod.common.plain (a format that cannot run code).")


def test_the_site_check_sees_every_form():
    src = ("import pickle\nimport cloudpickle as cp\nfrom pickle import loads\n"
           "pickle.loads(b'')\npickle.Unpickler(f).load()\ncloudpickle.load(f)\ncp.loads(b'')\n")
    assert _unpickle_sites(ast.parse(src)) == 5
