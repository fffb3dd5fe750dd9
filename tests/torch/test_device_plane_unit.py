"""The GPU path's pure parts: settings, routing, the plane's rounding and its placement checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import horovod.torch as hvd
from horovod.common.backends.base import Group
from horovod.common.config import EngineConfig
from horovod.common.engine.device import (
    DevicePlaneError,
    PlaneServices,
    check_gpu_settings,
    gpu_transport,
    is_plane,
)
from horovod.common.engine.tunables import Tunables
from horovod.common.exceptions import ConfigError
from horovod.common.types import ReduceOp, RequestType
from horovod.torch import _convert as cv
from horovod.torch import _device_plane as dp
from horovod.torch import _device_tensor as dt
from horovod.torch._torch_buffers import scale_into

A, G, B = RequestType.ALLREDUCE, RequestType.ALLGATHER, RequestType.BROADCAST


@pytest.mark.parametrize("env,nccl,kind,want", [
    ({}, True, A, "NCCL"),
    ({}, False, A, "HOST"),
    ({"HOROVOD_GPU_OPERATIONS": "MPI"}, True, A, "HOST"),
    ({"HOROVOD_GPU_OPERATIONS": "gloo"}, True, G, "HOST"),
    ({"HOROVOD_GPU_OPERATIONS": "MPI", "HOROVOD_GPU_ALLREDUCE": "NCCL"}, True, A, "NCCL"),
    ({"HOROVOD_GPU_OPERATIONS": "MPI", "HOROVOD_GPU_ALLREDUCE": "NCCL"}, True, G, "HOST"),
    ({"HOROVOD_GPU_BROADCAST": "MPI"}, True, B, "HOST"),
    ({"HOROVOD_GPU_BROADCAST": "MPI"}, True, A, "NCCL"),
])
def test_gpu_transport_per_op_setting_wins(env, nccl, kind, want):
    assert gpu_transport(EngineConfig.from_env(env), kind, nccl) == want


def test_gpu_settings_reject_unknown_values():
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_env({"HOROVOD_GPU_ALLGATHER": "CUDA"})
    assert err.value.variable == "HOROVOD_GPU_ALLGATHER" and "NCCL, MPI, GLOO" in str(err.value)


@pytest.mark.parametrize("env,variable", [({"HOROVOD_GPU_OPERATIONS": "NCCL"}, "HOROVOD_GPU_OPERATIONS"),
                                          ({"HOROVOD_GPU_REDUCESCATTER": "nccl"}, "HOROVOD_GPU_REDUCESCATTER")])
def test_check_gpu_settings_nccl_without_cuda(env, variable):
    cfg = EngineConfig.from_env(env)
    with pytest.raises(ConfigError) as err:
        check_gpu_settings(cfg, lambda: 0)
    assert err.value.variable == variable and "MPI or GLOO" in str(err.value)
    check_gpu_settings(cfg, lambda: 22105)  # NCCL present: fine
    check_gpu_settings(EngineConfig.from_env({"HOROVOD_GPU_OPERATIONS": "MPI"}), lambda: 0)


def test_build_probes_tell_the_truth():
    cuda = torch.cuda.is_available() and torch.distributed.is_nccl_available()
    assert hvd.cuda_built() == cuda
    assert (hvd.nccl_built() > 0) == cuda
    from horovod.runner.launch.horovodrun import check_build_text

    assert f"[{'X' if cuda else ' '}] NCCL" in check_build_text()


def test_plane_device_tags():
    assert is_plane(dp.PLANE_CUDA) and is_plane(dp.PLANE_CPU)
    assert not is_plane("cpu") and not is_plane(cv.HOST_CUDA)
    assert cv.route(torch.ones(1), A) == "cpu"  # no context: host path


def test_device_tensor_carries_what_the_core_checks():
    w = dp.DeviceTensor.of(torch.zeros(4, 3, dtype=torch.bfloat16))
    assert (w.shape, w.dtype, w.ndim, w.ready, w.done) == ((4, 3), "bfloat16", 2, None, None)
    part = w[:2]
    assert part.shape == (2, 3) and part.tensor.data_ptr() == w.tensor.data_ptr()
    assert part.parent is w  # the plane signals completion on the caller's wrapper too


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8])
def test_plane_integer_scaling_truncates_like_the_host_path(dtype):
    src = torch.tensor([-7, -3, 3, 7, 9], dtype=dtype)
    dst = torch.empty_like(src)
    scale_into(dst, src, 1.0, 2)  # Average over 2 ranks
    assert dst.tolist() == np.trunc(src.numpy() / 2).astype(np.int64).tolist()
    scale_into(dst, src, 0.5)  # prescale
    assert dst.tolist() == np.trunc(src.numpy() * 0.5).astype(np.int64).tolist()


def test_plane_float_scaling_is_exact_division():
    src = torch.arange(1, 100, dtype=torch.float32)
    dst = torch.empty_like(src)
    scale_into(dst, src, 1.0, 3)
    assert torch.equal(dst, src / 3)
    half = torch.arange(1, 50, dtype=torch.float16)
    out = torch.empty_like(half)
    scale_into(out, half, 1.0, 3)
    want = (half.numpy().astype(np.float32) / np.float32(3)).astype(np.float16)
    assert np.array_equal(out.numpy(), want)


def test_tensors_on_other_devices_are_refused_clearly():
    with pytest.raises(NotImplementedError, match="supports CPU and CUDA tensors"):
        cv.check_tensor(torch.empty(2, device="meta"), "allreduce", cv.TORCH_DTYPES)


class _FakeBackend:
    def __init__(self, rows):
        self.rows = rows

    def allgather_ints(self, values, group):
        return np.array(self.rows, np.int64)


def _services(rows):
    return PlaneServices(_FakeBackend(rows), Tunables())


def test_two_ranks_on_one_gpu_are_named_before_nccl_runs():
    plane = dp.TorchPlane(_services([[7, 0], [7, 0], [7, 1]]))
    group = Group([0, 1, 2], 0, None)
    with pytest.raises(DevicePlaneError) as err:
        plane._check_distinct_gpus(group, torch.device("cuda", 0))
    assert err.value.ranks == [0, 1]
    assert "torch.cuda.set_device(hvd.local_rank())" in str(err.value)
    assert "HOROVOD_GPU_OPERATIONS=MPI" in str(err.value)
    ok = dp.TorchPlane(_services([[7, 0], [7, 1], [8, 0]]))
    ok._check_distinct_gpus(group, torch.device("cuda", 0))


@pytest.mark.parametrize("scale_once", [True, False, None])
def test_torch_buffers_pack_scale_and_unpack_as_the_host_path(scale_once: bool) -> None:
    """The plane's buffer operations under the engine's runner: a fused buffer scaled once (the
    CUDA choice) or piece by piece (the twin's) gives the host path's values, widened dtypes too."""
    from horovod.common.engine.buffers import Item, Reduction, run_reduction
    from horovod.common.engine.placement import DevicePlacement
    from horovod.common.engine.plan import plan_reduction

    ops = dp.TorchBuffers(torch.device("cpu"))
    ops.scale_once = scale_once
    for dtype, work in ((torch.float32, torch.float32), (torch.int16, torch.int32), (torch.int64, torch.int64)):
        xs = [torch.arange(n, dtype=dtype).reshape(shape) * 3 + 1 for n, shape in ((6, (2, 3)), (5, (5,)), (40, (40,)))]
        outs = [torch.empty_like(x) for x in xs]
        items = [Item(x, o, False, "t", x.numel()) for x, o in zip(xs, outs)]
        calls = plan_reduction([it.n for it in items], work.itemsize, 0, 100, True, work != dtype)
        red = Reduction(ReduceOp.SUM, 1.0, 1.0, 3, work, work != dtype, False)
        run_reduction(calls, items, ops, red, lambda t: t.mul_(2), DevicePlacement())  # 2 ranks, Average over 3
        for x, o in zip(xs, outs):
            want = x.to(torch.float64) * 2 / 3
            want = want if dtype.is_floating_point else want.trunc()
            assert o.dtype == dtype and torch.equal(o, want.to(dtype)), (dtype, o, x)
        assert calls[-1].size == 40 or len(calls) == 1  # 40 elements above the cut go alone unless widened


def test_streams_wait_once_per_producer_stream_and_done_event(monkeypatch: pytest.MonkeyPatch) -> None:
    s1, s2 = object(), object()
    ws = [dp.DeviceTensor(torch.zeros(1), ready=f"e{i}", stream=s1 if i % 2 else s2, seq=i) for i in range(1, 7)]
    assert sorted(dt.latest_ready(ws)) == ["e5", "e6"]  # the latest event of each stream

    class Stream:
        waits: list = []

        def wait_event(self, e):
            self.waits.append(e)

    stream = Stream()
    monkeypatch.setattr(dt, "current_stream", lambda device: stream)
    monkeypatch.setattr(dt, "_waited", [None, None])
    done = object()
    for w in ws:
        w.done = done
        dp.wait_done([w], [w.tensor])
    assert stream.waits == [done]  # a batch's handles share one "done" event: one wait
    ws[0].done = other = object()
    dp.wait_done([ws[0]], [ws[0].tensor])
    assert stream.waits == [done, other]


def test_a_span_is_taken_only_over_views_of_one_storage() -> None:
    # CUDA's caching allocator often places separately allocated tensors end to end; they still have
    # storages of their own, so no single view may span them (the H100 run hit "setStorage ... out of
    # bounds"). Here two tensors of one bytearray, each with its own storage, lie end to end.
    from horovod.common.engine.buffers import Item

    ops = dp.TorchBuffers(torch.device("cpu"))
    raw = bytearray(64)
    a = torch.frombuffer(raw, dtype=torch.float32, count=4, offset=0)
    b = torch.frombuffer(raw, dtype=torch.float32, count=12, offset=16)
    assert a.data_ptr() + 16 == b.data_ptr()
    items = [Item(a, a, True, "x", 4), Item(b, b, True, "x", 12)]
    assert ops.span(items, [(0, 0, 4, 0), (1, 0, 12, 4)], True) is None
    # views of one flat buffer are one span
    flat = torch.arange(16, dtype=torch.float32)
    va, vb = flat[:4], flat[4:]
    span = ops.span([Item(va, va, True, "x", 4), Item(vb, vb, True, "x", 12)], [(0, 0, 4, 0), (1, 0, 12, 4)], True)
    assert span is not None and span.data_ptr() == flat.data_ptr() and torch.equal(span, flat)


def test_torch_buffers_remember_buffer_views_and_grouped_items_but_no_round_s_tensors() -> None:
    """A memoized plan's packed call reuses its views of the fusion buffer (made again for other
    shapes or a new buffer), a repeated grouped call its items; a round's list of items (a
    resubmitted allreduce_async_ per tensor) is not kept, so its tensors are not held alive."""
    import gc
    import weakref

    from horovod.common.engine.plan import plan_reduction

    ops = dp.TorchBuffers(torch.device("cpu"))
    n = dp.TorchBuffers.ITEMS_MEMO_MIN
    xs = [torch.full((2, 2), float(k)) for k in range(n)]
    ws = [dp.DeviceTensor(x) for x in xs]
    items = ops.items("g", ws, ops.outputs(ws, ws))
    assert isinstance(items, tuple) and ops.items("g", ws, ops.outputs(ws, ws)) is items
    other = list(ws)
    other[1] = dp.DeviceTensor(torch.zeros(2, 2))
    assert ops.items("g", other, ops.outputs(other, other))[1].x is other[1].tensor
    outs = [torch.empty(2, 2) for _ in ws]
    assert not ops.items("g", ws, outs)[0].inplace  # out of place: never from the memo
    segs = plan_reduction([4] * n, 4, 0, 1 << 20, True)[0].segments
    buf = ops.buffer(torch.float32, 4 * n)
    ops.pack(buf, items, segs, 1.0, False)
    assert torch.equal(buf, torch.cat([x.reshape(-1) for x in xs]))
    views = ops._whole(buf, items, segs).views
    assert ops._whole(buf, items, segs).views is views  # made once
    buf.mul_(3)
    ops.unpack(buf, items, segs, 1.0, 3)
    assert all(torch.equal(x, torch.full((2, 2), float(k))) for k, x in enumerate(xs))
    flat = [dp.DeviceTensor(torch.full((4,), float(k))) for k in range(n)]  # other shapes, same sizes
    flat_items = list(ops.items("f", flat, ops.outputs(flat, flat)))
    assert ops._whole(buf, flat_items, segs).views is not views
    ops.pack(buf, flat_items, segs, 2.0, False)
    assert torch.equal(buf, torch.cat([w.tensor for w in flat]) * 2)
    bigger = ops.buffer(torch.float32, 1 << 12)  # a new buffer: views made again
    assert not ops._pieces and bigger.data_ptr() != buf.data_ptr()
    round_tensors = [torch.ones(4) for _ in range(n)]
    ref = weakref.ref(round_tensors[0])
    round_items = [dp.TorchBuffers.item(tuple.__new__, f"t{k}", t) for k, t in enumerate(round_tensors)]
    buf = ops.buffer(torch.float32, 4 * n)
    ops.pack(buf, round_items, segs, 1.0, False)
    ops.unpack(buf, round_items, segs, 1.0, 1)
    del round_tensors, round_items
    gc.collect()
    assert ref() is None  # the memo kept only the buffer's views
