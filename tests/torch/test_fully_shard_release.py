"""When ``hvd.fully_shard`` hands the C allocator's free pages back to the kernel on CPU
(``_shard_collectives.release_freed_memory``, glibc's ``malloc_trim``): only once the memory that
is resident but not in use (the resident set less what the allocator has handed out) has grown by
more than four modules' buffers since its lowest point after the last release (live tensors
growing is no reason), never when ``HOROVOD_FULLY_SHARD_RELEASE_MEMORY=0`` or off CPU; and the
end-of-backward finite check (``all_finite``). One process, no ranks; the effect on a step's peak is measured by
benchmarks/fully_shard_bench.py (docs/fully_shard.md)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from horovod.torch import _finite as F
from horovod.torch import _shard_collectives as C

pytestmark = pytest.mark.unit

MIB = 1 << 20


def _group(device: str = "cpu", release: bool = True) -> SimpleNamespace:
    q = SimpleNamespace(shard=torch.zeros(1, device=device), unsharded=torch.zeros(1, device=device))
    g = SimpleNamespace(release_memory=release, params=[q], n=4, segment=MIB, module=None,
                        release_slack=0, released_idle=1 << 62)
    g.root = lambda: g
    return g


@pytest.fixture
def fake(monkeypatch):
    trims: list[int] = []
    rss = [100 * MIB]
    used = [0]
    monkeypatch.setattr(C, "_TRIM", [(lambda pad: trims.append(pad) or 1, lambda: used[0])])
    monkeypatch.setattr(C, "_resident_bytes", lambda: rss[0])
    monkeypatch.setattr(C, "groups_in", lambda module: [g for g in _made])
    _made.clear()
    _used[:] = [used]
    return trims, rss


_used: list[list[int]] = []


_made: list[SimpleNamespace] = []


def test_release_only_after_growth_beyond_four_modules(fake) -> None:
    trims, rss = fake
    g = _group()
    _made.append(g)
    C.release_freed_memory(g)
    assert trims == [] and g.release_slack == 4 * 4 * MIB * 4  # 4 x (n x segment x 4 bytes)
    rss[0] += 64 * MIB  # in flight: no more than the slack
    C.release_freed_memory(g)
    assert trims == []
    rss[0] += 1 * MIB  # beyond it: released, and the lowest point starts again from there
    C.release_freed_memory(g)
    assert trims == [0] and g.released_idle == 165 * MIB
    rss[0] = 120 * MIB  # lower: the new lowest point
    C.release_freed_memory(g)
    rss[0] = 120 * MIB + 65 * MIB
    C.release_freed_memory(g)
    assert trims == [0, 0]


def test_live_growth_is_no_reason_to_release(fake) -> None:
    """Resident memory the allocator has handed out (the shards' gradients filling during
    backward) does not count: only what is resident and free does."""
    trims, rss = fake
    used = _used[0]
    g = _group()
    _made.append(g)
    C.release_freed_memory(g)
    rss[0] += 200 * MIB
    used[0] += 200 * MIB  # all of it live
    C.release_freed_memory(g)
    assert trims == []
    used[0] -= 65 * MIB  # 65 MiB of it freed, still resident: beyond the slack
    C.release_freed_memory(g)
    assert trims == [0]


def test_memory_freed_before_an_iteration_is_not_released(fake) -> None:
    """Each iteration (``_shard_hooks._begin``) counts from its own start: memory freed between
    iterations (the optimizer's temporaries, another model's buffers, which their owners reuse)
    is no reason to release; growth within the iteration is."""
    from horovod.torch._shard_hooks import _begin

    trims, rss = fake
    used = _used[0]
    g = _group()
    g.order, g.prev_order, g.iteration, g.open, g.grad_pending = [], [], 0, False, False
    _made.append(g)
    _begin(g)
    C.release_freed_memory(g)
    used[0] -= 200 * MIB  # freed between iterations, still resident
    _begin(g)
    C.release_freed_memory(g)
    assert trims == []
    used[0] -= 65 * MIB  # freed within the iteration: beyond the slack
    C.release_freed_memory(g)
    assert trims == [0]


def test_no_release_when_switched_off_or_off_cpu(fake) -> None:
    trims, rss = fake
    for g in (_group(release=False), _group(device="meta")):
        _made[:] = [g]
        C.release_freed_memory(g)
        rss[0] += 1024 * MIB
        C.release_freed_memory(g)
    assert trims == []


def test_malloc_trim_found_on_glibc_and_none_elsewhere() -> None:
    import platform

    found = C._malloc_trim()
    if platform.libc_ver()[0] != "glibc":
        assert found is None
    else:
        assert found is not None
        trim, in_use = found
        assert trim(0) in (0, 1)
        before = in_use()
        block = torch.empty(64 * MIB, dtype=torch.uint8)  # from malloc: counted while it lives
        assert in_use() - before >= 64 * MIB or in_use() == 0  # 0: glibc before 2.33 (no mallinfo2)
        del block
        assert C._resident_bytes() > 0


def test_all_finite_sums_first_and_checks_exactly_when_a_sum_is_not_finite() -> None:
    """The end-of-backward finite check (``all_finite``): a sum decides when it is finite; a
    non-finite element always makes it not finite (inf, NaN, inf and -inf cancelling into NaN);
    finite elements whose sum overflows (fp32, and fp16 summed in fp16) are finite all the same."""
    nan, inf = float("nan"), float("inf")
    assert F.all_finite([torch.ones(5), torch.zeros(3, 2)])
    assert F.all_finite([]) and F.all_finite([torch.empty(0), torch.empty(0, 4)])
    assert not F.all_finite([torch.ones(5), torch.tensor([1.0, nan])])
    assert not F.all_finite([torch.tensor([inf, -inf])])  # the sum is NaN
    assert not F.all_finite([torch.tensor([-inf, 2.0])])
    big = torch.full((8,), 3e38)
    assert not torch.isfinite(big.sum())  # the sum overflows ...
    assert F.all_finite([big, torch.ones(2)])  # ... the elements are finite
    assert F.all_finite([torch.full((4,), 60000.0, dtype=torch.float16), torch.ones(2, dtype=torch.bfloat16)])
    assert not F.all_finite([torch.full((4,), 60000.0, dtype=torch.float16), torch.tensor([inf])])


def test_gradients_are_packed_and_freed_at_once_on_cpu() -> None:
    """On CPU a module's gradients are copied into the root's kept buffer and freed at once
    (``_direct_params`` None), so that each is allocated where the previous one was; off CPU they
    are the reduce-scatter's input as they are (docs/fully_shard.md, "Sixth round")."""
    from horovod.torch.compression import Compression

    for device, direct in (("cpu", False), ("meta", True)):
        q = SimpleNamespace(seg=8, rows=8, dtype=torch.float32,
                            shard=torch.zeros(2, 4, device=device),
                            unsharded=torch.zeros(8, 4, device=device, requires_grad=True))
        g = SimpleNamespace(direct=None, compression=Compression.none, n=4, params=[q])
        got = C._direct_params(g, torch.float32)
        assert (got == [q]) if direct else got is None, (device, got)
