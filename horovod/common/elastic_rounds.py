"""What the elastic driver and its workers say about rounds (standard library only).

Both sides import this module: the driver (``horovod.runner.elastic.driver``) builds a
``RoundInfo`` per member and answers ``ready`` with ``RoundInfo.to_wire()``; the worker
(``horovod.common.elastic.worker``) reads it back with ``RoundInfo.from_wire()``. A round's
members meet under ``round_scope(round)`` on the launcher's rendezvous service; the driver writes
``ABANDONED_KEY`` there when it gives the round up (one of its members died or left): every member
still forming the round (waiting for the store, creating the Gloo device or the process group)
notices it within ``ABANDON_POLL_SECONDS`` and asks for the next round instead of waiting for a
timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from horovod.common.exceptions import HorovodInternalError

__all__ = ["RoundInfo", "ABANDONED_KEY", "ABANDON_POLL_SECONDS", "round_scope"]

ABANDONED_KEY = "abandoned"
ABANDON_POLL_SECONDS = 0.25


def round_scope(round_number: int) -> str:
    """The rendezvous scope a round's members meet under (its store address, its abandon key)."""
    return f"elastic.{round_number}"


@dataclass(frozen=True)
class RoundInfo:
    """This worker's place in one round of an elastic job."""

    round: int
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    skip_sync: bool
    notice: int

    def to_wire(self) -> dict[str, Any]:
        """The driver's answer to ``ready`` that places a worker in this round (JSON object)."""
        return {"status": "round", **asdict(self)}

    @classmethod
    def from_wire(cls, answer: Mapping[str, Any]) -> RoundInfo:
        """Read the driver's ``round`` answer (``to_wire``).

        Raises:
            HorovodInternalError: a field is missing or of the wrong type.
        """
        try:
            return cls(**{f.name: _FIELD_TYPES[f.type](answer[f.name])  # type: ignore[index]
                          for f in fields(cls)})
        except (KeyError, TypeError, ValueError) as exc:
            raise HorovodInternalError(f"elastic driver's round answer {dict(answer)!r} is "
                                       f"malformed ({exc!r}): the launcher and this worker run "
                                       "different horovod-py versions?") from exc


_FIELD_TYPES: dict[str, Callable[[Any], Any]] = {"int": int, "str": str, "bool": bool}
