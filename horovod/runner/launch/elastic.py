"""``horovodrun``'s elastic job: the rendezvous service, the driver's session, and one process per
worker (``horovod.runner.elastic.workers``)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import IO, Any

from horovod.common import protocol
from horovod.runner.elastic.discovery import FixedHosts, HostDiscoveryScript, HostManager
from horovod.runner.elastic.driver import ElasticDriver, ElasticResult, Key, key_name
from horovod.runner.elastic.session import ElasticSession
from horovod.runner.elastic.settings import DriverSettings
from horovod.runner.elastic.workers import WorkerProcess
from horovod.runner.hosts import HostSpec, SlotInfo
from horovod.runner.job_outcome import JobOutcome
from horovod.runner.launch.plan import RankPlan, build_plan
from horovod.runner.settings import LaunchSettings

__all__ = ["launch_elastic", "configure_logging"]

log = logging.getLogger("horovod.runner.elastic")


def _discovery(settings: LaunchSettings) -> HostDiscoveryScript | FixedHosts:
    if settings.host_discovery_script:
        script = os.path.abspath(settings.host_discovery_script)
        from horovod.common import exceptions as errors

        if not (os.path.isfile(script) and os.access(script, os.X_OK)):
            raise errors.ConfigError(f"--host-discovery-script {settings.host_discovery_script}: "
                                     "not an executable file (chmod +x it).")
        return HostDiscoveryScript(script, settings.slots_per_host)
    from horovod.runner.hosts import resolve_hosts

    return FixedHosts({h.name: h.slots for h in resolve_hosts(settings)})


def launch_elastic(settings: LaunchSettings, *, environ: Mapping[str, str] | None = None,
                   stdout: IO[str] | None = None, stderr: IO[str] | None = None,
                   secret: str | None = None, call: protocol.FunctionCall | None = None,
                   discovery_interval: float = 1.0, monitor: Any = None) -> JobOutcome:
    """Run one elastic job to its end (``call``: the function every worker's ``run_task`` runs,
    ``horovod.run``; each stores its result under its slot name, and the final round's results
    come back in ``JobOutcome.outcomes``, by rank, every slot's in ``JobOutcome.workers``).

    Raises:
        ConfigError: bad options or discovery output.
    """
    from horovod.runner.launch.local import local_command
    from horovod.runner.launch.ssh import ssh_command
    from horovod.runner.network import is_local_host, route_address
    from horovod.runner.rendezvous import RendezvousServer, make_secret

    environ = dict(os.environ if environ is None else environ)
    assert settings.np is not None and settings.min_np is not None
    discovery = _discovery(settings)
    manager = HostManager(discovery, settings.blacklist_cooldown_range)
    secret = secret or make_secret()
    # Bind on every interface: hosts found later may be remote; every request is authenticated.
    server = RendezvousServer(secret, host="0.0.0.0")
    port = str(server.port)
    remote_seen: list[str] = []
    local_cache: dict[str, bool] = {}

    def local(host: str) -> bool:
        if host not in local_cache:
            local_cache[host] = is_local_host(host)
            if not local_cache[host]:
                remote_seen.append(host)
        return local_cache[host]

    base_settings = dataclasses.replace(settings, np=1, min_np=None, max_np=None,
                                        host_discovery_script=None, hosts=None, hostfile=None)
    base = build_plan(base_settings, [HostSpec("localhost", 1)], environ, set(), "gloo",
                      ("127.0.0.1", port))
    base.job_env.update({"HOROVOD_RUNNER_ADDR": "127.0.0.1", "HOROVOD_RUNNER_PORT": port})
    write_lock = threading.Lock()
    session: ElasticSession
    started: list[WorkerProcess] = []  # the worker processes that may still run
    started_lock = threading.Lock()

    def start_worker(key: Key, slot: SlotInfo) -> WorkerProcess:
        host = key[0]
        for known in list(manager.discovered):
            local(known)  # a remote host anywhere: local workers must use a routable address
        is_local = local(host)
        if is_local:
            addr = route_address(remote_seen[0]) if remote_seen else "127.0.0.1"
        else:
            addr = route_address(host)
        env = slot.env()
        env.update({**protocol.elastic_env(host, key[1]), protocol.RENDEZVOUS_ADDR_ENV: addr,
                    protocol.RUNNER_ADDR_ENV: addr})
        if call is not None:  # run_task stores its result under the slot's name (a rank changes)
            env[protocol.RESULT_KEY_ENV] = key_name(key)
        rank = RankPlan(slot=slot, local=is_local, argv=list(settings.command), env=env)
        plan = dataclasses.replace(base, ranks=[rank])
        cmd = (local_command(plan, rank, environ, secret) if is_local
               else ssh_command(plan, rank, settings, secret))
        w = session.driver.workers[key]
        proc = WorkerProcess(cmd, key_name(key), lambda: w.rank,
                             lambda code, sig, record: session.worker_exited(key, code, sig, record),
                             stdout=stdout, stderr=stderr, timestamp=settings.prefix_timestamp,
                             write_lock=write_lock)
        with started_lock:
            started[:] = [p for p in started if p.popen.poll() is None] + [proc]
        return proc

    def live_workers() -> list[WorkerProcess]:
        with started_lock:
            return [p for p in started if p.popen.poll() is None]

    elastic = DriverSettings.from_env(environ, timeout=settings.elastic_timeout,
                                       reset_limit=settings.reset_limit)
    session = ElasticSession(elastic, manager, settings.np, settings.min_np, settings.max_np,
                             start_worker, server, discovery_interval=discovery_interval)
    driver = session.driver
    if monitor is not None:  # horovod.runner.monitor.MonitorService: the driver reports in-process
        from horovod.runner.monitor import worker_env

        base.job_env.update(worker_env(monitor))
        monitor.state.elastic = lambda: elastic_status(driver)
    if call is not None:
        import cloudpickle

        server.put(protocol.FUNC_SCOPE, protocol.FUNC_KEY, cloudpickle.dumps(call))
    restore_usr1 = _pass_on_usr1(live_workers, stderr or sys.stderr, write_lock)
    restore_int = _note_sigint(driver)
    try:
        return session.run()
    except KeyboardInterrupt:
        log.warning("elastic: interrupted (SIGINT): every worker was stopped")
        result = ElasticResult("interrupted by SIGINT; every worker was stopped", driver.round + 1,
                               driver.resets, list(driver.events))
        return JobOutcome(returncode=130, interrupted="SIGINT", error=result.error, elastic=result)
    finally:
        restore_int()
        restore_usr1()


def _note_sigint(driver: ElasticDriver) -> Callable[[], None]:
    """Ctrl-C: the driver is told (``ElasticDriver.interrupted``, which its loop reads every 0.25 s)
    before KeyboardInterrupt is raised as usual, so the job ends even where that exception is lost
    (a signal handler's exception raised while the main thread runs a finalizer, such as a
    generator's close, is printed and dropped: the job then trained on to its end). Returns what
    puts the previous handler back (nothing to do off the main thread: nothing installed)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_sigint(signum: int, _frame: Any) -> None:
        driver.interrupted = signal.Signals(signum).name
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, on_sigint)

    def restore() -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler if old is None else old)

    return restore


def _pass_on_usr1(workers: Callable[[], list[WorkerProcess]], err: IO[str],
                  lock: threading.Lock) -> Callable[[], None]:
    """Stacks on demand: from now on a SIGUSR1 to horovodrun is passed on to every live worker
    through its shim (each prints its stacks and flight record, ``horovod/common/stacks.py``) and
    the job goes on; a worker still starting is skipped (``WorkerProcess.pass_signal``). Returns
    what puts the previous handler back (nothing to do off the main thread: nothing installed)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def pass_on(signum: int) -> None:
        live = workers()
        with lock:
            err.write(f"horovodrun: {signal.Signals(signum).name}: asking every worker ({len(live)} "
                      "running) for its stacks and flight record (the job goes on)\n")
            err.flush()
        for proc in live:
            proc.pass_signal(signum)

    def on_signal(signum: int, _frame: Any) -> None:
        # Not here: the main thread may hold the locks pass_on takes (the driver's, the output's).
        threading.Thread(target=pass_on, args=(signum,), daemon=True,
                         name="hvd-elastic-usr1").start()

    old = signal.signal(signal.SIGUSR1, on_signal)

    def restore() -> None:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL if old is None else old)

    return restore


def elastic_status(driver: ElasticDriver) -> dict[str, Any]:
    """Rounds formed so far and workers by state (the monitor's view of the driver)."""
    states = collections.Counter(w.state for w in list(driver.workers.values()))
    return {"rounds": driver.round + 1, "resets": driver.resets, "workers": dict(states)}


def configure_logging() -> None:
    """Elastic events are shown by default: they are what the user needs to follow the job."""
    lg = logging.getLogger("horovod.runner.elastic")
    if lg.level == logging.NOTSET or lg.level > logging.INFO:
        lg.setLevel(logging.INFO)
    if not logging.getLogger("horovod.runner").handlers and not lg.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("horovodrun: %(message)s"))
        lg.addHandler(handler)
        lg.propagate = False
