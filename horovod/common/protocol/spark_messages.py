"""What horovod.spark's tasks and agents exchange with the Spark driver."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ._reading import _malformed
from .markers import FailureRecord

__all__ = ["SparkTaskStarted", "SparkRankAssignment", "SparkRankExit", "SparkAgentRegistration",
           "StartWorker", "StopWorker", "KillWorker", "ExitAgent", "AgentCommand", "agent_command",
           "SparkWorkerExit", "SparkOutputBatch"]

# What horovod.spark.run's barrier tasks and horovod.spark.run_elastic's agents exchange with the
# Spark driver through its rendezvous store: JSON bytes, written with ``encode()`` and read with
# the class's ``decode()`` (or :func:`agent_command`), each under the scope its docstring names.
def _decode(what: str, raw: bytes | str, build: Callable[[dict[str, Any]], Any]) -> Any:
    try:
        message = json.loads(raw)
        if not isinstance(message, dict):
            raise TypeError(f"a JSON {type(message).__name__}, not an object")
        return build(message)
    except (KeyError, TypeError, ValueError) as exc:
        raise _malformed(what, raw, exc) from exc


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _env(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise TypeError(f"env is a {type(value).__name__}, not an object")
    return {str(k): str(v) for k, v in value.items()}


@dataclass(frozen=True)
class SparkTaskStarted:
    """A barrier task of ``horovod.spark.run`` started (:data:`SPARK_TASK_SCOPE`/<partition>):
    every task's executor address (``BarrierTaskContext.getTaskInfos()``), its attempt and pid."""

    addresses: tuple[str, ...]
    attempt: int = 0
    pid: int = 0

    def encode(self) -> bytes:
        return json.dumps({"addresses": list(self.addresses), "attempt": self.attempt,
                           "pid": self.pid}).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> SparkTaskStarted:
        return _decode("Spark task's start report", raw, lambda m: cls(
            tuple(str(a) for a in m["addresses"]), int(m.get("attempt", 0)), int(m.get("pid", 0))))


@dataclass(frozen=True)
class SparkRankAssignment:
    """The driver's answer to a barrier task (:data:`SPARK_ENV_SCOPE`/<partition>): the rank it
    runs, its host and local rank, and the rank's environment (without the job secret, which the
    task has from its Spark closure)."""

    rank: int
    host: str
    local_rank: int
    env: dict[str, str]

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> SparkRankAssignment:
        return _decode("Spark driver's rank assignment", raw, lambda m: cls(
            int(m["rank"]), str(m["host"]), int(m["local_rank"]), _env(m["env"])))


@dataclass(frozen=True)
class SparkRankExit:
    """How a rank of ``horovod.spark.run`` ended: what its barrier task returns to the driver
    (a row of the Spark job, pickled by Spark). ``record``: the failure record the rank left
    (or None); ``stderr_tail``: its last stderr lines."""

    rank: int
    host: str
    local_rank: int
    code: int | None
    signal: int | None
    time: float
    record: FailureRecord | None = None
    stderr_tail: tuple[str, ...] = ()


@dataclass(frozen=True)
class SparkAgentRegistration:
    """An agent of ``run_elastic`` registered (:data:`SPARK_AGENT_SCOPE`/<partition>.<attempt>):
    the executor it runs on (the elastic "host"), its pid and task attempt."""

    host: str
    pid: int = 0
    attempt: int = 0

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> SparkAgentRegistration:
        return _decode("Spark agent's registration", raw, lambda m: cls(
            str(m["host"]), int(m.get("pid", 0)), int(m.get("attempt", 0))))


# The driver's numbered commands to an agent (SPARK_COMMAND_SCOPE/<agent>.<n>).
@dataclass(frozen=True)
class StartWorker:
    """Start elastic worker number ``seq`` with ``env`` (the job secret is the agent's own)."""

    seq: int
    env: dict[str, str]

    def encode(self) -> bytes:
        return json.dumps({"op": "start", "seq": self.seq, "env": self.env}).encode()


@dataclass(frozen=True)
class StopWorker:
    """Stop the agent's worker (SIGTERM, SIGKILL after ``grace`` seconds)."""

    grace: float = 5.0

    def encode(self) -> bytes:
        return json.dumps({"op": "stop", "grace": self.grace}).encode()


@dataclass(frozen=True)
class KillWorker:
    """Kill the agent's worker now."""

    def encode(self) -> bytes:
        return json.dumps({"op": "kill"}).encode()


@dataclass(frozen=True)
class ExitAgent:
    """The job is over: the agent ends its Spark task."""

    def encode(self) -> bytes:
        return json.dumps({"op": "exit"}).encode()


AgentCommand = StartWorker | StopWorker | KillWorker | ExitAgent


def agent_command(raw: bytes | str) -> AgentCommand:
    """Read a command the driver wrote with ``encode()``.

    Raises:
        HorovodInternalError: an unknown or malformed command.
    """
    def build(m: dict[str, Any]) -> AgentCommand:
        op = m["op"]
        if op == "start":
            return StartWorker(int(m["seq"]), _env(m["env"]))
        if op == "stop":
            return StopWorker(float(m.get("grace", 5.0)))
        if op == "kill":
            return KillWorker()
        if op == "exit":
            return ExitAgent()
        raise ValueError(f"unknown op {op!r}")

    return _decode("Spark driver's agent command", raw, build)


@dataclass(frozen=True)
class SparkWorkerExit:
    """How an agent's worker ended (:data:`SPARK_EXIT_SCOPE`/<agent>.<seq>): exit code or
    signal, and the failure record it left (or None)."""

    code: int | None
    signal: int | None
    record: FailureRecord | None = None

    def encode(self) -> bytes:
        return json.dumps({"code": self.code, "signal": self.signal,
                           "record": None if self.record is None else self.record.to_wire()}).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> SparkWorkerExit:
        def build(m: dict[str, Any]) -> SparkWorkerExit:
            record = m.get("record")
            if record is not None and not isinstance(record, dict):
                raise TypeError(f"record is a {type(record).__name__}, not an object")
            return cls(_optional_int(m["code"]), _optional_int(m["signal"]), FailureRecord.from_wire(record))

        return _decode("Spark agent's worker exit", raw, build)


_STREAMS = frozenset(("stdout", "stderr"))  # the streams an output batch's lines belong to


def _is_line(pair: Any) -> bool:
    return type(pair) is list and len(pair) == 2 and pair[0] in _STREAMS and type(pair[1]) is str


def _output_lines(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list):
        raise TypeError(f"lines is a {type(value).__name__}, not a list")
    bad = next((i for i, pair in enumerate(value) if not _is_line(pair)), None)
    if bad is not None:
        raise ValueError(f"lines[{bad}] is {value[bad]!r:.80}, not a [stream, text] pair with "
                         "stream 'stdout' or 'stderr'")
    return tuple(map(tuple, value))


@dataclass(frozen=True, slots=True)
class SparkOutputBatch:
    """A batch of a Spark task's output lines (:data:`SPARK_OUTPUT_SCOPE`/``spark_output_key``):
    ``(stream, text)`` pairs in the order written, ``stream`` ``"stdout"`` or ``"stderr"``.

    On the wire: ``{"lines": [[stream, text], ...]}`` (a batch holds many lines: one JSON pair
    each, nothing more)."""

    lines: tuple[tuple[str, str], ...]

    def encode(self) -> bytes:
        return json.dumps({"lines": self.lines}).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> SparkOutputBatch:
        return _decode("Spark task's output batch", raw, lambda m: cls(_output_lines(m["lines"])))
