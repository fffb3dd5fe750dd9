"""The public functions of ``horovod.keras`` and ``horovod.tensorflow.keras`` keep their signatures.

Both bindings build several functions from one definition in ``horovod._keras.helpers`` (re-exported,
or made by a factory with the binding's default); this pins, per binding, every public function's
parameter names, kinds and defaults against the list below (upstream Horovod's, plus this package's
additions). Also checked at size 1: the behaviour each binding's parameterisation chooses.
"""

from __future__ import annotations

import inspect
import pickle

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("keras")

import horovod.keras as hvd_keras  # noqa: E402
import horovod.tensorflow.keras as hvd_tfk  # noqa: E402
from horovod.common.process_sets import global_process_set  # noqa: E402
from horovod.common.types import Average, Sum  # noqa: E402
from horovod.tensorflow.compression import Compression  # noqa: E402

_BASICS = {
    "init": "comm=None, process_sets=None", "shutdown": "", "is_initialized": "",
    "start_timeline": "file_path, mark_cycles=False", "stop_timeline": "", "size": "", "local_size": "",
    "cross_size": "", "rank": "", "local_rank": "", "cross_rank": "", "mpi_threads_supported": "",
    "mpi_enabled": "", "mpi_built": "", "gloo_enabled": "", "gloo_built": "", "nccl_built": "", "ddl_built": "",
    "ccl_built": "", "cuda_built": "", "rocm_built": "",
}
_OPTIMIZER_HEAD = ("optimizer, name=None, device_dense='', device_sparse='', compression=Compression.none, "
                   "sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average, ")
_PARTIAL = (_OPTIMIZER_HEAD + "backward_passes_per_step=1, average_aggregated_gradients=False, groups=None, "
            "process_set=global_process_set, local_layers=None, scale_local_gradients=True")
_COLLECTIVES = {
    "broadcast_global_variables": "root_rank",
    "allgather": "value, name=None",
    "broadcast": "value, root_rank, name=None",
    "reducescatter": "value, name=None, op=Average",
}
_ALLREDUCE = ("value, name=None, average={}, prescale_factor=1.0, postscale_factor=1.0, op=None, "
              "compression=Compression.none")
_LOAD_MODEL = "filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none"

SIGNATURES = {
    hvd_keras: {
        **_BASICS, "metrics": "", **_COLLECTIVES,
        "DistributedOptimizer": _OPTIMIZER_HEAD + "num_groups=0, groups=None, backward_passes_per_step=1, "
                                                  "average_aggregated_gradients=False",
        "PartialDistributedOptimizer": _PARTIAL,
        "allreduce": _ALLREDUCE.format("True"),
        "load_model": _LOAD_MODEL,
    },
    hvd_tfk: {
        **_BASICS, **_COLLECTIVES, "add_process_set": "process_set", "remove_process_set": "process_set",
        "DistributedOptimizer": _OPTIMIZER_HEAD + "backward_passes_per_step=1, "
                                                  "average_aggregated_gradients=False, num_groups=0, groups=None, "
                                                  "process_set=global_process_set, scale_local_gradients=True",
        "PartialDistributedOptimizer": _PARTIAL,
        "allreduce": _ALLREDUCE.format("None"),
        "load_model": _LOAD_MODEL + ", legacy_opts=False",
    },
}


def _expected(params: str) -> inspect.Signature:
    namespace = {"Compression": Compression, "Average": Average, "global_process_set": global_process_set}
    exec(f"def f({params}): pass", namespace)  # noqa: S102 - the literal parameter lists above
    return inspect.signature(namespace["f"])


def _pinned(sig: inspect.Signature) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("module", list(SIGNATURES), ids=lambda m: m.__name__)
def test_every_public_function_keeps_its_signature(module) -> None:
    public = {n for n in module.__all__ if inspect.isfunction(getattr(module, n))}
    assert public == set(SIGNATURES[module]), "public functions changed: update the list with care"
    wrong = {name: str(inspect.signature(getattr(module, name)))
             for name, params in SIGNATURES[module].items()
             if _pinned(inspect.signature(getattr(module, name))) != _pinned(_expected(params))}
    assert not wrong, f"{module.__name__}: signatures differ from the pinned list: {wrong}"


@pytest.mark.parametrize("module", list(SIGNATURES), ids=lambda m: m.__name__)
def test_built_functions_are_named_and_documented_where_they_are_exported(module) -> None:
    for name in ("allreduce", "PartialDistributedOptimizer"):
        fn = getattr(module, name)
        assert (fn.__name__, fn.__qualname__, fn.__module__) == (name, name, module.__name__)
        assert fn.__doc__ and pickle.loads(pickle.dumps(fn)) is fn


@pytest.fixture
def _size_one():
    hvd_tfk.init()
    yield


@pytest.mark.usefixtures("_size_one")
def test_keras_allreduce_lets_op_supersede_its_average_default() -> None:
    x = np.array([1.0, 2.0], dtype=np.float32)
    np.testing.assert_allclose(np.asarray(hvd_keras.allreduce(x, op=Sum)), x)
    np.testing.assert_allclose(np.asarray(hvd_keras.allreduce(x, average=False, op=Sum)), x)
    np.testing.assert_allclose(np.asarray(hvd_tfk.allreduce(x, op=Sum)), x)
    with pytest.raises(ValueError, match="supersedes average"):
        hvd_tfk.allreduce(x, average=True, op=Sum)


@pytest.mark.usefixtures("_size_one")
@pytest.mark.parametrize(("module", "layer_type"), [(hvd_keras, "keras.layers.Layer"),
                                                    (hvd_tfk, "tf.keras.layers.Layer")])
def test_partial_optimizer_names_its_bindings_layer_type(module, layer_type) -> None:
    with pytest.raises(ValueError, match=f"^All local layers must be of {layer_type} type."):
        module.PartialDistributedOptimizer(tf.keras.optimizers.SGD(0.1), local_layers=["not a layer"])
