"""Every ``HOROVOD_*`` setting the worker library reads, declared once.

Each setting is a dataclass field whose metadata carries its environment variable and help text.
``EngineConfig.from_env()`` reads them all once, at ``hvd.init()``; a bad value raises
``ConfigError`` naming the variable, the value and what is allowed. The launcher writes these
variables for its workers; no library code sets ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from horovod.common.exceptions import ConfigError

__all__ = ["EngineConfig", "LOG_LEVELS", "parse_bool"]

LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")


def parse_bool(text: str) -> bool:
    """Parse a flag the way upstream Horovod does (an integer > 0 is on), also accepting words."""
    t = text.strip().lower()
    if t in ("", "0", "false", "no", "off"):
        return False
    if t in ("true", "yes", "on"):
        return True
    try:
        return float(t) > 0
    except ValueError:
        raise ValueError("expected 0/1, true/false, yes/no or on/off") from None


def _parse_int(text: str) -> int:
    return int(text.strip())


def _parse_float(text: str) -> float:
    return float(text.strip())


def _parse_str(text: str) -> str:
    return text


def _parse_upper(text: str) -> str:
    return text.strip().upper()


def _parse_auto_bool(text: str) -> str:
    t = text.strip().lower()
    if t in ("", "auto"):
        return ""
    return "1" if parse_bool(t) else "0"


def _parse_level(text: str) -> str:
    t = text.strip().lower()
    return t if t in LOG_LEVELS else "warning"


_UNITS = {
    int: "an integer",
    float: "a number",
}


def _setting(env: str, default: Any, help: str, parse: Callable[[str], Any] | None = None,
             minimum: float | None = None, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={
        "env": env, "help": help, "parse": parse, "minimum": minimum, "choices": choices,
    })



_GPU_TRANSPORTS = ("", "NCCL", "MPI", "GLOO")


def _gpu_op_setting(env: str, op: str) -> Any:
    """The transport of one GPU operation; it wins over HOROVOD_GPU_OPERATIONS for that operation."""
    return _setting(env, "", f"NCCL, MPI or GLOO for GPU {op} (overrides HOROVOD_GPU_OPERATIONS).",
                    _parse_upper, choices=_GPU_TRANSPORTS)


@dataclass(frozen=True)
class EngineConfig:
    """Settings of the collective engine of one worker process."""

    fusion_threshold: int = _setting(
        "HOROVOD_FUSION_THRESHOLD", 128 * 1024 * 1024,
        "Fusion buffer size in bytes; small tensors are packed into one collective up to this size. "
        "0 disables fusion.", _parse_int, minimum=0)
    fusion_max_tensor_bytes: int = _setting(
        "HOROVOD_FUSION_MAX_TENSOR_BYTES", 128 * 1024 * 1024,
        "Tensors larger than this many bytes are always reduced in their own memory; smaller ones are "
        "reduced there when it is on transparent huge pages, else copied piece by piece through the "
        "engine's huge-page buffers (faster than the transport's walk over 4 KiB pages even with the "
        "copies).", _parse_int, minimum=0)
    chunk_bytes: int = _setting(
        "HOROVOD_CHUNK_BYTES", -1,
        "Piece size in bytes of CPU reductions: the fusion buffer and large tensors are reduced in "
        "pieces of at most this size, each scaled while hot in cache (0: one transport call per "
        "buffer). Unset (-1): the transport's own, 2 MiB on MPI, 16 MiB on Gloo (where tensors of "
        "1 MiB and more are then reduced where they lie, not packed).", _parse_int, minimum=0)
    adaptive_pieces: bool = _setting(
        "HOROVOD_ADAPTIVE_PIECES", True,
        "With HOROVOD_CHUNK_BYTES unset, on MPI: large reductions run in whichever of 2 MiB and "
        "16 MiB pieces is faster, re-measured while the job runs (docs/performance.md, \"The piece "
        "size follows the machine\"); 0: always 2 MiB. Off under HOROVOD_AUTOTUNE, which tunes the "
        "piece size itself.", parse_bool)
    overlap_gradients: str = _setting(
        "HOROVOD_OVERLAP_GRADIENTS", "",
        "1: reduce the optimizer's gradients in the background while the backward pass runs; 0: hold "
        "them until the optimizer waits, then reduce them all on the idle cores; empty (auto): 1 when "
        "the host has at least two cores per local rank, else 0.", _parse_auto_bool)
    flat_gradients: bool = _setting(
        "HOROVOD_FLAT_GRADIENTS", True,
        "1: DistributedOptimizer keeps the CPU gradients of each dtype as views of one flat buffer, "
        "reduced in buckets of up to 25 MiB as one span each, without copies (DDP's "
        "gradient_as_bucket_view); 0: each gradient is its own tensor and allreduce.", parse_bool)
    cycle_time_ms: float = _setting(
        "HOROVOD_CYCLE_TIME", 1.0,
        "Milliseconds between the engine thread's negotiation rounds (the least gap between two "
        "background rounds, and the tick while a rank has nothing to submit). A caller waiting on "
        "a handle drives its rounds at once; it never waits for this tick.", _parse_float, minimum=0)
    cache_capacity: int = _setting(
        "HOROVOD_CACHE_CAPACITY", 1024,
        "Number of negotiated operations remembered by the response cache; 0 disables the cache.",
        _parse_int, minimum=0)
    timeline: str = _setting(
        "HOROVOD_TIMELINE", "",
        "Path of a Chrome-trace timeline written by rank 0, or DYNAMIC to allow start_timeline().",
        _parse_str)
    timeline_mark_cycles: bool = _setting(
        "HOROVOD_TIMELINE_MARK_CYCLES", False, "Write a CYCLE_START marker for every round.", parse_bool)
    stall_check_disable: bool = _setting(
        "HOROVOD_STALL_CHECK_DISABLE", False, "Disable the stall inspector.", parse_bool)
    stall_check_time_seconds: float = _setting(
        "HOROVOD_STALL_CHECK_TIME_SECONDS", 60.0,
        "Warn when a tensor submitted by some ranks waits this long for the others.",
        _parse_float, minimum=0)
    stall_shutdown_time_seconds: float = _setting(
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0,
        "Shut Horovod down when a tensor waits this long (0: never). Must exceed the warning time.",
        _parse_float, minimum=0)
    flight_recorder: int = _setting(
        "HOROVOD_FLIGHT_RECORDER", 1024,
        "How many of its last collectives each rank keeps for stall reports and stacks on demand "
        "(the flight recorder); 0 turns it off.", _parse_int, minimum=0)
    straggler_interval_seconds: float = _setting(
        "HOROVOD_STRAGGLER_INTERVAL", 1.0,
        "Seconds between the coordinator's straggler verdicts (every rank sends it the records of "
        "the rounds it completed meanwhile; see hvd.metrics()); 0 turns straggler detection off.",
        _parse_float, minimum=0)
    log_level: str = _setting(
        "HOROVOD_LOG_LEVEL", "warning", "trace, debug, info, warning, error or fatal.", _parse_level)
    log_hide_time: bool = _setting(
        "HOROVOD_LOG_HIDE_TIME", False, "Leave the timestamp out of log lines.", parse_bool)
    controller: str = _setting(
        "HOROVOD_CONTROLLER", "",
        "MPI or GLOO: the transport for negotiation (default: GLOO under the Gloo launcher, else MPI).",
        _parse_upper, choices=("", "MPI", "GLOO"))
    cpu_operations: str = _setting(
        "HOROVOD_CPU_OPERATIONS", "",
        "MPI or GLOO: the transport for CPU tensors (default: the controller's).",
        _parse_upper, choices=("", "MPI", "GLOO"))
    gpu_operations: str = _setting(
        "HOROVOD_GPU_OPERATIONS", "",
        "NCCL, MPI or GLOO: how GPU tensors are reduced and moved. NCCL runs torch.distributed NCCL "
        "on the device; MPI and GLOO stage them through host memory over the job's CPU transport "
        "(default: NCCL when available).", _parse_upper, choices=_GPU_TRANSPORTS)
    gpu_allreduce: str = _gpu_op_setting("HOROVOD_GPU_ALLREDUCE", "allreduce")
    gpu_allgather: str = _gpu_op_setting("HOROVOD_GPU_ALLGATHER", "allgather")
    gpu_broadcast: str = _gpu_op_setting("HOROVOD_GPU_BROADCAST", "broadcast")
    gpu_alltoall: str = _gpu_op_setting("HOROVOD_GPU_ALLTOALL", "alltoall")
    gpu_reducescatter: str = _gpu_op_setting("HOROVOD_GPU_REDUCESCATTER", "reducescatter")
    torch_cpu_plane: bool = _setting(
        "HOROVOD_TORCH_CPU_PLANE", False,
        "Run CPU torch tensors through the device plane on torch.distributed Gloo (the CPU twin of "
        "the GPU path, for testing it without a GPU) instead of the host NumPy path.", parse_bool)
    mpi_threads_disable: bool = _setting(
        "HOROVOD_MPI_THREADS_DISABLE", False,
        "Ask MPI for MPI_THREAD_SINGLE instead of MPI_THREAD_MULTIPLE.", parse_bool)
    dynamic_process_sets: bool = _setting(
        "HOROVOD_DYNAMIC_PROCESS_SETS", False,
        "Allow add_process_set()/remove_process_set() after init.", parse_bool)
    hierarchical_allreduce: bool = _setting(
        "HOROVOD_HIERARCHICAL_ALLREDUCE", False,
        "Allreduce hierarchically: reduce within each host, allreduce across hosts among one rank "
        "per host, broadcast within the host.", parse_bool)
    hierarchical_allgather: bool = _setting(
        "HOROVOD_HIERARCHICAL_ALLGATHER", False,
        "Allgather hierarchically: gather within each host, allgather across hosts among one rank "
        "per host, broadcast within the host.", parse_bool)
    disable_group_fusion: bool = _setting(
        "HOROVOD_DISABLE_GROUP_FUSION", False,
        "Do not fuse grouped operations with other tensors.", parse_bool)
    elastic: bool = _setting("HOROVOD_ELASTIC", False, "This worker belongs to an elastic job.", parse_bool)
    gloo_timeout_seconds: float = _setting(
        "HOROVOD_GLOO_TIMEOUT_SECONDS", 30.0, "Timeout of Gloo rendezvous and operations.",
        _parse_float, minimum=0)
    gloo_pipeline: int = _setting(
        "HOROVOD_GLOO_PIPELINE", 2,
        "Gloo reductions of one batch kept in flight at once: the next piece is packed (and the last "
        "one unpacked) while Gloo's threads move the others (0 or 1: one at a time).", _parse_int,
        minimum=0)
    gloo_carry_bytes: int = _setting(
        "HOROVOD_GLOO_CARRY_BYTES", 64 * 1024,
        "On Gloo, the most bytes of small cached allreduces carried with a round's negotiation: "
        "each rank sends its ready tensors' data with its cache bits in one exchange, and every "
        "operation all ranks had ready is reduced from it with no Gloo call of its own (0: off).",
        _parse_int, minimum=0)
    autotune: bool = _setting(
        "HOROVOD_AUTOTUNE", False,
        "Tune the speed knobs at run time (fusion threshold, piece size, cycle time, response cache, "
        "hierarchical collectives) by Bayesian optimisation, then keep the best (docs/autotune.md).",
        parse_bool)
    autotune_log: str = _setting(
        "HOROVOD_AUTOTUNE_LOG", "", "CSV file (written by rank 0) of every autotune sample and, last, "
        "the best parameters.", _parse_str)
    autotune_warmup_samples: int = _setting(
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", 3, "Autotune samples discarded at the start.", _parse_int, minimum=0)
    autotune_steps_per_sample: int = _setting(
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", 10, "Training steps measured per autotune sample.",
        _parse_int, minimum=1)
    autotune_bayes_opt_max_samples: int = _setting(
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", 20, "Samples of the Bayesian optimisation before the "
        "best is kept.", _parse_int, minimum=1)
    autotune_gaussian_process_noise: float = _setting(
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", 0.8, "Noise of the autotuner's Gaussian process "
        "(0-1, relative to the scores' spread).", _parse_float, minimum=0)

    def __post_init__(self) -> None:
        if 0 < self.stall_shutdown_time_seconds < self.stall_check_time_seconds:
            # Upstream logs a warning and disables the shutdown in this case; so do we.
            object.__setattr__(self, "stall_shutdown_time_seconds", 0.0)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EngineConfig:
        """Read every setting from ``environ`` (default ``os.environ``).

        Raises:
            ConfigError: a variable has a value of the wrong type or out of range.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            meta = f.metadata
            raw = environ.get(meta["env"])
            if raw is None:
                continue
            try:
                value = meta["parse"](raw)
            except ValueError as exc:
                kind = _UNITS.get(type(f.default), "a valid value")
                raise ConfigError(
                    f"{meta['env']}={raw!r} is not {kind}: {exc}. {meta['help']}",
                    variable=meta["env"], value=raw) from exc
            if meta["minimum"] is not None and value < meta["minimum"]:
                raise ConfigError(
                    f"{meta['env']}={raw!r} must be >= {meta['minimum']:g}. {meta['help']}",
                    variable=meta["env"], value=raw)
            if meta["choices"] is not None and value not in meta["choices"]:
                allowed = ", ".join(c for c in meta["choices"] if c)
                raise ConfigError(f"{meta['env']}={raw!r} is not supported; use one of: {allowed}.",
                                  variable=meta["env"], value=raw)
            values[f.name] = value
        return cls(**values)
