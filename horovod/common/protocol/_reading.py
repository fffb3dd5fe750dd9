"""Helpers the protocol's readers share (private)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any


def _malformed(what: str, answer: Any, exc: Exception) -> Exception:
    from horovod.common.exceptions import HorovodInternalError  # a worker reads answers; the shim never

    shown = (dict(answer) if isinstance(answer, Mapping)
             else answer.decode(errors="replace") if isinstance(answer, bytes) else answer)
    return HorovodInternalError(f"{what} {shown!r:.300} is malformed ({exc!r}): the launcher and "
                                "this worker run different horovod-py versions?")


_FIELD_TYPES: dict[str, Callable[[Any], Any]] = {"int": int, "str": str, "bool": bool}


def _read_fields(cls: Any, answer: Mapping[str, Any]) -> dict[str, Any]:
    return {f.name: _FIELD_TYPES[f.type](answer[f.name]) for f in fields(cls) if f.type in _FIELD_TYPES}
