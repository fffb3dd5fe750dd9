"""``hvd.DistributedOptimizer(tf.compat.v1.train.Optimizer, op=hvd.Adasum)``: the delta optimizer.

As upstream's ``_DistributedAdasumOptimizer`` (default name ``DistributedDelta<OptType>``):
gradients are not reduced; the wrapped optimizer applies its local update, and every
``backward_passes_per_step``-th ``apply_gradients`` the change since the last synchronisation
(``delta = var - start``) is Adasum-allreduced (one grouped request, optionally compressed), then
``start += adasum(deltas)`` and ``var = start``. ``start`` is a ``delta_start`` slot set from the
variable on the first step. Works eagerly, inside ``tf.function`` and in TF1 graphs.

Upstream's class routes ``apply_gradients`` straight to the wrapped optimizer, so its delta logic
never runs and ranks are never synchronised; this one runs it.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from horovod.common.types import ReduceOp
from horovod.tensorflow._grads import make_allreduce_grads_fn

__all__ = ["DistributedAdasumOptimizer"]


class DistributedAdasumOptimizer(tf.compat.v1.train.Optimizer):
    """Applies local updates and combines the updates (deltas) of all ranks with Adasum."""

    def __init__(self, optimizer: Any, name: str | None, use_locking: bool, device_dense: str,
                 device_sparse: str, compression: Any, backward_passes_per_step: int) -> None:
        if name is None:
            name = f"DistributedDelta{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._backward_passes_per_step = int(backward_passes_per_step)
        self._reduce = make_allreduce_grads_fn(name, device_dense, device_sparse, compression, True,
                                               ReduceOp.ADASUM, default_name=name + "_Adasum")
        self._step_count: Any = None

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's gradients, unreduced (Adasum combines the updates instead)."""
        return self._optimizer.compute_gradients(*args, **kwargs)

    def _counter(self) -> Any:
        if self._step_count is None:
            with tf.init_scope():
                self._step_count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                               name=self._name + "_step_count")
        return self._step_count

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: str | None = None) -> Any:
        """Apply locally; on every ``backward_passes_per_step``-th call combine the deltas by Adasum."""
        grads_and_vars = list(grads_and_vars)
        variables = [v for g, v in grads_and_vars if g is not None]
        with tf.init_scope():
            starts = [self._zeros_slot(v, "delta_start", self._name) for v in variables]
        step = self._counter()
        k = self._backward_passes_per_step

        def init_starts() -> Any:
            return tf.group(*[s.assign(v) for s, v in zip(starts, variables)])

        def sync() -> Any:
            deltas = [tf.convert_to_tensor(v) - tf.convert_to_tensor(s) for s, v in zip(starts, variables)]
            reduced = self._reduce(deltas, variables)
            ops = []
            for s, v, d in zip(starts, variables, reduced):
                new = s.assign_add(d)
                ops.append(v.assign(new))
            return tf.group(*ops)

        if tf.executing_eagerly():
            if int(step.numpy()) == 0:
                init_starts()
            self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
            if int(step.numpy()) % k == k - 1:
                sync()
            return step.assign_add(1)
        first = tf.equal(step, 0)
        init = tf.cond(first, init_starts, tf.no_op)
        with tf.control_dependencies([init]):
            apply = self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        with tf.control_dependencies([apply]):
            synced = tf.cond(tf.equal(step % k, k - 1), sync, tf.no_op)
        with tf.control_dependencies([synced]):
            return step.assign_add(1)

    def get_slot(self, var: Any, name: str) -> Any:
        slot = super().get_slot(var, name)
        return slot if slot is not None else self._optimizer.get_slot(var, name)

    def get_slot_names(self) -> list[str]:
        return super().get_slot_names() + self._optimizer.get_slot_names()

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)
