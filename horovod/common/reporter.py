"""A rank's reporter: push ``hvd.metrics()`` to the launcher's monitor service, in the background.

Started by ``Context.start`` when the launcher passed ``HOROVOD_MONITOR_ADDR`` and
``HOROVOD_MONITOR_PORT`` (``horovodrun --monitor-port``). One daemon thread per rank posts this
rank's counters at most once per ``HOROVOD_MONITOR_INTERVAL`` seconds (default 1) as one JSON
body, signed with the job secret like every request to the launcher (``horovod.common.rendezvous``).
It only reads a snapshot of the engine's counters: nothing runs on a collective's path, and a slow,
unreachable or refusing service only makes this thread wait (with a short timeout) and retry later.
The same channel serves MPI, Gloo and elastic jobs.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from horovod.common import protocol
from horovod.common.rendezvous import RendezvousClient, RendezvousError

__all__ = ["Reporter", "from_env"]

log = logging.getLogger("horovod")

_TIMEOUT = 2.0


class Reporter:
    """Post ``snapshot()`` as this rank's ``protocol.MonitorReport`` to ``client`` every
    ``interval`` seconds."""

    def __init__(self, client: RendezvousClient, snapshot: Callable[[], Mapping[str, Any]], *, rank: int,
                 local_rank: int = -1, host: str = "", interval: float = 1.0) -> None:
        self.client = client
        self.snapshot = snapshot
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
                self.snapshot(), rank=self.rank, local_rank=self.local_rank, host=self.host,
                time=time.time(), final=final)
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

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.push()


def from_env(environ: Mapping[str, str], snapshot: Callable[[], dict[str, Any]], rank: int,
             local_rank: int, host: str | None = None) -> Reporter | None:
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
                        interval=interval)
    reporter.start()
    return reporter
