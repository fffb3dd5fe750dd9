"""Rank 0's control-plane work for one negotiation round of N simulated ranks, in one process.

    python benchmarks/control_plane.py --ranks 1024 4096 16384 --tensors 161

Every simulated rank builds its own requests for a ResNet-50 gradient set (161 allreduces, the
names and shapes ``DistributedOptimizer`` submits) and encodes them with the engine's real encoder
(``wire.encode_requests``); the transport's own step (pickling each rank's ``bytes``) is applied too.
Timed on rank 0, as the engine runs it:

- ``uncached``: unpickle the N gathered messages, ``Coordinator.submit_encoded``, ``ready``,
  ``wire.encode_responses`` (what is broadcast back);
- ``distinct``: the same, but every rank's message differs (each rank submitted its tensors in
  its own random order), so none is shared: the worst case of the message de-duplication;
- ``cached``: a cached round: the AND of N ranks' bit vectors (here all at rank 0; a real
  allreduce spreads it) and the responses of the 161 ready slots from the response cache;
- ``baseline``: today's path before issue 25, in the same run: unpickle each rank's requests as
  pickled ``Request`` dataclasses, the old coordinator's ``submit`` + ``ready``, pickle the
  responses (skipped above ``--baseline-max`` ranks: it takes seconds and gigabytes).

Peak memory is measured (tracemalloc) in a separate, untimed pass; the inputs (the gathered
messages) are counted apart. Times are medians of ``--reps`` interleaved repetitions.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _legacy_negotiation import LegacyCoordinator  # noqa: E402
from shapes import resnet50  # noqa: E402

from horovod.common.engine.cache import ResponseCache  # noqa: E402
from horovod.common.engine.negotiation import Coordinator  # noqa: E402
from horovod.common.engine.negotiation_codec import encode_requests, encode_responses  # noqa: E402
from horovod.common.types import Request, RequestType, Response  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
parser.add_argument("--tensors", type=int, default=161)
parser.add_argument("--reps", type=int, default=5)
parser.add_argument("--baseline-max", type=int, default=4096)


def _names_shapes(tensors: int) -> list[tuple[str, tuple[int, ...]]]:
    shapes = resnet50()
    out = []
    for i in range(tensors):
        s = shapes[i % len(shapes)]
        part = "weight" if len(s) > 1 else "bias"
        out.append((f"allreduce.module.layer{i // 12}.block{i % 12}.conv.{part}", s))
    return out


def _requests(rank: int, specs: list[tuple[str, tuple[int, ...]]], shuffle: bool = False) -> list[Request]:
    reqs = [Request(name, RequestType.ALLREDUCE, "float32", (shape,), rank=rank) for name, shape in specs]
    if shuffle:  # this rank's own order: no two ranks' messages are alike
        order = np.random.default_rng(rank).permutation(len(reqs))
        reqs = [reqs[i] for i in order]
    return reqs


def _members(size: int) -> Callable[[int], list[int] | None]:
    ranks = list(range(size))
    return {0: ranks}.get


def _new_round(size: int, wire: list[bytes]) -> tuple[int, bytes]:
    messages = [pickle.loads(w) for w in wire]  # the transport's unpickling of each rank's bytes
    coord = Coordinator(size, _members(size), time.monotonic)
    coord.submit_encoded(messages)
    responses = coord.ready()
    return len(responses), encode_responses(responses)


def _old_round(size: int, wire: list[bytes]) -> tuple[int, bytes]:
    coord = LegacyCoordinator(size, _members(size), time.monotonic)
    coord.submit([r for w in wire for r in pickle.loads(w)])
    responses = coord.ready()
    return len(responses), pickle.dumps(responses, protocol=pickle.HIGHEST_PROTOCOL)


def _cached_setup(size: int, specs: list[tuple[str, tuple[int, ...]]]) -> tuple[ResponseCache, np.ndarray]:
    cache = ResponseCache(1024)
    for r in _requests(0, specs):
        cache.put(Response(r))
    words = cache.words
    bits = np.zeros((size, 2 * words + 1), np.uint64)
    bits[:, 0:3] = np.uint64((1 << 64) - 1)  # slots 0..160 ready on every rank
    return cache, bits


def _cached_round(cache: ResponseCache, bits: np.ndarray, mine: list[Request]) -> int:
    for r in mine:  # this rank's lookups (every rank does the same)
        cache.lookup(r)
    anded = np.bitwise_and.reduce(bits, axis=0)
    words = cache.words
    ready = int.from_bytes(anded[:words].tobytes(), "little")
    out = []
    while ready:
        low = ready & -ready
        slot = low.bit_length() - 1
        ready ^= low
        if slot < len(cache):
            out.append(cache.response(slot))
    return len(out)


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def main() -> None:
    args = parser.parse_args()
    specs = _names_shapes(args.tensors)
    results = {}
    for size in args.ranks:
        wire_new = [pickle.dumps(encode_requests(_requests(r, specs)), protocol=pickle.HIGHEST_PROTOCOL)
                    for r in range(size)]
        wire_distinct = [pickle.dumps(encode_requests(_requests(r, specs, shuffle=True)),
                                      protocol=pickle.HIGHEST_PROTOCOL) for r in range(size)]
        baseline = size <= args.baseline_max
        wire_old = [pickle.dumps(_requests(r, specs), protocol=pickle.HIGHEST_PROTOCOL)
                    for r in range(size)] if baseline else []
        cache, bits = _cached_setup(size, specs)
        mine = _requests(0, specs)
        times: dict[str, list[float]] = {"uncached": [], "distinct": [], "cached": [], "baseline": []}
        for _ in range(args.reps):
            for label in times:
                if label == "baseline" and not baseline:
                    continue
                gc.collect()
                t0 = time.perf_counter()
                if label == "uncached":
                    n, _ = _new_round(size, wire_new)
                elif label == "distinct":
                    n, _ = _new_round(size, wire_distinct)
                elif label == "cached":
                    n = _cached_round(cache, bits, mine)
                else:
                    n, _ = _old_round(size, wire_old)
                times[label].append(time.perf_counter() - t0)
                assert n == args.tensors, (label, n)
        # Peak memory of one uncached round, untimed (tracemalloc slows allocation down).
        messages = [pickle.loads(w) for w in wire_new]
        inputs = sum(len(m) for m in messages)
        gc.collect()
        tracemalloc.start()
        coord = Coordinator(size, _members(size), time.monotonic)
        coord.submit_encoded(messages)
        encode_responses(coord.ready())
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del coord, messages
        row = {k: _median_ms(v) for k, v in times.items() if v}
        results[size] = row
        cells = size * args.tensors
        print(f"uncached_round_ms@{size}={row['uncached']:.1f}")
        print(f"uncached_distinct_round_ms@{size}={row['distinct']:.1f}")
        print(f"cached_round_ms@{size}={row['cached']:.3f}")
        print(f"rank0_peak_bytes@{size}={peak} ({peak / cells:.1f} B per rank x tensor; "
              f"inputs {inputs} B = {inputs / cells:.1f} B per rank x tensor)")
        if "baseline" in row:
            print(f"baseline_round_ms@{size}={row['baseline']:.1f} "
                  f"ratio={row['uncached'] / row['baseline']:.3f} "
                  f"distinct_ratio={row['distinct'] / row['baseline']:.3f}")
        else:
            print(f"baseline_round_ms@{size}=skipped (above --baseline-max {args.baseline_max})")
        sys.stdout.flush()
        del wire_new, wire_distinct, wire_old
    sizes = sorted(results)
    for a, b in zip(sizes, sizes[1:]):
        print(f"growth {a}->{b}: ranks x{b / a:.0f}, uncached x{results[b]['uncached'] / results[a]['uncached']:.2f}, "
              f"distinct x{results[b]['distinct'] / results[a]['distinct']:.2f}")


if __name__ == "__main__":
    main()
