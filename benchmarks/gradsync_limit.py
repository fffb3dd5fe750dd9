"""Gradient-set sync against the machine's limit, every binding and raw MPI interleaved in one run.

    mpirun -np 2 python benchmarks/gradsync_limit.py --case resnet50 [--frameworks numpy,torch,tf]
    mpirun -np 3 --oversubscribe python benchmarks/gradsync_limit.py --case bert_base

Cases: ``resnet50`` / ``bert_base`` (the model's gradient set, ``shapes.py``), ``single64`` (one 64 MiB
float32 tensor), ``latency`` (a 4-byte allreduce timed over 200 calls per repetition: ``numpy`` is the
blocking ``hvd.allreduce``, ``numpy-async`` ``allreduce_async`` + ``synchronize``, which also wakes
the engine thread; ``torch-blocking`` is the blocking ``allreduce_``, ``torch-grouped`` the blocking
``grouped_allreduce_``).

Modes (every repetition runs each mode once, in turn, after a barrier, so noise hits all alike):
  raw-flat          mpi4py: one in-place Allreduce of a flat float32 buffer of the same size, then /size
  raw-chunk-<k>MiB  mpi4py: the flat buffer cut into k MiB pieces, each reduced in place and divided
                    while hot in cache (k = 1, 2, 4, 8, 16, 32); the best of these is "the limit"
  oop-floor         mpi4py out of place: the flat buffer reduced into a second flat buffer, 2 MiB pieces
                    (Allreduce(sendbuf, recvbuf), then /size in the output while hot): the floor of
                    an out-of-place binding, whose every result is new memory (not a "raw" schedule:
                    it does another operation)
  schedule          the engine's piece schedule written directly in mpi4py, on separately allocated
                    arrays of the gradient set's shapes (in place): small arrays and the tails of
                    large ones packed into one 2 MiB huge-page buffer, whole 2 MiB pieces of large
                    arrays reduced in place (or copied through a buffer when not on huge pages).
                    What the engine could reach with no overhead of its own; not a "raw" schedule
                    (a flat buffer needs no packing at all)
  numpy             horovod.numpy allreduce_async of each array (op=Average), then synchronize each
  numpy-unchunked   the same with HOROVOD_CHUNK_BYTES=0 (one transport call per fusion buffer and per
                    large tensor: the engine before piecewise reductions)
  torch-async       horovod.torch allreduce_async_ of each tensor (op=Average), then synchronize each
                    (what DistributedOptimizer does)
  torch-grouped     horovod.torch grouped_allreduce_ of all tensors (op=Average)
  torch-flat        the same on a gradient set kept as views of one flat tensor (as DDP's
                    gradient_as_bucket_view, apex and DeepSpeed keep gradients): the packed runs
                    are then spans of that tensor, reduced where they lie
  tf-local          a tf.function step with a plain GradientTape over variables of these shapes
                    (loss = sum of reduce_sum(v * v): every gradient, 2 * v, is computed in full as
                    in training; with reduce_sum(v) TF folds the gradients of ones away and the local
                    step never materialises them, which charged that cost to the tape)
  tf-tape           the same step with hvd.DistributedGradientTape (gradients + averaging)
  tf-sync           tf-tape - tf-local: what averaging adds to the step (derived, not timed)
  torch-bf16        torch-async with hvd.Compression.bf16 (compress, allreduce_async_, synchronize,
                    decompress into the gradient: DistributedOptimizer's path with compression)
  tf-tape-bf16      tf-tape with compression=hvd.Compression.bf16; tf-sync-bf16 = it - tf-local
                    (on the host path bfloat16 is reduced in float32: the bytes sent do not shrink,
                    the rows show what the casts cost; a device plane sends 2 bytes per value)

Rank 0 prints the medians and each binding's ratio to the best raw schedule, and with --json
appends one JSON object per run to the file. ``--modes`` runs a subset (the raw schedules always
run): ``--modes numpy,torch-grouped,torch-flat,torch-async --warmup 2`` is a step of four kinds of
large batch through one engine, the mix that once locked the piece follower's trials onto the
step's phase (``engine/pieces.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import MODELS  # noqa: E402

CHUNKS_MIB = (1, 2, 4, 8, 16, 32)
DEFAULT_CHUNK = 2 * 1024 * 1024  # the engine's piece size (HOROVOD_CHUNK_BYTES default)
LATENCY_CALLS = 200

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--case", default="resnet50", choices=sorted(MODELS) + ["single64", "latency"])
parser.add_argument("--reps", type=int, default=15)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--frameworks", default="numpy,torch,tf",
                    help="comma-separated subset of numpy, torch, tf")
parser.add_argument("--json", default=None, help="append the medians to this file (rank 0)")
parser.add_argument("--modes", default=None,
                    help="comma-separated modes to run besides the raw-* ones (always run: they are "
                         "the reference), e.g. numpy,torch-grouped,torch-flat,torch-async; default all")


def case_shapes(case: str) -> list[tuple[int, ...]]:
    if case == "single64":
        return [(16 * 1024 * 1024,)]
    if case == "latency":
        return [(1,)]
    return MODELS[case]()


def main() -> None:
    args = parser.parse_args()
    frameworks = set(args.frameworks.split(","))
    if "tf" in frameworks:
        import tensorflow as tf

        import horovod.tensorflow as hvd_tf
        # One compute thread per rank, as torch below: the ranks share the machine's cores.
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        hvd_tf.init()
    import horovod.numpy as hvd

    hvd.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    size = comm.size
    shapes = case_shapes(args.case)
    numel = sum(math.prod(s) for s in shapes)
    latency = args.case == "latency"
    calls = LATENCY_CALLS if latency else 1
    modes = {}

    flat = np.ones(numel, np.float32)

    def raw_flat() -> None:
        for _ in range(calls):
            comm.Allreduce(MPI.IN_PLACE, flat)
            np.divide(flat, size, out=flat)

    modes["raw-flat"] = raw_flat

    def raw_chunked(nbytes: int):
        n = nbytes // 4

        def step() -> None:
            for o in range(0, numel, n):
                v = flat[o:o + n]
                comm.Allreduce(MPI.IN_PLACE, v)
                np.divide(v, size, out=v)
        return step

    if not latency:
        for mib in CHUNKS_MIB:
            if (mib << 20) < numel * 4 * 2 or mib == CHUNKS_MIB[0]:
                modes[f"raw-chunk-{mib}MiB"] = raw_chunked(mib << 20)

    if not latency:
        # Raw mpi4py out of place: the flat buffer reduced into a second flat buffer (MPI's own
        # out-of-place Allreduce in 2 MiB pieces, each divided in the output while hot). An
        # out-of-place binding (numpy, TF: every result is new memory) cannot beat it.
        flat_out = np.zeros_like(flat)

        def oop_floor() -> None:
            n = DEFAULT_CHUNK // 4
            for o in range(0, numel, n):
                out = flat_out[o:o + n]
                comm.Allreduce(flat[o:o + n], out)
                np.divide(out, size, out=out)
        modes["oop-floor"] = oop_floor

        # The engine's own piece schedule, written directly in mpi4py, on separately allocated
        # in-place arrays like a gradient set's: what the engine could do with zero overhead.
        from horovod.common.engine.pages import huge_page_backed, huge_page_empty

        sched_arrs = [np.ones(s, np.float32).reshape(-1) for s in shapes]
        piece = DEFAULT_CHUNK // 4
        packbuf = huge_page_empty(DEFAULT_CHUNK).view(np.float32)
        solobuf = huge_page_empty(DEFAULT_CHUNK).view(np.float32)
        own = [huge_page_backed(a) for a in sched_arrs]

        def flush(pending: list, fill: int) -> None:
            v = packbuf[:fill]
            comm.Allreduce(MPI.IN_PLACE, v)
            for a, s0, e, b in pending:
                np.divide(packbuf[b:b + e - s0], size, out=a[s0:e])

        def schedule() -> None:
            pending: list = []
            fill = 0
            for a, in_own in zip(sched_arrs, own):
                stop = a.size - a.size % piece if a.size >= piece else 0
                for o in range(0, stop, piece):
                    if in_own:
                        v = a[o:o + piece]
                        comm.Allreduce(MPI.IN_PLACE, v)
                        np.divide(v, size, out=v)
                    else:
                        np.copyto(solobuf, a[o:o + piece])
                        comm.Allreduce(MPI.IN_PLACE, solobuf)
                        np.divide(solobuf, size, out=a[o:o + piece])
                start = stop
                while start < a.size:
                    take = min(a.size - start, piece - fill)
                    np.copyto(packbuf[fill:fill + take], a[start:start + take])
                    pending.append((a, start, start + take, fill))
                    fill += take
                    start += take
                    if fill == piece:
                        flush(pending, fill)
                        pending, fill = [], 0
            if pending:
                flush(pending, fill)
        modes["schedule"] = schedule

    if "numpy" in frameworks:
        arrs = [np.ones(s, np.float32) for s in shapes]
        names = [f"np.{i}" for i in range(len(arrs))]

        def hvd_numpy() -> None:
            for _ in range(calls):
                hs = [hvd.allreduce_async(x, name=n, op=hvd.Average) for x, n in zip(arrs, names)]
                for h in hs:
                    hvd.synchronize(h)

        def hvd_numpy_blocking() -> None:
            for _ in range(calls):
                hvd.allreduce(arrs[0], name=names[0], op=hvd.Average)
        # Latency is a blocking call's; the async mode adds the wake-up of the engine thread.
        modes["numpy"] = hvd_numpy_blocking if latency else hvd_numpy
        if latency:
            modes["numpy-async"] = hvd_numpy
        if not latency:
            from horovod.common.context import get_context

            tunables = get_context().engine.tunables

            def hvd_numpy_unchunked() -> None:
                saved, tunables.chunk_bytes = tunables.chunk_bytes, 0  # every rank, between barriers
                try:
                    hvd_numpy()
                finally:
                    tunables.chunk_bytes = saved
            modes["numpy-unchunked"] = hvd_numpy_unchunked

    if "torch" in frameworks:
        import torch

        import horovod.torch as hvd_torch

        hvd_torch.init()
        torch.set_num_threads(1)
        tts = [torch.ones(s) for s in shapes]
        tnames = [f"t.{i}" for i in range(len(tts))]
        gts = [torch.ones(s) for s in shapes]

        def torch_async() -> None:
            for _ in range(calls):
                hs = [hvd_torch.allreduce_async_(t, name=n, op=hvd_torch.Average) for t, n in zip(tts, tnames)]
                for h in hs:
                    hvd_torch.synchronize(h)

        def torch_grouped() -> None:
            for _ in range(calls):
                hvd_torch.grouped_allreduce_(gts, name="grouped", op=hvd_torch.Average)
        modes["torch-async"] = torch_async
        modes["torch-grouped"] = torch_grouped
        if not latency:
            bts = [torch.ones(s) for s in shapes]
            bf16 = hvd_torch.Compression.bf16

            def torch_bf16() -> None:  # DistributedOptimizer's path with compression=Compression.bf16
                packed = [bf16.compress(t) for t in bts]
                hs = [hvd_torch.allreduce_async_(c, name=f"bf16.{i}", op=hvd_torch.Average)
                      for i, (c, _) in enumerate(packed)]
                for t, (_, ctx), h in zip(bts, packed, hs):
                    t.copy_(bf16.decompress(hvd_torch.synchronize(h), ctx))
            modes["torch-bf16"] = torch_bf16
        if not latency:
            flat_t = torch.ones(numel)
            fviews = [v.view(s) for v, s in zip(torch.split(flat_t, [math.prod(s) for s in shapes]), shapes)]

            def torch_flat() -> None:
                hvd_torch.grouped_allreduce_(fviews, name="grouped.flat", op=hvd_torch.Average)
            modes["torch-flat"] = torch_flat
        if latency:
            def torch_blocking() -> None:
                for _ in range(calls):
                    hvd_torch.allreduce_(tts[0], name=tnames[0], op=hvd_torch.Average)
            modes["torch-blocking"] = torch_blocking

    if "tf" in frameworks:
        variables = [tf.Variable(tf.ones(s)) for s in shapes]

        def make_step(distributed: bool, compression: str = "none"):
            @tf.function
            def step():
                with tf.GradientTape() as tape:
                    loss = tf.add_n([tf.reduce_sum(v * v) for v in variables])
                if distributed:
                    tape = hvd_tf.DistributedGradientTape(
                        tape, compression=getattr(hvd_tf.Compression, compression))
                grads = tape.gradient(loss, variables)
                return tf.add_n([g[(0,) * len(g.shape)] for g in grads])  # consume every gradient

            def run() -> None:
                for _ in range(calls):
                    step().numpy()
            return run
        modes["tf-local"] = make_step(False)
        modes["tf-tape"] = make_step(True)
        if not latency:
            modes["tf-tape-bf16"] = make_step(True, "bf16")

    if args.modes:
        wanted = set(args.modes.split(","))
        unknown = wanted - set(modes)
        if unknown:
            parser.error(f"--modes: no mode {sorted(unknown)} in this case and these frameworks; "
                         f"there are {sorted(modes)}")
        modes = {k: f for k, f in modes.items() if k in wanted or k.startswith("raw")}
    times: dict[str, list[float]] = {k: [] for k in modes}
    for _ in range(args.warmup):
        for f in modes.values():
            comm.Barrier()
            f()
    for _ in range(args.reps):
        for k, f in modes.items():
            comm.Barrier()
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) / calls)
    if comm.rank != 0:
        return
    unit, scale = ("us", 1e6) if latency else ("ms", 1e3)
    # Median, and the fastest repetition (on a shared machine, the least disturbed one).
    stats = {"median": {k: statistics.median(v) * scale for k, v in times.items()},
             "min": {k: min(v) * scale for k, v in times.items()}}
    best: dict[str, str] = {}
    for stat, values in stats.items():
        if "tf-tape" in values:
            values["tf-sync"] = values["tf-tape"] - values["tf-local"]
        if "tf-tape-bf16" in values:
            values["tf-sync-bf16"] = values["tf-tape-bf16"] - values["tf-local"]
        raw = {k: v for k, v in values.items() if k.startswith("raw")}
        best[stat] = min(raw, key=raw.get)
    from horovod.common.engine.pages import malloc_thp

    print(f"case={args.case} np={size} tensors={len(shapes)} MiB={numel * 4 / 2**20:.1f} "
          f"malloc={'jemalloc thp' if malloc_thp() else 'default'} "
          f"reps={args.reps} unit={unit}   (median | fastest rep; ratio to the best raw schedule)")
    for k in stats["median"]:
        row = f"  {k:18s}"
        for stat, values in stats.items():
            ref = values[best[stat]]
            ratio = "      " if k.startswith("raw") or k == "tf-local" else f" {values[k] / ref:5.2f}x"
            row += f" {values[k]:9.2f} {unit}{ratio} |"
        print(row)
    print(f"  best raw: {best['median']} (median), {best['min']} (fastest rep)")
    if args.json:
        with open(args.json, "a") as fh:
            fh.write(json.dumps({"case": args.case, "np": size, "unit": unit, "tensors": len(shapes),
                                 "mib": numel * 4 / 2**20, "reps": args.reps, **stats,
                                 "malloc": "jemalloc thp" if malloc_thp() else "default",
                                 "best_raw": best, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                         time.gmtime())}) + "\n")


if __name__ == "__main__":
    main()
