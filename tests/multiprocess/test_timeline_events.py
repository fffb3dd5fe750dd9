"""The timeline is an observer of the engine's rounds: its events come through the observers'
hooks (``observers.TimelineObserver``), which the engine takes only while a timeline is open, and
the file holds the same events, in the same order, as when the executor and the round controller
wrote them themselves (``EXPECTED``: the normalized file of this program from that tree)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from horovod.testing import run_ranks

pytestmark = pytest.mark.multiprocess

ENGINE = Path(__file__).resolve().parents[2] / "horovod" / "common" / "engine"


def _program(path: str) -> list[tuple[int, bool, int]]:
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common.context import get_context

    hvd.init()
    eng = get_context().engine

    def hooked() -> tuple[int, bool, int]:
        return (len(eng.runner.start_hooks), eng._executor.activity is not None,
                len(eng.rounds.negotiating_hooks))

    seen = [hooked()]
    hvd.allreduce(np.ones(4, np.float32), name="before")
    hvd.start_timeline(path)
    for _step in range(2):
        hvd.allreduce(np.ones(4, np.float32), name="a")
        hvd.grouped_allreduce([np.ones(3, np.float32), np.ones(5, np.float32)], name="g")
        hvd.broadcast(np.arange(6, dtype=np.int64).reshape(2, 3), 0, name="b")
        hvd.allgather(np.ones((2, 2)), name="ag")
        hvd.allreduce(np.ones(1 << 16, np.float32), name="big")
    seen.append(hooked())
    hvd.stop_timeline()
    hvd.allreduce(np.ones(4, np.float32), name="after")
    seen.append(hooked())
    hvd.shutdown()
    return seen


def normalized(events: list[dict]) -> list[list]:
    """The file's events without their times: [phase, event name, its row (the tensor), args]."""
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    out = []
    for e in events:
        if not e or e.get("ph") == "M":
            continue
        out.append([e["ph"], e.get("name", ""), rows.get(e.get("pid"), ""), e.get("args", {})])
    return out


def _negotiated(row: str, kind: str) -> list[list]:
    return [["B", f"NEGOTIATE_{kind}", row, {}], ["X", "0", row, {}], ["E", "", row, {}]]


def _reduced(row: str, dtype: str, shape: str) -> list[list]:
    steps = [[ph, name, row, {}] for step in ("MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE",
                                              "MEMCPY_OUT_FUSION_BUFFER") for ph, name in ((
                                                  "B", step), ("E", ""))]
    return [["B", "ALLREDUCE", row, {}], *steps, ["E", "", row, {"dtype": dtype, "shape": shape}]]


def _moved(row: str, kind: str, dtype: str, shape: str) -> list[list]:
    return [["B", kind, row, {}], ["E", "", row, {"dtype": dtype, "shape": shape}]]


_STEP = [("allreduce.a", "ALLREDUCE", _reduced("allreduce.a", "float32", "[[4]]")),
         ("grouped_allreduce.g", "ALLREDUCE", _reduced("grouped_allreduce.g", "float32", "[[3], [5]]")),
         ("broadcast.b", "BROADCAST", _moved("broadcast.b", "BROADCAST", "int64", "[[2, 3]]")),
         ("allgather.ag", "ALLGATHER", _moved("allgather.ag", "ALLGATHER", "float64", "[[2, 2]]")),
         ("allreduce.big", "ALLREDUCE", _reduced("allreduce.big", "float32", "[[65536]]"))]

# The file of ``_program`` as the tree before the observers wrote it (np=1, MPI: the same rounds
# every run): the first step negotiates each name, the second runs from the response cache.
EXPECTED: list[list] = [*(e for row, kind, ran in _STEP for e in [*_negotiated(row, kind), *ran]),
                        *(e for _, _, ran in _STEP for e in ran)]


def test_the_timeline_holds_the_same_events_through_the_observer_hooks(tmp_path):
    path = tmp_path / "timeline.json"
    (seen,) = run_ranks(_program, np=1, timeout=120, args=(str(path),),
                        env={"HOROVOD_TIMELINE": "DYNAMIC"})
    # no timeline: no hook of it anywhere in the round; with one: every per-tensor hook
    assert seen == [(0, False, 0), (1, True, 1), (0, False, 0)], seen
    events = normalized(json.loads(path.read_text()))
    assert events == EXPECTED, json.dumps(events)


def test_only_the_observer_writes_the_timeline():
    """The executor, the round controller, the batch runner and the device planes' services hold
    no timeline: no name, attribute, argument or import of one (read from the source)."""
    hits = []
    for name in ("executor.py", "rounds.py", "runner.py", "device.py", "buffers.py", "host_buffers.py"):
        tree = ast.parse((ENGINE / name).read_text())
        for node in ast.walk(tree):
            ident = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                     else node.arg if isinstance(node, ast.arg) else node.module or "" if isinstance(
                         node, ast.ImportFrom) else node.name if isinstance(node, ast.alias) else "")
            if "timeline" in ident.lower():
                hits.append(f"{name}:{node.lineno}: {ident}")
    assert not hits, hits
