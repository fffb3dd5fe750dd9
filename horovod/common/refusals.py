"""Bounded, rate-limited logging of refused network peers (the store and the rendezvous service).

A service that refuses strangers must say so (an operator wants to know that somebody knocks),
but a flood of strangers must not flood the log or grow memory: each address is named once (up
to ``max_addresses`` of them), and everything past that, like every overload event, is summed up
in at most one line per ``interval`` seconds. Standard library only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["RefusalLog"]


class RefusalLog:
    """Log refusals once per address and overload events at most once per interval."""

    def __init__(self, logger: logging.Logger, service: str, max_addresses: int = 256,
                 interval: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.service = logger, service
        self.max_addresses, self.interval, self._clock = max_addresses, interval, clock
        self._lock = threading.Lock()
        self._named: set[str] = set()
        self.refused = 0  # every refusal, logged or not
        self._quiet: dict[str, int] = {}  # what happened since that kind's last line
        self._last: dict[str, float] = {}
        self.lines = 0

    def refuse(self, peer: str, why: str, port: int | None = None) -> None:
        """A peer failed authentication (or sent garbage): name it once, then only count it.

        ``port``: the peer's source port, shown with the address in the one line.
        """
        with self._lock:
            self.refused += 1
            if peer not in self._named and len(self._named) < self.max_addresses:
                self._named.add(peer)
                self.lines += 1
                named = True
            else:
                named = False
        if named:
            self.logger.warning("%s refused a connection from %s (%s); further refusals of this "
                                "address are not logged", self.service,
                                peer if port is None else f"{peer}:{port}", why)
        else:
            self.event("refusal", "refused connections from addresses already named or past the "
                                  f"first {self.max_addresses}")

    def event(self, kind: str, what: str) -> None:
        """Count one ``kind`` event; log ``what`` with the count at most once per interval."""
        now = self._clock()
        with self._lock:
            count = self._quiet.get(kind, 0) + 1
            last = self._last.get(kind)
            if last is not None and now - last < self.interval:
                self._quiet[kind] = count
                return
            self._quiet[kind] = 0
            self._last[kind] = now
            self.lines += 1
        self.logger.warning("%s: %s (%d since the last such line; at most one line per %g s)",
                            self.service, what, count, self.interval)
