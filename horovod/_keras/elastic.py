"""Keras elastic callbacks shared by ``horovod.tensorflow.keras`` and ``horovod.keras``.

Each public class is ``class X(XImpl, <keras>.callbacks.Callback)`` in the binding module.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CommitStateCallbackImpl", "UpdateBatchStateCallbackImpl",
           "UpdateEpochStateCallbackImpl"]


class CommitStateCallbackImpl:
    """Commit the state every ``batches_per_commit`` batches and at the end of every epoch."""

    def __init__(self, backend: Any, state: Any, batches_per_commit: int = 1, *args: Any) -> None:
        super().__init__(*args)
        self.backend = backend
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        # Every rank starts counting again after a reset, so that they commit together.
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.commit()

    def commit(self) -> None:
        self.state.commit()


class UpdateBatchStateCallbackImpl:
    """Keep ``state.batch`` (batches done in the current epoch) up to date; after a reset, the
    interrupted epoch runs only the batches it had left, when ``steps_per_epoch`` is known.

    tf_keras honours a shortened ``params['steps']``; Keras 3 does not, so the epoch is ended
    with ``model.stop_training``, cleared again at the epoch's end.
    """

    def __init__(self, backend: Any, state: Any, *args: Any) -> None:
        super().__init__(*args)
        self.backend = backend
        self.state = state
        self.steps_per_epoch: int | None = None
        self._initial_epoch = 0
        self._epoch = 0
        self._offset = 0
        self._limit: int | None = None
        self._stopped = False

    def on_train_begin(self, logs: Any = None) -> None:
        self.steps_per_epoch = None
        self._initial_epoch = int(self.state.epoch)  # as UpdateEpochStateCallback counts epochs

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        params = getattr(self, "params", None) or {}
        self._epoch = epoch
        self._offset, self._limit = 0, None
        if params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = int(params["steps"])
            self._offset = int(self.state.batch)
            self._limit = self.steps_per_epoch - self._offset
            params["steps"] = self._limit

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        # Batches done in this epoch, counting those done before a reset (upstream stored the
        # batch index, so a reset after a commit ran the committed batch a second time).
        done = self._offset + batch + 1
        if self.steps_per_epoch is not None and done >= self.steps_per_epoch:
            # The epoch's last batch: the epoch counts as finished from now on, so that the commit
            # of this batch (CommitStateCallback runs before any on_epoch_end) resumes after a
            # reset at the next epoch's start. Committed as "this epoch, every batch done", the
            # resumed fit would run one more batch of it before this callback could end it.
            self.state.batch = 0
            self.state.epoch = self._initial_epoch + self._epoch + 1
        else:
            self.state.batch = done
        model = getattr(self, "model", None)
        if self._limit is not None and batch + 1 >= self._limit and model is not None \
                and self._offset > 0:
            model.stop_training = True
            self._stopped = True

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0
        model = getattr(self, "model", None)
        if self._stopped and model is not None:
            model.stop_training = False
        self._stopped = False


class UpdateEpochStateCallbackImpl:
    """Keep ``state.epoch`` as the number of finished epochs across resets."""

    def __init__(self, backend: Any, state: Any, *args: Any) -> None:
        super().__init__(*args)
        self.backend = backend
        self.state = state
        self.initial_epoch = self.state.epoch

    def on_train_begin(self, logs: Any = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
