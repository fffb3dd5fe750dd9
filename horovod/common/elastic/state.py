"""Elastic training state: what a worker keeps in memory to survive a reset (framework neutral).

``State`` is the protocol the ``run`` loop needs (save / restore / sync and host-change checks);
``ObjectState`` keeps plain Python attributes. Each framework adds a subclass that also keeps its
model and optimizer (``horovod.torch.elastic.TorchState``, ``horovod.tensorflow.elastic...``).
"""

from __future__ import annotations

import copy
import queue
from collections.abc import Callable, Iterable
from typing import Any

from horovod.common.elastic.worker import HostUpdateResult
from horovod.common.exceptions import HostsUpdatedInterrupt

__all__ = ["Committed", "State", "ObjectState"]


class Committed:
    """Something with a committed copy in memory: ``save`` it, ``restore`` it, ``sync`` it from rank 0."""

    def save(self) -> None:
        """Copy the state to host memory."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Go back to the last saved state."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Make every rank's state equal to rank 0's."""
        raise NotImplementedError()


class State(Committed):
    """State of a worker that is kept in memory across resets of an elastic job.

    Args:
        bcast_object: ``f(obj, root_rank=0) -> obj`` broadcasting a Python object from rank 0.
        get_rank: ``f() -> int``, this worker's current rank.
    """

    def __init__(self, bcast_object: Callable[..., Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: queue.Queue[tuple[int, HostUpdateResult]] = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: list[Callable[[], Any]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Call each of ``callbacks`` (no arguments) after every reset, before the state is synced.

        Typical use: scale the learning rate to the new ``hvd.size()``.
        """
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: HostUpdateResult) -> None:
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state in memory (it survives a failure), then check for host changes.

        Raises:
            HostsUpdatedInterrupt: hosts were added or removed (on every rank at the same commit).
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank if the driver announced a host change.

        Rank 0's view decides (it is broadcast), so every rank raises at the same call.
        """
        last = prev = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, res = self._host_messages.get()
            if timestamp > last:
                last = timestamp
                update |= res
        prev, last, update = self._bcast_object((prev, last, int(update)))
        self._last_updated_timestamp = last
        if last > prev:
            raise HostsUpdatedInterrupt(HostUpdateResult(update) == HostUpdateResult.removed)

    def reset(self) -> None:
        """Adjust to a new set of workers (called after a reset, before ``sync``)."""


class ObjectState(State):
    """State made of plain Python values, given as keyword arguments and kept as attributes.

    ``save`` deep-copies the values, so a later in-place change (``state.history.append(...)``)
    is undone by ``restore``.
    """

    def __init__(self, bcast_object: Callable[..., Any], get_rank: Callable[[], int],
                 **kwargs: Any) -> None:
        self._bcast_object = bcast_object
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))
