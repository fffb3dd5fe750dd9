"""Values logged by the ranks, delivered to callbacks on the driver (upstream's ``ray_logger``).

In the training function: ``from horovod.ray import ray_logger; ray_logger.log({"loss": l})``.
``RayExecutor.run(fn, callbacks=[cb])`` calls ``cb(info)`` on the driver for every value logged
while the function runs: by rank 0 in a static job, by every worker in an elastic job (as
upstream's elastic executor; workers come and go, so each reports its own events), or by every
rank of either kind with ``chief_only=False`` (``chief_only=True``: rank 0 only).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["configure", "log", "CallbackPump"]

_queue: Any = None
_warned = False


def configure(queue: Any) -> None:
    """Send this worker's ``log`` calls to ``queue`` (a ``ray.util.queue.Queue``)."""
    global _queue
    _queue = queue


def log(info_dict: dict[str, Any], chief_only: bool | None = None) -> None:
    """Send ``info_dict`` to the driver's callbacks (only from rank 0 when ``chief_only``; by
    default every worker of an elastic job, rank 0 of a static one)."""
    global _warned
    if chief_only is None:
        chief_only = os.environ.get("HOROVOD_ELASTIC") != "1"
    if chief_only and os.environ.get("HOROVOD_RANK") != "0":
        return
    if _queue is None:
        if not _warned:
            warnings.warn("ray_logger.log was called, but this run has no callbacks "
                          "(RayExecutor.run(..., callbacks=[...])): the value is dropped.",
                          stacklevel=2)
            _warned = True
        return
    _queue.put(info_dict)


class CallbackPump:
    """A queue for the workers' ``log`` calls and a driver thread that hands them to callbacks.

    ``wrap(fn)`` makes a worker function that configures the logger first. Leaving the context
    delivers what is left in the queue and removes it.
    """

    def __init__(self, callbacks: Sequence[Callable[[Any], Any]]) -> None:
        from ray.util.queue import Queue

        self.callbacks = list(callbacks)
        self.queue = Queue(actor_options={"num_cpus": 0})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="hvd-ray-callbacks", daemon=True)

    def wrap(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        queue = self.queue

        def logged(executable: Any) -> Any:
            from horovod.ray import ray_logger

            ray_logger.configure(queue)
            try:
                return fn(executable)
            finally:
                ray_logger.configure(None)

        return logged

    def _deliver(self, items: list[Any]) -> None:
        for item in items:
            for cb in self.callbacks:
                cb(item)

    def _pump(self) -> None:
        from ray.util.queue import Empty

        while not self._stop.is_set():
            try:
                item = self.queue.get(timeout=0.2)
            except Empty:
                continue
            self._deliver([item])

    def __enter__(self) -> CallbackPump:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            left = self.queue.size()
            if left:
                self._deliver(self.queue.get_nowait_batch(left))
        finally:
            self.queue.shutdown()
