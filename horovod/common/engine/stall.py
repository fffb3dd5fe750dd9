"""Stall inspector: report tensors that some ranks submitted and others did not. PURE.

The coordinator calls ``StallInspector.check`` with the stalled names from its message table; the
inspector decides, from an injected clock, when to warn and when a stall has lasted long enough to
shut the job down.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["StallInspector", "StallReport", "format_stall_report"]

_MAX_NAMES = 6


@dataclass(frozen=True)
class StallReport:
    message: str
    shutdown: bool
    missing: dict[int, list[str]]


def format_stall_report(stalled: Sequence[tuple[str, list[int], list[int], float]], warn_after: float,
                        shutdown_after: float) -> StallReport:
    """Build the warning text for stalled names: (name, submitted ranks, missing ranks, age)."""
    missing: dict[int, list[str]] = {}
    over: set[int] = set()
    for name, _submitted, absent, age in stalled:
        for r in absent:
            missing.setdefault(r, []).append(name)
            if shutdown_after > 0 and age >= shutdown_after:
                over.add(r)
    lines = [
        f"One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks "
        f"and are waiting for remainder of ranks for more than {warn_after:g} seconds. This may "
        "indicate that different ranks are trying to submit different tensors or that only subset "
        "of ranks is submitting tensors, which will cause deadlock.",
    ]
    for name, submitted, absent, age in stalled[:_MAX_NAMES]:
        lines.append(f"  {name!r}: waiting {age:.0f} s; submitted by ranks {submitted}, missing on ranks {absent}")
    if len(stalled) > _MAX_NAMES:
        lines.append(f"  ... and {len(stalled) - _MAX_NAMES} more")
    lines.append("Missing ranks:")
    for r in sorted(missing):
        names = missing[r]
        shown = ", ".join(names[:_MAX_NAMES]) + (" ..." if len(names) > _MAX_NAMES else "")
        lines.append(f"{r}{'!' if r in over else ''}: [{shown}]")
    if over:
        lines.append(f"Ranks marked with '!' exceeded the shutdown limit of {shutdown_after:g} seconds "
                     "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS); Horovod will shut down.")
    return StallReport("\n".join(lines), bool(over), missing)


class StallInspector:
    """Decide when to look for stalls and what to report.

    Args:
        warn_after: ``HOROVOD_STALL_CHECK_TIME_SECONDS``: age at which a waiting name is reported,
            also the period between reports.
        shutdown_after: ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (0: never shut down).
        clock: monotonic clock.
    """

    def __init__(self, warn_after: float, shutdown_after: float, clock: Callable[[], float]) -> None:
        self.warn_after = warn_after
        self.shutdown_after = shutdown_after if shutdown_after > warn_after else 0.0
        self._clock = clock
        self._next_check = clock() + min(warn_after, 1.0)

    def due(self) -> bool:
        """True when it is time to look at the message table again (cheap; call every round)."""
        return self._clock() >= self._next_check

    def check(self, stalled: Sequence[tuple[str, list[int], list[int], float]]) -> StallReport | None:
        """Return a report for names older than the warning time, at most once per period."""
        now = self._clock()
        self._next_check = now + min(self.warn_after, 1.0)
        relevant = [s for s in stalled if s[3] >= self.warn_after and s[2]]
        if not relevant:
            return None
        report = format_stall_report(relevant, self.warn_after, self.shutdown_after)
        if not report.shutdown:
            # Warn once per period, but keep checking often enough to catch the shutdown limit.
            self._next_check = now + (self.warn_after if self.shutdown_after == 0
                                      else min(self.warn_after, 1.0))
        return report
