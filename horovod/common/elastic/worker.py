"""The worker's side of an elastic job: join each round of the job, and hear about host changes.

An elastic worker (started by the elastic driver with ``HOROVOD_ELASTIC=1``) is known to the
driver by its slot: the host name and local rank it was started with. Two calls of the rendezvous
protocol (``horovod.common.rendezvous``, ``POST /elastic/<call>``, JSON both ways) carry
everything:

* ``ready`` (``protocol.ReadyRequest``): "I am ready for the next round after round ``after``".
  The driver holds the request for a moment and answers ``Wait`` (ask again), ``RoundInfo``
  (this worker's place in the new round), ``Removed`` (the job goes on without this worker) or
  ``Stop`` (the job is over).
* ``notice`` (``protocol.NoticeRequest``): the driver holds the request until a host-change
  notice newer than ``after`` exists (or a few seconds pass) and answers ``protocol.Notice``.

``horovod.common.elastic.rounds`` calls ``join_round`` from ``hvd.init()``;
``NotificationManager`` runs one background thread per worker that long-polls ``notice`` and
hands notices to registered states.
"""

from __future__ import annotations

import atexit
import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TypeVar

from horovod.common import protocol
from horovod.common.elastic import heartbeat
from horovod.common.exceptions import HorovodError, HorovodInternalError
from horovod.common.protocol import ABANDON_POLL_SECONDS, ABANDONED_KEY, RoundInfo, round_scope
from horovod.common.rendezvous import RendezvousClient, RendezvousError

__all__ = ["HostUpdateResult", "RoundInfo", "WorkerRemovedError", "JobStoppedError", "is_elastic",
           "join_round", "current_round", "NotificationManager", "notification_manager",
           "set_ready_reason", "warm_up_before_joining", "form_round", "Cancel", "ABANDONED_KEY", "round_scope"]


log = logging.getLogger("horovod")
T = TypeVar("T")

ELASTIC_ENV = protocol.ELASTIC_ENV


class HostUpdateResult(enum.IntFlag):
    """What changed in a host notice (upstream's values)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = 3


class WorkerRemovedError(HorovodError, RuntimeError):
    """The elastic driver left this worker out of the job's new round (its host was removed)."""


class JobStoppedError(HorovodInternalError):
    """The elastic driver ended the job while this worker waited for a new round."""


_lock = threading.Lock()
_current: RoundInfo | None = None
_reason = "start"


def is_elastic(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(ELASTIC_ENV, "0") not in ("", "0")


_warm_ups: dict[str, Callable[[], None]] = {}


def warm_up_before_joining(name: str, warm_up: Callable[[], None]) -> None:
    """Run ``warm_up()`` once, before this worker first tells the driver it is ready.

    For a binding's slow first-use cost (``horovod.torch.elastic``: loading ``torch._dynamo``, which
    torch does when the first optimizer is made): paid there, not while the round's other members
    wait for this worker in the round's first collective. Registering does nothing else; outside
    elastic jobs no round is joined and ``warm_up`` never runs.
    """
    with _lock:
        _warm_ups.setdefault(name, warm_up)


def _run_warm_ups() -> None:
    with _lock:
        warm_ups = list(_warm_ups.values())
        _warm_ups.clear()
    for warm_up in warm_ups:
        try:
            warm_up()
        except Exception:  # noqa: BLE001 - only a warm-up: the cost is paid later instead
            log.debug("elastic warm-up %r failed", warm_up, exc_info=True)


def current_round() -> RoundInfo | None:
    """The round this worker last joined (None before the first, or outside elastic jobs)."""
    return _current


def set_ready_reason(reason: str) -> None:
    """Why this worker asks for the next round: 'error', 'added', 'removed' (sent to the driver)."""
    global _reason
    _reason = reason


class Cancel:
    """Tells a round's build that the driver abandoned the round.

    The build registers how to cut its waits short (``on_cancel``: close the store it waits on);
    ``cancel()`` runs those hooks once, and a hook registered after that runs at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []
        self.cancelled = False

    def on_cancel(self, hook: Callable[[], None]) -> None:
        with self._lock:
            if not self.cancelled:
                self._hooks.append(hook)
                return
        self._run(hook)

    def cancel(self) -> None:
        with self._lock:
            if self.cancelled:
                return
            self.cancelled = True
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            self._run(hook)

    @staticmethod
    def _run(hook: Callable[[], None]) -> None:
        try:
            hook()
        except Exception:  # noqa: BLE001 - best effort: the build's own timeout still bounds it
            log.debug("elastic: cancelling an abandoned round's build failed", exc_info=True)


# Builds of abandoned rounds that may still be running: the interpreter waits for them at exit
# (a thread still inside Gloo's C++ code when Python finalizes aborts the process, "terminate
# called without an active exception", and would turn a finished job into a failed one).
_orphans: list[threading.Thread] = []
ORPHAN_EXIT_WAIT_SECONDS = 60.0


def _join_orphans() -> None:
    deadline = time.monotonic() + ORPHAN_EXIT_WAIT_SECONDS
    for thread in _orphans:
        if thread.is_alive():
            log.info("elastic: waiting for the connection attempt of an abandoned round to end "
                     "before exiting (%s)", thread.name)
            thread.join(max(0.0, deadline - time.monotonic()))


def form_round(build: Callable[[], T], client: RendezvousClient, info: RoundInfo,
               close: Callable[[T], None] | None = None,
               poll: float = ABANDON_POLL_SECONDS, cancel: Cancel | None = None) -> T:
    """Run ``build()`` (connect to the round's members) unless the driver abandons the round.

    ``build`` runs in a helper thread; this thread checks the round's abandon key every ``poll``
    seconds. When the driver gives the round up first, ``HorovodInternalError`` is raised at once,
    ``cancel`` (given to ``build`` by the caller) is cancelled so that the build's waits on the
    round's store end, and whatever ``build`` still makes is closed (``close``) when it ends.
    Waits ``cancel`` cannot reach (Gloo connecting to a dead peer) end at their own timeout, and
    the interpreter waits for them at exit.

    Raises:
        HorovodInternalError: the round was abandoned, or ``build`` raised it.
    """
    box: dict[str, Any] = {}
    done = threading.Event()
    lock = threading.Lock()

    def runner() -> None:
        try:
            result = build()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc
        else:
            with lock:
                box["result"] = result
                orphan = box.get("abandoned", False)
            if orphan and close is not None:
                try:
                    close(result)
                except Exception:  # noqa: BLE001 - best effort on an abandoned round
                    log.debug("elastic: closing the abandoned round's backend failed", exc_info=True)
        finally:
            done.set()

    thread = threading.Thread(target=runner, name=f"horovod-elastic-round-{info.round}", daemon=True)
    thread.start()
    scope = round_scope(info.round)
    while not done.wait(poll):
        try:
            why = client.get(scope, ABANDONED_KEY)
        except RendezvousError:
            why = None  # the driver may be busy; the build's own timeout still bounds the wait
        if why is None:
            continue
        with lock:
            if "result" not in box and "error" not in box:
                box["abandoned"] = True
                if not _orphans:
                    atexit.register(_join_orphans)
                _orphans[:] = [t for t in _orphans if t.is_alive()] + [thread]
                if cancel is not None:
                    cancel.cancel()
                raise HorovodInternalError(
                    f"elastic: round {info.round} was abandoned by the driver while rank "
                    f"{info.slot.rank} was joining it ({why.decode(errors='replace')})", rank=info.slot.rank)
        break
    done.wait()
    if "error" in box:
        raise box["error"]
    return box["result"]  # type: ignore[no-any-return]


def _identity(environ: Mapping[str, str]) -> tuple[str, int]:
    host = environ.get(protocol.ELASTIC_HOST_ENV) or environ.get("HOROVOD_HOSTNAME") or "localhost"
    slot = int(environ.get(protocol.ELASTIC_SLOT_ENV) or environ.get("HOROVOD_LOCAL_RANK") or 0)
    return host, slot


def join_round(client: RendezvousClient, environ: MutableMapping[str, str] | None = None,
               after: int | None = None, poll_timeout: float = 60.0) -> RoundInfo:
    """Wait until the driver places this worker in a round newer than the last one it joined.

    Writes the new identity back to ``HOROVOD_RANK``/``SIZE``/``LOCAL_RANK``/... of ``environ``
    (as upstream Horovod does: scripts and ``horovod.run`` read them).

    Raises:
        WorkerRemovedError: the job continues without this worker.
        JobStoppedError: the driver ended the job.
        HorovodInternalError: the driver cannot be reached.
    """
    global _current, _reason
    environ = os.environ if environ is None else environ
    host, slot = _identity(environ)
    if _current is None:
        _run_warm_ups()
    if after is None:
        after = _current.round if _current is not None else -1
    request = protocol.ReadyRequest(host, slot, after, _reason, os.getpid()).to_wire()
    heartbeat.start_heartbeat(client, host, slot, environ)
    failures = 0
    while True:
        try:
            ans = protocol.ready_answer(client.call(protocol.READY_CALL, request, timeout=poll_timeout))
            failures = 0
        except RendezvousError as exc:
            failures += 1
            if failures >= 5:
                raise HorovodInternalError(
                    f"elastic worker {host}[{slot}] cannot reach the elastic driver: {exc}") from exc
            time.sleep(0.2 * failures)
            continue
        if isinstance(ans, protocol.Wait):
            continue
        if isinstance(ans, protocol.Removed):
            raise WorkerRemovedError(ans.message or f"{host}[{slot}] has been removed from the elastic job")
        if isinstance(ans, protocol.Stop):
            raise JobStoppedError(ans.message or "the elastic job has stopped")
        environ.update({**ans.slot.env(), protocol.ELASTIC_HOST_ENV: host,
                        protocol.ELASTIC_SLOT_ENV: str(slot)})
        with _lock:
            _current = ans
            _reason = "retry"
        notification_manager.set_floor(ans.notice)
        return ans


class NotificationManager:
    """Delivers the driver's host notices to every registered ``State`` (one background thread)."""

    def __init__(self) -> None:
        self._listeners: list[Any] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._floor = 0
        self._environ: Mapping[str, str] = os.environ

    def init(self, environ: Mapping[str, str] | None = None) -> None:
        """Start listening (once per process; only in elastic jobs)."""
        environ = os.environ if environ is None else environ
        with self._lock:
            if self._thread is not None or not is_elastic(environ):
                return
            self._environ = environ
            self._thread = threading.Thread(target=self._listen, name="horovod-elastic-notices",
                                            daemon=True)
            self._thread.start()

    def set_floor(self, version: int) -> None:
        """Notices up to ``version`` are already reflected in the round just joined."""
        with self._lock:
            self._floor = max(self._floor, version)

    def register_listener(self, state: Any) -> None:
        with self._lock:
            if state not in self._listeners:
                self._listeners.append(state)

    def remove_listener(self, state: Any) -> None:
        with self._lock:
            if state in self._listeners:
                self._listeners.remove(state)

    def handle_notice(self, version: int, update: int) -> None:
        with self._lock:
            if version <= self._floor:
                return
            listeners = list(self._listeners)
        for state in listeners:
            state.on_hosts_updated(version, HostUpdateResult(update))

    def _listen(self) -> None:
        client = RendezvousClient.from_env(self._environ)
        seen = 0
        delay = 0.2
        while True:
            try:
                ans = protocol.Notice.from_wire(client.call(
                    protocol.NOTICE_CALL, protocol.NoticeRequest(seen).to_wire(), timeout=60))
                delay = 0.2
            except RendezvousError:
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if ans.version > seen:
                seen = ans.version
                self.handle_notice(ans.version, ans.update)


notification_manager = NotificationManager()
