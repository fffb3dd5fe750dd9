"""``Compression.fp16``/``bf16`` narrowed in the fusion buffer: the same values as the generic path.

A plain cast compression of a host float32 tensor is handed to the engine as it is, with the
16-bit dtype as its request's (``collectives.allreduce_async(wire=)``): the engine rounds it into
the fusion buffer on the way in and widens it on the way out
(``host_buffers.NumpyBuffers.pack_narrowed``, ``unpack_narrowed``). Every rank checks, at np=2 and
np=3 on MPI and on Gloo, for fp16 and bf16, Average and Sum (with factors), odd sizes, small
(packed) and large (pieces, Gloo's tensors alone):

* ``hvd.allreduce(x, compression=c)`` is bit for bit ``hvd.allreduce(x.to(wire)).float()`` (the
  compress / reduce / decompress the generic path does), and the narrowing ran in the engine;
* narrowed float32 tensors and native 16-bit tensors submitted together share one fused call
  (observed), and each gets its own generic-path value;
* ``DistributedOptimizer(compression=c)``'s gradients (per tensor, and with ``groups=2``) equal the
  by-hand reduction of the local gradients narrowed, over several steps (the later ones
  resubmitted unchecked);
* (Gloo) a repeated step of small narrowed tensors is carried with the negotiation
  (``engine/carry.py``: the rows hold their narrowed values), with the same results;
* a user's ``Compressor`` subclass that overrides ``compress`` keeps its own path (never fused).

A fused call and the by-hand reductions are bit for bit equal at np=2 (one rounding of a + b); at
np=3 MPI may order the steps differently for calls of different sizes, so the mixed, optimizer and
carried checks then allow n roundings of the magnitudes and ask for the same bits on every rank.

Run alone in a job of one process (the local backend widens bfloat16 to float32): the narrowing
rounds through the 16-bit dtype first, the value a 16-bit tensor gets there.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _fused_cases(gloo: bool = False) -> list[str]:
    """``_fused_checks`` with the engine's narrowing as it was afterwards (the body spies on it, in
    ranks that run other bodies after it)."""
    from horovod.common.engine import host_buffers

    real_pack = host_buffers.NumpyBuffers.pack_narrowed
    try:
        return _fused_checks(gloo)
    finally:
        host_buffers.NumpyBuffers.pack_narrowed = real_pack


def _fused_checks(gloo: bool) -> list[str]:
    import zlib

    import torch

    import horovod.torch as hvd
    from horovod.common.engine import host_buffers
    from horovod.torch import mpi_ops

    # Spy on the engine's narrowing: the item dtypes of every call it packs narrowed.
    packed: list[frozenset[str]] = []
    real_pack = host_buffers.NumpyBuffers.pack_narrowed

    def spy(self, buf, items, segs, red, _real=real_pack):
        packed.append(frozenset(items[i].x.dtype.name for i, *_ in segs))
        return _real(self, buf, items, segs, red)
    host_buffers.NumpyBuffers.pack_narrowed = spy

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad: list[str] = []
    gen = torch.Generator().manual_seed(7 + r)
    wires = ((hvd.Compression.fp16, torch.float16), (hvd.Compression.bf16, torch.bfloat16))
    ops = ((hvd.Average, 1.0, 1.0), (hvd.Sum, 1.0, 1.0), (hvd.Sum, 0.5, 3.0), (hvd.Average, 0.25, 2.0))

    def agrees(got: torch.Tensor, want: torch.Tensor, local: torch.Tensor, wdt: torch.dtype, label: str,
               average: bool = True) -> str | None:
        """None when ``got`` (a fused reduction) agrees with ``want`` (the same inputs reduced
        apart): bit for bit at np=2 (one rounding of a + b, whatever the grouping); at np=3 the
        transport's order of the steps may differ with the call's size (an MPI algorithm per
        message size), so within n roundings of the magnitudes summed, and the same bits on every
        rank. ``local``: this rank's input."""
        if n == 2:
            return None if torch.equal(got, want) else first_diff(got, want)
        eps = 2.0 ** -10 if wdt == torch.float16 else 2.0 ** -7
        mag = hvd.allreduce(local.to(wdt).float().abs(), op=hvd.Sum, name=label + ".mag")
        if average:
            mag = mag / n
        over = (got - want).abs() - n * eps * mag
        if got.shape != want.shape or (over > 0).any():
            return first_diff(got, want)
        crc = torch.tensor([float(zlib.crc32(got.numpy().tobytes()))], dtype=torch.float64)
        crcs = hvd.allgather(crc, name=label + ".crc")
        return None if len(set(crcs.tolist())) == 1 else f"ranks hold different bits: {crcs.tolist()}"

    def first_diff(got: torch.Tensor, want: torch.Tensor) -> str:
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
        i = int((got != want).nonzero()[0, 0])
        return f"[{i}] = {got[i].item()!r}, want {want[i].item()!r}"

    # 1. hvd.allreduce with compression, alone: small, odd, a packed tail, several pieces
    for comp, wdt in wires:
        for count in (1, 7, 1001, 300_001, (1 << 20) + 3):
            for k, (op, pre, post) in enumerate(ops):
                x = torch.randn(count, generator=gen) * 5
                label = f"one.{wdt}.{count}.{k}"
                want = hvd.allreduce(x.to(wdt), name=label + ".ref", op=op, prescale_factor=pre,
                                     postscale_factor=post).float()
                packed.clear()
                got = hvd.allreduce(x, name=label, op=op, prescale_factor=pre, postscale_factor=post,
                                    compression=comp)
                if not torch.equal(got, want):
                    bad.append(f"rank {r}: {label}: {first_diff(got, want)}")
                if not packed:
                    bad.append(f"rank {r}: {label}: not narrowed in the fusion buffer")
        # grouped: several float32 tensors compressed as one unit
        xs = [torch.randn(c, generator=gen) for c in (3, 513, 70_001)]
        wants = hvd.grouped_allreduce([x.to(wdt) for x in xs], name=f"grp.{wdt}.ref")
        packed.clear()
        gots = hvd.grouped_allreduce(xs, name=f"grp.{wdt}", compression=comp)
        for i, (g, w) in enumerate(zip(gots, wants)):
            if not torch.equal(g, w.float()):
                bad.append(f"rank {r}: grouped {wdt} tensor {i}: {first_diff(g, w.float())}")
        if not packed:
            bad.append(f"rank {r}: grouped {wdt}: not narrowed in the fusion buffer")

    # 2. narrowed float32 and native 16-bit tensors in one fused batch (submitted without waking
    # the engine: they meet in its next round; retried until a call held both kinds)
    ps = hvd.global_process_set
    for _comp, wdt in wires:
        wire = "float16" if wdt == torch.float16 else "bfloat16"
        mixed = False
        for attempt in range(6):
            sizes = (5, 1001, 33, 4097)
            xs = [torch.randn(c, generator=gen) for c in sizes]
            natives = [torch.randn(c, generator=gen).to(wdt) for c in (9, 257)]
            inputs, ninputs = [x.clone() for x in xs], [t.clone() for t in natives]
            label = f"mix.{wdt}.{attempt}"
            wants = [hvd.allreduce(x.to(wdt), name=f"{label}.{i}.ref").float() for i, x in enumerate(xs)]
            nwants = [hvd.allreduce(t, name=f"{label}.n{i}.ref") for i, t in enumerate(natives)]
            packed.clear()
            hs = [mpi_ops._allreduce_wire_async_(x, wire, f"{label}.{i}", hvd.Average, 1.0, 1.0, ps,
                                                 _wake=False) for i, x in enumerate(xs[:2])]
            hs += [hvd.allreduce_async_(t, name=f"{label}.n{i}", _wake=False) for i, t in enumerate(natives)]
            hs += [mpi_ops._allreduce_wire_async_(x, wire, f"{label}.{i + 2}", hvd.Average, 1.0, 1.0, ps,
                                                  _wake=False) for i, x in enumerate(xs[2:])]
            for h in hs:
                hvd.synchronize(h)
            for i, (x, w, x0) in enumerate(zip(xs, wants, inputs)):
                why = agrees(x, w, x0, wdt, f"{label}.{i}.check")
                if why:
                    bad.append(f"rank {r}: {label} narrowed {i}: {why}")
            for i, (t, w, t0) in enumerate(zip(natives, nwants, ninputs)):
                why = agrees(t.float(), w.float(), t0.float(), wdt, f"{label}.n{i}.check")
                if why:
                    bad.append(f"rank {r}: {label} native {i}: {why}")
            # every rank must agree on whether to retry (the names must match)
            here = any(len(kinds) > 1 for kinds in packed)
            mixed = bool(hvd.allreduce(torch.tensor([float(here)]), op=hvd.Max, name=f"{label}.seen").item())
            if mixed:
                break
        if not mixed:
            bad.append(f"rank {r}: {wdt}: no fused call held narrowed and native tensors in 6 tries")

    # 3. DistributedOptimizer with compression: gradients reduced in place, narrowed in the buffer
    from horovod.common.context import get_context

    carrier = get_context().engine.rounds.carrier
    for (comp, wdt), groups in [(w, g) for w in wires for g in (None, 2)]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(37, 129), torch.nn.Tanh(), torch.nn.Linear(129, 3))
        twin = torch.nn.Sequential(torch.nn.Linear(37, 129), torch.nn.Tanh(), torch.nn.Linear(129, 3))
        twin.load_state_dict(model.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=model.named_parameters(), compression=comp,
                                       groups=groups)
        for step in range(3):
            data = torch.randn(16, 37, generator=gen)
            opt.zero_grad()
            twin.zero_grad()
            packed.clear()  # (the hooks may start the reductions during the backward pass)
            carried = carrier.carried_ops if carrier is not None else 0
            model(data).square().sum().backward()
            twin(data).square().sum().backward()
            opt.synchronize()
            # (on Gloo a repeated step's small gradients may travel with the negotiation, narrowed
            # into its rows: no fusion buffer; part 5 checks those rows)
            if not packed and (carrier is None or carrier.carried_ops == carried):
                bad.append(f"rank {r}: optimizer {wdt} groups={groups} step {step}: not narrowed in the fusion buffer")
            for (pname, p), q in zip(model.named_parameters(), twin.parameters()):
                label = f"opt.{wdt}.{groups}.{step}.{pname}"
                want = hvd.allreduce(q.grad.to(wdt), name=label).float()
                why = agrees(p.grad, want, q.grad, wdt, label + ".check")
                if why:
                    bad.append(f"rank {r}: optimizer {wdt} groups={groups} step {step} {pname}: {why}")
            with opt.skip_synchronize():
                opt.step()

    # 5. (Gloo) a repeated step of small narrowed tensors is carried with the negotiation
    # (``engine/carry.py``): their rows hold the narrowed 16-bit values, no transport call
    if gloo:
        from horovod.common.backends import gloo as gloo_backend

        calls = [0]
        real_start = gloo_backend.GlooBackend.allreduce_start
        real_sync = gloo_backend.GlooBackend.allreduce

        def spy_start(self, *a, _real=real_start):
            calls[0] += 1
            return _real(self, *a)

        def spy_sync(self, *a, _real=real_sync):
            calls[0] += 1
            return _real(self, *a)
        gloo_backend.GlooBackend.allreduce_start = spy_start
        gloo_backend.GlooBackend.allreduce = spy_sync
        carried_steps = 0
        for step in range(12):
            xs = [torch.randn(c, generator=gen) for c in (5, 33, 257)]
            native = torch.randn(17, generator=gen).half()
            wants = [hvd.allreduce(x.half(), name=f"carry.{step}.{i}.ref").float() for i, x in enumerate(xs)]
            nwant = hvd.allreduce(native, name=f"carry.{step}.n.ref")
            inputs = [x.clone() for x in xs] + [native.clone()]
            calls[0] = 0
            hs = [mpi_ops._allreduce_wire_async_(x, "float16", f"carry.{i}", hvd.Average, 1.0, 1.0, ps)
                  for i, x in enumerate(xs)]
            hs.append(hvd.allreduce_async_(native, name="carry.n"))
            for h in hs:
                hvd.synchronize(h)
            carried_steps += calls[0] == 0
            for i, (x, w, x0) in enumerate(zip(xs + [native.float()], wants + [nwant.float()], inputs)):
                why = agrees(x, w, x0.float(), torch.float16, f"carry.{step}.{i}.check")
                if why:
                    bad.append(f"rank {r}: carried step {step} tensor {i}: {why}")
        gloo_backend.GlooBackend.allreduce_start = real_start
        gloo_backend.GlooBackend.allreduce = real_sync
        if not carried_steps:
            bad.append(f"rank {r}: no step of narrowed tensors was carried with the negotiation")

    # 4. a user's subclass with its own compress keeps the generic path
    class Doubled(hvd.Compression.fp16):
        @staticmethod
        def compress(tensor):
            c, ctx = hvd.Compression.fp16.compress(tensor * 2)
            return c, ctx

        @staticmethod
        def decompress(tensor, ctx):
            return hvd.Compression.fp16.decompress(tensor, ctx) / 2

    x = torch.randn(1001, generator=gen)
    want = hvd.allreduce((x * 2).half(), name="user.ref").float() / 2
    packed.clear()
    got = hvd.allreduce(x, name="user", compression=Doubled)
    if not torch.equal(got, want):
        bad.append(f"rank {r}: user compressor: {first_diff(got, want)}")
    if packed:
        bad.append(f"rank {r}: user compressor: fused path taken ({packed})")
    return bad


def _fused_cases_gloo() -> list[str]:
    return _fused_cases(gloo=True)


# Parts of the torch launches at np=2 and np=3 that other modules share (tests/_shared_launch.py),
# on mpirun and on Gloo (horovodrun --gloo): the ranks start and import torch once for all of them.
_MPIRUN = {n: joint_launch("torch", n, {"fused": _fused_cases}, timeout=300) for n in (2, 3)}
_GLOO = {n: joint_launch("torch", n, {"fused": _fused_cases_gloo}, timeout=300, gloo=True) for n in (2, 3)}


@pytest.mark.parametrize("np_", [2, 3])
def test_fused_compression_mpi(np_):
    for rank, bad in enumerate(_MPIRUN[np_].results("fused")):
        assert bad == [], f"rank {rank}"


@pytest.mark.parametrize("np_", [2, 3])
def test_fused_compression_gloo(np_):
    for rank, bad in enumerate(_GLOO[np_].results("fused")):
        assert bad == [], f"rank {rank}"


def test_fused_compression_alone_rounds_through_16_bits():
    """A job of one process: the local backend reduces float16 itself and widens bfloat16 to
    float32; both give ``x.to(wire).float()`` (scaled as the 16-bit tensor is), never ``x``."""
    code = textwrap.dedent("""
        import torch, horovod.torch as hvd
        hvd.init()
        assert hvd.size() == 1
        x = torch.randn(300_001, generator=torch.Generator().manual_seed(3)) * 7
        for comp, w in ((hvd.Compression.fp16, torch.float16), (hvd.Compression.bf16, torch.bfloat16)):
            for pre, post in ((1.0, 1.0), (0.5, 3.0)):
                want = hvd.allreduce(x.to(w), prescale_factor=pre, postscale_factor=post).float()
                got = hvd.allreduce(x, prescale_factor=pre, postscale_factor=post, compression=comp)
                assert torch.equal(got, want), (w, pre, (got != want).sum())
                assert not torch.equal(got, x)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
