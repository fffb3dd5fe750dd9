"""What the launcher and its workers say to each other, spelled once (standard library only).

(The messages the ranks' engines exchange during negotiation are another protocol:
``horovod/common/engine/negotiation_codec.py``.)

Both sides import this module: the workers (``horovod.common.lifecycle``, the rendezvous handlers,
the elastic worker, ``horovod.runner.run_task``, the Spark tasks), the worker shim
(``horovod/runner/_shim.py``, which runs by file path and loads this file by path too), and the
launchers (``horovodrun``'s static and elastic jobs, the elastic driver, Spark, Ray).

* **Variables**: where a process finds its rank (:data:`RANK_VARS`, in the order every reader
  checks them; :data:`RANK_SIZE_VARS` pairs each with its size variable), the identity of a
  worker's slot (:meth:`RankIdentity.env`), where ``horovod.run()``'s workers find the launcher
  (:data:`RUNNER_ADDR_ENV`, :data:`RUNNER_PORT_ENV`, :data:`SECRET_ENV`), where Gloo workers find
  the rendezvous service (:data:`RENDEZVOUS_ADDR_ENV`, :data:`RENDEZVOUS_PORT_ENV`), the file
  named by :data:`EXIT_RECORD_ENV` that a failing rank writes its failure record to, the
  fail-fast switch (:data:`LIFECYCLE_ENV`).
* **Rank identity**: :class:`RankIdentity`, where one rank sits in its job (host, global, local and
  cross ranks and sizes): a launcher's slot, a round's member, an initialised rank's topology.
* **Store scopes and keys** on the launcher's rendezvous service (``horovod.common.rendezvous``):
  the Gloo store address (:data:`STORE_KEY` under :func:`gloo_scope` or :func:`round_scope`), an
  abandoned elastic round (:data:`ABANDONED_KEY`, :data:`ABANDONED_STORE`), ``horovod.run()``'s
  function and results (:data:`FUNC_SCOPE`, :data:`RESULT_SCOPE`), the Spark tasks' scopes.
* **Elastic calls** (``POST /elastic/<call>``, JSON both ways): :class:`ReadyRequest` answered by
  :class:`Wait`, :class:`RoundInfo`, :class:`Removed` or :class:`Stop` (:func:`ready_answer`
  reads one back); :class:`NoticeRequest` answered by :class:`Notice`.
* **Outcomes**: what a worker's function ended with (:data:`TaskOutcome`: :class:`Returned`,
  :class:`Raised`, :class:`Exited`), as ``horovod.runner.run_task`` stores it under
  :data:`RESULT_SCOPE` and a Ray worker returns it; :class:`Died`, the launcher's record of a
  worker that never reported (:data:`WorkerOutcome`: any of the four). :func:`task_outcome`
  checks what a launcher read.
* **Spark messages** (JSON in the rendezvous store, ``encode()``/``decode()``): a barrier task's
  :class:`SparkTaskStarted`, answered by :class:`SparkRankAssignment`, and its row
  :class:`SparkRankExit`; an elastic agent's :class:`SparkAgentRegistration`, the driver's
  :data:`AgentCommand` (:class:`StartWorker`, :class:`StopWorker`, :class:`KillWorker`,
  :class:`ExitAgent`; :func:`agent_command` reads one), and :class:`SparkWorkerExit`.
* **Markers**: two stderr lines a launcher removes from the output it shows.
  ``__HOROVOD_RANK_ERROR__ {json}`` is written by a failing Horovod rank the moment it fails
  (:class:`FailureRecord`: whether its error is its own or the consequence of a peer leaving);
  ``__HOROVOD_RUNNER_EXIT__ {json}`` is the shim's last line about a rank (:class:`ExitReport`:
  rank, host, pid, exit code or signal, why the shim stopped it, the failure record).
  :func:`strip_markers` is the one function that finds and removes them, and reads both.
* **Life line**: a launcher gives a remote shim its worker's environment as the first line of its
  stdin (:func:`env_line`, read with :func:`parse_env_line`), and stops the worker by writing
  :func:`signal_line` there, then closing it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["ERROR_MARKER", "EXIT_MARKER", "EXIT_RECORD_ENV", "RANK_VARS", "RANK_SIZE_VARS",
           "LIFECYCLE_ENV", "RUNNER_ADDR_ENV", "RUNNER_PORT_ENV", "SECRET_ENV",
           "RENDEZVOUS_ADDR_ENV", "RENDEZVOUS_PORT_ENV", "ELASTIC_ENV", "elastic_env",
           "ELASTIC_HOST_ENV", "ELASTIC_SLOT_ENV", "RESULT_KEY_ENV", "job_secret",
           "MONITOR_ADDR_ENV", "MONITOR_PORT_ENV", "MONITOR_INTERVAL_ENV", "Markers", "env_rank",
           "error_line", "exit_line", "FAILURE_KINDS", "FailureRecord", "ExitReport",
           "parse_signal_line", "signal_line", "env_line", "parse_env_line",
           "strip_markers",
           "RankIdentity", "RoundInfo", "ReadyRequest", "Wait", "Removed", "Stop", "ReadyAnswer",
           "ready_answer", "NoticeRequest", "Notice", "READY_CALL", "NOTICE_CALL", "Returned",
           "Raised", "Exited", "Died", "TaskOutcome", "WorkerOutcome", "task_outcome",
           "SparkTaskStarted", "SparkRankAssignment", "SparkRankExit", "SparkAgentRegistration",
           "StartWorker", "StopWorker", "KillWorker", "ExitAgent", "AgentCommand",
           "agent_command", "SparkWorkerExit", "STORE_KEY", "ABANDONED_KEY", "ABANDONED_STORE",
           "ABANDON_POLL_SECONDS", "gloo_scope", "round_scope", "FUNC_SCOPE", "FUNC_KEY",
           "RESULT_SCOPE", "SPARK_TASK_SCOPE", "SPARK_ENV_SCOPE", "SPARK_AGENT_SCOPE",
           "SPARK_HEARTBEAT_SCOPE", "SPARK_COMMAND_SCOPE", "SPARK_EXIT_SCOPE",
           "SPARK_OUTPUT_SCOPE", "spark_agent_key", "spark_output_key"]

ERROR_MARKER = "__HOROVOD_RANK_ERROR__ "
EXIT_MARKER = "__HOROVOD_RUNNER_EXIT__ "
EXIT_RECORD_ENV = "HOROVOD_EXIT_RECORD"
# 0 in a worker's environment: no fail-fast hook (see horovod.common.lifecycle); a failed rank
# takes the normal exit path, and the launcher stops the job when the rank's process ends.
LIFECYCLE_ENV = "HOROVOD_FAIL_FAST"

# horovodrun / Open MPI / PMIx / PMI (MPICH, Intel MPI): the first one set names the rank.
RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
# (rank variable, size variable) per launcher, in the order upstream's helper checks them.
RANK_SIZE_VARS = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                  ("PMI_RANK", "PMI_SIZE"))
# Where horovod.run()'s workers (horovod.runner.run_task) find the launcher's service, and its key.
RUNNER_ADDR_ENV = "HOROVOD_RUNNER_ADDR"
RUNNER_PORT_ENV = "HOROVOD_RUNNER_PORT"
SECRET_ENV = "HOROVOD_SECRET_KEY"
# Where a Gloo worker of a Horovod launcher (horovodrun --gloo, horovod.run, Spark, Ray) finds the
# launcher's rendezvous service (horovod.common.rendezvous), which it signs its requests for with
# SECRET_ENV.
RENDEZVOUS_ADDR_ENV = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
RENDEZVOUS_PORT_ENV = "HOROVOD_GLOO_RENDEZVOUS_PORT"
# An elastic worker (not "0"), and the slot the driver knows it by (host name, local rank).
ELASTIC_ENV = "HOROVOD_ELASTIC"
ELASTIC_HOST_ENV = "HOROVOD_ELASTIC_HOST"
ELASTIC_SLOT_ENV = "HOROVOD_ELASTIC_SLOT"
# The key a horovod.run() worker stores its outcome under, where not its rank (an elastic worker
# of horovod.spark.run_elastic changes rank between rounds; its slot name does not).
RESULT_KEY_ENV = "HOROVOD_RUN_TASK_RESULT_KEY"
# Where a rank pushes its counters (``horovodrun --monitor-port``; see horovod/common/reporter.py).
MONITOR_ADDR_ENV = "HOROVOD_MONITOR_ADDR"
MONITOR_PORT_ENV = "HOROVOD_MONITOR_PORT"
MONITOR_INTERVAL_ENV = "HOROVOD_MONITOR_INTERVAL"


def elastic_env(host: str, slot: int) -> dict[str, str]:
    """The variables of an elastic worker the driver knows as slot ``host[slot]`` for its life."""
    return {ELASTIC_ENV: "1", ELASTIC_HOST_ENV: host, ELASTIC_SLOT_ENV: str(slot)}


def job_secret(backend: Any = None, env: Mapping[str, str] | None = None) -> str | None:
    """The secret every rank of this job holds and no outsider does, or None (MPI, torchrun).

    ``HOROVOD_SECRET_KEY`` (horovodrun, horovod.run, Spark, Ray, a batch script), else the one the
    CPU transport established at init (``backend.job_secret``: an srun step's secret from MUNGE
    or a key file). Stores keyed from it need no key sent over the network.
    """
    env = os.environ if env is None else env
    return env.get(SECRET_ENV) or getattr(backend, "job_secret", None) or None


def env_rank(env: Mapping[str, str] | None = None) -> str | None:
    """The rank the launcher put in ``env`` (default ``os.environ``), as written, or None."""
    env = os.environ if env is None else env
    return next((env[v] for v in RANK_VARS if v in env), None)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


#: a rank's own error, or one that only says a peer left (a consequence of another failure)
FAILURE_KINDS = ("cause", "consequence")


@dataclass(frozen=True)
class FailureRecord:
    """Why a rank's process ends badly, as the rank writes it the moment it fails
    (``horovod.common.lifecycle``: the file named by :data:`EXIT_RECORD_ENV`, and
    :data:`ERROR_MARKER` with its ``rank``), or as a launcher makes it from an exception a
    function raised (``horovod.runner.failures.exception_record``): its exit code, whether the
    error is its own (``"cause"``) or the consequence of a peer leaving (``"consequence"``), the
    error's text, when (``time.time()``), and the rank where known."""

    code: int | None
    kind: str
    error: str
    time: float | None
    rank: int | None = None

    def to_wire(self) -> dict[str, Any]:
        """The JSON object (``rank`` only where known)."""
        wire = {"code": self.code, "kind": self.kind, "error": self.error, "time": self.time}
        return wire if self.rank is None else {**wire, "rank": self.rank}

    @classmethod
    def from_wire(cls, record: Any) -> FailureRecord | None:
        """The record in a JSON object, or None where it is none (no object, an unknown kind:
        another program's text, or a malformed record, which a launcher ignores)."""
        if not isinstance(record, Mapping) or record.get("kind") not in FAILURE_KINDS:
            return None
        return cls(_int_or_none(record.get("code")), str(record["kind"]), str(record.get("error") or ""),
                   _float_or_none(record.get("time")), _int_or_none(record.get("rank")))


@dataclass(frozen=True)
class ExitReport:
    """The worker shim's last word about its rank (:data:`EXIT_MARKER`): the rank (None where
    the shim did not know it), the host the launcher named and the one the shim ran on, the
    worker's pid, its exit code or the signal that ended it, when, why the shim stopped it (None:
    it ended by itself), and the failure record the worker left."""

    rank: int | None
    host: str = ""
    pid: int | None = None
    code: int | None = None
    signal: int | None = None
    time: float | None = None
    stopped_by: str | None = None
    error: FailureRecord | None = None
    real_host: str = ""

    def to_wire(self) -> dict[str, Any]:
        """The JSON object (the failure record inline)."""
        return {"rank": self.rank, "host": self.host, "real_host": self.real_host, "pid": self.pid,
                "code": self.code, "signal": self.signal, "time": self.time,
                "stopped_by": self.stopped_by, "error": None if self.error is None else self.error.to_wire()}

    @classmethod
    def from_wire(cls, info: Any) -> ExitReport | None:
        """The report in a JSON object, or None where it is none; fields of the wrong type read as
        unknown."""
        if not isinstance(info, Mapping):
            return None
        stopped = info.get("stopped_by")
        return cls(_int_or_none(info.get("rank")), str(info.get("host") or ""), _int_or_none(info.get("pid")),
                   _int_or_none(info.get("code")), _int_or_none(info.get("signal")),
                   _float_or_none(info.get("time")), stopped if isinstance(stopped, str) else None,
                   FailureRecord.from_wire(info.get("error")), str(info.get("real_host") or ""))


def error_line(record: FailureRecord) -> str:
    """The stderr line a failing rank writes (its record, with its rank)."""
    return ERROR_MARKER + json.dumps(record.to_wire()) + "\n"


def exit_line(report: ExitReport) -> str:
    """The shim's last stderr line about its rank."""
    return EXIT_MARKER + json.dumps(report.to_wire()) + "\n"


def env_line(env: Mapping[str, str]) -> bytes:
    """The first stdin line of a remote shim (``--stdin-env``): the worker's environment, which
    an ssh command line would show to every user of the host."""
    return (json.dumps({"env": dict(env)}) + "\n").encode()


def parse_env_line(line: bytes) -> dict[str, str]:
    """The environment of an :func:`env_line`.

    Raises:
        ValueError: not an environment line.
    """
    try:
        env = json.loads(line.decode("utf-8"))["env"]
    except (KeyError, TypeError, ValueError) as exc:  # ValueError: not JSON, not UTF-8
        raise ValueError(f"not an environment line ({exc!r})") from exc
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("not an environment line (the environment is not a mapping of strings)")
    return env


def signal_line(signum: int) -> bytes:
    """The life-line command that asks a shim to send ``signum`` to its worker."""
    return f"signal {int(signum)}\n".encode()


def parse_signal_line(line: bytes) -> int | None:
    """The signal number of a life-line command, or None for anything else."""
    words = line.split()
    if len(words) == 2 and words[0] == b"signal" and words[1].isdigit():
        return int(words[1])
    return None


@dataclass
class Markers:
    """What :func:`strip_markers` found in one line: the text to show and the records."""

    text: str
    terminator: str
    error: FailureRecord | None = None  # a rank's failure record (ERROR_MARKER)
    exit: ExitReport | None = None  # the shim's exit report (EXIT_MARKER)

    @property
    def empty(self) -> bool:
        """The line held only markers: show nothing."""
        return not self.text and (self.error is not None or self.exit is not None)


def _take(text: str, marker: str, read: Callable[[Any], Any]) -> tuple[str, Any]:
    at = text.find(marker)
    if at < 0:
        return text, None
    try:
        record = read(json.loads(text[at + len(marker):]))
    except ValueError:
        return text, None  # not ours after all (a program printing the word): shown as is
    if record is None:
        return text, None
    return text[:at], record


def strip_markers(text: str, terminator: str = "\n") -> Markers:
    """Remove the markers from one output line; what came before a marker on the line stays.

    A marker that is not followed by a JSON object (for the error marker: a failure record) is
    left in the text (it was not written by Horovod). The line's terminator becomes ``"\\n"`` when a
    marker ended it (the marker line always ends the text a rank had written on it).
    """
    text, error = _take(text, ERROR_MARKER, FailureRecord.from_wire)
    text, exit_info = _take(text, EXIT_MARKER, ExitReport.from_wire)
    if error is not None or exit_info is not None:
        terminator = "\n"
    return Markers(text, terminator, error, exit_info)


# ------------------------------------------------------------------------------ rank identity
@dataclass(frozen=True)
class RankIdentity:
    """Where one rank sits in its job: its host, and its global, local (on its host) and cross
    (across hosts, among the ranks of its local rank) numbers.

    A launcher's slot (``horovod.runner.hosts.SlotInfo`` is this type), an elastic round's member
    (:attr:`RoundInfo.slot`) and an initialised rank's place (``horovod.common.topology``).
    """

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int

    def env(self) -> dict[str, str]:
        """The identity variables a launcher gives the worker of this slot (upstream's names)."""
        return {"HOROVOD_HOSTNAME": self.hostname, "HOROVOD_RANK": str(self.rank),
                "HOROVOD_SIZE": str(self.size), "HOROVOD_LOCAL_RANK": str(self.local_rank),
                "HOROVOD_LOCAL_SIZE": str(self.local_size), "HOROVOD_CROSS_RANK": str(self.cross_rank),
                "HOROVOD_CROSS_SIZE": str(self.cross_size)}


def _malformed(what: str, answer: Any, exc: Exception) -> Exception:
    from horovod.common.exceptions import HorovodInternalError  # a worker reads answers; the shim never

    shown = (dict(answer) if isinstance(answer, Mapping)
             else answer.decode(errors="replace") if isinstance(answer, bytes) else answer)
    return HorovodInternalError(f"{what} {shown!r:.300} is malformed ({exc!r}): the launcher and "
                                "this worker run different horovod-py versions?")


_FIELD_TYPES: dict[str, Callable[[Any], Any]] = {"int": int, "str": str, "bool": bool}


def _read_fields(cls: Any, answer: Mapping[str, Any]) -> dict[str, Any]:
    return {f.name: _FIELD_TYPES[f.type](answer[f.name]) for f in fields(cls) if f.type in _FIELD_TYPES}


# ------------------------------------------------------------------------------ store scopes, keys
STORE_KEY = "store"  # rank 0's authenticated store, "host:port", under gloo_scope() / round_scope()
# Under a round's scope: why the driver gave the round up (one of its members died or left). Every
# member still forming the round (waiting for the store, creating the Gloo device or the process
# group) notices it within ABANDON_POLL_SECONDS and asks for the next round instead of waiting for
# a timeout; ABANDONED_STORE under STORE_KEY ends the wait of a member for rank 0's address.
ABANDONED_KEY = "abandoned"
ABANDONED_STORE = b"abandoned"
ABANDON_POLL_SECONDS = 0.25
# horovod.run(): the pickled (function, args, kwargs) under FUNC_SCOPE/FUNC_KEY; every worker's
# pickled Outcome under RESULT_SCOPE/<rank or RESULT_KEY_ENV>.
FUNC_SCOPE = "runfunc"
FUNC_KEY = "func"
RESULT_SCOPE = "runfunc_result"
# horovod.spark.run: a task's executor (JSON) and the environment the driver computed for it.
SPARK_TASK_SCOPE = "spark_task"
SPARK_ENV_SCOPE = "spark_env"
# horovod.spark.run_elastic agents: registration, heartbeats, commands from the driver, exits.
SPARK_AGENT_SCOPE = "spark_agent"
SPARK_HEARTBEAT_SCOPE = "spark_agent_hb"
SPARK_COMMAND_SCOPE = "spark_agent_cmd"
SPARK_EXIT_SCOPE = "spark_agent_exit"
# Spark tasks' output lines, batched (horovod.spark.output).
SPARK_OUTPUT_SCOPE = "spark_output"


def gloo_scope(sequence: int) -> str:
    """The scope of the ``sequence``-th Gloo store a worker of a static job creates (every rank
    creates its stores in the same order: init, shutdown, init...)."""
    return f"gloo.{sequence}"


def spark_agent_key(agent: str, number: int) -> str:
    """The key of an elastic Spark agent's ``number``-th command (:data:`SPARK_COMMAND_SCOPE`), or
    of the exit of the worker it started ``number``-th (:data:`SPARK_EXIT_SCOPE`)."""
    return f"{agent}.{number}"


def spark_output_key(source: str | int, batch: int) -> str:
    """The key of the ``batch``-th output batch of a Spark task (``source``: its rank, or an
    elastic agent's name) under :data:`SPARK_OUTPUT_SCOPE`."""
    return f"{source}.{batch}"


def round_scope(round_number: int) -> str:
    """The rendezvous scope a round's members meet under (its store address, its abandon key)."""
    return f"elastic.{round_number}"


# ------------------------------------------------------------------------------ elastic calls
READY_CALL = "ready"
NOTICE_CALL = "notice"


@dataclass(frozen=True)
class ReadyRequest:
    """``ready``: "the worker of slot ``host[slot]`` is ready for the round after ``after``"."""

    host: str
    slot: int
    after: int = -1
    reason: str = ""  # why it asks: start, error, added, removed, retry
    pid: int = 0

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, request: Mapping[str, Any]) -> ReadyRequest:
        return cls(str(request["host"]), int(request["slot"]), int(request.get("after", -1)),
                   str(request.get("reason", "")), int(request.get("pid", 0)))


@dataclass(frozen=True)
class Wait:
    """Answer to ``ready``: ask again (the round has not formed yet)."""

    def to_wire(self) -> dict[str, Any]:
        return {"status": "wait"}


@dataclass(frozen=True)
class Removed:
    """Answer to ``ready``: the job goes on without this worker."""

    message: str

    def to_wire(self) -> dict[str, Any]:
        return {"status": "removed", "message": self.message}


@dataclass(frozen=True)
class Stop:
    """Answer to ``ready``: the job is over."""

    message: str

    def to_wire(self) -> dict[str, Any]:
        return {"status": "stop", "message": self.message}


@dataclass(frozen=True)
class RoundInfo:
    """Answer to ``ready``: this worker's place (``slot``) in round ``round`` of an elastic job;
    ``skip_sync``: every member comes from the last round with the same committed state;
    ``notice``: the host notices already reflected in this round."""

    round: int
    slot: RankIdentity
    skip_sync: bool
    notice: int

    def to_wire(self) -> dict[str, Any]:
        """The JSON object of the answer (the slot's fields inline)."""
        return {"status": "round", "round": self.round, **asdict(self.slot),
                "skip_sync": self.skip_sync, "notice": self.notice}

    @classmethod
    def from_wire(cls, answer: Mapping[str, Any]) -> RoundInfo:
        """Read a ``round`` answer (``to_wire``).

        Raises:
            HorovodInternalError: a field is missing or of the wrong type.
        """
        try:
            return cls(int(answer["round"]), RankIdentity(**_read_fields(RankIdentity, answer)),
                       bool(answer["skip_sync"]), int(answer["notice"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise _malformed("elastic driver's round answer", answer, exc) from exc


ReadyAnswer = Wait | Removed | Stop | RoundInfo


def ready_answer(answer: Mapping[str, Any]) -> ReadyAnswer:
    """Read the driver's answer to ``ready`` (the ``to_wire`` of one of the four answers).

    Raises:
        HorovodInternalError: an unknown status, or a malformed answer.
    """
    status = answer.get("status")
    if status == "wait":
        return Wait()
    if status == "round":
        return RoundInfo.from_wire(answer)
    if status in ("removed", "stop"):
        return (Removed if status == "removed" else Stop)(str(answer.get("message") or ""))
    raise _malformed("elastic driver's answer", answer, ValueError(f"unknown status {status!r}"))


@dataclass(frozen=True)
class NoticeRequest:
    """``notice``: "tell me about host changes newer than notice ``after``"."""

    after: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"after": self.after}

    @classmethod
    def from_wire(cls, request: Mapping[str, Any]) -> NoticeRequest:
        return cls(int(request.get("after", 0)))


@dataclass(frozen=True)
class Notice:
    """Answer to ``notice``: the newest host notice, and what it changed (``HostUpdateResult``)."""

    version: int = 0
    update: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "update": self.update}

    @classmethod
    def from_wire(cls, answer: Mapping[str, Any]) -> Notice:
        return cls(int(answer.get("version", 0)), int(answer.get("update", 0)))


# ------------------------------------------------------------------------------ outcomes
# What a worker's function ended with, as the worker reports it (pickled: the value and the
# exception go as they are). ``horovod.runner.run_task`` stores Returned or Raised under
# RESULT_SCOPE; a Ray worker (``BaseHorovodWorker.execute_reported``) returns one of the three
# through Ray's object store. Died is the launcher's own record of a worker that never reported.
@dataclass(frozen=True)
class Returned:
    """A worker's function returned ``value``."""

    value: Any


@dataclass(frozen=True)
class Raised:
    """A worker's function raised ``error`` (``traceback``: its text, as the worker printed it)."""

    error: BaseException
    traceback: str = ""


@dataclass(frozen=True)
class Exited:
    """A worker's function called ``sys.exit(code)`` (an elastic worker the job went on without
    exits 0); a non-integer exit code counts as 1."""

    code: int = 0


@dataclass(frozen=True)
class Died:
    """The launcher's record of a worker whose process was lost before it reported (killed, out
    of memory, its node or executor gone): ``error`` is how the launcher saw it."""

    error: BaseException


TaskOutcome = Returned | Raised | Exited
WorkerOutcome = Returned | Raised | Exited | Died


def task_outcome(item: object, who: str = "a worker") -> TaskOutcome:
    """``item`` if it is what a worker reports (:data:`TaskOutcome`), for the launcher reading it.

    Raises:
        HorovodInternalError: anything else (a worker of another horovod-py version).
    """
    if isinstance(item, Returned | Raised | Exited):
        return item
    from horovod.common.exceptions import HorovodInternalError  # the launcher reads; the shim never

    raise HorovodInternalError(f"{who} reported {type(item).__name__} {item!r:.200}, not an outcome "
                               "(Returned, Raised or Exited): the launcher and this worker run "
                               "different horovod-py versions?")


# ------------------------------------------------------------------------------ Spark messages
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
