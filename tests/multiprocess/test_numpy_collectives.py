"""Every collective of horovod.numpy on real ranks (mpirun), np=2 and np=3, every dtype.

Each rank body runs all cases of one collective and returns the list of failures (it does not
stop at the first), so one launch reports every broken (dtype, shape, op) combination.
"""

from __future__ import annotations

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]

NPS = [2, 3]
DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]


def _allreduce_cases():
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    for dt in DTYPES:
        for shape in [(), (5,), (3, 4), (2, 3, 2)]:
            x = (np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) % 7 + r).astype(dt)
            allx = [(np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) % 7 + k) for k in range(n)]
            for op, want in [(hvd.Sum, sum(allx)), (hvd.Min, np.min(allx, 0)), (hvd.Max, np.max(allx, 0)),
                             (hvd.Product, np.prod(allx, 0))]:
                if dt in ("uint8", "int8") and op == hvd.Product:
                    continue  # overflows
                got = hvd.allreduce(x, op=op, name=f"{dt}.{shape}.{op}")
                if got.dtype != np.dtype(dt) or got.shape != shape or not np.allclose(got, want.astype(dt), rtol=1e-3):
                    bad.append(f"rank {r}: allreduce({dt}, {shape}, {op}) -> {got!r}, expected {want.astype(dt)!r}")
            got = hvd.allreduce(x, name=f"avg.{dt}.{shape}")
            want = (sum(allx) / n)
            want = want.astype(dt) if np.dtype(dt).kind == "f" else np.trunc(want).astype(dt)
            if not np.allclose(got, want, rtol=1e-3, atol=1e-3):
                bad.append(f"rank {r}: allreduce({dt}, {shape}, Average) -> {got!r}, expected {want!r}")
    # prescale / postscale, in place, async, grouped
    x = np.full(6, r + 1.0, np.float32)
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5, name="scaled")
    if not np.allclose(got, sum(k + 1 for k in range(n))):
        bad.append(f"rank {r}: scaled allreduce -> {got}")
    y = np.full(4, float(r), np.float64)
    out = hvd.allreduce_(y, op=hvd.Sum, name="inplace")
    if out is not y or not np.allclose(y, sum(range(n))):
        bad.append(f"rank {r}: allreduce_ did not write in place: {y}")
    nc = np.zeros((4, 4), np.float32)[:, ::2]  # non-contiguous
    nc[...] = r
    hvd.allreduce_(nc, op=hvd.Sum, name="noncontig")
    if not np.allclose(nc, sum(range(n))):
        bad.append(f"rank {r}: non-contiguous allreduce_ -> {nc}")
    hs = [hvd.allreduce_async(np.full(k + 1, float(r)), name=f"async.{k}", op=hvd.Sum) for k in range(50)]
    for k, h in enumerate(hs):
        got = hvd.synchronize(h)
        if got.shape != (k + 1,) or not np.allclose(got, sum(range(n))):
            bad.append(f"rank {r}: async allreduce {k} -> {got}")
    ts = [np.full((k + 1, 2), float(r + k), np.float32) for k in range(5)]
    outs = hvd.grouped_allreduce(ts, op=hvd.Sum, name="grp")
    for k, o in enumerate(outs):
        if not np.allclose(o, sum(q + k for q in range(n))):
            bad.append(f"rank {r}: grouped_allreduce[{k}] -> {o}")
    hvd.grouped_allreduce_(ts, op=hvd.Average, name="grp_")
    for k, t in enumerate(ts):
        if not np.allclose(t, sum(q + k for q in range(n)) / n):
            bad.append(f"rank {r}: grouped_allreduce_[{k}] -> {t}")
    # caller-given outputs (the TF bridge's pooled buffers): small fused, large out of place,
    # Average (its power-of-two scaling is folded into the copy), float16 widened
    from horovod.common import collectives as C
    for dt, size in [(np.float32, 7), (np.float32, 300_000), (np.float64, 70_000), (np.float16, 5_000)]:
        xs = [np.full(size, r + 1.0, dt), np.full(3, r + 2.0, dt)]
        outs = [np.full_like(x, -1) for x in xs]
        got = C.allreduce_async(xs, name=f"out.{dt.__name__}.{size}", grouped=True, out=outs).wait()
        for k, (g, o) in enumerate(zip(got, outs)):
            want = sum(q + 1.0 + k for q in range(n)) / n
            if g is not o or not np.allclose(o, want, rtol=1e-3) or not np.all(xs[k] == r + 1.0 + k):
                bad.append(f"rank {r}: allreduce out= {dt.__name__} {size}[{k}] -> {o[:3]}, want {want}; "
                           f"input now {xs[k][:3]}")
    # tensors with no element: nothing to reduce, and nothing may fail (out of place, in place,
    # grouped, and beside a tensor that has elements)
    z = hvd.allreduce(np.ones(0, np.float32), name="empty")
    z2 = hvd.allreduce_(np.ones((0, 3), np.float64), op=hvd.Sum, name="empty_")
    zs = hvd.grouped_allreduce([np.ones(0, np.float32), np.full(2, float(r), np.float32)], op=hvd.Sum,
                               name="empty_grp")
    if z.shape != (0,) or z2.shape != (0, 3) or zs[0].shape != (0,) or not np.allclose(zs[1], sum(range(n))):
        bad.append(f"rank {r}: allreduce of empty tensors -> {z!r}, {z2!r}, {zs!r}")
    # unnamed ops in the same order on every rank
    for _ in range(3):
        got = hvd.allreduce(np.ones(3), op=hvd.Sum)
        if not np.allclose(got, n):
            bad.append(f"rank {r}: unnamed allreduce -> {got}")
    return bad


def _allgather_broadcast_cases():
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    for dt in DTYPES + ["bool"]:
        x = (np.ones((r + 1, 3)) * r).astype(dt)
        got = hvd.allgather(x, name=f"ag.{dt}")
        want = np.concatenate([(np.ones((k + 1, 3)) * k).astype(dt) for k in range(n)])
        if got.dtype != np.dtype(dt) or not np.array_equal(got, want):
            bad.append(f"rank {r}: allgather({dt}) -> {got!r}, expected {want!r}")
        for root in range(n):
            b = (np.arange(6).reshape(2, 3) + 10 * r).astype(dt)
            got = hvd.broadcast(b, root, name=f"bc.{dt}.{root}")
            want = (np.arange(6).reshape(2, 3) + 10 * root).astype(dt)
            if not np.array_equal(got, want) or not np.array_equal(b, (np.arange(6).reshape(2, 3) + 10 * r).astype(dt)):
                bad.append(f"rank {r}: broadcast({dt}, root={root}) -> {got!r}, expected {want!r}")
    b = np.full(5, float(r))
    hvd.broadcast_(b, n - 1, name="bc_")
    if not np.allclose(b, n - 1):
        bad.append(f"rank {r}: broadcast_ -> {b}")
    # many small broadcasts (fused), like broadcast_parameters
    hs = [hvd.broadcast_async_(np.full(k + 1, float(r)), 0, name=f"p{k}") for k in range(40)]
    for k, h in enumerate(hs):
        got = hvd.synchronize(h)
        if not np.allclose(got, 0.0):
            bad.append(f"rank {r}: fused broadcast {k} -> {got}")
    outs = hvd.grouped_allgather([np.full((r + 1,), r), np.full((1, 2), r)], name="gag")
    if outs[0].tolist() != sum(([k] * (k + 1) for k in range(n)), []) or outs[1].shape != (n, 2):
        bad.append(f"rank {r}: grouped_allgather -> {outs}")
    obj = hvd.broadcast_object({"from": r, "list": [1, 2]} if r == 1 else None, root_rank=1)
    if obj != {"from": 1, "list": [1, 2]}:
        bad.append(f"rank {r}: broadcast_object -> {obj}")
    objs = hvd.allgather_object(("rank", r))
    if objs != [("rank", k) for k in range(n)]:
        bad.append(f"rank {r}: allgather_object -> {objs}")
    return bad


def _alltoall_reducescatter_cases():
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    for dt in DTYPES + ["bool"]:
        x = (np.arange(2 * n) + 100 * r).astype(dt)
        got = hvd.alltoall(x, name=f"a2a.{dt}")
        want = np.concatenate([(np.arange(2 * n) + 100 * k)[2 * r:2 * r + 2] for k in range(n)]).astype(dt)
        if not np.array_equal(got, want):
            bad.append(f"rank {r}: alltoall({dt}) -> {got}, expected {want}")
    # uneven splits: rank k sends (j + 1) rows to rank j
    splits = [j + 1 for j in range(n)]
    x = np.repeat(np.arange(n)[:, None] * 0 + r, 1, 1).repeat(1, 0)
    x = np.concatenate([np.full((j + 1, 2), 10 * r + j) for j in range(n)]).astype(np.float32)
    out, recv = hvd.alltoall(x, splits=splits, name="a2a.splits")
    want = np.concatenate([np.full((r + 1, 2), 10 * k + r) for k in range(n)])
    if not np.array_equal(out, want) or recv.tolist() != [r + 1] * n:
        bad.append(f"rank {r}: alltoall splits -> {out.tolist()}, {recv}, expected {want.tolist()}")
    for dt in ["int32", "int64", "float16", "float32", "float64"]:
        for rows in [n, 2 * n + 1, 7]:
            x = (np.arange(rows * 2).reshape(rows, 2) + r).astype(dt)
            total = sum((np.arange(rows * 2).reshape(rows, 2) + k) for k in range(n))
            base, extra = divmod(rows, n)
            counts = [base + (1 if i < extra else 0) for i in range(n)]
            start = sum(counts[:r])
            got = hvd.reducescatter(x, op=hvd.Sum, name=f"rs.{dt}.{rows}")
            want = total[start:start + counts[r]].astype(dt)
            if got.shape != want.shape or not np.allclose(got, want, rtol=1e-3):
                bad.append(f"rank {r}: reducescatter({dt}, rows={rows}) -> {got}, expected {want}")
            got = hvd.reducescatter(x, name=f"rsavg.{dt}.{rows}")
            wavg = total[start:start + counts[r]] / n
            wavg = wavg if np.dtype(dt).kind == "f" else np.trunc(wavg)
            if not np.allclose(got, wavg.astype(dt), rtol=1e-3, atol=1e-3):
                bad.append(f"rank {r}: reducescatter Average({dt}, rows={rows}) -> {got}, expected {wavg}")
    outs = hvd.grouped_reducescatter([np.ones((n, 2)), np.ones((2 * n,))], op=hvd.Sum, name="grs")
    if [o.shape for o in outs] != [(1, 2), (2,)] or not all(np.allclose(o, n) for o in outs):
        bad.append(f"rank {r}: grouped_reducescatter -> {outs}")
    return bad


def _large_reducescatter_cases():
    """Reduce-scatters above the MPI backend's split threshold (one alltoall + a local reduction in
    member order): uneven rows (one rank receiving none), integer wrap-around, exact float sums in member order, and the
    parts gathered back equal to the whole sum on every rank."""
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common.backends.mpi import SPLIT_REDUCESCATTER_MIN

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    width = 65537
    for dt in ["int8", "int32", "int64", "float32", "float64"]:
        for rows in [2 * n + 1, 3 * n, n - 1]:  # n - 1: the last rank receives no row
            base, extra = divmod(rows, n)
            counts = [base + (1 if i < extra else 0) for i in range(n)]
            start = sum(counts[:r])
            if dt.startswith("float"):
                xs = [np.random.default_rng(k).standard_normal((rows, width)).astype(dt) for k in range(n)]
            else:
                xs = [((np.arange(rows * width).reshape(rows, width) % 251) * (k + 3)).astype(dt)
                      for k in range(n)]
            assert xs[r].nbytes >= SPLIT_REDUCESCATTER_MIN
            total = xs[0].copy()
            for k in range(1, n):  # member order, in the dtype (integers wrap)
                total = (total + xs[k]).astype(dt)
            got = hvd.reducescatter(xs[r], op=hvd.Sum, name=f"bigrs.{dt}.{rows}")
            want = total[start:start + counts[r]]
            if got.dtype != want.dtype or not np.array_equal(got, want):
                diff = np.flatnonzero(got.reshape(-1) != want.reshape(-1)) if got.shape == want.shape else []
                bad.append(f"rank {r}: reducescatter Sum({dt}, rows={rows}, width={width}) -> shape "
                           f"{got.shape}, {len(diff)} elements differ from the member-order sum")
                continue
            whole = hvd.allgather(got, name=f"bigrs.gather.{dt}.{rows}")
            if not np.array_equal(whole, total):
                bad.append(f"rank {r}: reducescatter Sum({dt}, rows={rows}) parts gathered differ "
                           "from the whole sum")
            if dt.startswith("float"):
                got = hvd.reducescatter(xs[r], name=f"bigrsavg.{dt}.{rows}")
                if not np.allclose(got, want / n, rtol=1e-6, atol=1e-6):
                    bad.append(f"rank {r}: reducescatter Average({dt}, rows={rows}) -> differs from sum / {n}")
    return bad


@pytest.mark.parametrize("np_", NPS)
def test_large_reducescatter_exact_uneven_and_wrapping(np_):
    results = _LAUNCH[np_].results("large_reducescatter")
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize("np_", NPS)
def test_allreduce_every_dtype_op_and_variant(np_):
    results = _LAUNCH[np_].results("allreduce")
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize("np_", NPS)
def test_allgather_broadcast_and_objects(np_):
    results = _LAUNCH[np_].results("allgather_broadcast")
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize("np_", NPS)
def test_alltoall_and_reducescatter(np_):
    results = _LAUNCH[np_].results("alltoall_reducescatter")
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])


def _average_rounding_cases():
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(1234)
    # Integers, rank 0 contributes zeros (as a joined rank does): the sum (n - 1) * x is exact.
    x = rng.integers(-100, 100, size=4099).astype(np.float64)
    bad = []
    for dt in ("float32", "float64"):
        t = (x * (r > 0)).astype(dt)
        total = (x * (n - 1)).astype(dt)
        for post in (1.0, 0.7):
            got = hvd.allreduce(t, op=hvd.Average, postscale_factor=post, name=f"avg_round.{dt}.{post}")
            # A plain Average is the sum divided by the size, rounded once (the framework's own
            # `t / size`); with a postscale factor it is one multiplication by postscale / size in
            # the tensor's precision (upstream's rule for scale factors).
            want = total / np.asarray(n, dt) if post == 1.0 else total * np.asarray(post / n, dt)
            if not np.array_equal(got, want):
                bad.append(f"rank {r}: Average {dt} post={post}: {int(np.sum(got != want))} "
                           f"of {got.size} elements differ from the exactly rounded result, e.g. "
                           f"{got[got != want][:3]} vs {want[got != want][:3]}")
    return bad


@pytest.mark.parametrize("np_", NPS)
def test_average_rounds_like_upstream(np_):
    # At np=3, an Average multiplied by 1/3 was one ulp off the framework's `sum / 3` in about a
    # third of the elements (upstream's join test compares them exactly).
    results = _LAUNCH[np_].results("average_rounding")
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])


def _mixed_memory_cases():
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common.engine.pages import huge_page_backed

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    # Large tensors (several 2 MiB pieces plus a tail) next to small ones. Even ranks own NumPy
    # memory (huge pages: reduced in place), odd ranks hand in memory nobody vouches for (copied
    # through the fusion buffer); the pieces must still pair up.
    sizes = [7, (5 << 20) // 4 + 13, 1000, (3 << 20) // 4, 1]

    def make(k: int, size: int) -> np.ndarray:
        if r % 2 == 0:
            return np.full(size, float(r + k), np.float32)
        a = np.frombuffer(bytearray(size * 4), np.float32)
        a[:] = r + k
        return a

    for in_place in (True, False):
        xs = [make(k, s) for k, s in enumerate(sizes)]
        if r % 2 and any(huge_page_backed(x) for x in xs):
            bad.append(f"rank {r}: a bytearray was taken for huge-page memory")
        if r % 2 == 0 and not huge_page_backed(xs[1]):
            continue  # no huge pages on this kernel: nothing to mix
        if in_place:
            hs = [hvd.allreduce_async_(x, name=f"mixed.ip.{k}", op=hvd.Sum) for k, x in enumerate(xs)]
        else:
            hs = [hvd.allreduce_async(x, name=f"mixed.oop.{k}", op=hvd.Average) for k, x in enumerate(xs)]
        for k, h in enumerate(hs):
            got = hvd.synchronize(h)
            want = sum(q + k for q in range(n)) / (1 if in_place else n)
            if got.shape != (sizes[k],) or not np.all(got == np.float32(want)):
                bad.append(f"rank {r}: {'in place' if in_place else 'out of place'} tensor {k} "
                           f"({sizes[k]} floats): {np.unique(got)[:5]}, expected {want}")
    return bad


@pytest.mark.parametrize("np_", NPS)
def test_ranks_holding_large_tensors_in_different_memory(np_):
    results = _LAUNCH[np_].results("mixed_memory")
    assert results == [[]] * np_, results


def _flat_view_cases():
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    # A gradient set kept as views of one flat buffer (as flattened optimizers keep it) on some
    # ranks and as separate arrays on others: the packed runs are reduced in the flat buffer
    # where it is one span, copied elsewhere; the transport calls must pair up either way.
    sizes = [3, (5 << 20) // 4 + 13, 1000, 77, (3 << 20) // 4 + 5, 1, 4096, (2 << 20) // 4, 9]
    for step, layout in enumerate(("flat", "separate", "flat" if r % 2 else "separate")):
        flat = np.empty(sum(sizes), np.float32)
        views, o = [], 0
        for k, size in enumerate(sizes):
            flat[o:o + size] = r + k + step
            views.append(flat[o:o + size] if layout == "flat" else flat[o:o + size].copy())
            o += size
        grouped = step == 1
        if grouped:
            hvd.grouped_allreduce_(views, name=f"flat.{step}", op=hvd.Sum, prescale_factor=2.0)
        else:
            hs = [hvd.allreduce_async_(v, name=f"flat.{step}.{k}", op=hvd.Sum, prescale_factor=2.0)
                  for k, v in enumerate(views)]
            for h in hs:
                hvd.synchronize(h)
        for k, v in enumerate(views):
            want = 2.0 * sum(q + k + step for q in range(n))
            if not np.all(v == np.float32(want)):
                bad.append(f"rank {r}: step {step} ({layout}) tensor {k} ({sizes[k]} floats): "
                           f"{np.unique(v)[:5]}, expected {want}")
        if layout == "flat" and not np.shares_memory(views[0], flat):
            bad.append(f"rank {r}: views lost their buffer")
    return bad


@pytest.mark.parametrize("np_", NPS)
def test_ranks_holding_a_flat_gradient_set_or_separate_tensors(np_):
    results = _LAUNCH[np_].results("flat_view")
    assert results == [[]] * np_, results


def _flat_group_cases():
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common.context import get_context

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    backend = get_context().engine._executor.backend
    calls: list[int] = []
    real = backend.allreduce

    def counted(buf, *args, **kwargs):
        calls.append(buf.nbytes)
        return real(buf, *args, **kwargs)

    backend.allreduce = counted
    bad = []
    piece = get_context().engine.tunables.chunk_bytes // 4
    sizes = [3, (5 << 20) // 4 + 13, 1000, 77, (3 << 20) // 4 + 5, 1, 4096, (2 << 20) // 4, 9]
    total = sum(sizes)
    one_span = total // piece + (1 if total % piece else 0)  # the raw schedule of one flat buffer
    # (name, layout of this rank): a grouped in-place allreduce on views of one flat buffer on every
    # rank is negotiated as flat and reduced as one span; the hint stays with the cached name when
    # a rank later holds separate arrays (gathered through the buffer, same calls); ranks that
    # differ at negotiation get the per-tensor schedule.
    steps = [("g", "flat"), ("g", "flat"), ("g", "separate" if r == 1 else "flat"), ("g", "separate"),
             ("mixed", "flat" if r % 2 == 0 else "separate")]
    for step, (name, layout) in enumerate(steps):
        flat = np.empty(total, np.float32)
        views, o = [], 0
        for k, size in enumerate(sizes):
            flat[o:o + size] = r + k + step
            views.append(flat[o:o + size] if layout == "flat" else flat[o:o + size].copy())
            o += size
        calls.clear()
        hvd.grouped_allreduce_(views, name=name, op=hvd.Average, prescale_factor=2.0)
        for k, v in enumerate(views):
            want = np.float32(2.0 * sum(q + k + step for q in range(n)) / n)
            if not np.allclose(v, want, rtol=1e-6):
                bad.append(f"rank {r}: step {step} ({name}, {layout}) tensor {k}: {np.unique(v)[:5]}, "
                           f"expected {want}")
        if sum(calls) != total * 4:
            bad.append(f"rank {r}: step {step}: the calls moved {sum(calls)} bytes, not {total * 4}")
        if (len(calls) == one_span) != (name == "g"):
            bad.append(f"rank {r}: step {step} ({name}): {len(calls)} transport calls (one span: {one_span})")
    del backend.allreduce  # the instance's spy: the class's method again (the
    # bound original left on the instance would hide any later spy on the class)
    return bad


@pytest.mark.parametrize("np_", NPS)
def test_grouped_views_of_one_flat_buffer_are_reduced_as_one_span(np_):
    results = _LAUNCH[np_].results("flat_group")
    assert results == [[]] * np_, results


# One launch per world size for every body above, shared with the other NumPy modules' plain-init
# bodies: each needs only hvd.init() (tests/_shared_launch.py).
_LAUNCH = {n: joint_launch("numpy", n, {"allreduce": _allreduce_cases,
                                        "allgather_broadcast": _allgather_broadcast_cases,
                                        "alltoall_reducescatter": _alltoall_reducescatter_cases,
                                        "large_reducescatter": _large_reducescatter_cases,
                                        "average_rounding": _average_rounding_cases,
                                        "mixed_memory": _mixed_memory_cases,
                                        "flat_view": _flat_view_cases, "flat_group": _flat_group_cases},
                            timeout=600)
           for n in NPS}
