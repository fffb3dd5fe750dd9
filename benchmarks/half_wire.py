"""16-bit reductions on the wire: bytes and time of one large allreduce, relative to float32.

    python benchmarks/half_wire.py                     # MPI and Gloo, ranks talking TCP on loopback
    python benchmarks/half_wire.py --local             # MPI's default transports (shared memory):
                                                       # time only, one host
    python benchmarks/half_wire.py --planes mpi --n 8388608 --reps 5

np=2 ranks of ``horovod.torch`` reduce one tensor of ``--n`` elements (32 Mi by default), every
case once per rep, interleaved; rank 0 reports medians. Cases:

  float32        ``hvd.allreduce_`` of a float32 tensor (the reference)
  float32_out    ``hvd.allreduce`` of it (out of place: a new result, the compressed cases' reference)
  fp16_compress  ``hvd.allreduce`` of the float32 tensor with ``Compression.fp16``
  bf16_compress  the same with ``Compression.bf16``
  float16        ``hvd.allreduce_`` of a float16 tensor
  bfloat16       ``hvd.allreduce_`` of a bfloat16 tensor

and, only when named in ``--cases``, the compression as it ran before the engine narrowed in its
fusion buffer (the same values; a before/after in one run, under the same load):

  fp16_twopass   the float32 tensor narrowed into a kept float16 tensor (one pass), reduced there
                 in place, widened into a new result on NumPy's memory (a second pass)
  bf16_twopass   the same with bfloat16

Bytes are counted on the wire: the driver re-runs itself in a network namespace of its own
(``unshare -n``, root only) whose loopback carries nothing but this job; MPI is forced onto its TCP
transport there (``--mca pml ob1 --mca btl tcp,self``), Gloo is TCP anyway. Rank 0 reads the
loopback's transmitted bytes (``/proc/net/dev``) around each case, between barriers: every byte
the two ranks send each other, plus the barrier's few. With ``--local`` nothing is counted and MPI
keeps its shared-memory transport: the time one host pays for 16-bit arithmetic.

``--phases`` adds, per case, the CPU time (``time.thread_time``: not inflated by other jobs'
load, unlike the wall clock) rank 0's engine thread spends in each part of the call, medians in
ms: ``pack`` (copies into the fusion buffer, a compression's narrowing included), ``reduce`` (the
transport's allreduce, waiting included: MPI polls), ``op16`` (inside it: MPI's 16-bit user
operation), ``half_local`` (inside it: Gloo's local 16-bit reduction), ``unpack`` (copies out,
scaling and a compression's widening included) and ``scale`` (a call reduced in the tensor's own
memory: its copy in and its scaling)::

    python benchmarks/half_wire.py --local --planes mpi,gloo --n 16777216 --reps 7 --phases
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CASES = ("float32", "float32_out", "fp16_compress", "bf16_compress", "float16", "bfloat16")
EXTRA_CASES = ("fp16_twopass", "bf16_twopass")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=32 * 2**20, help="elements of the reduced tensor")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions of every case")
    p.add_argument("--planes", default="mpi,gloo", help="comma-separated: mpi, gloo")
    p.add_argument("--local", action="store_true",
                   help="no namespace, MPI's default transports, time only")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of the cases")
    p.add_argument("--phases", action="store_true",
                   help="rank 0's engine-thread CPU time per part of each case (see above)")
    p.add_argument("--rank-body", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _lo_tx() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    return 0


def _instrument() -> dict[str, float]:
    """Wrap the engine's parts (``--phases``): CPU seconds of the calling thread per part, summed
    into the returned dict (cleared by the caller around each case)."""
    from horovod.common.backends import gloo, mpi
    from horovod.common.engine import host_buffers

    spent: dict[str, float] = {}

    def timed(part: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent[part] = spent.get(part, 0.0) + time.thread_time() - t0
        return wrapper

    numpy_buffers = host_buffers.NumpyBuffers
    numpy_buffers.pack_narrowed = timed("pack", numpy_buffers.pack_narrowed)  # type: ignore[method-assign]
    numpy_buffers.unpack_narrowed = timed("unpack", numpy_buffers.unpack_narrowed)  # type: ignore[method-assign]
    numpy_buffers.pack = timed("pack", numpy_buffers.pack)  # type: ignore[method-assign]
    numpy_buffers.unpack = timed("unpack", numpy_buffers.unpack)  # type: ignore[method-assign]
    numpy_buffers.scale = staticmethod(timed("scale", numpy_buffers.scale))
    mpi.MPIBackend.allreduce = timed("reduce", mpi.MPIBackend.allreduce)  # type: ignore[method-assign]
    kernel = mpi.kernel
    mpi.kernel = lambda dtype, op: timed("op16", kernel(dtype, op))
    gloo.GlooBackend.allreduce = timed("reduce", gloo.GlooBackend.allreduce)  # type: ignore[method-assign]
    for name in ("_reduce_half_pair", "_reduce_half_parts"):  # absent from older trees
        if hasattr(gloo, name):
            setattr(gloo, name, timed("half_local", getattr(gloo, name)))
    start = gloo.GlooBackend.allreduce_start

    def timed_start(self, *a, **k):  # type: ignore[no-untyped-def]
        return timed("reduce", timed("reduce", start)(self, *a, **k))
    gloo.GlooBackend.allreduce_start = timed_start  # type: ignore[method-assign]
    return spent


def rank_body(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    import horovod.torch as hvd

    spent = _instrument() if args.phases else None
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(r)
    cases = args.cases.split(",")
    base = torch.randn(args.n)
    tensors = {"float32": base.clone(), "float32_out": base.clone(), "fp16_compress": base.clone(),
               "bf16_compress": base.clone(), "float16": base.half(), "bfloat16": base.bfloat16(),
               "fp16_twopass": base.clone(), "bf16_twopass": base.clone()}
    kept = {"fp16_twopass": torch.empty(args.n, dtype=torch.float16),
            "bf16_twopass": torch.empty(args.n, dtype=torch.bfloat16)}
    ms: dict[str, list[float]] = {c: [] for c in cases}
    parts: dict[str, dict[str, list[float]]] = {c: {} for c in cases}
    nbytes: dict[str, list[int]] = {c: [] for c in cases}

    def one(case: str, tag: str) -> None:
        t = tensors[case]
        if case == "fp16_compress":
            hvd.allreduce(t, name=tag, compression=hvd.Compression.fp16)
        elif case == "bf16_compress":
            hvd.allreduce(t, name=tag, compression=hvd.Compression.bf16)
        elif case == "float32_out":
            hvd.allreduce(t, name=tag)
        elif case in kept:  # before the fused narrowing: a pass each way around an in-place call
            buf = kept[case]
            buf.copy_(t)
            hvd.allreduce_(buf, name=tag)
            torch.from_numpy(np.empty(args.n, np.float32)).copy_(buf)
        else:
            hvd.allreduce_(t, name=tag)

    for case in cases:  # warm-up: buffers allocated, pages touched, connections made
        one(case, f"warm.{case}")
    for rep in range(args.reps):
        for case in cases:
            hvd.barrier()
            if spent is not None:
                spent.clear()
            tx = _lo_tx()
            start = time.perf_counter()
            one(case, f"{case}.{rep}")
            elapsed = time.perf_counter() - start
            hvd.barrier()
            if spent is not None:
                for part, sec in spent.items():
                    parts[case].setdefault(part, []).append(sec * 1e3)
            ms[case].append(elapsed * 1e3)
            nbytes[case].append(_lo_tx() - tx)
    if r == 0:
        med = {c: sorted(v)[len(v) // 2] for c, v in ms.items()}
        mb = {c: sorted(v)[len(v) // 2] for c, v in nbytes.items()}
        ref_ms, ref_b = med.get("float32"), mb.get("float32")
        out = {
            "transport": os.environ.get("HALF_WIRE_PLANE", "?"), "n": args.n, "reps": args.reps,
            "median_ms": med, "time_vs_float32": {c: v / ref_ms for c, v in med.items()} if ref_ms else {},
        }
        if spent is not None:
            out["phases_cpu_ms"] = {c: {p: round(sorted(v)[len(v) // 2], 2) for p, v in ps.items()}
                                    for c, ps in parts.items()}
        if os.environ.get("HALF_WIRE_COUNT") == "1":  # our own namespace: the loopback is ours
            out["bytes"] = mb
            out["bytes_vs_float32"] = {c: v / ref_b for c, v in mb.items()} if ref_b else {}
        print("HALF_WIRE " + json.dumps(out), flush=True)
    hvd.shutdown()


def _launch(plane: str, args: argparse.Namespace) -> dict:
    body = [sys.executable, os.path.abspath(__file__), "--rank-body", "--n", str(args.n),
            "--reps", str(args.reps), "--cases", args.cases] + (["--phases"] if args.phases else [])
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", HALF_WIRE_PLANE=plane,
               HALF_WIRE_COUNT="0" if args.local else "1")
    if plane == "mpi":
        cmd = ["mpirun", "--oversubscribe", "-np", "2"]
        if not args.local:
            cmd += ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]
        cmd += body
    else:
        cmd = [sys.executable, "-m", "horovod.runner", "--gloo", "-np", "2"]
        if not args.local:
            cmd += ["--network-interface", "lo"]
        cmd += body
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=REPO)
    for line in res.stdout.splitlines():
        if "HALF_WIRE " in line:
            return json.loads(line.split("HALF_WIRE ", 1)[1])
    raise SystemExit(f"{plane} run failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


def main() -> None:
    args = _args()
    if args.rank_body:
        rank_body(args)
        return
    if not args.local and not args.in_netns:
        if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
            raise SystemExit("counting bytes needs root, unshare and ip (a network namespace of its "
                             "own); use --local for times only")
        inner = " ".join([sys.executable, os.path.abspath(__file__), "--in-netns"] + sys.argv[1:])
        raise SystemExit(subprocess.call(["unshare", "-n", "sh", "-c", f"ip link set lo up && {inner}"]))
    for plane in args.planes.split(","):
        print(json.dumps(_launch(plane, args)), flush=True)


if __name__ == "__main__":
    main()
