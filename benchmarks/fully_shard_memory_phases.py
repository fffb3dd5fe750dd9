"""Where a fully sharded step's memory goes: per phase (built, after forward, after backward,
after the optimizer step, three steps), each rank's RSS above the RSS after ``hvd.init()``, the
step's peak (``VmHWM``, reset at each step's start) and glibc's ``mallinfo2`` of the main heap
(bytes in use, bytes free but resident, bytes mapped). Resident memory far above the heap in use
with much of the heap free is the allocator keeping freed holes, not live tensors.

    python benchmarks/fully_shard_memory_phases.py --np 4 --layers 24 --width 2048
    MALLOC_MMAP_THRESHOLD_=1048576 python benchmarks/fully_shard_memory_phases.py --np 4 --layers 24 --width 2048

glibc only (``mallinfo2``, glibc 2.33+); prints rank 0's rows and the worst rank's peak.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _sharded_memory import by_value, reset_peak, sharded_stack, status  # noqa: E402


def _phases(layers: int, width: int) -> list[tuple[Any, ...]]:
    import ctypes

    import torch

    import horovod.torch as hvd

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                   "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    rows: list[tuple[Any, ...]] = []

    def snap(tag: str) -> None:
        m = libc.mallinfo2()
        rows.append((tag, (status("VmRSS") - base) >> 20, (status("VmHWM") - base) >> 20,
                     m.uordblks >> 20, m.fordblks >> 20, m.hblkhd >> 20))

    hvd.init()
    torch.set_num_threads(1)
    base = status("VmRSS")
    model, opt = sharded_stack(layers, width)
    snap("built")
    x = torch.randn(16, width)
    for k in range(3):
        reset_peak()
        opt.zero_grad()
        loss = model(x).square().mean()
        snap(f"step {k} forward")
        loss.backward()
        snap(f"step {k} backward")
        opt.step()
        snap(f"step {k} optimizer")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from horovod.testing import run_ranks

    by_value()
    res = run_ranks(_phases, np=args.np, args=(args.layers, args.width), timeout=3600)
    print(f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', '(unset)')}, MiB:")
    print(f"{'phase':<20}{'RSS':>7}{'peak':>7}{'heap used':>11}{'heap free':>11}{'mapped':>8}{'worst peak':>12}")
    for i, (tag, rss, peak, used, free, mapped) in enumerate(res[0]):
        print(f"{tag:<20}{rss:>7}{peak:>7}{used:>11}{free:>11}{mapped:>8}{max(r[i][2] for r in res):>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
