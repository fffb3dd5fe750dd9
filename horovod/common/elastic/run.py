"""The elastic retry loop: ``hvd.elastic.run(train)(state)``.

``train(state)`` runs; when a collective fails (a worker died: ``HorovodInternalError``) the
state goes back to its last commit, Horovod re-forms the job with the workers that remain (a new
rendezvous round), rank 0's state is broadcast and ``train`` runs again. When hosts were added or
removed (``HostsUpdatedInterrupt`` at a commit) the state is kept as it is. A mismatch between
ranks (``CollectiveMismatchError``) is a programming error and is raised, not retried.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from horovod.common.elastic.worker import (
    WorkerRemovedError,
    current_round,
    notification_manager,
    set_ready_reason,
)
from horovod.common.exceptions import (
    CollectiveMismatchError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
)

__all__ = ["run_fn", "default_reset"]

log = logging.getLogger("horovod")


def _cause(exc: BaseException) -> str:
    text = str(exc)
    marker = text.find("Cause on rank")
    if marker >= 0:
        text = text[marker:]
    return text.splitlines()[0][:300] if text else type(exc).__name__


def default_reset() -> None:
    """Leave the current round and join the next one (``shutdown()`` then ``init()``)."""
    from horovod.common import basics

    basics.shutdown()
    basics.init()


def run_fn(func: Callable[..., Any], reset: Callable[[], None] | None = None) -> Callable[..., Any]:
    """Wrap ``func(state, ...)`` in the elastic retry loop (see the module docstring)."""
    do_reset = reset or default_reset

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        notification_manager.init()
        notification_manager.register_listener(state)
        skip_sync = False
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except CollectiveMismatchError:
                    raise
                except HorovodInternalError as exc:
                    log.warning("elastic: a collective failed (%s); restoring the last commit and "
                                "re-forming the job", _cause(exc))
                    state.restore()
                    skip_sync = False
                    set_ready_reason("error")
                except HostsUpdatedInterrupt as exc:
                    skip_sync = exc.skip_sync
                    set_ready_reason("removed" if skip_sync else "added")
                try:
                    do_reset()
                except WorkerRemovedError as exc:
                    log.warning("elastic: %s; this worker stops here", exc)
                    raise SystemExit(0) from None
                info = current_round()
                # Skip the sync only when the driver says every member of the new round comes
                # from the old one with the same committed state (upstream #3494: survivors that
                # skipped it while new workers waited in it deadlocked).
                if info is not None:
                    skip_sync = skip_sync and info.skip_sync
                else:
                    skip_sync = False
                state.on_reset()
        finally:
            notification_manager.remove_listener(state)

    return wrapper
