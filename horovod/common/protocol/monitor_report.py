"""A rank's report to the launcher's monitor (``POST /api/report``, a JSON object)."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["MonitorReport", "REPORT_PATH", "describe_collective", "flight_record_lines"]

REPORT_PATH = "/api/report"


def _number(kind: type) -> Callable[[Any], Any]:
    abstract = numbers.Real if kind is float else numbers.Integral  # NumPy's scalars too

    def read(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, abstract):
            raise ValueError(f"{value!r:.60} is not {'a number' if kind is float else 'an integer'}")
        return kind(value)
    return read


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r:.60} is not true or false")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r:.60} is not a string")
    return value


def _times(value: Any) -> tuple[float, ...]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"{value!r:.60} is not a list")
    return tuple(_number(float)(v) for v in value)


# At most this many rows in each list of a report's flight record (the reporter sends fewer).
MAX_FLIGHT_ROWS = 64


def _shapes(value: Any) -> list[list[int]]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"{value!r:.60} is not a list of shapes")
    out = []
    for shape in value:
        if not isinstance(shape, list | tuple):
            raise ValueError(f"{shape!r:.60} is not a shape (a list of integers)")
        out.append([_number(int)(d) for d in shape])
    return out


# A flight record's rows (``horovod.common.engine.flight``): completed collectives end with their
# age and run time, in-flight ones with their state and age.
_ROW_HEAD = (_number(int), _number(int), _text, _text, _text, _shapes)
_ROW_TAIL = {"done": (_number(float), _number(float)), "in_flight": (_text, _number(float))}


def _flight(value: Any) -> dict[str, list[list[Any]]]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{value!r:.60} is not an object")
    unknown = sorted(set(value) - set(_ROW_TAIL))
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; a flight record has 'done' and 'in_flight'")
    record: dict[str, list[list[Any]]] = {}
    for part, tail in _ROW_TAIL.items():
        rows = value.get(part, [])
        if not isinstance(rows, list | tuple):
            raise ValueError(f"{part!r}: {rows!r:.60} is not a list")
        if len(rows) > MAX_FLIGHT_ROWS:
            raise ValueError(f"{part!r}: {len(rows)} rows, at most {MAX_FLIGHT_ROWS}")
        readers = _ROW_HEAD + tail
        checked = []
        for i, row in enumerate(rows):
            if not isinstance(row, list | tuple) or len(row) != len(readers):
                raise ValueError(f"{part!r} row {i}: {row!r:.80} is not a list of {len(readers)} "
                                 "values (seq, process set, op, name, dtype, shapes, ...)")
            try:
                checked.append([read(v) for read, v in zip(readers, row)])
            except ValueError as exc:
                raise ValueError(f"{part!r} row {i}: {exc}") from exc
        record[part] = checked
    return record


def _per_op(kind: type) -> Callable[[Any], dict[str, Any]]:
    def read(value: Any) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise ValueError(f"{value!r:.60} is not an object")
        return {_text(op): _number(kind)(v) for op, v in value.items()}
    return read


_READERS: dict[str, Callable[[Any], Any]] = {
    "rank": _number(int), "host": _text, "local_rank": _number(int), "size": _number(int),
    "time": _number(float), "final": _flag, "steps": _number(int), "step_times": _times,
    "wait_seconds": _number(float), "collectives": _per_op(int), "collective_bytes": _per_op(int),
    "collective_seconds": _per_op(float), "stalled_tensors": _number(int), "straggler": _flag,
    "straggler_score": _number(float), "pid": _number(int), "where": _text, "stack": _text,
    "flight": _flight,
}


@dataclass(frozen=True)
class MonitorReport:
    """One rank's counters as its reporter (``horovod.common.reporter``) posts them: who it is,
    when, whether it is its last report, and what ``hvd.metrics()`` said (steps and their
    durations, time waiting for other ranks, per-operation counts, bytes and transport seconds,
    stalled tensors, the coordinator's straggler verdict for this rank), and where the rank is:
    its pid, its main thread's innermost frame of user code (``where``) and stack (``stack``,
    text as the stall report prints it) and a short flight record (``flight``: the last completed
    and the first in-flight collectives, ``horovod.common.engine.flight``'s rows). These four are
    optional: a report without them (an older rank) is accepted, and they stay unset (``pid`` 0,
    ``where`` empty, ``stack`` and ``flight`` None)."""

    rank: int
    host: str = ""
    local_rank: int = -1
    size: int = 0
    time: float = 0.0
    final: bool = False
    steps: int = 0
    step_times: tuple[float, ...] = ()
    wait_seconds: float = 0.0
    collectives: Mapping[str, int] = field(default_factory=dict)
    collective_bytes: Mapping[str, int] = field(default_factory=dict)
    collective_seconds: Mapping[str, float] = field(default_factory=dict)
    stalled_tensors: int = 0
    straggler: bool = False
    straggler_score: float = 0.0
    pid: int = 0
    where: str = ""
    stack: str | None = None
    flight: Mapping[str, Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        """The JSON object."""
        wire = {f.name: getattr(self, f.name) for f in fields(self)}
        wire["step_times"] = list(self.step_times)
        for name in ("collectives", "collective_bytes", "collective_seconds"):
            wire[name] = dict(wire[name])
        for name in ("stack", "flight"):
            if wire[name] is None:
                del wire[name]
        return wire

    @classmethod
    def from_wire(cls, message: Any) -> MonitorReport:
        """The report in a JSON object; fields it does not know are ignored (a newer rank).

        Raises:
            ValueError: not an object, no ``rank``, or a field of the wrong type (named).
        """
        if not isinstance(message, Mapping):
            raise ValueError(f"a monitor report is a JSON object, not {type(message).__name__}")
        if "rank" not in message:
            raise ValueError("a monitor report without a rank")
        values: dict[str, Any] = {}
        for name, read in _READERS.items():
            if name in message and message[name] is not None:
                try:
                    values[name] = read(message[name])
                except ValueError as exc:
                    raise ValueError(f"monitor report field {name!r}: {exc}") from exc
        return cls(**values)

    @classmethod
    def from_snapshot(cls, snapshot: Mapping[str, Any], *, rank: int, local_rank: int, host: str,
                      time: float, final: bool = False) -> MonitorReport:
        """This rank's report from its ``hvd.metrics()`` snapshot (the keys the monitor reads)."""
        known = {k: v for k, v in snapshot.items() if k in _READERS}
        return cls.from_wire({**known, "rank": rank, "local_rank": local_rank, "host": host,
                              "time": time, "final": final})


def _shape_text(shape: Any) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def describe_collective(op: str, name: str, seq: int, process_set: int = 0) -> str:
    """``allreduce 'grad.w' (seq 12)``, with the process set when it is not the global one."""
    where = f", process set {process_set}" if process_set else ""
    return f"{op} {name!r} (seq {seq}{where})"


def flight_record_lines(record: dict[str, Any], indent: str = "  ") -> list[str]:
    """A flight record (``{"done": ..., "in_flight": ...}``, a report's ``flight``) as text lines,
    oldest first: what the stall report, a SIGUSR1 dump and the monitor show."""
    lines = []
    for seq, ps, op, name, dtype, shapes, age, ran in record.get("done", []):
        shown = " ".join(_shape_text(s) for s in shapes)
        lines.append(f"{indent}done       {describe_collective(op, name, seq, ps)} {dtype} {shown}: "
                     f"ended {age:.1f} s ago, ran {ran * 1e3:.2f} ms")
    for seq, ps, op, name, dtype, shapes, state, age in record.get("in_flight", []):
        shown = " ".join(_shape_text(s) for s in shapes)
        lines.append(f"{indent}{state:<10} {describe_collective(op, name, seq, ps)} {dtype} {shown}: "
                     f"submitted {age:.1f} s ago")
    if not lines:
        lines.append(f"{indent}(no collective yet)")
    return lines
