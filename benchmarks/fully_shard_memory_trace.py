"""Where a fully sharded step's resident memory goes, hook by hook: for the last of ``steps``
steps, at every forward/backward hook of every wrapped module, each reduce-scatter and the end of
backward, the worst rank's RSS and peak (``VmHWM``, reset at each step) above its RSS after
``hvd.init()``, glibc's arenas (``malloc_info``: bytes the arenas hold, bytes free in them, the
bytes in use) and, per arena holding over 8 MiB, ``(arena, held, free)``.

    python benchmarks/fully_shard_memory_trace.py --np 4 --layers 12 --width 2048
    HOROVOD_FULLY_SHARD_RELEASE_MEMORY=0 python benchmarks/fully_shard_memory_trace.py --np 4

glibc only. Figures: docs/fully_shard.md, "Peak memory on CPU: the allocator".
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _sharded_memory import by_value, reset_peak, sharded_stack, status  # noqa: E402


def _trace(layers: int, width: int, steps: int) -> list[tuple[Any, ...]]:
    import ctypes
    import re
    import tempfile

    import torch

    import horovod.torch as hvd
    from horovod.torch import _shard_collectives, _shard_hooks

    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    path = os.path.join(tempfile.gettempdir(), f"hvd_malloc_info.{os.getpid()}")

    def arenas() -> tuple[int, int, list[tuple[int, int, int]]]:
        fh = libc.fopen(path.encode(), b"w")
        libc.malloc_info(0, fh)
        libc.fclose(fh)
        with open(path) as f:
            text = f.read()
        per = []
        for nr, body in re.findall(r'<heap nr="(\d+)">(.*?)</heap>', text, re.S):
            held = int(re.findall(r'<system type="current" size="(\d+)"/>', body)[0])
            free = sum(int(v) for v in re.findall(r'<total type="(?:fast|rest)" count="\d+" size="(\d+)"/>', body))
            if held > 8 << 20:
                per.append((int(nr), held >> 20, free >> 20))
        held = int(re.findall(r'<system type="current" size="(\d+)"/>', text)[-1])
        return held >> 20, sum(f for _, _, f in per), per

    rows: list[tuple[Any, ...]] = []
    on = [False]

    def snap(tag: str) -> None:
        if on[0]:
            held, free, per = arenas()
            rows.append((tag, (status("VmRSS") - base) >> 20, (status("VmHWM") - base) >> 20, held, free,
                         held - free, per))

    def wrap(mod: Any, name: str, tag: str) -> None:
        f = getattr(mod, name)

        def traced(*a: Any, **k: Any) -> Any:
            out = f(*a, **k)
            snap(f"{tag} {getattr(a[0], 'index', '')}")
            return out
        setattr(mod, name, traced)

    for name, tag in (("_pre_forward", "pre-forward"), ("_post_forward", "post-forward"),
                      ("_pre_backward", "pre-backward"), ("reduce", "reduce"), ("finish_backward", "end")):
        wrap(_shard_hooks, name, tag)
    wrap(_shard_collectives, "complete", "complete")
    hvd.init()
    torch.set_num_threads(1)
    base = status("VmRSS")
    model, opt = sharded_stack(layers, width)
    x = torch.randn(16, width)
    for k in range(steps):
        on[0] = k == steps - 1
        reset_peak()
        snap("step start")
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        snap("after the optimizer")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from horovod.testing import run_ranks

    by_value()
    res = run_ranks(_trace, np=args.np, args=(args.layers, args.width, args.steps), timeout=3600)
    worst = max(range(args.np), key=lambda r: max(row[2] for row in res[r]))
    print(f"rank {worst}, MiB (RSS and peak above the RSS after hvd.init(); arenas absolute)")
    print(f"{'at':<18}{'RSS':>6}{'peak':>6}{'held':>6}{'free':>6}{'in use':>8}  arenas (nr, held, free)")
    for tag, rss, peak, held, free, used, per in res[worst]:
        print(f"{tag:<18}{rss:>6}{peak:>6}{held:>6}{free:>6}{used:>8}  {per}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
