"""What the bindings keep between calls for one job: made by ``hvd.init()``, dropped by ``shutdown()``.

Each ``Context`` owns one ``JobState`` (``Context.state``). State that lived in module-level
one-element lists (a joined rank's CUDA device, the numbers of checkpoint saves and of
``fully_shard`` groups, the last error of a traced JAX collective) lives here instead, so that a
``shutdown()`` and a new ``init()`` start from nothing on every rank alike: an elastic reset, or a
rank that joins a running job, numbers its operations from the same start as the others.

Framework objects are held as ``Any``: the core imports no framework.
"""

from __future__ import annotations

from typing import Any

from horovod.common.current import peek_context

__all__ = ["JobState", "next_number"]


class JobState:
    """One job's binding state (see the module docstring)."""

    __slots__ = ("join_device", "traced_error", "_numbers")

    def __init__(self) -> None:
        #: torch: where a joined rank makes its zero contributions to CUDA allreduces
        #: (``hvd.join(device)``); None: the last CUDA device the device plane ran on
        self.join_device: Any = None
        #: jax: the exception a collective last raised inside a compiled program (``last_error``)
        self.traced_error: BaseException | None = None
        self._numbers: dict[str, int] = {}

    def next_number(self, what: str) -> int:
        """1, 2, 3, ... per ``what`` (a save's, a group's number in collective names that every
        rank makes in the same order)."""
        n = self._numbers[what] = self._numbers.get(what, 0) + 1
        return n


def next_number(what: str) -> int:
    """The live job's ``JobState.next_number(what)``; 0 without a job (a single process: no
    collective name to agree on)."""
    ctx = peek_context()
    return 0 if ctx is None else ctx.state.next_number(what)
