"""The Gloo plane's own Python per cached grouped step, one process, no transport.

    python benchmarks/gloo_python_cost.py [--tensors 161] [--elements 4] [--reps 20]

What a cached ``grouped_allreduce_`` of ``--tensors`` float32 tensors costs on the Gloo plane beyond
what the MPI plane runs as well (docs/performance.md, "Both planes in one job"):

* ``carrier``: ``Carrier.exchange`` (this rank's row: the round's bits, the tensors packed into it)
  and ``CarriedRound.batch`` (the batch found in the rows), with an exchange that stacks two
  copies of the row;
* ``pack``: of that, the copy of the tensors into the row alone (``np.concatenate``: the copy the
  MPI plane makes into its fusion buffer instead);
* ``exchange_rows``: ``GlooBackend.exchange_rows`` on a stub process group whose sends and
  receives return finished works (the next receives posted during the exchange, as the engine's);
* ``stubs``: the stub group's calls alone.

Prints the fastest of ``--reps`` repetitions of 25 calls each, in microseconds per call (the
minimum is the least disturbed by other load on the machine).
"""

from __future__ import annotations

import argparse
import json
import timeit
from typing import Any

import numpy as np
import torch

from horovod.common.backends.gloo import GlooBackend
from horovod.common.engine.cache import ResponseCache
from horovod.common.engine.carry import Carrier
from horovod.common.types import ReduceOp, Request, RequestType, Response


class _Entry:
    def __init__(self, inputs: list[np.ndarray]) -> None:
        self.inputs = inputs


class _Done:
    def wait(self) -> None:
        pass


class _StubGroup:
    """A process group whose point-to-point calls return finished works."""

    def send(self, tensors: Any, peer: int, tag: int) -> _Done:
        return _Done()

    def recv(self, tensors: Any, peer: int, tag: int) -> _Done:
        return _Done()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=161)
    p.add_argument("--elements", type=int, default=4)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    cache = ResponseCache(1024)
    resp = Response(Request("grouped", RequestType.ALLREDUCE, "float32",
                            tuple((args.elements,) for _ in range(args.tensors)), ReduceOp.SUM))
    cache.put(resp)
    pending = {"grouped": _Entry([np.ones(args.elements, np.float32) for _ in range(args.tensors)])}
    carrier = Carrier(lambda row, n=0: np.stack([row, row]), 2, cache, 64 * 1024, post_ahead=True)
    words = cache.words
    bits = np.zeros(2 * words + 1, np.uint64)
    bits[cache.slot_of["grouped"] // 64] = np.uint64(1 << (cache.slot_of["grouped"] % 64))
    bits[words:] = np.uint64(2**64 - 1)
    batch = (resp,)

    def entry_of(slot: int) -> _Entry:
        return pending["grouped"]

    for _ in range(3):  # the capacity agreed, the layouts memoized
        carrier.exchange(bits, entry_of, False, 4, 0, pending)

    def carried() -> None:
        rnd = carrier.exchange(bits, entry_of, False, 4, 0, pending)[1]
        assert rnd is not None and rnd.batch(batch) is not None

    out = np.empty(args.tensors * args.elements, np.float32)

    def pack() -> None:
        np.concatenate(pending["grouped"].inputs, out=out)

    backend = object.__new__(GlooBackend)  # only what exchange_rows and post_rows read
    backend._torch = torch
    backend.rank, backend.size = 1, 2
    backend._rows_posted = None
    backend._world = _StubGroup()
    row = np.zeros(8 * (2 * words + 3) + carrier.capacity, np.uint8)
    backend.post_rows(row.size)

    def exchange_rows() -> None:
        backend.exchange_rows(row, row.size)

    group = _StubGroup()

    def stubs() -> None:
        t = torch.from_numpy(row)
        group.send([t], 0, 1).wait()
        group.recv([t], 0, 1)

    best = {}
    for name, fn in (("carrier", carried), ("pack", pack), ("exchange_rows", exchange_rows), ("stubs", stubs)):
        best[name] = round(min(timeit.timeit(fn, number=25) / 25 * 1e6 for _ in range(args.reps)), 2)
    ours = best["carrier"] - best["pack"] + best["exchange_rows"] - best["stubs"]
    print(json.dumps({"bench": "gloo_python_cost", "tensors": args.tensors, "elements": args.elements,
                      "us_per_call": best, "gloo_only_us": round(ours, 2)}))


if __name__ == "__main__":
    main()
