"""Every kind of buffer operations has every member of ``BufferOps`` (``engine/buffers.py``), so
that the executor calls them directly: an allgather's or reduce-scatter's result comes from
``ops.result`` on every kind (NumPy's warm output pool, torch's allocator), with no per-result
``getattr`` fallback in the executor; ``batch_items`` asks every kind's batch memo
(``recall``/``remember``: a no-op on torch's) and one-tensor fast path (``item``) directly, with
no per-batch ``getattr``."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from horovod.common.engine import buffers, executor
from horovod.common.engine.buffers import BufferOps, NarrowingBuffers
from horovod.common.engine.host_buffers import NumpyBuffers


def _members(protocol: type) -> set[str]:
    names = {n for n, v in vars(protocol).items() if not n.startswith("_") and callable(v)}
    return names | set(getattr(protocol, "__annotations__", {}))


def _kinds() -> list[type]:
    kinds: list[type] = [NumpyBuffers]
    try:
        from horovod.torch._torch_buffers import TorchBuffers
    except ImportError:  # torch is not installed here
        pass
    else:
        kinds.append(TorchBuffers)
    return kinds


def test_the_protocol_names_the_result_policy() -> None:
    assert "result" in _members(BufferOps)


def test_the_protocol_names_the_batch_memo_and_the_one_tensor_item() -> None:
    assert {"item", "recall", "remember"} <= _members(BufferOps)


@pytest.mark.parametrize("kind", _kinds(), ids=lambda k: k.__name__)
def test_every_kind_has_every_member(kind: type) -> None:
    missing = sorted(n for n in _members(BufferOps) if not hasattr(kind, n))
    assert not missing, f"{kind.__name__} lacks BufferOps members {missing}"


def test_the_host_buffers_narrow() -> None:
    """The runner reaches a compression's narrowing through the ops (``NarrowingBuffers``); only
    host buffers narrow (the executor sets ``Reduction.narrow`` for its own NumPy ops alone), so
    ``NumpyBuffers`` has every member of it."""
    assert {"pack_narrowed", "unpack_narrowed"} <= _members(NarrowingBuffers)
    missing = sorted(n for n in _members(NarrowingBuffers) if not hasattr(NumpyBuffers, n))
    assert not missing, f"NumpyBuffers lacks NarrowingBuffers members {missing}"


def test_the_executor_asks_the_ops_for_results_directly() -> None:
    src = inspect.getsource(executor)
    assert 'getattr(ops, "result"' not in src and "ops.result(" in src


def test_batch_items_asks_the_ops_directly() -> None:
    src = inspect.getsource(buffers.batch_items)
    assert "getattr(" not in src and "ops.recall(" in src and "ops.remember(" in src and "ops.item" in src


def test_torch_buffers_have_no_batch_memo() -> None:
    import torch

    from horovod.torch._torch_buffers import TorchBuffers

    ops = TorchBuffers(torch.device("cpu"))
    batch, entries, items, starts = (object(),), [object()], [object()], [0]
    assert ops.recall(batch, entries) is None
    got = ops.remember(batch, entries, items, starts)  # type: ignore[arg-type]
    assert got[0] is items and got[1] is starts


def test_numpy_results_come_from_the_output_pool() -> None:
    given: list[tuple[tuple[int, ...], object]] = []

    def output(shape: tuple[int, ...], dtype: object) -> np.ndarray:
        given.append((shape, dtype))
        return np.empty(shape, dtype)  # type: ignore[call-overload]

    ops = NumpyBuffers(lambda n: np.empty(n, np.uint8), output)
    assert ops.result((2, 3), np.float32).shape == (2, 3) and given == [((2, 3), np.float32)]


def test_torch_results_are_allocated_on_the_ops_device() -> None:
    import torch

    from horovod.torch._torch_buffers import TorchBuffers

    out = TorchBuffers(torch.device("cpu")).result((4, 2), torch.float16)
    assert (out.shape, out.dtype, out.device.type) == ((4, 2), torch.float16, "cpu")
