"""The raw cost of 16-bit conversions on this CPU, against the float32 copies they replace.

    python benchmarks/half_convert.py                 # 16 Mi elements, 7 interleaved repetitions
    python benchmarks/half_convert.py --n 8388608 --reps 9

One process, torch on one thread (as the engine's thread runs it under ``mpirun``), buffers on
the memory the engine uses (``OutputPool``: huge pages), every operation in the pieces the engine
uses (``half.piece``). Each figure is the median CPU time of the thread (``time.thread_time``:
not inflated by other jobs' load), in ms, for ``--n`` elements:

  f32_copy         np.copyto of float32 (the float32 call's copy into the fusion buffer)
  f32_scale        np.multiply by 0.5 into another float32 array (its copy out, Average at np=2)
  f32_add_half     np.add of half the elements in place (MPI's own sum at np=2: each rank sums half)
  {fp16,bf16}_narrow      float32 -> 16 bits (a compression's narrowing into the fusion buffer)
  {fp16,bf16}_narrow_4k   the same from a ``torch.randn`` tensor's memory (torch's allocator: 4 KiB
                          pages, as a user's tensor usually lies; the rest lie on huge pages)
  {fp16,bf16}_widen       16 bits -> float32
  {fp16,bf16}_widen_avg   16 bits -> float32 divided by 2, as ``half.cast`` does (float16: scaled
                          in the 16-bit type then widened; bfloat16: widened then scaled)
  {fp16,bf16}_add_half    the 16-bit sum of half the elements in place (MPI's user operation)

Then the compression's conversions against the float32 copies: ``narrow + widen_avg + add_half``
of each 16-bit type minus ``f32_copy + f32_scale + f32_add_half`` (``extra_ms``): what a
compressed reduction costs one core beyond the float32 one before the wire saves anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from horovod.common.backends import half
from horovod.common.engine.outputs import OutputPool
from horovod.common.types import ReduceOp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=16 * 2**20, help="elements")
    p.add_argument("--reps", type=int, default=7, help="interleaved repetitions")
    args = p.parse_args()
    torch.set_num_threads(1)
    import ml_dtypes

    n, pool = args.n, OutputPool()
    x = pool.empty((n,), np.float32)
    x[:] = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    x4k = torch.from_numpy(x).clone().numpy()  # torch's allocator: no huge pages
    out = pool.empty((n,), np.float32)
    out[:] = 0
    cut = 1 << 20  # the engine's calls: fusion-buffer-sized pieces of a large tensor
    half_n = n // 2
    def f32_copy() -> None:
        for i in range(0, n, cut):
            np.copyto(out[i:i + cut], x[i:i + cut])

    cases: dict[str, Callable[[], Any]] = {
        "f32_copy": f32_copy,
        "f32_scale": lambda: [np.multiply(x[i:i + cut], np.float32(0.5), out=out[i:i + cut])
                              for i in range(0, n, cut)],
        "f32_add_half": lambda: [np.add(out[i:i + cut], x[i:i + cut], out=out[i:i + cut])
                                 for i in range(0, half_n, cut)],
    }
    for label, dt in (("fp16", np.dtype(np.float16)), ("bf16", np.dtype(ml_dtypes.bfloat16))):
        h = pool.empty((n,), dt)
        h[:] = x.astype(dt)
        other = h.copy()
        wide_src = h.copy()
        add = half.kernel("float16" if label == "fp16" else "bfloat16", ReduceOp.SUM)

        def narrow(h: np.ndarray = h) -> None:
            for i in range(0, n, cut):
                half.cast(h[i:i + cut], x[i:i + cut])

        def narrow_4k(h: np.ndarray = h) -> None:
            for i in range(0, n, cut):
                half.cast(h[i:i + cut], x4k[i:i + cut])

        def widen(h: np.ndarray = h) -> None:
            for i in range(0, n, cut):
                half.cast(out[i:i + cut], h[i:i + cut])

        def widen_avg(h: np.ndarray = h, src: np.ndarray = wide_src) -> None:
            np.copyto(src, h)  # float16 is scaled in its source, in place: a fresh copy, untimed
            t0 = time.thread_time()
            for i in range(0, n, cut):
                half.cast(out[i:i + cut], src[i:i + cut], 1.0, 2)
            _timed[0] = time.thread_time() - t0

        def add_half(h: np.ndarray = h, other: np.ndarray = other, add: Any = add) -> None:
            for i in range(0, half_n, cut):
                add(other[i:i + cut].view(np.uint16), h[i:i + cut].view(np.uint16))  # raw 16-bit buffers

        cases[f"{label}_narrow"] = narrow
        cases[f"{label}_narrow_4k"] = narrow_4k
        cases[f"{label}_widen"] = widen
        cases[f"{label}_widen_avg"] = widen_avg
        cases[f"{label}_add_half"] = add_half
    _timed: list[float | None] = [None]
    ms: dict[str, list[float]] = {k: [] for k in cases}
    for f in cases.values():
        f()
    for _ in range(args.reps):
        for k, f in cases.items():
            _timed[0] = None
            t0 = time.thread_time()
            f()
            spent = time.thread_time() - t0 if _timed[0] is None else _timed[0]
            ms[k].append(spent * 1e3)
    med = {k: round(statistics.median(v), 2) for k, v in ms.items()}
    f32 = med["f32_copy"] + med["f32_scale"] + med["f32_add_half"]
    extra = {t: round(med[f"{t}_narrow"] + med[f"{t}_widen_avg"] + med[f"{t}_add_half"] - f32, 2)
             for t in ("fp16", "bf16")}
    print(json.dumps({"n": n, "reps": args.reps, "cpu_ms": med, "extra_ms": extra}))


if __name__ == "__main__":
    main()
