"""The Python cost of building one carried row (``horovod/common/engine/carry.py``), one process.

    python benchmarks/carry_cost.py [--slots 161] [--elements 4] [--reps 30]

A cache of ``--slots`` float32 allreduces of ``--elements`` each, all ready and carried; each
round builds this rank's row (``Carrier.exchange``) and reads a batch of all of them from the rows
(``CarriedRound.batch``), with an exchange that returns two copies of the row (no transport). The
entries are looked up by slot through the cache (``entry_of``, as before) and by the names the
layout remembers (``pending``, what the engine's rounds pass now), interleaved; prints the fastest
of ``--reps`` repetitions of 100 rounds each, in microseconds per round (the minimum is the least
disturbed by other load on the machine).
"""

from __future__ import annotations

import argparse
import json
import timeit

import numpy as np

from horovod.common.engine.cache import ResponseCache
from horovod.common.engine.carry import Carrier
from horovod.common.types import ReduceOp, Request, RequestType, Response


class _Entry:
    def __init__(self, inputs: list[np.ndarray]) -> None:
        self.inputs = inputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=161)
    p.add_argument("--elements", type=int, default=4)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    cache = ResponseCache(1024)
    resps = [Response(Request(f"g{i}", RequestType.ALLREDUCE, "float32", ((args.elements,),), ReduceOp.SUM))
             for i in range(args.slots)]
    for r in resps:
        cache.put(r)
    pending = {r.request.name: _Entry([np.ones(args.elements, np.float32)]) for r in resps}

    def entry_of(slot: int) -> _Entry:  # rounds' lookup before: through the cache, per slot
        return pending[cache.response(slot).request.name]

    carrier = Carrier(lambda row: np.stack([row, row]), 2, cache, 64 * 1024)
    words = cache.words
    bits = np.zeros(2 * words + 1, np.uint64)
    ready = 0
    for r in resps:
        ready |= 1 << cache.slot_of[r.request.name]
    for w in range(words):
        bits[w] = (ready >> (64 * w)) & ((1 << 64) - 1)
    bits[words:] = np.uint64(2**64 - 1)
    batch = tuple(resps)

    def by_slot() -> None:
        rnd = carrier.exchange(bits, entry_of, False, 4, 0)[1]
        assert rnd is not None and rnd.batch(batch) is not None

    def by_name() -> None:
        rnd = carrier.exchange(bits, entry_of, False, 4, 0, pending)[1]
        assert rnd is not None and rnd.batch(batch) is not None

    for _ in range(3):  # the capacity agreed, the layouts memoized
        carrier.exchange(bits, entry_of, False, 4, 0)
    best = {"by_slot": float("inf"), "by_name": float("inf")}
    for _ in range(args.reps):
        for name, fn in (("by_slot", by_slot), ("by_name", by_name)):
            best[name] = min(best[name], timeit.timeit(fn, number=100) / 100 * 1e6)
    print(json.dumps({"bench": "carry_cost", "slots": args.slots,
                      "us_per_round": {k: round(v, 1) for k, v in best.items()},
                      "ratio": round(best["by_name"] / best["by_slot"], 2)}))


if __name__ == "__main__":
    main()
