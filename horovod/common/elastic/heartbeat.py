"""An elastic worker's heartbeat: proof of life that does not depend on the main thread.

A daemon thread of the worker process (not of its shim) sends ``beat`` (``protocol.Beat``) to
the elastic driver every ``HOROVOD_ELASTIC_HEARTBEAT_INTERVAL`` seconds (0.5). A process that is
stopped (SIGSTOP, a debugger), frozen or cut off from the driver stops beating with all its
threads, and the driver leaves it behind after ``HOROVOD_ELASTIC_HEARTBEAT_TIMEOUT`` seconds of
silence; a main thread busy for minutes in Python code or in a collective leaves this thread
running, so such a worker is kept. Started by the first ``join_round`` of an elastic worker;
it stops when the driver answers that it no longer watches this worker, and as the process
exits it sends a last beat saying so (``Beat.leaving``): the driver then watches the process's
end instead (an interpreter's finalization may hold the GIL for seconds).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Mapping

from horovod.common import protocol
from horovod.common.rendezvous import RendezvousClient, RendezvousError

__all__ = ["start_heartbeat", "heartbeat_interval", "leave"]

log = logging.getLogger("horovod")

_lock = threading.Lock()
_thread: threading.Thread | None = None
_pid = 0
_stop = threading.Event()
_last: tuple[RendezvousClient, protocol.Beat] | None = None
_atexit_registered = False


def heartbeat_interval(environ: Mapping[str, str]) -> float:
    """``HOROVOD_ELASTIC_HEARTBEAT_INTERVAL`` (seconds; the default when unset or not positive)."""
    raw = environ.get(protocol.HEARTBEAT_INTERVAL_ENV, "")
    try:
        value = float(raw) if raw.strip() else protocol.DEFAULT_HEARTBEAT_INTERVAL
    except ValueError:
        log.warning("%s=%r is not a number of seconds; beating every %g s",
                    protocol.HEARTBEAT_INTERVAL_ENV, raw, protocol.DEFAULT_HEARTBEAT_INTERVAL)
        value = protocol.DEFAULT_HEARTBEAT_INTERVAL
    return value if value > 0 else protocol.DEFAULT_HEARTBEAT_INTERVAL


def _beat(client: RendezvousClient, beat: protocol.Beat, interval: float,
          stop: threading.Event) -> None:
    request = beat.to_wire()
    while not stop.is_set():
        try:
            ans = protocol.BeatAnswer.from_wire(
                client.call(protocol.BEAT_CALL, request, timeout=max(2.0, 4 * interval)))
        except RendezvousError as exc:
            if getattr(exc, "status", None) == 404:  # a driver without heartbeats (or no elastic job any more)
                return
            ans = protocol.BeatAnswer(True)  # the driver is busy or briefly unreachable: go on
        if not ans.beating:
            return
        stop.wait(interval)


def start_heartbeat(client: RendezvousClient, host: str, slot: int,
                    environ: Mapping[str, str] | None = None) -> None:
    """Start this process's heartbeat thread (once per process; again in a forked child)."""
    global _thread, _pid, _stop, _last, _atexit_registered
    environ = os.environ if environ is None else environ
    with _lock:
        if _thread is not None and _thread.is_alive() and _pid == os.getpid():
            return
        _pid, _stop = os.getpid(), threading.Event()
        beat = protocol.Beat(host, slot, os.getpid())
        _last = (client, beat)
        _thread = threading.Thread(target=_beat, args=(client, beat, heartbeat_interval(environ), _stop),
                                   name="horovod-elastic-heartbeat", daemon=True)
        _thread.start()
        if not _atexit_registered:
            atexit.register(leave)
            _atexit_registered = True


def leave() -> None:
    """Stop beating and tell the driver that this process is exiting (at exit)."""
    with _lock:
        last = _last if _pid == os.getpid() else None
        _stop.set()
    if last is None:
        return
    client, beat = last
    try:
        client.call(protocol.BEAT_CALL, {**beat.to_wire(), "leaving": True}, timeout=2.0)
    except Exception:  # noqa: BLE001 - best effort at exit: the driver watches the exit anyway
        log.debug("elastic: the last heartbeat failed", exc_info=True)
