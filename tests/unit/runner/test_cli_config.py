"""Command line, config file and environment precedence (table-driven)."""

from __future__ import annotations

from pathlib import Path

import pytest

from horovod.common.exceptions import ConfigError
from horovod.runner.cli import parse_args, settings_from_args


def settings(argv: list[str], env: dict[str, str] | None = None):
    return settings_from_args(parse_args(argv), environ=env or {})


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "hvd.yaml"
    p.write_text(text)
    return str(p)


CONFIG = """
controller: gloo
params:
  fusion_threshold_mb: 32
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: false
autotune:
  enabled: true
  warmup_samples: 5
timeline:
  filename: /tmp/tl.json
  mark_cycles: true
stall_check:
  enabled: false
  warning_time_seconds: 120
library_options:
  gloo_timeout_seconds: 45
logging:
  level: debug
  with_timestamp: false
"""


def test_config_file_values_become_worker_env(tmp_path: Path) -> None:
    s = settings(["-np", "2", "--config-file", write(tmp_path, CONFIG), "python", "x.py"])
    assert s.controller == "gloo"
    assert s.tunable_env == {
        "HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "10.0",
        "HOROVOD_CACHE_CAPACITY": "2048", "HOROVOD_HIERARCHICAL_ALLREDUCE": "0",
        "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "5",
        "HOROVOD_TIMELINE": "/tmp/tl.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1",
        "HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "120.0",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "45.0", "HOROVOD_LOG_LEVEL": "DEBUG",
        "HOROVOD_LOG_HIDE_TIME": "1",
    }


@pytest.mark.parametrize("flags, key, want", [
    # flag given after the config file wins
    (["--config-file", "{cfg}", "--fusion-threshold-mb", "8"], "HOROVOD_FUSION_THRESHOLD",
     str(8 * 1024 * 1024)),
    # ... and before it too: the command line always wins
    (["--cycle-time-ms", "2.5", "--config-file", "{cfg}"], "HOROVOD_CYCLE_TIME", "2.5"),
    (["--config-file", "{cfg}", "--hierarchical-allreduce"], "HOROVOD_HIERARCHICAL_ALLREDUCE", "1"),
    (["--config-file", "{cfg}", "--stall-check"], "HOROVOD_STALL_CHECK_DISABLE", None),
    (["--config-file", "{cfg}", "--no-autotune"], "HOROVOD_AUTOTUNE", None),
    (["--config-file", "{cfg}", "--no-autotune"], "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", None),
    (["--config-file", "{cfg}"], "HOROVOD_CACHE_CAPACITY", "2048"),
    # without a config file or flag nothing is written: the environment or default applies
    ([], "HOROVOD_CACHE_CAPACITY", None),
])
def test_command_line_beats_config_file(tmp_path: Path, flags: list[str], key: str,
                                        want: str | None) -> None:
    cfg = write(tmp_path, CONFIG)
    argv = ["-np", "2"] + [f.replace("{cfg}", cfg) for f in flags] + ["python", "x.py"]
    assert settings(argv).tunable_env.get(key) == want


def test_controller_flag_beats_config_file(tmp_path: Path) -> None:
    s = settings(["-np", "1", "--mpi", "--config-file", write(tmp_path, CONFIG), "true"])
    assert s.controller == "mpi"


@pytest.mark.parametrize("text, culprit", [
    ("params:\n  fusion_threshold: 3\n", "params.fusion_threshold"),
    ("parms:\n  cycle_time_ms: 3\n", "parms"),
    ("controller: nccl\n", "controller"),
])
def test_config_file_unknown_key_is_named(tmp_path: Path, text: str, culprit: str) -> None:
    with pytest.raises(ConfigError) as err:
        settings(["-np", "1", "--config-file", write(tmp_path, text), "true"])
    assert err.value.key == culprit


@pytest.mark.parametrize("argv, fragment", [
    (["--fusion-threshold-mb", "-1"], "fusion_threshold_mb=-1.0 must be >= 0"),
    (["--cache-capacity", "-5"], "cache_capacity=-5 must be >= 0"),
    (["--autotune", "--autotune-gaussian-process-noise", "1.5"], "must be in [0, 1]"),
])
def test_negative_tunables_are_rejected(argv: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        settings(["-np", "1"] + argv + ["true"])
    assert fragment in str(err.value)


def test_flags_map_to_upstream_env_names() -> None:
    s = settings(["-np", "2", "--fusion-threshold-mb", "0", "--cycle-time-ms", "5",
                  "--hierarchical-allgather", "--timeline-filename", "t.json",
                  "--no-stall-check", "--stall-check-shutdown-time-seconds", "90",
                  "--mpi-threads-disable", "--tcp", "--log-level", "info", "--log-without-timestamp",
                  "--autotune-warmup-samples", "9", "python", "train.py", "--lr", "0.1"])
    assert s.tunable_env == {
        "HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": "5.0",
        "HOROVOD_HIERARCHICAL_ALLGATHER": "1", "HOROVOD_TIMELINE": "t.json",
        "HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90.0",
        "HOROVOD_MPI_THREADS_DISABLE": "1", "NCCL_IB_DISABLE": "1", "HOROVOD_LOG_LEVEL": "INFO",
        "HOROVOD_LOG_HIDE_TIME": "1"}  # autotune knobs only count with --autotune
    assert s.command == ["python", "train.py", "--lr", "0.1"]


def test_launcher_options_parse() -> None:
    s = settings(["-np", "4", "-H", "a:2,b:2", "-p", "2222", "-i", "/k", "--network-interfaces",
                  "eth0,eth1", "--network-interface", "ib0", "--start-timeout", "7", "--verbose",
                  "--output-filename", "/o", "--gloo", "-x", "FOO=bar", "-x", "HOME",
                  '--mpi-args=--mca x y', "--binding-args=--bind-to core", "--dry-run",
                  "--", "python", "t.py"])
    assert (s.np, s.hosts, s.ssh_port, s.ssh_identity_file) == (4, "a:2,b:2", 2222, "/k")
    assert s.nics == ["eth0", "eth1", "ib0"] and s.start_timeout == 7.0 and s.verbose == 2
    assert s.extra_env == {"FOO": "bar", "HOME": None}
    assert (s.mpi_args, s.binding_args, s.controller) == ("--mca x y", "--bind-to core", "gloo")
    assert s.dry_run and s.command == ["python", "t.py"] and s.output_filename == "/o"


def test_start_timeout_default_from_env() -> None:
    assert settings(["-np", "1", "true"], env={"HOROVOD_START_TIMEOUT": "12"}).start_timeout == 12.0
    assert settings(["-np", "1", "true"]).start_timeout == 30.0


def test_hosts_and_hostfile_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        parse_args(["-np", "1", "-H", "a:1", "--hostfile", "f", "true"])
