"""``horovod._keras.backends.backend_compression``: a Keras ``Compression`` given on Keras 3's torch
or JAX backend is replaced by that binding's compressor of the same kind (whatever binding's
``Compression`` it came from), and a kind the binding lacks is refused, not passed on."""

from __future__ import annotations

import pytest

from horovod._keras.backends import backend_compression
from horovod.numpy.compression import Compression as NumpyCompression

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kind", ["none", "fp16", "bf16"])
def test_torch_gets_its_own_compressor_of_the_same_kind(kind: str) -> None:
    from horovod.torch.compression import Compression as TorchCompression

    assert backend_compression("torch", getattr(NumpyCompression, kind)) is getattr(TorchCompression, kind)


@pytest.mark.parametrize("kind", ["none", "fp16"])
def test_jax_gets_its_own_compressor_of_the_same_kind(kind: str) -> None:
    from horovod.jax.compression import Compression as JaxCompression

    assert backend_compression("jax", getattr(NumpyCompression, kind)) is getattr(JaxCompression, kind)


def test_a_kind_the_binding_lacks_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match=r"Compression\.bf16 is not available on Keras's jax backend"):
        backend_compression("jax", NumpyCompression.bf16)


def test_another_compressor_is_used_as_given() -> None:
    class Mine:
        pass

    assert backend_compression("torch", Mine) is Mine
