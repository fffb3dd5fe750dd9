"""The ``horovodrun`` command line and ``--config-file`` (YAML), turned into ``LaunchSettings``.

Flags follow upstream Horovod (API.md 6.1). Flags given on the command line win over the config
file wherever they appear; the config file wins over ``HOROVOD_*`` variables already set.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from horovod.common import exceptions as errors
from horovod.runner.settings import (
    LOG_LEVEL_CHOICES,
    TUNABLES,
    TUNABLES_BY_DEST,
    LaunchSettings,
    default_start_timeout,
    engine_help,
    tunables_to_env,
    validate_tunable,
)

__all__ = ["make_parser", "parse_args", "settings_from_args", "load_config_file", "CONFIG_KEYS"]

# YAML section -> key -> argparse dest (API.md 6.2).
CONFIG_KEYS: dict[str, dict[str, str]] = {
    "params": {
        "fusion_threshold_mb": "fusion_threshold_mb", "cycle_time_ms": "cycle_time_ms",
        "cache_capacity": "cache_capacity", "hierarchical_allreduce": "hierarchical_allreduce",
        "hierarchical_allgather": "hierarchical_allgather", "torus_allreduce": "torus_allreduce",
    },
    "autotune": {
        "enabled": "autotune", "log_file": "autotune_log_file",
        "warmup_samples": "autotune_warmup_samples", "steps_per_sample": "autotune_steps_per_sample",
        "bayes_opt_max_samples": "autotune_bayes_opt_max_samples",
        "gaussian_process_noise": "autotune_gaussian_process_noise",
    },
    "timeline": {"filename": "timeline_filename", "mark_cycles": "timeline_mark_cycles"},
    "stall_check": {
        "enabled": "!no_stall_check", "warning_time_seconds": "stall_check_warning_time_seconds",
        "shutdown_time_seconds": "stall_check_shutdown_time_seconds",
    },
    "library_options": {
        "mpi_threads_disable": "mpi_threads_disable", "num_nccl_streams": "num_nccl_streams",
        "thread_affinity": "thread_affinity", "gloo_timeout_seconds": "gloo_timeout_seconds",
    },
    "logging": {"level": "log_level", "with_timestamp": "!log_without_timestamp",
                "hide_timestamp": "log_without_timestamp"},
}


class _EnvAction(argparse.Action):
    """``-x NAME`` forwards the launcher's NAME; ``-x NAME=VALUE`` sets it for every worker."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        current = dict(getattr(namespace, self.dest, None) or {})
        name, sep, value = str(values).partition("=")
        if not name or not name.replace("_", "a").isalnum() or name[0].isdigit():
            parser.error(f"-x {values!r}: expected NAME or NAME=VALUE with a valid variable name")
        current[name] = value if sep else None
        setattr(namespace, self.dest, current)


_ENGINE_HELP = "@engine:"


class _HelpFormatter(argparse.HelpFormatter):
    """Fill tunables' help from ``EngineConfig`` only when help is shown.

    Reading it at parser construction would import ``horovod.common`` (the engine and NumPy) on
    every ``horovodrun`` start.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text and text.startswith(_ENGINE_HELP):
            env = text[len(_ENGINE_HELP):]
            text = f"{engine_help(env, env)} [{env}]"
        return text


def make_parser() -> argparse.ArgumentParser:
    """Build the ``horovodrun`` argument parser."""
    p = argparse.ArgumentParser(
        prog="horovodrun", description="Horovod runner: start a distributed job.",
        allow_abbrev=False, formatter_class=_HelpFormatter)
    S = argparse.SUPPRESS
    p.add_argument("-v", "--version", action="store_true", default=S, help="Print the version.")
    p.add_argument("-np", "--num-proc", dest="np", type=int, default=S,
                   help="Total number of processes.")
    p.add_argument("-cb", "--check-build", action="store_true", default=S,
                   help="Show which frameworks, controllers and tensor operations are available.")
    p.add_argument("--disable-cache", action="store_true", default=S,
                   help="Detect the MPI implementation on every start instead of using the "
                        "answer cached in ~/.horovod.")
    p.add_argument("--start-timeout", type=float, default=S,
                   help="Seconds allowed for checks and process start (default "
                        "HOROVOD_START_TIMEOUT or 30).")
    p.add_argument("--network-interfaces", dest="nics_csv", default=S,
                   help="Comma-separated network interfaces (or CIDR ranges for MPI) to use.")
    p.add_argument("--network-interface", dest="nics_list", action="append", default=S,
                   help="A network interface to use (repeatable).")
    p.add_argument("--output-filename", default=S,
                   help="Write each rank's output to DIR/rank.<rank>/stdout and stderr as well.")
    p.add_argument("--verbose", action="store_true", default=S, help="Show the commands run.")
    p.add_argument("--config-file", default=S,
                   help="YAML file of tunables; flags given on the command line win.")
    p.add_argument("--dry-run", action="store_true", default=S,
                   help="Print the launch plan (per rank: host, command, environment) and exit.")
    p.add_argument("-x", "--env", dest="extra_env", action=_EnvAction, default=S, metavar="NAME[=VALUE]",
                   help="Forward NAME (or set it to VALUE) in every worker (repeatable).")
    mon = p.add_argument_group("monitor")
    mon.add_argument("--monitor-port", type=int, default=S, metavar="PORT",
                     help="Serve a live view of the job (a page at /, Prometheus metrics at /metrics, "
                          "JSON at /api/job) on this port of the launcher; 0 picks a free port. The "
                          "URL is printed at start.")
    mon.add_argument("--monitor-address", default=S, metavar="ADDR",
                     help="Address the monitor listens on (default 127.0.0.1). On any other address "
                          "reading it needs the token printed with its URL.")
    mon.add_argument("--monitor-linger", type=float, default=S, metavar="SECONDS",
                     help="Keep the monitor up this long after the job ends (to read its last state "
                          "and failure); Ctrl-C ends it sooner.")
    ssh = p.add_argument_group("SSH")
    ssh.add_argument("-p", "--ssh-port", type=int, default=S, help="SSH port of remote hosts.")
    ssh.add_argument("-i", "--ssh-identity-file", default=S, help="SSH identity (private key) file.")
    ssh.add_argument("--ssh-strict-host-key-checking", choices=("accept-new", "yes", "no"), default=S,
                     help="How ssh checks remote hosts' keys (OpenSSH's StrictHostKeyChecking): accept-new "
                          "(default: a host seen for the first time is added to known_hosts, a changed key "
                          "is refused), yes (only hosts already in known_hosts), no (no check). "
                          "[HOROVOD_SSH_STRICT_HOST_KEY_CHECKING]")

    groups: dict[str, argparse._ArgumentGroup] = {}
    for t in TUNABLES:
        g = groups.setdefault(t.group, p.add_argument_group(t.group))
        help_text = f"{t.help} [{t.env}]" if t.help else _ENGINE_HELP + t.env
        if t.kind == "bool":
            g.add_argument(*t.flags, dest=t.dest, action="store_true", default=S, help=help_text)
            g.add_argument(*["--no-" + f[2:] for f in t.flags], dest=t.dest, action="store_false",
                           default=S, help=S)
        elif t.kind == "store_true":
            g.add_argument(*t.flags, dest=t.dest, action="store_true", default=S, help=help_text)
        elif t.kind == "choice":
            g.add_argument(*t.flags, dest=t.dest, choices=LOG_LEVEL_CHOICES, type=str.upper,
                           default=S, help=help_text)
        else:
            conv = {"int": int, "float": float, "str": str}[t.kind]
            g.add_argument(*t.flags, dest=t.dest, type=conv, default=S, help=help_text)
    # Hidden twins that upstream accepts.
    p.add_argument("--stall-check", dest="no_stall_check", action="store_false", default=S, help=S)
    p.add_argument("--log-with-timestamp", dest="log_without_timestamp", action="store_false",
                   default=S, help=S)

    lib = groups["library"]
    lib.add_argument("--mpi-args", default=S, help='Extra mpirun arguments (use --mpi-args="...").')
    lib.add_argument("--tcp", action="store_true", default=S,
                     help="TCP only: sets NCCL_IB_DISABLE=1 in the workers.")
    lib.add_argument("--binding-args", default=S,
                     help='Process binding arguments for mpirun (default: no binding).')
    logg = groups["logging"]
    logg.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", dest="prefix_timestamp",
                      action="store_true", default=S, help="Timestamp every forwarded output line.")

    hosts = p.add_argument_group("hosts").add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", default=S,
                       help="Hosts and slots, e.g. host1:2,host2:4 (default localhost:<np>).")
    hosts.add_argument("-hostfile", "--hostfile", default=S,
                       help="File of '<hostname> slots=<n>' lines.")
    el = p.add_argument_group("elastic")
    el.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, default=S,
                    help="Fewest processes to go on with (default -np); enables elastic mode.")
    el.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, default=S,
                    help="Most processes to use when more slots are available; enables elastic "
                         "mode.")
    el.add_argument("--slots-per-host", dest="slots_per_host", type=int, default=S,
                    help="Slots of a discovered host printed without ':slots'.")
    el.add_argument("--elastic-timeout", type=float, default=S,
                    help="Seconds to wait for enough hosts (default HOROVOD_ELASTIC_TIMEOUT or "
                         "600).")
    el.add_argument("--reset-limit", type=int, default=S,
                    help="Most resets (re-formations after a failure or host change) allowed.")
    el.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("MIN", "MAX"),
                    default=S, help="A failed host may come back after a cooldown between MIN and "
                                    "MAX seconds (default: blacklisted for good).")
    p.add_argument("--host-discovery-script", default=S,
                   help="Executable printing one 'hostname[:slots]' per line; enables elastic "
                        "mode (polled every second).")
    ctrl = p.add_argument_group("controller").add_mutually_exclusive_group()
    ctrl.add_argument("--gloo", dest="controller", action="store_const", const="gloo", default=S,
                      help="Start workers with the built-in launcher and run collectives on Gloo.")
    ctrl.add_argument("--mpi", dest="controller", action="store_const", const="mpi", default=S,
                      help="Start workers with mpirun (the default).")
    p.add_argument("command", nargs=argparse.REMAINDER, help="The command each worker runs.")
    return p


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML config file into argparse dests (API.md 6.2).

    Raises:
        ConfigError: the file cannot be read, is not a mapping, or has an unknown key.
    """
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as exc:
        raise errors.ConfigError(f"--config-file {path}: cannot read it: {exc}", path=path) from exc
    except yaml.YAMLError as exc:
        raise errors.ConfigError(f"--config-file {path}: not valid YAML: {exc}", path=path) from exc
    if not isinstance(data, Mapping):
        raise errors.ConfigError(f"--config-file {path}: expected a mapping of sections, got "
                          f"{type(data).__name__}.", path=path)
    out: dict[str, Any] = {}
    for section, body in data.items():
        if section == "controller":
            out["controller"] = str(body).lower()
            if out["controller"] not in ("mpi", "gloo"):
                raise errors.ConfigError(f"No such controller supported: {body!r} (in {path}); use mpi or "
                                  "gloo.", path=path, key="controller")
            continue
        keys = CONFIG_KEYS.get(section)
        if keys is None:
            raise errors.ConfigError(f"--config-file {path}: unknown section {section!r}; known: controller, "
                              f"{', '.join(CONFIG_KEYS)}.", path=path, key=section)
        if not isinstance(body, Mapping):
            raise errors.ConfigError(f"--config-file {path}: section {section!r} must be a mapping.",
                              path=path, key=section)
        for key, value in body.items():
            dest = keys.get(key)
            if dest is None:
                raise errors.ConfigError(f"--config-file {path}: unknown key {section}.{key}; known: "
                                  f"{', '.join(keys)}.", path=path, key=f"{section}.{key}")
            if dest.startswith("!"):
                dest, value = dest[1:], not value
            out[dest] = value
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; only options actually given appear in the namespace."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if getattr(args, "command", None) and args.command[0] == "--":
        args.command = args.command[1:]
    return args



# LaunchSettings fields taken as given from the merged command line and config file (None: unset).
_AS_GIVEN = (
    "np", "hosts", "hostfile", "ssh_port", "ssh_identity_file", "ssh_strict_host_key_checking",
    "output_filename", "controller", "mpi_args", "binding_args", "min_np", "max_np",
    "host_discovery_script", "slots_per_host", "elastic_timeout", "reset_limit", "monitor_port",
    "monitor_address",
)
# LaunchSettings switches (absent: False).
_FLAGS = ("disable_cache", "tcp", "prefix_timestamp", "dry_run")


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None,
                       ) -> LaunchSettings:
    """Merge command line, config file and environment into ``LaunchSettings``.

    Raises:
        ConfigError: a value is out of range, a config key is unknown, or options conflict.
    """
    given = vars(args)
    merged: dict[str, Any] = {}
    if "config_file" in given:
        merged.update(load_config_file(given["config_file"]))
    merged.update({k: v for k, v in given.items() if k != "config_file"})

    tunable_values = {k: v for k, v in merged.items() if k in TUNABLES_BY_DEST}
    for dest, value in tunable_values.items():
        tunable_values[dest] = validate_tunable(TUNABLES_BY_DEST[dest], value)

    nics: list[str] = []
    if "nics_csv" in merged:
        nics += [n.strip() for n in str(merged["nics_csv"]).split(",") if n.strip()]
    for item in merged.get("nics_list", []) or []:
        nics += [n.strip() for n in str(item).split(",") if n.strip()]

    start_timeout = merged.get("start_timeout")
    if start_timeout is None:
        start_timeout = default_start_timeout(environ)
    as_given: dict[str, Any] = {name: merged.get(name) for name in _AS_GIVEN}
    flags: dict[str, Any] = {name: bool(merged.get(name, False)) for name in _FLAGS}
    return LaunchSettings(
        command=list(merged.get("command") or []),
        nics=nics,
        start_timeout=float(start_timeout),
        verbose=2 if merged.get("verbose") else 0,
        extra_env=dict(merged.get("extra_env") or {}),
        tunable_env=tunables_to_env(tunable_values, tcp=bool(merged.get("tcp", False))),
        log_level=tunable_values.get("log_level"),
        blacklist_cooldown_range=(tuple(merged["blacklist_cooldown_range"])  # type: ignore[arg-type]
                                  if merged.get("blacklist_cooldown_range") else None),
        monitor_linger=float(merged.get("monitor_linger") or 0.0),
        **as_given,
        **flags,
    )
