"""A rank's reporter: push ``hvd.metrics()`` to the launcher's monitor service, in the background.

Started by ``Context.start`` when the launcher passed ``HOROVOD_MONITOR_ADDR`` and
``HOROVOD_MONITOR_PORT`` (``horovodrun --monitor-port``). One daemon thread per rank posts this
rank's counters at most once per ``HOROVOD_MONITOR_INTERVAL`` seconds (default 1) as one JSON
body, signed with the job secret like every request to the launcher (``horovod.common.rendezvous``).
It only reads a snapshot of the engine's counters: nothing runs on a collective's path, and a slow,
unreachable or refusing service only makes this thread wait (with a short timeout) and retry later.
The same channel serves MPI, Gloo and elastic jobs.

Each report also says where the rank is (the monitor's ``/api/stacks``): its pid, its main
thread's stack as the stall report prints it (at most ``STACK_FRAMES`` innermost frames and
``STACK_CHARS`` characters) and a short flight record (the last ``FLIGHT_DONE`` completed and the
first ``FLIGHT_IN_FLIGHT`` in-flight collectives, a grouped one with its first ``FLIGHT_SHAPES``
shapes). When that cannot be read, the report carries the counters alone. Reading them from this thread needs nothing of
the main thread, so a rank stuck in user code still says where; it costs tens of microseconds per
report (docs/monitor.md).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from horovod.common import protocol
from horovod.common.engine.diagnosis import format_stack, main_stack, user_frame
from horovod.common.rendezvous import RendezvousClient, RendezvousError

__all__ = ["Reporter", "from_env", "whereabouts"]

log = logging.getLogger("horovod")

_TIMEOUT = 2.0
# What a report says of where the rank is: bounded, so that a deep stack or a long name cannot
# make reports large or slow.
STACK_FRAMES = 40
STACK_CHARS = 8000
FLIGHT_DONE = 8
FLIGHT_IN_FLIGHT = 8
FLIGHT_SHAPES = 16  # a grouped operation's first shapes


def whereabouts(flight: Callable[[int, int], Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """This process's pid, its main thread's innermost user frame and stack (text, as the stall
    report prints it, cut to ``STACK_CHARS`` keeping the innermost frames) and, with ``flight``
    (``Engine.flight_record``), its last completed and first in-flight collectives; any thread."""
    frames = main_stack(STACK_FRAMES)
    stack = "\n".join(format_stack(frames, "  "))
    if frames is not None and len(frames) >= STACK_FRAMES:
        stack = f"  ... (outer frames cut: the innermost {STACK_FRAMES} shown)\n" + stack
    if len(stack) > STACK_CHARS:
        cut = stack.find("\n", len(stack) - STACK_CHARS)
        stack = "  ... (outer frames cut)" + stack[cut if cut >= 0 else len(stack) - STACK_CHARS:]
    out: dict[str, Any] = {"pid": os.getpid(), "where": user_frame(frames), "stack": stack}
    if flight is not None:
        record = flight(FLIGHT_DONE, FLIGHT_IN_FLIGHT)
        out["flight"] = {
            "done": [[*r[:5], r[5][:FLIGHT_SHAPES], *r[6:]] for r in record.get("done", [])[-FLIGHT_DONE:]],
            "in_flight": [[*r[:5], r[5][:FLIGHT_SHAPES], *r[6:]]
                          for r in record.get("in_flight", [])[:FLIGHT_IN_FLIGHT]]}
    return out


class Reporter:
    """Post ``snapshot()`` as this rank's ``protocol.MonitorReport`` to ``client`` every
    ``interval`` seconds, with where the rank is (``whereabouts``; ``flight``: the engine's
    ``flight_record``)."""

    def __init__(self, client: RendezvousClient, snapshot: Callable[[], Mapping[str, Any]], *, rank: int,
                 local_rank: int = -1, host: str = "", interval: float = 1.0,
                 flight: Callable[[int, int], Mapping[str, Any]] | None = None) -> None:
        self.client = client
        self.snapshot = snapshot
        self.flight = flight
        self.rank, self.local_rank, self.host = rank, local_rank, host
        self.interval = max(float(interval), 0.1)
        self.sent = 0
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="horovod-monitor-reporter",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, final: bool = True) -> None:
        """Stop the thread; with ``final``, push the last counters once more (short timeout)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(_TIMEOUT + 1.0)
        if final:
            self.push(final=True)

    def push(self, final: bool = False) -> bool:
        try:
            report = protocol.MonitorReport.from_snapshot(
                {**self.snapshot(), **self._whereabouts()}, rank=self.rank,
                local_rank=self.local_rank, host=self.host, time=time.time(), final=final)
            status, _ = self.client.request("POST", protocol.REPORT_PATH,
                                            json.dumps(report.to_wire()).encode(), timeout=_TIMEOUT)
        except (RendezvousError, OSError, ValueError) as exc:
            if not self._warned:
                self._warned = True
                log.warning("cannot report to the monitor at %s:%s (%s); the job goes on, "
                            "reporting is retried every %g s", self.client.addr, self.client.port,
                            exc, self.interval)
            return False
        except Exception:  # noqa: BLE001 - the engine stopped meanwhile, and the like
            log.debug("monitor report failed", exc_info=True)
            return False
        if status == 200:
            self.sent += 1
        return status == 200

    def _whereabouts(self) -> dict[str, Any]:
        try:
            return whereabouts(self.flight)
        except Exception:  # noqa: BLE001 - the engine stopped meanwhile: the counters still go
            log.debug("monitor report: cannot read where the rank is", exc_info=True)
            return {"pid": os.getpid()}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.push()


def from_env(environ: Mapping[str, str], snapshot: Callable[[], dict[str, Any]], rank: int,
             local_rank: int, host: str | None = None,
             flight: Callable[[int, int], Mapping[str, Any]] | None = None) -> Reporter | None:
    """A started ``Reporter`` when the launcher asked for one, else None."""
    addr, port = environ.get(protocol.MONITOR_ADDR_ENV), environ.get(protocol.MONITOR_PORT_ENV)
    secret = environ.get(protocol.SECRET_ENV)
    if not addr or not port:
        return None
    if not secret:
        log.warning("%s is set but %s is not: cannot sign monitor reports; not reporting",
                    protocol.MONITOR_ADDR_ENV, protocol.SECRET_ENV)
        return None
    try:
        interval = float(environ.get(protocol.MONITOR_INTERVAL_ENV) or 1.0)
    except ValueError:
        interval = 1.0
    reporter = Reporter(RendezvousClient(addr, int(port), secret, timeout=_TIMEOUT), snapshot,
                        rank=rank, local_rank=local_rank,
                        host=host or environ.get("HOROVOD_HOSTNAME") or socket.gethostname(),
                        interval=interval, flight=flight)
    reporter.start()
    return reporter
