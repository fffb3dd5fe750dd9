"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` averages across ranks."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.types import Average
from horovod.tensorflow._grads import (
    _var_key,
    check_op_args,
    make_allreduce_grads_fn,
    normalize_groups,
    reduce_except_local,
)
from horovod.tensorflow.compression import Compression

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]


class _DistributedGradientTape(tf.GradientTape):
    """Methods mixed into a subclass of the user's tape class (see ``DistributedGradientTape``)."""

    def __init__(self, tape: Any, device_dense: str, device_sparse: str, compression: Any,
                 sparse_as_dense: bool, op: int, gradient_predivide_factor: float, groups: Any,
                 persistent: bool = False, watch_accessed_variables: bool = True,
                 process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True) -> None:
        if hasattr(tape, "_watch_accessed_variables"):
            super().__init__(persistent, watch_accessed_variables)
        else:
            super().__init__(persistent)
        # Share the operations the user's tape recorded.
        self._tape = tape
        self._process_set = process_set
        self._scale_local_gradients = scale_local_gradients
        self._local_sources: set[Any] = set()
        self._allreduce_grads = make_allreduce_grads_fn(
            "DistributedGradientTape_Allreduce", device_dense, device_sparse, compression, sparse_as_dense,
            op, gradient_predivide_factor, groups, process_set,
            default_name="DistributedGradientTape_Allreduce")

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local (not averaged), e.g. for model-parallel layers."""
        self._local_sources.add(_var_key(source))

    def _split(self, sources: Sequence[Any]) -> tuple[list[int], list[int]]:
        local = [i for i, s in enumerate(sources) if _var_key(s) in self._local_sources]
        mine = set(local)
        return local, [i for i in range(len(sources)) if i not in mine]

    def _reduce(self, gradients: Sequence[Any], sources: Sequence[Any],
                use_generic_names: bool) -> tuple[list[Any], list[int], list[int]]:
        local, glob = self._split(sources)
        out = reduce_except_local(gradients, sources, self._local_sources,
                                  lambda g, s: self._allreduce_grads(g, s, use_generic_names), self._process_set,
                                  self._scale_local_gradients)
        return out, local, glob

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 use_generic_names: bool = False) -> Any:
        """Compute gradients with the recorded tape, then average them across the process set.

        Every rank of the set must call it for the same sources (one engine op for all of them).
        """
        gradients = super().gradient(target, sources, output_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(gradients, expand_composites=False)
        out, _, _ = self._reduce(flat_grads, flat_sources, use_generic_names)
        return tf.nest.pack_sequence_as(gradients, out)

    def get_local_and_global_gradients(self, target: Any, sources: Any, output_gradients: Any = None,
                                       use_generic_names: bool = False) -> tuple[list[Any], list[Any]]:
        """Return ``(local (var, grad) pairs, global (var, grad) pairs)``."""
        gradients = super().gradient(target, sources, output_gradients)
        flat_sources = tf.nest.flatten(sources)
        out, local, glob = self._reduce(tf.nest.flatten(gradients), flat_sources, use_generic_names)
        return ([(flat_sources[i], out[i]) for i in local], [(flat_sources[i], out[i]) for i in glob])


def DistributedGradientTape(gradtape: Any, device_dense: str = "", device_sparse: str = "",  # noqa: N802
                            compression: Any = Compression.none, sparse_as_dense: bool = False,
                            op: int = Average, gradient_predivide_factor: float = 1.0,
                            num_groups: int = 0, groups: Any = None,
                            process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> Any:
    """Wrap a ``tf.GradientTape`` so that ``gradient()`` averages the gradients over all ranks.

    The returned object is an instance of a subclass of ``gradtape``'s class sharing its recorded
    operations. All gradients of one ``gradient()`` call go to the engine as one op.

    Args:
        gradtape: the tape that recorded the forward pass.
        device_dense, device_sparse: devices for dense and sparse reductions ('' = default).
        compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16``.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors.
        op: ``hvd.Average`` or ``hvd.Sum``.
        gradient_predivide_factor: divide by this before the sum and multiply after (Average only).
        num_groups: deprecated, use ``groups``.
        groups: an int (split gradients into that many fused groups) or lists of variables.
        process_set: the ranks to average over; other ranks get local gradients.
        scale_local_gradients: divide gradients of registered local sources by the set size.

    Raises:
        ValueError: predivide with an op other than Average, or bad ``groups``.
    """
    op = check_op_args(op, gradient_predivide_factor)
    groups = normalize_groups(num_groups, groups)
    base = gradtape.__class__
    bases = (_DistributedGradientTape,) if base is tf.GradientTape else (_DistributedGradientTape, base)
    cls = type(base.__name__, bases, {})
    tape = gradtape._tape
    persistent = getattr(gradtape, "_persistent", False)
    if hasattr(gradtape, "_watch_accessed_variables"):
        return cls(tape, device_dense, device_sparse, compression, sparse_as_dense, op,
                   gradient_predivide_factor, groups, persistent, gradtape._watch_accessed_variables,
                   process_set=process_set, scale_local_gradients=scale_local_gradients)
    return cls(tape, device_dense, device_sparse, compression, sparse_as_dense, op,
               gradient_predivide_factor, groups, persistent, process_set=process_set,
               scale_local_gradients=scale_local_gradients)


def PartialDistributedGradientTape(gradtape: Any, device_dense: str = "", device_sparse: str = "",  # noqa: N802
                                   compression: Any = Compression.none, sparse_as_dense: bool = False,
                                   op: int = Average, gradient_predivide_factor: float = 1.0,
                                   num_groups: int = 0, groups: Any = None,
                                   process_set: ProcessSet = global_process_set, local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> Any:
    """A ``DistributedGradientTape`` that keeps the gradients of ``local_layers`` local.

    Raises:
        ValueError: an entry of ``local_layers`` is not a Keras layer.
    """
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    if local_layers is None:
        return tape
    layers = local_layers if isinstance(local_layers, list | tuple) else [local_layers]
    for layer in layers:
        if not _is_keras_layer(layer):
            raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
        for w in layer.trainable_weights:
            tape.register_local_source(w)
    return tape


def _is_keras_layer(obj: Any) -> bool:
    for mod in ("keras", "tf_keras"):
        layers = getattr(sys.modules.get(mod), "layers", None)
        layer_cls = getattr(layers, "Layer", None)
        if layer_cls is not None and isinstance(obj, layer_cls):
            return True
    return False
