"""The elastic calls (``POST /elastic/<call>``, JSON both ways): requests and answers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ._reading import _malformed, _read_fields
from .identity import RankIdentity

__all__ = ["READY_CALL", "NOTICE_CALL", "ReadyRequest", "Wait", "Removed", "Stop", "RoundInfo", "ReadyAnswer",
           "ready_answer", "NoticeRequest", "Notice", "BEAT_CALL", "Beat", "BeatAnswer",
           "HEARTBEAT_INTERVAL_ENV", "HEARTBEAT_TIMEOUT_ENV", "DEFAULT_HEARTBEAT_INTERVAL",
           "DEFAULT_HEARTBEAT_TIMEOUT"]

READY_CALL = "ready"
NOTICE_CALL = "notice"
BEAT_CALL = "beat"

# A worker's heartbeat: a daemon thread of the worker process beats every interval (so a stopped
# or partitioned process falls silent while one whose main thread computes keeps beating); the
# driver declares a worker that was silent for the timeout hung, kills it and goes on without it.
HEARTBEAT_INTERVAL_ENV = "HOROVOD_ELASTIC_HEARTBEAT_INTERVAL"
HEARTBEAT_TIMEOUT_ENV = "HOROVOD_ELASTIC_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_INTERVAL = 0.5
DEFAULT_HEARTBEAT_TIMEOUT = 5.0


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


@dataclass(frozen=True)
class Beat:
    """``beat``: "the worker of slot ``host[slot]`` (process ``pid``) is alive", sent by a
    daemon thread of the worker every ``HOROVOD_ELASTIC_HEARTBEAT_INTERVAL`` seconds;
    ``leaving``: its last beat, sent as the process exits (its end is watched from then on, not
    its heartbeat: an interpreter's finalization may hold the GIL for a while)."""

    host: str
    slot: int
    pid: int = 0
    leaving: bool = False

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, request: Mapping[str, Any]) -> Beat:
        return cls(str(request["host"]), int(request["slot"]), int(request.get("pid", 0)),
                   bool(request.get("leaving", False)))


@dataclass(frozen=True)
class BeatAnswer:
    """Answer to ``beat``: ``beating`` False once the driver no longer watches this worker (it
    was removed, or the job is over): the worker stops beating."""

    beating: bool = True

    def to_wire(self) -> dict[str, Any]:
        return {"beating": self.beating}

    @classmethod
    def from_wire(cls, answer: Mapping[str, Any]) -> BeatAnswer:
        return cls(bool(answer.get("beating", True)))
