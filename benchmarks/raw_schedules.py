"""Raw mpi4py schedules of a gradient set's bytes: the references the engine is measured against.

Each function returns a step (no arguments) that averages its buffers over ``comm`` in place, and
adds the seconds spent packing, inside MPI and unpacking/scaling to ``phases`` when given (keys
``pack``, ``mpi``, ``unpack``), so a binding's breakdown can be set beside its reference's:

* ``flat(comm, buf)``: one ``Allreduce`` of the whole flat buffer, then ``/ size``;
* ``pieces(comm, buf, nbytes)``: the flat buffer in ``nbytes`` pieces, each reduced in place and
  divided while hot in cache (the best of these is the "raw limit" of ``gradsync_limit.py``);
* ``schedule(comm, arrays, in_place, chunk)``: the engine's piece schedule written directly on
  separately allocated arrays (the *same memory* as a binding's tensors): whole ``chunk`` pieces
  of arrays of at least one piece reduced where they lie when ``in_place(array)`` says so, else
  copied through a huge-page buffer; small arrays and the tails packed into a second one;
* ``per_tensor(comm, arrays)``: one in-place ``Allreduce`` per array, whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

Phases = dict[str, float]


def _add(phases: Phases | None, key: str, t0: float) -> float:
    t1 = time.perf_counter()
    if phases is not None:
        phases[key] = phases.get(key, 0.0) + t1 - t0
    return t1


def flat(comm, buf: np.ndarray, phases: Phases | None = None) -> Callable[[], None]:
    from mpi4py import MPI

    size = comm.size

    def step() -> None:
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf)
        t0 = _add(phases, "mpi", t0)
        np.divide(buf, size, out=buf)
        _add(phases, "unpack", t0)
    return step


def pieces(comm, buf: np.ndarray, nbytes: int, phases: Phases | None = None,
           multiply: bool = False) -> Callable[[], None]:
    """``multiply``: scale by ``1 / size`` (the same values when ``size`` is a power of two)."""
    from mpi4py import MPI

    size = comm.size
    scale = (np.multiply, buf.dtype.type(1 / size)) if multiply else (np.divide, size)
    n = nbytes // buf.itemsize
    views = [buf[o:o + n] for o in range(0, buf.size, n)]

    def step() -> None:
        mpi = div = 0.0
        op, by = scale
        for v in views:
            t0 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, v)
            t1 = time.perf_counter()
            op(v, by, out=v)
            mpi += t1 - t0
            div += time.perf_counter() - t1
        if phases is not None:
            phases["mpi"] = phases.get("mpi", 0.0) + mpi
            phases["unpack"] = phases.get("unpack", 0.0) + div
    return step


def per_tensor(comm, arrays: Sequence[np.ndarray], phases: Phases | None = None) -> Callable[[], None]:
    from mpi4py import MPI

    size = comm.size
    flats = [a.reshape(-1) for a in arrays]

    def step() -> None:
        mpi = div = 0.0
        for v in flats:
            t0 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, v)
            t1 = time.perf_counter()
            np.divide(v, size, out=v)
            mpi += t1 - t0
            div += time.perf_counter() - t1
        if phases is not None:
            phases["mpi"] = phases.get("mpi", 0.0) + mpi
            phases["unpack"] = phases.get("unpack", 0.0) + div
    return step


def schedule(comm, arrays: Sequence[np.ndarray], in_place: Callable[[np.ndarray], bool], chunk: int,
             empty: Callable[[int], np.ndarray], phases: Phases | None = None,
             alone: int | None = None, piece_bytes: int | None = None) -> Callable[[], None]:
    """See the module docstring; ``empty(nbytes)`` makes the huge-page buffers (the engine's
    ``huge_page_empty``). ``alone``: arrays of at least this many bytes are never packed, tails
    included (their last piece is short); None: arrays of at least one piece, tails packed.
    ``piece_bytes``: the pieces of arrays reduced alone (default ``chunk``, the packed calls'
    size)."""
    from mpi4py import MPI

    size = comm.size
    flats = [a.reshape(-1) for a in arrays]
    dtype = flats[0].dtype
    piece = chunk // dtype.itemsize
    packbuf = empty(chunk).view(dtype)
    solobuf = empty(max(chunk, piece_bytes or 0)).view(dtype)
    own = [in_place(a) for a in arrays]
    # The plan, made once: ("own", view) | ("solo", view) | ("pack", fill, [(out view, buf view)])
    plan: list[tuple] = []
    pending: list[tuple[np.ndarray, np.ndarray]] = []
    fill = 0
    for a, mine in zip(flats, own):
        if alone is not None:
            stop = a.size if a.nbytes >= alone else 0
        else:
            stop = a.size - a.size % piece if a.size >= piece else 0
        if stop and pending:
            plan.append(("pack", fill, pending))
            pending, fill = [], 0
        step_n = piece if piece_bytes is None else piece_bytes // dtype.itemsize
        for o in range(0, stop, step_n):
            plan.append(("own" if mine else "solo", a[o:o + step_n]))
        start = stop
        while start < a.size:
            take = min(a.size - start, piece - fill)
            pending.append((a[start:start + take], packbuf[fill:fill + take]))
            fill += take
            start += take
            if fill == piece:
                plan.append(("pack", fill, pending))
                pending, fill = [], 0
    if pending:
        plan.append(("pack", fill, pending))

    def step() -> None:
        acc = {"pack": 0.0, "mpi": 0.0, "unpack": 0.0}
        for call in plan:
            t0 = time.perf_counter()
            if call[0] == "own":
                v = call[1]
                comm.Allreduce(MPI.IN_PLACE, v)
                t1 = time.perf_counter()
                np.divide(v, size, out=v)
                acc["mpi"] += t1 - t0
            elif call[0] == "solo":
                v = call[1]
                buf = solobuf[:v.size]
                np.copyto(buf, v)
                t1 = time.perf_counter()
                comm.Allreduce(MPI.IN_PLACE, buf)
                t2 = time.perf_counter()
                np.divide(buf, size, out=v)
                acc["pack"] += t1 - t0
                acc["mpi"] += t2 - t1
                t1 = t2
            else:
                _, n, pairs = call
                np.concatenate([src for src, _ in pairs], out=packbuf[:n])
                t1 = time.perf_counter()
                comm.Allreduce(MPI.IN_PLACE, packbuf[:n])
                t2 = time.perf_counter()
                np.divide(packbuf[:n], size, out=packbuf[:n])
                for out, view in pairs:
                    out[...] = view
                acc["pack"] += t1 - t0
                acc["mpi"] += t2 - t1
                t1 = t2
            acc["unpack"] += time.perf_counter() - t1
        if phases is not None:
            for k, v in acc.items():
                phases[k] = phases.get(k, 0.0) + v
    return step
