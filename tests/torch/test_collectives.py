"""Every horovod.torch collective on real ranks (mpirun), np=2 and np=3, every supported dtype.

Each rank body runs all cases of one family and returns its list of failures (it does not stop at
the first), so one launch reports every broken (dtype, shape, op) combination. The bodies that
need nothing but ``hvd.init()`` share one launch per world size with the other torch modules'
(tests/_shared_launch.py, the error paths last), and so do the allreduce family, which starts
Horovod with dynamic process sets, and the resubmit spies, each between shutdowns of its own
(``own_init``).
"""

from __future__ import annotations

import sys

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch, own_init

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]

NPS = [2, 3]


def _allreduce_cases():
    import warnings

    import torch

    import horovod.torch as hvd

    hvd.init(process_sets="dynamic")
    r, n = hvd.rank(), hvd.size()
    bad = []
    dtypes = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64]
    for dt in dtypes:
        for shape in [(), (5,), (3, 4)]:
            base = torch.arange(int(torch.Size(shape).numel()), dtype=torch.float64).reshape(shape) % 5
            allx = [base + k for k in range(n)]
            x = (base + r).to(dt)
            for op, want in [(hvd.Sum, sum(allx)), (hvd.Min, allx[0]), (hvd.Max, allx[-1]),
                             (hvd.Average, sum(allx) / n)]:
                got = hvd.allreduce(x, op=op, name=f"{dt}.{shape}.{int(op)}")
                w = want.to(dt) if dt.is_floating_point else torch.trunc(want).to(dt)
                if got.dtype != dt or tuple(got.shape) != shape or not torch.allclose(
                        got.double(), w.double(), rtol=1e-2, atol=1e-2):
                    bad.append(f"rank {r}: allreduce({dt}, {shape}, op={int(op)}) -> {got}, expected {w}")
            # in place, tensor's own memory
            y = x.clone()
            out = hvd.allreduce_(y, op=hvd.Sum, name=f"inplace.{dt}.{shape}")
            if out is not y or not torch.allclose(y.double(), sum(allx).to(dt).double(), rtol=1e-2):
                bad.append(f"rank {r}: allreduce_({dt}, {shape}) -> {y}")
    # bool: Sum/Max = or, Min = and
    b = torch.tensor([r == 0, True, False])
    for op, want in [(hvd.Sum, [True, True, False]), (hvd.Max, [True, True, False]),
                     (hvd.Min, [n == 1, True, False])]:
        got = hvd.allreduce(b, op=op, name=f"bool.{int(op)}")
        if got.dtype != torch.bool or got.tolist() != want:
            bad.append(f"rank {r}: allreduce(bool, op={int(op)}) -> {got}, expected {want}")
    bb = b.clone()
    hvd.allreduce_(bb, op=hvd.Min, name="bool.inplace")
    if bb.tolist() != [n == 1, True, False]:
        bad.append(f"rank {r}: allreduce_(bool) -> {bb}")
    # scale factors, async, async in place, non-contiguous, requires_grad input untouched
    x = torch.full((6,), r + 1.0)
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5, name="scaled")
    if not torch.allclose(got, torch.full((6,), float(sum(k + 1 for k in range(n))))):
        bad.append(f"rank {r}: scaled allreduce -> {got}")
    if not torch.equal(x, torch.full((6,), r + 1.0)):
        bad.append(f"rank {r}: allreduce modified its input: {x}")
    hs = [hvd.allreduce_async(torch.full((k + 1,), float(r)), name=f"async.{k}", op=hvd.Sum) for k in range(40)]
    for k, h in enumerate(hs):
        got = hvd.synchronize(h)
        if tuple(got.shape) != (k + 1,) or not torch.allclose(got, torch.tensor(float(sum(range(n))))):
            bad.append(f"rank {r}: allreduce_async #{k} -> {got}")
    ts = [torch.full((k + 2,), float(r)) for k in range(20)]
    hs = [hvd.allreduce_async_(t, name=f"async_.{k}") for k, t in enumerate(ts)]
    outs = [hvd.synchronize(h) for h in hs]
    if any(o is not t for o, t in zip(outs, ts)) or any(
            not torch.allclose(t, torch.tensor((n - 1) / 2)) for t in ts):
        bad.append(f"rank {r}: allreduce_async_ results {ts[:2]}")
    nc = torch.zeros(4, 4)[:, ::2]
    nc.fill_(float(r))
    hvd.allreduce_(nc, op=hvd.Sum, name="noncontig")
    if not torch.allclose(nc, torch.tensor(float(sum(range(n))))):
        bad.append(f"rank {r}: non-contiguous allreduce_ -> {nc}")
    # deprecated average=, compression
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = hvd.allreduce(torch.ones(3) * r, average=False, name="avg.false")
    if not torch.allclose(got, torch.tensor(float(sum(range(n))))) or not any(
            issubclass(w.category, DeprecationWarning) for w in caught):
        bad.append(f"rank {r}: allreduce(average=False) -> {got}, warnings {caught}")
    got = hvd.allreduce(torch.full((5,), r + 0.5, dtype=torch.float64), name="fp16",
                        compression=hvd.Compression.fp16)
    if got.dtype != torch.float64 or not torch.allclose(got, torch.tensor((n - 1) / 2 + 0.5, dtype=torch.float64)):
        bad.append(f"rank {r}: fp16-compressed allreduce -> {got}")
    # bf16: each rank's values rounded to bfloat16, reduced, rounded again, restored to float32 (and
    # NumPy's Compression.bf16 gives the same values in the same processes)
    import numpy as np

    import horovod.numpy as hnp

    fine = [1.0 + q / 3.0 + torch.arange(6, dtype=torch.float32) * 1e-3 for q in range(n)]
    want = (sum(x.to(torch.bfloat16).float() for x in fine) / n).to(torch.bfloat16).float()
    got = hvd.allreduce(fine[r], name="bf16", compression=hvd.Compression.bf16)
    exact = sum(fine) / n
    if got.dtype != torch.float32 or not torch.equal(got, want) or torch.equal(got, exact):
        bad.append(f"rank {r}: bf16-compressed allreduce -> {got}, want {want}")
    got_np = hnp.allreduce(fine[r].numpy().astype(np.float64), name="bf16.np", compression=hnp.Compression.bf16)
    if got_np.dtype != np.float64 or not np.array_equal(got_np, want.double().numpy()):
        bad.append(f"rank {r}: NumPy bf16-compressed allreduce -> {got_np}, want {want}")
    (got_g,) = hnp.grouped_allreduce([fine[r].numpy()], name="bf16.np.g", compression=hnp.Compression.bf16)
    if not np.array_equal(got_g, want.numpy()):
        bad.append(f"rank {r}: NumPy bf16 grouped allreduce -> {got_g}, want {want}")
    # grouped, all four variants
    g = [torch.full((k + 1, 2), float(r + k)) for k in range(5)]
    want = [torch.full((k + 1, 2), float(sum(q + k for q in range(n)))) for k in range(5)]
    for label, outs in [
        ("grouped_allreduce", hvd.grouped_allreduce(g, op=hvd.Sum, name="ga")),
        ("grouped_allreduce_async", hvd.synchronize(hvd.grouped_allreduce_async(g, op=hvd.Sum, name="gaa"))),
    ]:
        if len(outs) != 5 or any(not torch.allclose(o, w) for o, w in zip(outs, want)):
            bad.append(f"rank {r}: {label} -> {outs}")
    g2 = [t.clone() for t in g]
    outs = hvd.grouped_allreduce_(g2, op=hvd.Sum, name="ga_")
    if any(o is not t for o, t in zip(outs, g2)) or any(not torch.allclose(o, w) for o, w in zip(g2, want)):
        bad.append(f"rank {r}: grouped_allreduce_ -> {g2}")
    g3 = [t.to(torch.bfloat16) for t in g]
    outs = hvd.synchronize(hvd.grouped_allreduce_async_(g3, op=hvd.Sum, name="gaa_"))
    if any(not torch.allclose(t.float(), w) for t, w in zip(g3, want)):
        bad.append(f"rank {r}: grouped_allreduce_async_(bfloat16) -> {g3}")
    # process sets
    if n == 3:
        ps = hvd.add_process_set([0, 2])
        if r in (0, 2):
            got = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="ps", process_set=ps)
            if got.item() != 2.0:
                bad.append(f"rank {r}: allreduce on process set [0, 2] -> {got}")
        else:
            try:
                hvd.allreduce(torch.ones(1), name="ps", process_set=ps)
                bad.append(f"rank {r}: non-member allreduce did not raise")
            except ValueError as exc:
                if "not a member" not in str(exc):
                    bad.append(f"rank {r}: non-member message: {exc}")
        hvd.remove_process_set(ps)
    return bad


def _movement_cases():
    import torch

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64]

    def make(k: int, rows: int, dt: torch.dtype) -> torch.Tensor:
        v = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) + 10 * k
        return (v % 2 == 1) if dt == torch.bool else v.to(dt)

    for dt in dtypes:
        # allgather with different first dimensions, and the async form
        got = hvd.allgather(make(r, r + 1, dt), name=f"ag.{dt}")
        want = torch.cat([make(k, k + 1, dt) for k in range(n)])
        if got.dtype != dt or not torch.equal(got, want):
            bad.append(f"rank {r}: allgather({dt}) -> {got}, expected {want}")
        got = hvd.synchronize(hvd.allgather_async(make(r, 2, dt), name=f"aga.{dt}"))
        if not torch.equal(got, torch.cat([make(k, 2, dt) for k in range(n)])):
            bad.append(f"rank {r}: allgather_async({dt}) -> {got}")
        # broadcast from every root, out of place and in place
        for root in range(n):
            x = make(r, 4, dt)
            got = hvd.broadcast(x, root, name=f"bc.{dt}.{root}")
            if got.dtype != dt or not torch.equal(got, make(root, 4, dt)):
                bad.append(f"rank {r}: broadcast({dt}, root={root}) -> {got}")
            if not torch.equal(x, make(r, 4, dt)):
                bad.append(f"rank {r}: broadcast({dt}, root={root}) modified its input")
            if r == root:
                got[0] = got[1]
                if not torch.equal(x, make(r, 4, dt)):
                    bad.append(f"rank {r}: broadcast output aliases the root's input ({dt})")
            y = make(r, 4, dt)
            out = hvd.broadcast_(y, root, name=f"bc_.{dt}.{root}")
            if out is not y or not torch.equal(y, make(root, 4, dt)):
                bad.append(f"rank {r}: broadcast_({dt}, root={root}) -> {y}")
        z = make(r, 3, dt)
        hvd.synchronize(hvd.broadcast_async_(z, 0, name=f"bca_.{dt}"))
        if not torch.equal(z, make(0, 3, dt)):
            bad.append(f"rank {r}: broadcast_async_({dt}) -> {z}")
        # alltoall: even split and explicit splits (rank r sends k+1 rows to rank k)
        x = make(r, 2 * n, dt)
        got = hvd.alltoall(x, name=f"a2a.{dt}")
        want = torch.cat([make(k, 2 * n, dt)[2 * r:2 * r + 2] for k in range(n)])
        if not torch.equal(got, want):
            bad.append(f"rank {r}: alltoall({dt}) -> {got}, expected {want}")
        splits = torch.tensor([k + 1 for k in range(n)], dtype=torch.int32)
        rows = int(splits.sum())
        out, recv = hvd.alltoall(make(r, rows, dt), splits=splits, name=f"a2as.{dt}")
        off = sum(range(1, r + 1))
        want = torch.cat([make(k, rows, dt)[off:off + r + 1] for k in range(n)])
        if not torch.equal(out, want) or recv.tolist() != [r + 1] * n or recv.dtype != torch.int32:
            bad.append(f"rank {r}: alltoall({dt}, splits) -> {out}, {recv}")
    # grouped allgather
    outs = hvd.grouped_allgather([torch.full((r + 1,), float(r)), torch.full((1, 2), r, dtype=torch.float32)],
                                 name="gag")
    if outs[0].tolist() != [float(k) for k in range(n) for _ in range(k + 1)] or tuple(outs[1].shape) != (n, 2):
        bad.append(f"rank {r}: grouped_allgather -> {outs}")
    # reducescatter: uneven rows, Sum and Average, dtypes
    for dt in [torch.int32, torch.float16, torch.bfloat16, torch.float32, torch.float64]:
        rows = 2 * n + 1
        x = (torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) + r).to(dt)
        total = sum(torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) + k for k in range(n))
        base, extra = divmod(rows, n)
        counts = [base + (1 if k < extra else 0) for k in range(n)]
        start = sum(counts[:r])
        for op, want in [(hvd.Sum, total), (hvd.Average, total / n)]:
            got = hvd.reducescatter(x, op=op, name=f"rs.{dt}.{int(op)}")
            w = want[start:start + counts[r]]
            w = w.to(dt) if dt.is_floating_point else torch.trunc(w).to(dt)
            if got.dtype != dt or not torch.allclose(got.double(), w.double(), rtol=1e-2):
                bad.append(f"rank {r}: reducescatter({dt}, op={int(op)}) -> {got}, expected {w}")
    outs = hvd.grouped_reducescatter([torch.ones(n, 2) * r, torch.ones(2 * n) * (r + 1)], op=hvd.Sum, name="grs")
    if not torch.allclose(outs[0], torch.full((1, 2), float(sum(range(n))))) or not torch.allclose(
            outs[1], torch.full((2,), float(sum(range(1, n + 1))))):
        bad.append(f"rank {r}: grouped_reducescatter -> {outs}")
    got = hvd.synchronize(hvd.reducescatter_async(torch.ones(n, 3), op=hvd.Sum, name="rsa"))
    if not torch.allclose(got, torch.full((1, 3), float(n))):
        bad.append(f"rank {r}: reducescatter_async -> {got}")
    # objects, barrier, join
    objs = hvd.allgather_object({"rank": r})
    if objs != [{"rank": k} for k in range(n)]:
        bad.append(f"rank {r}: allgather_object -> {objs}")
    obj = hvd.broadcast_object({"a": [1, 2]} if r == 0 else None, root_rank=0)
    if obj != {"a": [1, 2]}:
        bad.append(f"rank {r}: broadcast_object -> {obj}")
    hvd.barrier()
    if r != 0:
        got = hvd.allreduce(torch.ones(4), name="while.joined")
        if not torch.allclose(got, torch.full((4,), (n - 1) / n)):
            bad.append(f"rank {r}: allreduce with rank 0 joined -> {got}")
    last = hvd.join()
    if last not in range(1, n):
        bad.append(f"rank {r}: join returned {last}")
    return bad


def _grad_cases():
    import torch

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []

    def check(label, got, want):
        if not torch.allclose(got, want, atol=1e-5):
            bad.append(f"rank {r}: grad of {label} = {got}, expected {want}")

    for op, want in [(hvd.Sum, float(sum(k + 1 for k in range(n)))), (hvd.Average, (n + 1) / 2)]:
        x = torch.ones(3, 2, requires_grad=True)
        hvd.allreduce(x, op=op, name=f"g.ar.{int(op)}").backward(torch.full((3, 2), r + 1.0))
        check(f"allreduce op={int(op)}", x.grad, torch.full((3, 2), want))
        xs = [torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)]
        ys = hvd.grouped_allreduce(xs, op=op, name=f"g.gar.{int(op)}")
        torch.autograd.backward(ys, [torch.full((2,), r + 1.0), torch.full((3,), r + 1.0)])
        check(f"grouped_allreduce op={int(op)}", xs[1].grad, torch.full((3,), want))
    # allgather: block k of the output gets gradient k + 10 * (this rank)
    x = torch.ones(r + 1, 2, requires_grad=True)
    y = hvd.allgather(x, name="g.ag")
    gy = torch.cat([torch.full((k + 1, 2), k + 10.0 * r) for k in range(n)])
    y.backward(gy)
    check("allgather", x.grad, torch.full((r + 1, 2), r + 10.0 * (n - 1) / 2))
    xs = [torch.ones(r + 1, requires_grad=True), torch.ones(1, 3, requires_grad=True)]
    ys = hvd.grouped_allgather(xs, name="g.gag")
    torch.autograd.backward(ys, [torch.cat([torch.full((k + 1,), float(k)) for k in range(n)]),
                                 torch.ones(n, 3)])
    check("grouped_allgather[0]", xs[0].grad, torch.full((r + 1,), float(r)))
    # broadcast: averaged gradient on the root, zero elsewhere
    x = torch.ones(4, requires_grad=True)
    hvd.broadcast(x, 0, name="g.bc").backward(torch.full((4,), r + 1.0))
    check("broadcast", x.grad, torch.full((4,), (n + 1) / 2 if r == 0 else 0.0))
    # alltoall: the rows sent to rank k get rank k's gradient
    x = torch.ones(2 * n + 1, 2, requires_grad=True)
    splits = [2] * n
    out, _ = hvd.alltoall(x, splits=splits, name="g.a2a")
    out.backward(torch.full(out.shape, r + 1.0))
    want = torch.cat([torch.full((2, 2), k + 1.0) for k in range(n)] + [torch.zeros(1, 2)])
    check("alltoall", x.grad, want)
    # reducescatter: allgather of the gradient, times size for Sum
    for op, factor in [(hvd.Sum, n), (hvd.Average, 1)]:
        x = torch.ones(2 * n, 3, requires_grad=True)
        hvd.reducescatter(x, op=op, name=f"g.rs.{int(op)}").backward(torch.full((2, 3), r + 1.0))
        want = torch.cat([torch.full((2, 3), (k + 1.0) * factor) for k in range(n)])
        check(f"reducescatter op={int(op)}", x.grad, want)
    xs = [torch.ones(n, 2, requires_grad=True)]
    ys = hvd.grouped_reducescatter(xs, op=hvd.Sum, name="g.grs")
    ys[0].backward(torch.full((1, 2), r + 1.0))
    check("grouped_reducescatter", xs[0].grad, torch.cat([torch.full((1, 2), (k + 1.0) * n) for k in range(n)]))
    return bad


def _error_cases():

    import torch

    import horovod.torch as hvd
    from horovod.common.exceptions import HorovodInternalError

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []

    def expect(label, exc_type, fn, text=""):
        try:
            fn()
        except exc_type as exc:
            if text and text not in str(exc):
                bad.append(f"rank {r}: {label}: message {exc!s} lacks {text!r}")
            return
        except Exception as exc:  # noqa: BLE001
            bad.append(f"rank {r}: {label}: raised {type(exc).__name__}: {exc}")
            return
        bad.append(f"rank {r}: {label}: did not raise {exc_type.__name__}")

    expect("complex dtype", ValueError, lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64)),
           "Tensor type")
    expect("non-tensor", TypeError, lambda: hvd.allreduce([1.0, 2.0]), "torch.Tensor")
    expect("meta device", NotImplementedError, lambda: hvd.allreduce(torch.ones(2, device="meta")),
           "supports CPU and CUDA tensors")
    expect("reducescatter Max", NotImplementedError, lambda: hvd.reducescatter(torch.ones(n), op=hvd.Max),
           "AVERAGE and SUM")
    expect("alltoall bad splits", ValueError, lambda: hvd.alltoall(torch.ones(4), splits=[1] * (n + 1)))
    expect("alltoall indivisible", ValueError, lambda: hvd.alltoall(torch.ones(n + 1)), "splits not provided")
    expect("allgather scalar", ValueError, lambda: hvd.allgather(torch.tensor(1.0)), "rank-zero")
    # a shape mismatch fails on every rank, and the engine keeps working afterwards
    expect("shape mismatch", HorovodInternalError,
           lambda: hvd.allreduce(torch.ones(r + 2), name="mismatch"), "shape")
    got = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after.mismatch")
    if not torch.allclose(got, torch.full((2,), float(n))):
        bad.append(f"rank {r}: allreduce after a mismatch -> {got}")
    # a name still in flight: the other ranks submit 'dup' only after a barrier that rank 0 enters
    # once it tried the duplicate, so rank 0's first 'dup' cannot have finished by then
    if r == 0:
        h = hvd.allreduce_async(torch.ones(3), name="dup")
        expect("duplicate name", ValueError, lambda: hvd.allreduce_async(torch.ones(3), name="dup"),
               "same name")
        hvd.barrier()
    else:
        hvd.barrier()
        h = hvd.allreduce_async(torch.ones(3), name="dup")
    hvd.synchronize(h)
    if hvd.synchronize(h) is not None:
        bad.append(f"rank {r}: synchronize of a finished handle did not return None")
    return bad


@pytest.mark.parametrize("np_", NPS)
def test_allreduce_family(np_):
    fails = _OWN[np_].results("allreduce")
    assert not any(fails), "\n".join(f for per_rank in fails for f in per_rank)


@pytest.mark.parametrize("np_", NPS)
def test_allgather_broadcast_alltoall_reducescatter_join(np_):
    fails = _LAUNCH[np_].results("movement")
    assert not any(fails), "\n".join(f for per_rank in fails for f in per_rank)


@pytest.mark.parametrize("np_", NPS)
def test_autograd_gradients(np_):
    fails = _LAUNCH[np_].results("grad")
    assert not any(fails), "\n".join(f for per_rank in fails for f in per_rank)


@pytest.mark.parametrize("np_", NPS)
def test_error_paths(np_):
    fails = _ERRORS[np_].results("errors")
    assert not any(fails), "\n".join(f for per_rank in fails for f in per_rank)


def _repeat_cases():

    import torch

    import horovod.torch as hvd
    from horovod.common.context import Context, Prepared

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    fails = []
    fast = []
    # One submit path (``Prepared.submit``): the checked path (``collectives.py``) prepares the
    # request it submits (``Context.prepare``); a resubmission submits one prepared earlier.
    real_prepare, real_submit = Context.prepare, Prepared.submit
    just_prepared = []

    def spy_prepare(self, request):
        p = real_prepare(self, request)
        if sys._getframe(1).f_globals["__name__"] == "horovod.common.collectives":
            just_prepared[:] = [p]
        return p

    def spy_submit(self, *args, **kwargs):
        if just_prepared and just_prepared[0] is self:
            just_prepared.clear()  # the checked path
        else:
            fast.append(self.request.name)
        return real_submit(self, *args, **kwargs)

    Context.prepare, Prepared.submit = spy_prepare, spy_submit
    total = sum(range(n))

    def check(what, got, want):
        if not torch.equal(got, want):
            fails.append(f"rank {r}: {what}: {got.tolist()} != {want.tolist()}")

    # The same name, op and tensor signature every step: from the second call on the checked
    # request is resubmitted as it is.
    for step in range(4):
        t = torch.full((4,), float(r + step))
        out = hvd.allreduce_(t, name="rep", op=hvd.Sum)
        check(f"step {step}", out, torch.full((4,), float(total + n * step)))
        if out is not t:
            fails.append(f"rank {r}: allreduce_ returned another tensor")
    h = hvd.allreduce_async_(torch.full((4,), float(r)), name="rep", op=hvd.Sum)
    check("async", hvd.synchronize(h), torch.full((4,), float(total)))
    if fast.count("allreduce.rep") != 4:
        fails.append(f"rank {r}: repeats resubmitted {fast.count('allreduce.rep')} times, expected 4")
    # Anything different takes the checked path, with the right result or error.
    check("new shape", hvd.allreduce_(torch.full((5,), float(r)), name="rep", op=hvd.Sum),
          torch.full((5,), float(total)))
    check("new dtype", hvd.allreduce_(torch.full((5,), float(r), dtype=torch.float64), name="rep",
                                      op=hvd.Sum), torch.full((5,), float(total), dtype=torch.float64))
    nc = torch.zeros(4, 2)[:, 0]
    nc += r
    check("non-contiguous", hvd.allreduce_(nc, name="rep", op=hvd.Sum), torch.full((4,), float(total)))
    check("average", hvd.allreduce_(torch.full((5,), float(r), dtype=torch.float64), name="rep"),
          torch.full((5,), total / n, dtype=torch.float64))
    try:
        hvd.allreduce_(torch.ones(5, dtype=torch.float64) if r == 0 else torch.ones(6, dtype=torch.float64),
                       name="rep", op=hvd.Sum)
        fails.append(f"rank {r}: a shape mismatch on a repeated name did not raise")
    except Exception as exc:  # noqa: BLE001 - any Horovod error naming the mismatch
        if "shape" not in str(exc).lower():
            fails.append(f"rank {r}: mismatch error does not name the shapes: {exc}")
    # A named grouped_allreduce_ repeated on a gradient set of the same signature is resubmitted
    # too; the tensors come back reduced in place.
    fast.clear()
    for step in range(3):
        ts = [torch.full((3,), float(r + step)), torch.full((2, 2), float(r))]
        outs = hvd.grouped_allreduce_(ts, name="grep", op=hvd.Sum)
        check(f"grouped step {step}", outs[0], torch.full((3,), float(total + n * step)))
        check(f"grouped step {step}", outs[1], torch.full((2, 2), float(total)))
        if outs[0] is not ts[0] or outs[1] is not ts[1]:
            fails.append(f"rank {r}: grouped_allreduce_ returned other tensors")
    if len(fast) != 2:
        fails.append(f"rank {r}: grouped repeats resubmitted {len(fast)} times, expected 2")
    fast.clear()
    check("grouped, one new shape", hvd.grouped_allreduce_(
        [torch.full((3,), float(r)), torch.full((5,), float(r))], name="grep", op=hvd.Sum)[1],
        torch.full((5,), float(total)))
    check("grouped, one tensor fewer", hvd.grouped_allreduce_(
        [torch.full((3,), float(r))], name="grep", op=hvd.Sum)[0], torch.full((3,), float(total)))
    if fast:
        fails.append(f"rank {r}: a changed gradient set was resubmitted unchecked")
    hvd.grouped_allreduce_([torch.ones(3), torch.ones(2)], name="grep", op=hvd.Sum)
    try:  # rank 0 resubmits unchecked, the others' shapes differ: still an error on every rank
        hvd.grouped_allreduce_([torch.ones(3), torch.ones(2 if r == 0 else 4)], name="grep", op=hvd.Sum)
        fails.append(f"rank {r}: a grouped shape mismatch on a repeated name did not raise")
    except Exception as exc:  # noqa: BLE001 - any Horovod error naming the mismatch
        if "shape" not in str(exc).lower():
            fails.append(f"rank {r}: grouped mismatch error does not name the shapes: {exc}")
    # The same tensor objects again (a fixed set): their views are reused, after a check of what
    # could have changed in place. A tensor given new storage, resized, retyped or made
    # non-contiguous in place is checked again, and its values come out right.
    from horovod.torch import mpi_ops

    fast.clear()
    same = [torch.zeros(3), torch.zeros(2, 2)]

    def grouped_same(what, fast_expected):
        before = len(fast)
        for t in same:
            t.fill_(float(r))
        hvd.grouped_allreduce_(same, name="gsame", op=hvd.Sum)
        for t in same:
            check(what, t, torch.full(t.shape, float(total), dtype=t.dtype))
        if (len(fast) > before) != fast_expected:
            fails.append(f"rank {r}: {what}: resubmitted unchecked: {len(fast) > before}, "
                         f"expected {fast_expected}")

    grouped_same("same tensors, first call", False)
    grouped_same("same tensors, second call", True)
    from horovod.common.context import get_context

    repeat = next(v for v in get_context().repeats.values()
                  if isinstance(v, mpi_ops._GroupRepeat) and v.request.name.endswith("gsame"))
    views = repeat.arrays
    grouped_same("same tensors, third call", True)
    if repeat.arrays is not views:
        fails.append(f"rank {r}: the same tensors got new views")
    same[0].set_(torch.zeros(3))  # new storage, same shape: checked, then resubmitted
    grouped_same("new storage", True)
    if repeat.arrays is views or repeat.arrays[0].ctypes.data != same[0].data_ptr():
        fails.append(f"rank {r}: a tensor with new storage kept its old view")
    same[1].set_(same[1].untyped_storage(), 0, (2, 2), (1, 2))  # same memory and shape, transposed
    grouped_same("non-contiguous in place", False)
    same[1].resize_(4)
    grouped_same("resized in place", False)
    for t in same:  # a grouped allreduce takes one dtype
        t.data = t.data.double()
    grouped_same("retyped in place", False)
    grouped_same("after the changes", True)
    Context.prepare, Prepared.submit = real_prepare, real_submit
    return fails


@pytest.mark.parametrize("np_", [2, 3])
def test_repeated_named_allreduce_resubmits_and_falls_back(np_):
    fails = _OWN[np_].results("repeat")
    assert fails == [[]] * np_, fails


def _flat_gradient_cases():
    import torch

    import horovod.torch as hvd
    from horovod.torch import _convert

    _convert._TORCH_THP = True  # the flat buffer counts as huge pages: its runs are reduced in place
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    fails = []
    sizes = [5, (3 << 20) // 4 + 7, 300, 1, (2 << 20) // 4, 64]
    flat = torch.empty(sum(sizes))
    for step in range(3):
        # views of one flat tensor on even ranks (every step), separate tensors on odd ranks
        views = list(torch.split(flat, sizes)) if r % 2 == 0 else [torch.empty(s) for s in sizes]
        for k, v in enumerate(views):
            v.fill_(float(r + k + step))
        outs = hvd.grouped_allreduce_(views, name="flatgrads", op=hvd.Average)
        for k, (v, o) in enumerate(zip(views, outs)):
            want = torch.full((sizes[k],), sum(q + k + step for q in range(n)) / n)
            if o is not v or not torch.allclose(v, want):
                fails.append(f"rank {r} step {step} tensor {k}: {v.unique()[:4].tolist()} != {want[0].item()}")
        if r % 2 == 0 and not torch.allclose(flat[:sizes[0]], outs[0]):
            fails.append(f"rank {r}: the flat buffer does not hold the result")
    return fails


@pytest.mark.parametrize("np_", [2, 3])
def test_gradients_in_one_flat_tensor_on_some_ranks(np_):
    fails = _LAUNCH[np_].results("flat_gradient")
    assert fails == [[]] * np_, fails


def _flat_hint_cases():
    import torch

    import horovod.torch as hvd
    from horovod.common.context import get_context

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    backend = get_context().engine._executor.backend
    calls: list[int] = []
    real = backend.allreduce
    backend.allreduce = lambda buf, *a, **k: (calls.append(buf.nbytes), real(buf, *a, **k))[1]
    fails = []
    sizes = [5, (3 << 20) // 4 + 7, 300, 1, (2 << 20) // 4, 64]
    piece = get_context().engine.tunables.chunk_bytes // 4
    one_span = sum(sizes) // piece + (1 if sum(sizes) % piece else 0)
    flat = torch.empty(sum(sizes))
    # Views of one flat tensor on every rank: negotiated flat, then resubmitted unchecked (the
    # repeat path keeps the hint); at step 2 rank 1 holds separate tensors of the same shapes.
    for step in range(3):
        separate = step == 2 and r == 1
        views = [torch.empty(s) for s in sizes] if separate else list(torch.split(flat, sizes))
        for k, v in enumerate(views):
            v.fill_(float(r + k + step))
        calls.clear()
        outs = hvd.grouped_allreduce_(views, name="flathint", op=hvd.Average)
        for k, (v, o) in enumerate(zip(views, outs)):
            want = torch.full((sizes[k],), sum(q + k + step for q in range(n)) / n)
            if o is not v or not torch.allclose(v, want):
                fails.append(f"rank {r} step {step} tensor {k}: {v.unique()[:4].tolist()} != {want[0].item()}")
        if len(calls) != one_span:
            fails.append(f"rank {r} step {step}: {len(calls)} transport calls, one span takes {one_span}")
    del backend.allreduce  # the instance's spy: the class's method again (the
    # bound original left on the instance would hide any later spy on the class)
    return fails


@pytest.mark.parametrize("np_", [2, 3])
def test_flat_gradient_set_on_every_rank_is_one_span(np_):
    fails = _LAUNCH[np_].results("flat_hint")
    assert fails == [[]] * np_, fails


# The bodies above that need only hvd.init() are part of one launch per world size, shared with the
# other torch modules' such bodies (tests/_shared_launch.py); the error paths run last.
def _large_cases():
    """Buffers large enough for Gloo's split reduce-scatter (alltoall + local reduction) and
    point-to-point allgather; uneven rows, every rank's part checked against the whole."""
    import torch

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    for dt in [torch.int32, torch.float16, torch.bfloat16, torch.float32, torch.float64]:
        rows = 64 * 1024 * n + 1  # uneven: the first rank gets one row more
        base = torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) % 97
        total = sum(base + k for k in range(n))
        counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
        start = sum(counts[:r])
        for op, want in [(hvd.Sum, total), (hvd.Average, total / n)]:
            got = hvd.reducescatter((base + r).to(dt), op=op, name=f"big.rs.{dt}.{int(op)}")
            w = want[start:start + counts[r]]
            w = w.to(dt) if dt.is_floating_point else torch.trunc(w).to(dt)
            if got.dtype != dt or tuple(got.shape) != tuple(w.shape) or not torch.allclose(
                    got.double(), w.double(), rtol=1e-2):
                bad.append(f"rank {r}: large reducescatter({dt}, op={int(op)}): max error "
                           f"{(got.double() - w.double()).abs().max() if got.shape == w.shape else got.shape}")
        for k_rows in (lambda k: 300_000, lambda k: 300_000 + k):  # equal parts (p2p), unequal
            got = hvd.allgather(torch.full((k_rows(r), 2), r, dtype=torch.float64).to(dt),
                                name=f"big.ag.{dt}.{k_rows(1)}")
            want = torch.cat([torch.full((k_rows(k), 2), k, dtype=torch.float64) for k in range(n)]).to(dt)
            if not torch.equal(got, want):
                bad.append(f"rank {r}: large allgather({dt}, rows {[k_rows(k) for k in range(n)]}) wrong")
    return bad


@pytest.mark.parametrize("np_", NPS)
def test_large_reducescatter_and_allgather_on_gloo(np_):
    fails = _GLOO[np_].results("large")
    assert not any(fails), "\n".join(f for per_rank in fails for f in per_rank)


_LAUNCH = {n: joint_launch("torch", n, {"movement": _movement_cases, "grad": _grad_cases,
                                        "flat_gradient": _flat_gradient_cases, "flat_hint": _flat_hint_cases},
                           timeout=400)
           for n in NPS}
# The allreduce family starts Horovod with dynamic process sets, and the resubmit spies need a context
# of their own (the repeats it has seen): late parts of the same launches, each between shutdowns
# of its own (own_init).
# Under horovodrun --gloo: one launch per world size, shared with the other torch modules' Gloo bodies.
_GLOO = {n: joint_launch("torch", n, {"large": _large_cases}, timeout=300, gloo=True) for n in NPS}
_OWN = {n: joint_launch("torch", n, {"allreduce": own_init(_allreduce_cases), "repeat": own_init(_repeat_cases)},
                        timeout=300, late=True) for n in NPS}
_ERRORS = {n: joint_launch("torch", n, {"errors": _error_cases}, timeout=80, late=True) for n in NPS}