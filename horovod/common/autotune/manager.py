"""The autotuner's parameter manager: measures samples, asks the optimiser, applies its choice everywhere.

``HOROVOD_AUTOTUNE=1`` makes the engine call ``ParameterManager.observe(responses)`` after every
round it executes. Every rank executes the same responses in the same order, so every rank sees
the same step and sample boundaries:

- a **step** ends when an operation name repeats (a training step submits the same names again);
- a **sample** is ``steps_per_sample`` steps; its score is the bytes the collectives moved per
  microsecond on rank 0 (upstream's unit), over the median step duration of the sample (upstream
  takes the sample's total time; the median ignores a step slowed down by another job);
- at each sample boundary rank 0 decides (the first ``warmup_samples`` samples are discarded; then
  each score is logged as a CSV row and given to the Bayesian optimiser, which proposes the next
  parameters; after ``bayes_opt_max_samples`` scored samples the measured point with the best
  smoothed score (the Gaussian process's mean: single measurements are noisy) is kept and tuning
  stops) and every rank receives the decision in one broadcast from rank 0, at the same
  point of its round sequence, and applies it to the engine's ``Tunables``.

The knobs: fusion threshold, piece (chunk) size, the largest tensor packed (fusion max tensor
bytes), cycle time, response cache on/off and, on jobs of more than one host, hierarchical
allreduce/allgather on/off. A knob whose variable the user set
explicitly (``HOROVOD_FUSION_THRESHOLD``, ...) stays fixed, as upstream.
"""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from horovod.common.autotune.bayes import BayesianOptimizer

__all__ = ["Knob", "KNOBS", "CSV_HEADER", "ParameterManager", "from_config"]


@dataclass(frozen=True)
class Knob:
    """One tunable: its ``Tunables`` field, the variable that fixes it, and its search range.

    ``scale`` is ``"log2"``/``"log10"`` (``low``/``high`` are exponents; values are rounded) or
    ``"bool"``. ``encode``/``decode`` map values to and from ``[0, 1]``.
    """

    name: str
    env: str
    scale: str
    low: float = 0.0
    high: float = 1.0

    def encode(self, value: Any) -> float:
        if self.scale == "bool":
            return 1.0 if value else 0.0
        base = 2.0 if self.scale == "log2" else 10.0
        v = math.log(max(float(value), base ** self.low), base)
        return min(max((v - self.low) / (self.high - self.low), 0.0), 1.0)

    def decode(self, u: float) -> Any:
        if self.scale == "bool":
            return bool(u >= 0.5)
        e = self.low + min(max(float(u), 0.0), 1.0) * (self.high - self.low)
        if self.scale == "log2":
            return int(round(2.0 ** e / 1024.0)) * 1024  # bytes, whole KiB
        return round(10.0 ** e, 2)  # milliseconds


KNOBS: tuple[Knob, ...] = (
    Knob("fusion_threshold", "HOROVOD_FUSION_THRESHOLD", "log2", 16, 28),  # 64 KiB - 256 MiB
    Knob("chunk_bytes", "HOROVOD_CHUNK_BYTES", "log2", 15, 26),  # 32 KiB - 64 MiB
    # the largest tensor packed into the fusion buffer (larger ones are reduced where they lie, in
    # pieces of chunk_bytes): 4 KiB - 128 MiB. With large pieces and a small bound, each tensor is
    # reduced whole in its own memory: the fastest schedule of separate tensors in one state of
    # this project's VM, 2 MiB pieces in another (docs/performance.md, "The MPI data plane")
    Knob("max_tensor_bytes", "HOROVOD_FUSION_MAX_TENSOR_BYTES", "log2", 12, 27),
    Knob("cycle_time_ms", "HOROVOD_CYCLE_TIME", "log10", math.log10(0.5), math.log10(50.0)),
    Knob("cache_enabled", "HOROVOD_CACHE_CAPACITY", "bool"),
    Knob("hierarchical_allreduce", "HOROVOD_HIERARCHICAL_ALLREDUCE", "bool"),
    Knob("hierarchical_allgather", "HOROVOD_HIERARCHICAL_ALLGATHER", "bool"),
)
_HIERARCHICAL = ("hierarchical_allreduce", "hierarchical_allgather")

# Upstream's columns (fusion threshold in MiB, booleans 0/1, torus always 0 here), then ours.
CSV_HEADER = ["hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce", "cache_enabled",
              "cycle_time_ms", "tensor_fusion_threshold", "score", "chunk_bytes", "fusion_max_tensor_bytes"]

_DATA_KINDS = frozenset({"allreduce", "allgather", "broadcast", "alltoall", "reducescatter"})


def _nbytes(request: Any) -> int:
    item = np.dtype(request.dtype).itemsize if request.dtype != "bfloat16" else 2
    return item * sum(math.prod(s) for s in request.shapes)


class ParameterManager:
    """Tunes a ``Tunables`` object at run time (see the module docstring).

    Args:
        tunables: the engine's knobs; changed in place, identically on every rank.
        rank: this process's rank (rank 0 measures, decides and writes the log).
        bcast: the controller's broadcast from rank 0 (collective over all ranks).
        free: names of the knobs to tune (others keep their values).
        log_path: CSV log written by rank 0 ('' for none).
        on_change: called on every rank with (old, new) values after a change is applied.
    """

    def __init__(self, tunables: Any, rank: int, bcast: Callable[[Any], Any], free: Sequence[str], *,
                 warmup_samples: int = 3, steps_per_sample: int = 10, max_samples: int = 20,
                 noise: float = 0.8, log_path: str = "", seed: int = 0,
                 on_change: Callable[[dict[str, Any], dict[str, Any]], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.tunables = tunables
        self.rank = rank
        self._bcast = bcast
        self.knobs = [k for k in KNOBS if k.name in free]
        self.warmup_remaining = warmup_samples
        self.steps_per_sample = max(1, steps_per_sample)
        self.max_samples = max_samples
        self._on_change = on_change
        self._clock = clock
        self.active = bool(self.knobs)
        self.history: list[dict[str, Any]] = []  # every sample: params, score (rank 0), phase
        # Every rank: (operations observed so far, parameters applied) at each sample boundary.
        self.applied: list[tuple[int, dict[str, Any]]] = []
        self._observed = 0
        start = [k.encode(getattr(tunables, k.name)) for k in self.knobs]
        rng = np.random.default_rng(seed)
        initial = [start] + [list(rng.random(len(self.knobs))) for _ in range(2)]
        self._bo = BayesianOptimizer(len(self.knobs), initial=initial, noise=noise, seed=seed) if self.knobs \
            else None
        self._current = np.asarray(start)
        self._seen: set[str] = set()
        self._steps = 0
        self._bytes = 0
        self._t0 = self._t_step = clock()
        self._step_times: list[float] = []
        self._log = None
        if rank == 0 and log_path and self.active:
            self._log = open(log_path, "w", newline="")  # noqa: SIM115 - closed when tuning ends
            csv.writer(self._log).writerow(CSV_HEADER)
            self._log.flush()

    # ------------------------------------------------------------------ every rank, every round
    def observe(self, responses: Sequence[Any]) -> None:
        """Count the executed responses of one round; at a sample boundary, tune (collective)."""
        if not self.active:
            return
        for resp in responses:
            if resp.kind.value not in _DATA_KINDS or resp.error is not None:
                continue
            name = resp.name
            if name in self._seen:
                self._seen.clear()
                self._steps += 1
                now = self._clock()
                self._step_times.append(now - self._t_step)
                self._t_step = now
            self._seen.add(name)
            self._bytes += _nbytes(resp.request)
            self._observed += 1
        if self._steps >= self.steps_per_sample:
            self._end_sample()

    # ------------------------------------------------------------------ sample boundary
    def _params(self) -> dict[str, Any]:
        return {k.name: getattr(self.tunables, k.name) for k in self.knobs}

    def _end_sample(self) -> None:
        # Bytes per microsecond of a typical step: the bytes of the sample's steps over their median
        # duration (one step slowed by another job on the machine does not decide the sample).
        median = float(np.median(self._step_times)) if self._step_times else self._clock() - self._t0
        score = self._bytes / max(len(self._step_times), 1) / (max(median, 1e-9) * 1e6)
        message = self._decide(score) if self.rank == 0 else None
        params, active = self._bcast(message)
        old = self._params()
        self.tunables.update(**params)
        self.active = active
        self.applied.append((self._observed, params))
        if self._on_change is not None and params != old:
            self._on_change(old, params)
        # self._seen is kept: it holds the names of the step now under way.
        self._steps = 0
        self._bytes = 0
        self._step_times.clear()
        self._t0 = self._t_step = self._clock()

    def _decide(self, score: float) -> tuple[dict[str, Any], bool]:
        """Rank 0: record the sample, choose the next parameters; returns (params, still active)."""
        params = self._params()
        if self.warmup_remaining > 0:
            self.warmup_remaining -= 1
            self.history.append({**params, "score": score, "phase": "warmup"})
            return params, True
        assert self._bo is not None
        self._bo.add([float(v) for v in self._current], score)
        self.history.append({**params, "score": score, "phase": "sample"})
        self._write(params, score)
        if len(self._bo.ys) >= self.max_samples:
            best_x, best_y = self._bo.best_estimate()
            best = self._decode(best_x)
            self.history.append({**best, "score": best_y, "phase": "best"})
            self._write(best, best_y)
            if self._log is not None:
                self._log.close()
                self._log = None
            return best, False
        self._current = np.asarray(self._bo.suggest())
        return self._decode(self._current), True

    def _decode(self, x: np.ndarray) -> dict[str, Any]:
        return {k.name: k.decode(u) for k, u in zip(self.knobs, x)}

    def _write(self, params: Mapping[str, Any], score: float) -> None:
        if self._log is None:
            return
        full = {**self.tunables.as_dict(), **params}
        csv.writer(self._log).writerow([
            int(full["hierarchical_allreduce"]), int(full["hierarchical_allgather"]), 0,
            int(full["cache_enabled"]), full["cycle_time_ms"],
            round(full["fusion_threshold"] / (1024 * 1024), 4), f"{score:.6g}", full["chunk_bytes"],
            full["max_tensor_bytes"]])
        self._log.flush()


def from_config(config: Any, tunables: Any, rank: int, bcast: Callable[[Any], Any],
                environ: Mapping[str, str], multi_host: bool,
                on_change: Callable[[dict[str, Any], dict[str, Any]], None] | None = None
                ) -> ParameterManager:
    """A manager for an engine: knobs the user set explicitly, and hierarchical ones on one host, stay fixed."""
    free = [k.name for k in KNOBS if k.env not in environ and (multi_host or k.name not in _HIERARCHICAL)]
    if config.cache_capacity == 0:
        free = [n for n in free if n != "cache_enabled"]
    return ParameterManager(
        tunables, rank, bcast, free, warmup_samples=config.autotune_warmup_samples,
        steps_per_sample=config.autotune_steps_per_sample, max_samples=config.autotune_bayes_opt_max_samples,
        noise=config.autotune_gaussian_process_noise, log_path=config.autotune_log, on_change=on_change)
