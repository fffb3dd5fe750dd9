"""The two stderr markers (a rank's failure record, the shim's exit report) and the shim's life line."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ERROR_MARKER", "EXIT_MARKER", "FAILURE_KINDS", "FailureRecord", "ExitReport", "error_line",
           "exit_line", "env_line", "parse_env_line", "signal_line", "parse_signal_line", "Markers",
           "strip_markers"]

ERROR_MARKER = "__HOROVOD_RANK_ERROR__ "
EXIT_MARKER = "__HOROVOD_RUNNER_EXIT__ "


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


#: a rank's own error, or one that only says a peer left (a consequence of another failure), or
#: "finished": its program ended normally (code 0; written as it exits, so that a rank whose peers
#: still wait in a collective for it is named as having left early)
FAILURE_KINDS = ("cause", "consequence", "finished")


@dataclass(frozen=True)
class FailureRecord:
    """Why a rank's process ends badly, as the rank writes it the moment it fails
    (``horovod.common.lifecycle``: the file named by :data:`EXIT_RECORD_ENV`, and
    :data:`ERROR_MARKER` with its ``rank``), or as a launcher makes it from an exception a
    function raised (``horovod.runner.failures.exception_record``): its exit code, whether the
    error is its own (``"cause"``) or the consequence of a peer leaving (``"consequence"``), the
    error's text, when (``time.time()``), and the rank where known; ``waiting``: the collective
    a consequence came from ("broadcast 'zero.consolidate.0.sz'"), where known. Kind
    ``"finished"``: the program ended normally at ``time`` (code 0)."""

    code: int | None
    kind: str
    error: str
    time: float | None
    rank: int | None = None
    waiting: str = ""

    def to_wire(self) -> dict[str, Any]:
        """The JSON object (``rank`` and ``waiting`` only where known)."""
        wire: dict[str, Any] = {"code": self.code, "kind": self.kind, "error": self.error, "time": self.time}
        if self.waiting:
            wire["waiting"] = self.waiting
        return wire if self.rank is None else {**wire, "rank": self.rank}

    @classmethod
    def from_wire(cls, record: Any) -> FailureRecord | None:
        """The record in a JSON object, or None where it is none (no object, an unknown kind:
        another program's text, or a malformed record, which a launcher ignores)."""
        if not isinstance(record, Mapping) or record.get("kind") not in FAILURE_KINDS:
            return None
        return cls(_int_or_none(record.get("code")), str(record["kind"]), str(record.get("error") or ""),
                   _float_or_none(record.get("time")), _int_or_none(record.get("rank")),
                   str(record.get("waiting") or ""))


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
