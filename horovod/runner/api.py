"""``horovod.run()``: run a Python function on every rank of a new job and return the results."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

from horovod.common.exceptions import ConfigError
from horovod.runner.settings import LaunchSettings, default_start_timeout

__all__ = ["run"]


def run(func: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
        num_proc: int | None = None, min_num_proc: int | None = None,
        max_num_proc: int | None = None, slots: int | None = None, reset_limit: int | None = None,
        cooldown_range: tuple[int, int] | None = None, hosts: str | None = None,
        hostfile: str | None = None, host_discovery_script: str | None = None,
        start_timeout: float | None = None, ssh_port: int | None = None,
        ssh_identity_file: str | None = None, disable_cache: bool | None = None,
        output_filename: str | None = None, verbose: int | None = None,
        use_gloo: bool | None = None, use_mpi: bool | None = None, mpi_args: str | None = None,
        network_interface: str | None = None, network_interfaces: list[str] | None = None,
        executable: str | None = None, np: int | None = None, min_np: int | None = None,
        max_np: int | None = None, prefix_output_with_timestamp: bool = False,
        env: dict[str, str] | None = None, monitor_port: int | None = None,
        monitor_address: str | None = None) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on every rank and return the results in rank order.

    The function is shipped with cloudpickle; workers run ``python -m horovod.runner.run_task``
    with ``executable`` (default: this Python). Worker output is printed with ``[rank]<stdout>:``
    prefixes as it happens.

    Args:
        func: the function every rank runs.
        args: its positional arguments.
        kwargs: its keyword arguments.
        num_proc: number of processes (``horovodrun -np``; in elastic mode, the number to start
            with, default ``min_num_proc``).
        min_num_proc: elastic mode's fewest processes to go on with (``--min-np``; this,
            ``max_num_proc`` or ``host_discovery_script`` makes the job elastic, on Gloo).
        max_num_proc: elastic mode's most processes to use (``--max-np``).
        slots: slots per host that the discovery script lists without a count (``--slots-per-host``).
        reset_limit: elastic mode's most resets (re-formations) before the job fails
            (``--reset-limit``).
        cooldown_range: ``(min, max)`` seconds a failed host stays excluded before it may come back,
            growing with its failures (``--blacklist-cooldown-range``); None: never comes back.
        hosts: where the ranks run, ``"host1:2,host2:2"`` (``-H``; default: this host; not with
            ``hostfile``).
        hostfile: a file of ``host slots=N`` lines (``--hostfile``; not with ``hosts``).
        host_discovery_script: an executable printing the available ``host:slots`` lines (elastic
            mode; ``--host-discovery-script``).
        start_timeout: seconds for every rank to start and meet (``--start-timeout``;
            ``HOROVOD_START_TIMEOUT``, default 30).
        ssh_port: ssh's port on remote hosts (``-p``).
        ssh_identity_file: ssh's key for remote hosts (``-i``).
        disable_cache: detect the MPI implementation on every start instead of using the answer
            cached in ``~/.horovod`` (``--disable-cache``).
        output_filename: a directory where each rank's output is also written,
            ``DIR/rank.<r>/stdout`` and ``stderr`` (``--output-filename``).
        verbose: 1 or more prints the launch command and what the launcher decides (``--verbose``).
        use_gloo: launch with Gloo (``--gloo``; not with ``use_mpi``). Neither: as ``horovodrun``,
            MPI when ``mpirun`` is found, else Gloo.
        use_mpi: launch under ``mpirun`` (``--mpi``; not with ``use_gloo``).
        mpi_args: extra arguments for ``mpirun`` (``--mpi-args``).
        network_interface: the interface the ranks talk over (upstream's comma list of several is
            deprecated: use ``network_interfaces``).
        network_interfaces: the interfaces the ranks talk over (``--network-interfaces``).
        executable: the Python the workers run (default: this one, ``sys.executable``).
        np: deprecated name of ``num_proc``.
        min_np: deprecated name of ``min_num_proc``.
        max_np: deprecated name of ``max_num_proc``.
        prefix_output_with_timestamp: put the time before each output line
            (``--prefix-output-with-timestamp``).
        env: extra variables for every worker (as ``horovodrun -x NAME=VALUE``).
        monitor_port: serve the job's live view on this port from this process while the job runs
            (``horovodrun --monitor-port``; docs/monitor.md; 0: a free port).
        monitor_address: the address the live view listens on (``--monitor-address``; default
            ``127.0.0.1``).

    Returns:
        One return value per rank, indexed by rank.

    Raises:
        ValueError (ConfigError): conflicting or invalid arguments.
        WorkerFailedError: a rank raised (the error names the rank, carries ``rank``, ``host`` and
            ``exception``, and chains the original exception) or a worker died.

    Elastic mode (``min_num_proc``, ``max_num_proc`` or ``host_discovery_script``; Gloo) returns
    the results of the first ``min_num_proc`` ranks of the final round, as upstream does; a failed
    elastic job's ``WorkerFailedError`` says why the job gave up and names the root-cause worker
    (``rank``, ``host``, ``exception``) as a static job's does.
    """
    from horovod.common.protocol import FunctionCall
    from horovod.runner.launch.horovodrun import launch

    if np is not None:
        warnings.warn("np is deprecated, use num_proc", DeprecationWarning, stacklevel=2)
        num_proc = num_proc if num_proc is not None else np
    if min_np is not None or max_np is not None:
        warnings.warn("min_np/max_np are deprecated, use min_num_proc/max_num_proc",
                      DeprecationWarning, stacklevel=2)
        min_num_proc = min_num_proc if min_num_proc is not None else min_np
        max_num_proc = max_num_proc if max_num_proc is not None else max_np
    elastic = any(v is not None for v in (min_num_proc, max_num_proc, host_discovery_script))
    if hosts and hostfile:
        raise ConfigError("Give either hosts or hostfile to horovod.run(), not both.")
    if use_gloo and use_mpi:
        raise ConfigError("Give either use_gloo=True or use_mpi=True to horovod.run(), not both.")
    if num_proc is None and elastic:
        num_proc = min_num_proc
    if num_proc is None:
        raise ConfigError("horovod.run() needs num_proc (the number of processes).")
    nics: list[str] = list(network_interfaces or [])
    if network_interface:
        if "," in network_interface:
            warnings.warn("network_interface with a comma list is deprecated, use "
                          "network_interfaces", DeprecationWarning, stacklevel=2)
        nics += [n.strip() for n in network_interface.split(",") if n.strip()]

    python = executable or sys.executable
    settings = LaunchSettings(
        command=[python, "-m", "horovod.runner.run_task"], np=num_proc, hosts=hosts,
        hostfile=hostfile, ssh_port=ssh_port, ssh_identity_file=ssh_identity_file, nics=nics,
        start_timeout=start_timeout or default_start_timeout(), verbose=int(verbose or 0),
        output_filename=output_filename, disable_cache=bool(disable_cache),
        controller="gloo" if use_gloo else "mpi" if use_mpi else None, mpi_args=mpi_args,
        prefix_timestamp=prefix_output_with_timestamp, extra_env=dict(env or {}),
        min_np=min_num_proc, max_np=max_num_proc, host_discovery_script=host_discovery_script,
        slots_per_host=slots, reset_limit=reset_limit,
        blacklist_cooldown_range=(tuple(cooldown_range)  # type: ignore[arg-type]
                                  if cooldown_range else None),
        monitor_port=monitor_port, monitor_address=monitor_address)

    from horovod.runner.rendezvous import make_secret

    outcome = launch(settings, secret=make_secret(), call=FunctionCall.of(func, args, kwargs))
    assert not isinstance(outcome, str)
    if settings.elastic:
        # Elastic (upstream): the results of the first min_num_proc ranks of the final round.
        num_proc = settings.min_np or num_proc
    return outcome.results("horovod.run", num_proc)
