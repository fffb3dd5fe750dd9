"""horovod.jax._ffi in one process: the in-place host call that in-jit collectives lower to."""

from __future__ import annotations

import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from horovod.jax import _ffi  # noqa: E402

# The pinned JAX (constraints/ci.txt) on the CPU must take the in-place route: a JAX whose internals moved
# would otherwise fall back to the copying callback silently, and these tests would not notice.
pytestmark = pytest.mark.skipif(os.environ.get("HOROVOD_JAX_FFI") == "0",
                                reason="HOROVOD_JAX_FFI=0 chooses the copying callback")


def test_the_in_place_route_is_available_on_the_cpu() -> None:
    assert jax.default_backend() == "cpu"
    assert _ffi.available(), "horovod.jax._ffi could not register its handler with this JAX"



def _specs(xs):
    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]


def test_views_of_xla_buffers_every_dtype():
    seen = {}

    def fn(ins, outs):
        seen["ro"] = [i.flags.writeable for i in ins]
        for i, o in zip(ins, outs):
            assert i.dtype == o.dtype and i.shape == o.shape
            o[...] = i
        outs[0][...] += 1

    xs = [jnp.arange(4, dtype=jnp.float32), jnp.arange(4, dtype=jnp.bfloat16), jnp.array([True, False]),
          jnp.zeros((0, 3)), jnp.float32(3.0), jnp.arange(3, dtype=jnp.complex64),
          jnp.arange(6, dtype=jnp.int64 if jax.config.jax_enable_x64 else jnp.int32).reshape(2, 3)]
    out = jax.jit(lambda v: _ffi.host_call_into(fn, _specs(v), v))(xs)
    assert seen["ro"] == [False] * len(xs)  # operands are read-only views
    np.testing.assert_array_equal(np.asarray(out[0]), np.arange(4) + 1)
    for a, b in zip(out[1:], xs[1:]):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_operands_are_not_copied():
    x = jnp.arange(1 << 20, dtype=jnp.float32)
    ptr = {}

    def fn(ins, outs):
        ptr["in"] = ins[0].ctypes.data
        outs[0][...] = ins[0] * 2

    out = jax.jit(lambda v: _ffi.host_call_into(fn, _specs([v]), [v]))(x)
    assert ptr["in"] == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(out[0]), np.arange(1 << 20, dtype=np.float32) * 2)


def test_program_order_kept_and_unused_results_still_run():
    calls = []

    def mark(tag):
        def fn(ins, outs):
            calls.append(tag)
            outs[0][...] = ins[0]
        return fn

    def step(v):
        a = _ffi.host_call_into(mark("a"), _specs([v]), [v])[0]
        _ffi.host_call_into(mark("unused"), _specs([v]), [v])
        b = _ffi.host_call_into(mark("b"), _specs([v]), [v * 3])[0]
        return a + b

    f = jax.jit(step)
    for _ in range(2):
        np.testing.assert_allclose(np.asarray(f(jnp.ones(3))), 4.0)
    assert calls == ["a", "unused", "b"] * 2


def test_error_is_raised_from_the_jitted_call():
    def bad(ins, outs):
        raise ValueError("boom from the host")

    f = jax.jit(lambda v: _ffi.host_call_into(bad, _specs([v]), [v]))
    with pytest.raises(jax.errors.JaxRuntimeError, match="boom from the host"):
        jax.block_until_ready(f(jnp.ones(2)))
    # the handler still works after an error
    ok = jax.jit(lambda v: _ffi.host_call_into(lambda i, o: o[0].__setitem__(..., i[0]), _specs([v]), [v]))
    np.testing.assert_array_equal(np.asarray(ok(jnp.ones(2))[0]), 1.0)


def test_horovod_jax_ffi_0_chooses_the_copying_callback() -> None:
    import subprocess
    import sys

    code = ("import horovod.jax._ffi as f, os; assert os.environ['HOROVOD_JAX_FFI'] == '0'; "
            "print('AVAILABLE', f.available())")
    env = dict(os.environ, HOROVOD_JAX_FFI="0", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "AVAILABLE False" in out.stdout
