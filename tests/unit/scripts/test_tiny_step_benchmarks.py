"""benchmarks/tiny_step_planes.py reads its phases right, and benchmarks/gloo_python_cost.py still
runs against the engine it reaches into (both read private parts of the Gloo plane)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import sys
from typing import Any

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "benchmarks", f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rank(t0: float, xchg: float, send: float, rwait: float, end: float) -> list[tuple[str, float, float]]:
    """One rank's events of one rep (seconds; the thread's CPU clock runs at half the wall's)."""
    marks = [("start", t0), ("drive<", t0 + 0.0001), ("agree<", t0 + 0.0001), ("xchg<", xchg),
             ("send<", send - 0.0002), ("send>", send), ("post<", send), ("post>", send + 0.00001),
             ("rwait<", send + 0.00001), ("rwait>", rwait), ("swait<", rwait), ("swait>", rwait),
             ("xchg>", rwait), ("agree>", rwait), ("execute<", rwait), ("run<", rwait),
             ("run>", end), ("complete<", end), ("complete>", end), ("drive>", end), ("end", end)]
    return [(n, t, t / 2) for n, t in marks]


def test_phases_name_the_late_rank_and_time_the_exchange_from_both_sides() -> None:
    planes = _module("tiny_step_planes")
    # rank 1 enters the exchange 0.3 ms after rank 0; rank 0's receive completes 0.1 ms after rank
    # 1's send call returned; one rep where rank 0 drove two rounds is left out
    early = _rank(0.0, 0.0010, 0.0012, 0.0024, 0.0030)
    late = _rank(0.0002, 0.0013, 0.0023, 0.0023, 0.0028)
    twice = early + [("drive<", 0.004, 0.002)]
    out = planes.phases([[early, twice], [late, late]])
    assert out["reps not driven once by the caller"] == 1
    assert out["early entered the exchange before late by"] == pytest.approx(0.3)
    assert out["late: the send call"] == pytest.approx(0.2)
    assert out["late CPU: the send call"] == pytest.approx(0.1)
    assert out["early: receive done after the peer's send"] == pytest.approx(0.1)
    assert out["late: receive done after the peer's send"] == pytest.approx(1.1)
    assert out["last end - last start"] == pytest.approx(2.8)  # rank 0's end, rank 1's start
    assert out["early: wait for receives"] == pytest.approx(1.19)


def test_summary_pairs_gloo_blocks_with_the_mpi_block_after_them() -> None:
    planes = _module("tiny_step_planes")
    blocks = [{"plane": "gloo", "grouped": 0.9, "gloo_rows": 0.1, "load": 3.0},
              {"plane": "mpi", "grouped": 0.3, "gloo_rows": 0.2, "load": 3.1},
              {"plane": "gloo", "grouped": 0.8, "gloo_rows": 0.15, "load": 3.2},
              {"plane": "mpi", "grouped": 0.4, "gloo_rows": 0.1, "load": 3.3}]
    out = planes.summary(blocks)
    assert out["gloo_minus_mpi"] == [pytest.approx(0.6), pytest.approx(0.4)]
    assert out["gloo_minus_mpi_minus_rows"] == [pytest.approx(0.5), pytest.approx(0.25)]
    assert out["median_gloo_minus_mpi"] == pytest.approx(0.5)


def test_gloo_python_cost_runs_and_separates_the_pack(monkeypatch: pytest.MonkeyPatch) -> None:
    cost = _module("gloo_python_cost")
    monkeypatch.setattr(sys, "argv", ["gloo_python_cost.py", "--reps", "2", "--tensors", "21"])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cost.main()
    out = json.loads(buf.getvalue())
    calls = out["us_per_call"]
    assert set(calls) == {"carrier", "pack", "exchange_rows", "stubs"}
    assert calls["carrier"] > calls["pack"] > 0 and calls["exchange_rows"] > calls["stubs"] > 0
    assert out["gloo_only_us"] == pytest.approx(calls["carrier"] - calls["pack"] + calls["exchange_rows"]
                                                - calls["stubs"], abs=0.02)
