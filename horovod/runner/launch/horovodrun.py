"""``horovodrun``: check, plan, then start a job with mpirun or the built-in Gloo launcher.

``launch(settings)`` is shared by the command line (``run_commandline``) and ``horovod.run()``:

1. hosts from ``-H``/``--hostfile`` (default ``localhost:<np>``), and the slot check;
2. the mode: ``--mpi``/``--gloo``, else MPI when an ``mpirun`` is found, else Gloo;
3. checks before anything starts: each remote host answers ssh (its error is shown), and the
   program exists (locally and on every remote host);
4. the plan (``plan.py``) and the commands (``local.py``, ``ssh.py``, ``mpirun.py``); ``--dry-run``
   prints them and stops;
5. execution, one ``StaticSession`` (``static_session.py``) around the ``Supervisor``
   (``supervisor.py``): live ``[rank]<stdout>:`` output, everything stopped on the first failure,
   and a per-rank report (``horovod.runner.failures``); an elastic job runs in ``elastic.py``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from horovod.common import exceptions as errors
from horovod.common import protocol
from horovod.runner.hosts import resolve_hosts
from horovod.runner.job_outcome import JobOutcome
from horovod.runner.launch.commands import Command
from horovod.runner.launch.plan import LaunchPlan, build_plan, format_plan
from horovod.runner.launch.static_session import StaticSession
from horovod.runner.launch.supervisor import Supervisor
from horovod.runner.settings import LaunchSettings

__all__ = ["run_commandline", "main", "launch", "resolve_hosts", "choose_mode", "check_build_text"]

log = logging.getLogger("horovod.runner")


def choose_mode(settings: LaunchSettings, environ: Mapping[str, str]) -> str:
    """``"mpi"`` or ``"gloo"``: the explicit choice, else MPI when mpirun exists, else Gloo."""
    from horovod.runner.launch.mpirun import find_mpirun

    if settings.controller:
        return settings.controller
    return "mpi" if find_mpirun(environ) is not None else "gloo"


def _check_torch() -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise errors.LaunchError("Gloo mode (--gloo) runs collectives on torch.distributed, but PyTorch is "
                          "not installed for this Python. Install it (pip install 'horovod-py[torch]')"
                          " or use MPI (horovodrun --mpi).")


def _check_program(plan: LaunchPlan, settings: LaunchSettings, env_path: str | None) -> None:
    program = plan.command[0]
    if os.sep in program:
        if plan.all_local or plan.mode == "mpi":
            if not (os.path.isfile(program) and os.access(program, os.X_OK)):
                raise errors.LaunchError(
                    f"Cannot run {program!r}: no such executable file. Check the path of the command "
                    "after the horovodrun options.", program=program)
        return
    if any(r.local for r in plan.ranks) or plan.mode == "mpi":
        if shutil.which(program, path=env_path) is None:
            raise errors.LaunchError(f"Cannot run {program!r}: not found on PATH. Install it or give its "
                              "full path.", program=program)


def _check_remote(plan: LaunchPlan, settings: LaunchSettings, env_path: str | None) -> None:
    remote = plan.remote_hosts
    if not remote:
        return
    from horovod.runner.launch.ssh import check_hosts

    if shutil.which("ssh") is None:
        raise errors.LaunchError(
            f"Host(s) {', '.join(remote)} are remote, but the ssh client is not installed here "
            "(apt-get install openssh-client).", hosts=remote)
    log.info("checking ssh to remote hosts: %s", ", ".join(remote))
    results = check_hosts(remote, settings, program=plan.command[0], path=env_path,
                          timeout=settings.start_timeout)
    bad = [r for r in results if not r.ok]
    if bad:
        details = "\n".join(f"  {r.host}: {r.message}" for r in bad)
        raise errors.LaunchError(
            f"Could not connect to {len(bad)} host(s) via ssh:\n{details}\nEvery host must accept "
            "passwordless ssh from this one (check the host name, -p/--ssh-port and "
            "-i/--ssh-identity-file), or raise --start-timeout.", hosts=[r.host for r in bad])
    missing = [r.host for r in results if not r.program_found]
    if missing:
        raise errors.LaunchError(f"Cannot run {plan.command[0]!r} on host(s) {', '.join(missing)}: not found "
                          "on PATH there.", hosts=missing, program=plan.command[0])


def _rendezvous_address(settings: LaunchSettings, plan_hosts: list[str], all_local: bool,
                        ) -> tuple[str, str]:
    """(bind address, address the workers use) for the rendezvous service."""
    from horovod.runner.network import interface_address, route_address

    if all_local:
        return "127.0.0.1", "127.0.0.1"
    if settings.nics and "/" not in settings.nics[0]:
        addr = interface_address(settings.nics[0])
        return addr, addr
    return "0.0.0.0", route_address(plan_hosts[0])


def launch(settings: LaunchSettings, *, environ: Mapping[str, str] | None = None,
           stdout: IO[str] | None = None, stderr: IO[str] | None = None,
           line_hook: Callable[[int | None, str, str], None] | None = None,
           secret: str | None = None,
           call: protocol.FunctionCall | None = None) -> JobOutcome | str:
    """Check, plan and run one job; returns its outcome, or the plan text for ``--dry-run``.

    ``call``: the function every rank's ``run_task`` runs (``horovod.run``), published on the job's
    rendezvous service; its ranks' results come back in ``JobOutcome.outcomes``.

    Raises:
        ConfigError: bad hosts, ``-np``, options.
        LaunchError: a pre-launch check failed.
        BackendUnavailableError: ``--mpi`` without an MPI.
    """
    environ = dict(os.environ if environ is None else environ)
    if settings.elastic:
        return _launch_elastic(settings, environ, stdout, stderr, secret, call)
    return _launch_static(settings, environ, stdout, stderr, line_hook, secret, call)


def _launch_static(settings: LaunchSettings, environ: dict[str, str], stdout: IO[str] | None,
                   stderr: IO[str] | None, line_hook: Callable[[int | None, str, str], None] | None,
                   secret: str | None, call: protocol.FunctionCall | None,
                   ) -> JobOutcome | str:
    hosts = resolve_hosts(settings)
    mode = choose_mode(settings, environ)
    from horovod.runner.network import is_local_host

    local = {h.name for h in hosts if is_local_host(h.name)}
    # A throwaway plan without rendezvous first: it does the slot check and tells which hosts
    # are remote, before anything is started.
    plan = build_plan(settings, hosts, environ, local, "mpi")
    env_path = {**environ, **plan.job_env}.get("PATH")
    if mode == "gloo":
        _check_torch()
    impl = None
    if mode == "mpi":
        from horovod.runner.launch.mpirun import default_cache_dir, detect_mpi

        impl = detect_mpi(environ, None if settings.disable_cache else default_cache_dir())
    if settings.dry_run:
        rdv = ("<launcher address>", "<port chosen at start>") if mode == "gloo" else None
        plan = build_plan(settings, hosts, environ, local, mode, rdv)
        cmds = _commands(plan, settings, environ, impl, "<secret>" if mode == "gloo" else secret)
        return format_plan(plan, [c.text() for c in cmds])

    _check_program(plan, settings, env_path)
    _check_remote(plan, settings, env_path)

    server = None
    need_server = mode == "gloo" or secret is not None
    monitor = None
    if settings.monitor_port is not None:  # before any rank starts: a port in use fails here
        from horovod.runner.monitor import start_monitor
        from horovod.runner.rendezvous import make_secret

        secret = secret or make_secret()  # reports are signed with the job secret
        monitor = start_monitor(secret, settings.monitor_port, settings.monitor_address, plan.np,
                                {r.slot.rank: (r.slot.hostname, r.slot.local_rank) for r in plan.ranks})
        if plan.remote_hosts and monitor.read_token is None:
            log.warning("the monitor listens on %s only: ranks on %s cannot report to it (set "
                        "--monitor-address to an address they reach)", monitor.address,
                        ", ".join(plan.remote_hosts))
    if need_server:
        from horovod.runner.rendezvous import RendezvousServer, make_secret

        secret = secret or make_secret()
        bind, advertised = _rendezvous_address(settings, plan.remote_hosts, plan.all_local)
        try:
            server = RendezvousServer(secret, host=bind)
        except BaseException:
            if monitor is not None:
                monitor.stop()
            raise
        rdv_addr = (advertised, str(server.port))
    result = None
    try:
        if mode == "gloo":
            plan = build_plan(settings, hosts, environ, local, mode, rdv_addr)
        if server is not None:
            # Where run_task workers of horovod.run() find the launcher, in both modes (the
            # HOROVOD_GLOO_* names would make an MPI worker's hvd.init() choose Gloo).
            plan.job_env.update({protocol.RUNNER_ADDR_ENV: rdv_addr[0],
                                 protocol.RUNNER_PORT_ENV: rdv_addr[1]})
        if monitor is not None:
            from horovod.runner.monitor import worker_env

            plan.job_env.update(worker_env(monitor, _rendezvous_address(
                settings, plan.remote_hosts, plan.all_local)[1]))
        # The session publishes the function before any rank starts, and collects the ranks'
        # results from the service before it is stopped (below).
        session = StaticSession(plan.np, "horovodrun", service=server, call=call, own_service=False)
        cmds = _commands(plan, settings, environ, impl, secret)
        for c in cmds:
            log.info("%s", c.text() if c.tagged else f"rank {c.ranks[0]} on {c.host}: {c.text()}")

        def supervised() -> JobOutcome:
            return session.run(Supervisor(
                cmds, plan.np, hosts_by_rank={r.slot.rank: r.slot.hostname for r in plan.ranks},
                local_rank_by_rank={r.slot.rank: r.slot.local_rank for r in plan.ranks},
                timestamp=settings.prefix_timestamp,
                output_dir=settings.output_filename if mode == "gloo" else None,
                stdout=stdout, stderr=stderr, line_hook=line_hook).run)

        result = supervised()
        starts = _MPIRUN_STARTS if mode == "mpi" else 1
        for attempt in range(2, starts + 1):
            if not _mpirun_failed_to_start(result):
                break
            log.warning("mpirun failed before starting any rank (Open MPI's launcher could not "
                        "start; nothing of the job ran): starting it again (%d of %d)",
                        attempt, starts)
            result = supervised()
        return result
    finally:
        if server is not None:
            server.stop()
        if monitor is not None:
            _end_monitor(monitor, result, settings.monitor_linger)


# How many times horovodrun starts mpirun when it fails before any rank starts (``_mpirun_failed_to_start``).
_MPIRUN_STARTS = 3


def _mpirun_failed_to_start(result: JobOutcome) -> bool:
    """Whether mpirun ended the job before starting any rank, for a reason that a new start survives."""
    from horovod.runner.launch.mpirun import failed_to_start

    return (result.returncode != 0 and result.interrupted is None
            and all(e.rank is None for e in result.exits)
            and failed_to_start("\n".join(result.launcher_tail)))


def _end_monitor(monitor: object, result: JobOutcome | None, linger: float) -> None:
    from horovod.runner.monitor import MonitorService, finish

    assert isinstance(monitor, MonitorService)
    finish(monitor, result, linger)


def _launch_elastic(settings: LaunchSettings, environ: dict[str, str], stdout: IO[str] | None,
                    stderr: IO[str] | None, secret: str | None,
                    call: protocol.FunctionCall | None) -> JobOutcome | str:
    """Elastic mode (``--host-discovery-script``, ``--min-np``, ``--max-np``): see runner/elastic."""
    from horovod.runner.launch.elastic import configure_logging, launch_elastic

    _check_torch()
    if settings.dry_run:
        source = settings.host_discovery_script or settings.hosts or settings.hostfile or "localhost"
        return (f"Elastic job: start {settings.np} processes (at least {settings.min_np}, at most "
                f"{settings.max_np or 'all available slots'}) on the hosts of {source}, on Gloo; "
                f"command: {' '.join(settings.command)}")
    configure_logging()
    monitor = None
    if settings.monitor_port is not None:  # before any worker starts: a port in use fails here
        from horovod.runner.monitor import start_monitor
        from horovod.runner.rendezvous import make_secret

        secret = secret or make_secret()
        monitor = start_monitor(secret, settings.monitor_port, settings.monitor_address, settings.np or 0)
    result = None
    try:
        result = launch_elastic(settings, environ=environ, stdout=stdout, stderr=stderr,
                                secret=secret, call=call, monitor=monitor)
        return result
    finally:
        if monitor is not None:
            _end_monitor(monitor, result, settings.monitor_linger)


def _commands(plan: LaunchPlan, settings: LaunchSettings, environ: Mapping[str, str], impl: object,
              secret: str | None) -> list[Command]:
    if plan.mode == "mpi":
        from horovod.runner.launch.mpirun import MpiImplementation, mpirun_command

        assert isinstance(impl, MpiImplementation)
        return [mpirun_command(plan, settings, impl, environ, secret=secret)]
    from horovod.runner.launch.local import local_command
    from horovod.runner.launch.ssh import ssh_command

    return [local_command(plan, r, environ, secret) if r.local else ssh_command(plan, r, settings, secret)
            for r in plan.ranks]


def check_build_text() -> str:
    """What ``horovodrun --check-build`` prints (upstream's checkbox layout)."""
    import importlib.util

    from horovod._version import __version__

    def has(mod: str) -> bool:
        try:
            return importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            return False

    from horovod.runner.launch.mpirun import find_mpirun

    mpi = has("mpi4py") and find_mpirun() is not None
    gloo = has("torch")
    nccl = False
    if gloo:
        # Only importing torch can tell whether it has CUDA and NCCL (a second or two).
        try:
            import torch

            nccl = bool(torch.cuda.is_available() and torch.distributed.is_nccl_available())
        except Exception:  # noqa: BLE001 - a broken torch shows as no NCCL
            nccl = False

    def box(flag: bool) -> str:
        return "[X]" if flag else "[ ]"

    lines = [f"Horovod v{__version__}:", "", "Available Frameworks:",
             f"    {box(has('tensorflow'))} TensorFlow", f"    {box(gloo)} PyTorch",
             f"    {box(has('jax'))} JAX", "", "Available Controllers:",
             f"    {box(mpi)} MPI", f"    {box(gloo)} Gloo", "", "Available Tensor Operations:",
             f"    {box(nccl)} NCCL", f"    {box(False)} DDL", f"    {box(False)} CCL",
             f"    {box(mpi)} MPI", f"    {box(gloo)} Gloo"]
    return "\n".join(lines)


def _configure_logging(settings: LaunchSettings) -> None:
    level = logging.INFO if settings.verbose else logging.WARNING
    if settings.log_level:
        level = min(level, getattr(logging, {"TRACE": "DEBUG", "FATAL": "CRITICAL"}.get(
            settings.log_level, settings.log_level), logging.WARNING))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("horovodrun: %(message)s"))
    root = logging.getLogger("horovod.runner")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``horovodrun`` with ``argv``; return the exit status.

    A SIGINT ends the job (the supervisor passes it on) and then a monitor's linger, also when
    horovodrun was started with SIGINT ignored (a background job of a script: ``cmd &`` in a
    shell without job control, which is how test runners and CI start it): Python then keeps
    the inherited ``SIG_IGN``, and a Ctrl-C or ``kill -INT`` after the job's end was lost, the
    monitor kept up for its whole ``--monitor-linger``. The inherited disposition is restored on
    return."""
    inherited = None
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _main(argv)
    finally:
        if inherited is not None:
            signal.signal(signal.SIGINT, inherited)


def _main(argv: Sequence[str] | None) -> int:
    from horovod.runner.cli import parse_args, settings_from_args

    args = parse_args(argv)
    if getattr(args, "version", False):
        from horovod._version import __version__

        print(__version__)
        return 0
    if getattr(args, "check_build", False):
        print(check_build_text())
        return 0
    try:
        settings = settings_from_args(args)
        _configure_logging(settings)
        result = launch(settings)
    except KeyboardInterrupt:
        # A Ctrl-C while no supervisor held the signal (before any rank started, or while the
        # ended job was collected): a line instead of a traceback, and no monitor left lingering.
        _stop_monitors()
        print("horovodrun: interrupted", file=sys.stderr)
        return 128 + int(signal.SIGINT)
    except Exception as exc:  # noqa: BLE001 - our errors become a message, the rest propagates
        if not isinstance(exc, (errors.ConfigError, errors.LaunchError, errors.BackendUnavailableError)):
            raise
        print(f"horovodrun: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, errors.ConfigError) else 1
    if isinstance(result, str):
        print(result)
        return 0
    interrupted = False
    try:
        if result.returncode != 0:
            print(result.report(), file=sys.stderr)
    except KeyboardInterrupt:  # the job had ended; the monitor does not linger after a Ctrl-C
        interrupted = True
    if settings.monitor_port is not None:
        if interrupted:
            _stop_monitors()
        else:
            from horovod.runner.monitor import linger

            linger()
    return result.returncode or (128 + int(signal.SIGINT) if interrupted else 0)


def _stop_monitors() -> None:
    """Stop the monitors of ended jobs now (those ``--monitor-linger`` would keep up)."""
    monitor = sys.modules.get("horovod.runner.monitor")
    if monitor is not None:
        monitor.stop_lingering()


def run_commandline() -> None:
    """Entry point of the ``horovodrun`` console script."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    run_commandline()
