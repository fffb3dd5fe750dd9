"""Launcher settings, and the table of tunables that become worker environment variables.

``LaunchSettings`` is what both entry points produce: ``horovodrun`` (``cli.py``) and
``horovod.run()`` (``api.py``). Tunables (``--fusion-threshold-mb`` ...) are kept as the
environment they become for the workers (API.md 6.3); a tunable that was not given writes nothing,
so a ``HOROVOD_*`` variable already in the environment, or the worker's default, applies.

Precedence, highest first: an explicit ``horovod.run()`` argument or command-line flag, then the
``--config-file``, then ``HOROVOD_*`` variables already in the environment, then the defaults.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from horovod.common import exceptions as errors

__all__ = ["LaunchSettings", "Tunable", "TUNABLES", "tunables_to_env", "engine_help",
           "default_start_timeout"]


def _engine_meta() -> dict[str, Mapping[str, Any]]:
    from horovod.common.config import EngineConfig

    return {f.metadata["env"]: f.metadata for f in dataclasses.fields(EngineConfig)}


def engine_help(env: str, fallback: str) -> str:
    """The worker-side help text of ``env`` from ``EngineConfig``, else ``fallback``."""
    meta = _engine_meta().get(env)
    return str(meta["help"]) if meta else fallback


def _flag(value: Any) -> str:
    return "1" if value else "0"


@dataclass(frozen=True)
class Tunable:
    """One command-line tunable: its flag, value type, and the worker variable it sets."""

    dest: str
    flags: tuple[str, ...]
    kind: str  # "int", "float", "str", "bool" (with a --no- twin), "store_true"
    env: str
    help: str
    to_env: Callable[[Any], str] = str
    minimum: float | None = 0
    maximum: float | None = None
    group: str = "tunables"


_MIB = 1024 * 1024

TUNABLES: tuple[Tunable, ...] = (
    Tunable("fusion_threshold_mb", ("--fusion-threshold-mb",), "float", "HOROVOD_FUSION_THRESHOLD",
            "Fusion buffer size in MB (default 128; 0 disables fusion).",
            lambda v: str(int(float(v) * _MIB))),
    Tunable("cycle_time_ms", ("--cycle-time-ms",), "float", "HOROVOD_CYCLE_TIME", ""),
    Tunable("cache_capacity", ("--cache-capacity",), "int", "HOROVOD_CACHE_CAPACITY", ""),
    Tunable("hierarchical_allreduce", ("--hierarchical-allreduce",), "bool",
            "HOROVOD_HIERARCHICAL_ALLREDUCE", "", _flag),
    Tunable("hierarchical_allgather", ("--hierarchical-allgather",), "bool",
            "HOROVOD_HIERARCHICAL_ALLGATHER", "", _flag),
    Tunable("torus_allreduce", ("--torus-allreduce",), "bool", "HOROVOD_TORUS_ALLREDUCE",
            "2-D torus allreduce (accepted for compatibility).", _flag),
    Tunable("autotune", ("--autotune",), "bool", "HOROVOD_AUTOTUNE", "", _flag, group="autotune"),
    Tunable("autotune_log_file", ("--autotune-log-file",), "str", "HOROVOD_AUTOTUNE_LOG",
            "CSV log of the autotuner's samples.", group="autotune", minimum=None),
    Tunable("autotune_warmup_samples", ("--autotune-warmup-samples",), "int",
            "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "Samples discarded at the start (default 3).",
            group="autotune"),
    Tunable("autotune_steps_per_sample", ("--autotune-steps-per-sample",), "int",
            "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "Steps per sample (default 10).", group="autotune"),
    Tunable("autotune_bayes_opt_max_samples", ("--autotune-bayes-opt-max-samples",), "int",
            "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "Bayesian optimisation samples (default 20).",
            group="autotune"),
    Tunable("autotune_gaussian_process_noise", ("--autotune-gaussian-process-noise",), "float",
            "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "Noise of the Gaussian process, in [0, 1] "
            "(default 0.8).", maximum=1.0, group="autotune"),
    Tunable("timeline_filename", ("--timeline-filename",), "str", "HOROVOD_TIMELINE", "",
            minimum=None, group="timeline"),
    Tunable("timeline_mark_cycles", ("--timeline-mark-cycles",), "bool",
            "HOROVOD_TIMELINE_MARK_CYCLES", "", _flag, group="timeline"),
    Tunable("no_stall_check", ("--no-stall-check",), "store_true", "HOROVOD_STALL_CHECK_DISABLE",
            "Disable the stall check.", _flag, group="stall check"),
    Tunable("stall_check_warning_time_seconds", ("--stall-check-warning-time-seconds",), "float",
            "HOROVOD_STALL_CHECK_TIME_SECONDS", "", group="stall check"),
    Tunable("stall_check_shutdown_time_seconds", ("--stall-check-shutdown-time-seconds",), "float",
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "", group="stall check"),
    Tunable("mpi_threads_disable", ("--mpi-threads-disable",), "bool", "HOROVOD_MPI_THREADS_DISABLE",
            "", _flag, group="library"),
    Tunable("num_nccl_streams", ("--num-nccl-streams",), "int", "HOROVOD_NUM_NCCL_STREAMS",
            "NCCL streams per device (default 1).", group="library"),
    Tunable("thread_affinity", ("--thread-affinity",), "int", "HOROVOD_THREAD_AFFINITY",
            "Core to pin the background thread to.", group="library"),
    Tunable("gloo_timeout_seconds", ("--gloo-timeout-seconds",), "float", "HOROVOD_GLOO_TIMEOUT_SECONDS",
            "", group="library"),
    Tunable("log_level", ("--log-level",), "choice", "HOROVOD_LOG_LEVEL",
            "Log level of the workers and the launcher.", lambda v: str(v).upper(), minimum=None,
            group="logging"),
    Tunable("log_without_timestamp", ("--log-without-timestamp", "--log-hide-timestamp"), "store_true",
            "HOROVOD_LOG_HIDE_TIME", "Leave timestamps out of the workers' log lines.", _flag,
            group="logging"),
)

TUNABLES_BY_DEST = {t.dest: t for t in TUNABLES}
LOG_LEVEL_CHOICES = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


def validate_tunable(t: Tunable, value: Any) -> Any:
    """Convert and range-check one tunable value.

    Raises:
        ConfigError: the value has the wrong type or is out of range (message names the option).
    """
    name = t.flags[0].lstrip("-").replace("-", "_")
    try:
        if t.kind == "int":
            value = int(value)
        elif t.kind == "float":
            value = float(value)
        elif t.kind in ("bool", "store_true"):
            if isinstance(value, str):
                from horovod.common.config import parse_bool

                value = parse_bool(value)
            value = bool(value)
        elif t.kind == "choice":
            value = str(value).upper()
            if value not in LOG_LEVEL_CHOICES:
                raise ValueError(f"must be one of {', '.join(LOG_LEVEL_CHOICES)}")
        else:
            value = str(value)
    except (TypeError, ValueError) as exc:
        raise errors.ConfigError(f"{name}={value!r} is invalid: {exc}", option=name, value=value) from exc
    if t.minimum is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < t.minimum:
            raise errors.ConfigError(f"{name}={value} must be >= {t.minimum:g}", option=name, value=value)
        if t.maximum is not None and value > t.maximum:
            raise errors.ConfigError(f"{name}={value} must be in [{t.minimum:g}, {t.maximum:g}]",
                              option=name, value=value)
    return value


def tunables_to_env(values: Mapping[str, Any], tcp: bool = False) -> dict[str, str]:
    """Map given tunables (dest -> value; absent = not given) to worker variables (API.md 6.3)."""
    env: dict[str, str] = {}
    autotune_on = bool(values.get("autotune"))
    timeline_on = bool(values.get("timeline_filename"))
    for t in TUNABLES:
        if t.dest not in values or values[t.dest] is None:
            continue
        value = validate_tunable(t, values[t.dest])
        if t.group == "autotune" and not autotune_on:
            continue
        if t.group == "timeline" and not timeline_on:
            continue
        if t.kind == "store_true" and not value:
            continue
        env[t.env] = t.to_env(value)
    if tcp:
        env["NCCL_IB_DISABLE"] = "1"
    return env


def default_start_timeout(environ: Mapping[str, str] | None = None) -> float:
    environ = os.environ if environ is None else environ
    raw = environ.get("HOROVOD_START_TIMEOUT", "30")
    try:
        return float(raw)
    except ValueError as exc:
        raise errors.ConfigError(f"HOROVOD_START_TIMEOUT={raw!r} is not a number of seconds.",
                          variable="HOROVOD_START_TIMEOUT", value=raw) from exc


@dataclass
class LaunchSettings:
    """Everything the launcher needs to plan and start one job."""

    command: list[str] = field(default_factory=list)
    np: int | None = None
    hosts: str | None = None
    hostfile: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    # ssh's StrictHostKeyChecking: "accept-new" (default), "yes" or "no" (launch/ssh.py)
    ssh_strict_host_key_checking: str | None = None
    nics: list[str] = field(default_factory=list)
    start_timeout: float = 30.0
    verbose: int = 0
    output_filename: str | None = None
    disable_cache: bool = False
    controller: str | None = None  # "mpi" | "gloo" | None (auto)
    mpi_args: str | None = None
    tcp: bool = False
    binding_args: str | None = None
    prefix_timestamp: bool = False
    # -x NAME[=VALUE]: None forwards the launcher's own value of NAME.
    extra_env: dict[str, str | None] = field(default_factory=dict)
    tunable_env: dict[str, str] = field(default_factory=dict)
    log_level: str | None = None
    dry_run: bool = False
    # Elastic mode (chosen by any of these; see horovod/runner/elastic/).
    min_np: int | None = None
    max_np: int | None = None
    host_discovery_script: str | None = None
    slots_per_host: int | None = None
    elastic_timeout: float | None = None
    reset_limit: int | None = None
    blacklist_cooldown_range: tuple[float, float] | None = None
    # The monitor service (--monitor-port; see horovod/runner/monitor): None is off, 0 any port.
    monitor_port: int | None = None
    monitor_address: str | None = None
    monitor_linger: float = 0.0

    @property
    def elastic(self) -> bool:
        """Elastic mode: a discovery script, --min-np or --max-np was given."""
        return (self.host_discovery_script is not None or self.min_np is not None
                or self.max_np is not None)

    def __post_init__(self) -> None:
        if self.controller is not None:
            self.controller = self.controller.lower()
            if self.controller not in ("mpi", "gloo"):
                raise errors.ConfigError(f"No such controller supported: {self.controller!r}; use 'mpi' or "
                                  "'gloo'.", controller=self.controller)
        if self.hosts and self.hostfile:
            raise errors.ConfigError("Give either -H/--hosts or --hostfile, not both.")
        if self.monitor_port is not None and not 0 <= self.monitor_port <= 65535:
            raise errors.ConfigError(f"--monitor-port {self.monitor_port}: a TCP port is 0 (any free "
                                     "port) to 65535.", port=self.monitor_port)
        if self.monitor_linger < 0:
            raise errors.ConfigError(f"--monitor-linger {self.monitor_linger} must be >= 0 seconds.")
        if self.start_timeout <= 0:
            raise errors.ConfigError(f"--start-timeout {self.start_timeout} must be > 0 seconds.")
        if self.elastic:
            self._check_elastic()

    def _check_elastic(self) -> None:
        if self.controller == "mpi":
            raise errors.ConfigError("Elastic training (--host-discovery-script, --min-np, --max-np) "
                                     "runs on Gloo; drop --mpi.")
        self.controller = "gloo"
        if self.host_discovery_script and (self.hosts or self.hostfile):
            raise errors.ConfigError("Give either --host-discovery-script or -H/--hostfile, not both.")
        if self.np is None:
            self.np = self.min_np
        if self.np is None:
            raise errors.ConfigError("Elastic mode needs -np (the number of processes to start "
                                     "with), e.g. -np 4 --min-np 2 --max-np 8.")
        if self.min_np is None:
            self.min_np = self.np
        for name, value in (("-np", self.np), ("--min-np", self.min_np), ("--max-np", self.max_np),
                            ("--slots-per-host", self.slots_per_host)):
            if value is not None and value < 1:
                raise errors.ConfigError(f"{name} {value} must be at least 1.")
        if self.min_np > self.np:
            raise errors.ConfigError(f"--min-np {self.min_np} is larger than -np {self.np}.")
        if self.max_np is not None and self.max_np < self.np:
            raise errors.ConfigError(f"--max-np {self.max_np} is smaller than -np {self.np}.")
        if self.elastic_timeout is not None and self.elastic_timeout <= 0:
            raise errors.ConfigError(f"--elastic-timeout {self.elastic_timeout} must be > 0 s.")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise errors.ConfigError(f"--reset-limit {self.reset_limit} must be >= 0.")
        if self.blacklist_cooldown_range is not None:
            lo, hi = (float(v) for v in self.blacklist_cooldown_range)
            if lo < 1 or hi > 3600 or lo > hi:
                raise errors.ConfigError(
                    f"--blacklist-cooldown-range {lo:g} {hi:g}: need 1 <= MIN <= MAX <= 3600 "
                    "seconds.")
            self.blacklist_cooldown_range = (lo, hi)
