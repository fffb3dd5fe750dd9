"""Start remote ranks over ssh, and check that remote hosts are reachable before launch.

The remote side runs the worker shim by absolute path with this Python (all hosts are expected to
have the same installation paths, as with upstream Horovod). The worker's variables and the job
secret travel as one JSON line on ssh's stdin, never on a command line; stdin then stays open as a
life line: when the launcher closes it (or dies), the remote shim stops the worker's process tree,
which a signal to the local ssh client alone would not do.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from horovod.common import protocol
from horovod.common.exceptions import ConfigError
from horovod.runner.launch.commands import Command, shim_argv
from horovod.runner.launch.plan import SECRET_ENV, LaunchPlan, RankPlan
from horovod.runner.settings import LaunchSettings

__all__ = ["SshLauncher", "ssh_base_argv", "host_key_checking", "HOST_KEY_ENV", "ssh_command", "check_hosts",
           "HostCheck"]


HOST_KEY_ENV = "HOROVOD_SSH_STRICT_HOST_KEY_CHECKING"
HOST_KEY_MODES = ("accept-new", "yes", "no")


def host_key_checking(value: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """ssh's ``StrictHostKeyChecking``: ``value`` (the flag), else ``HOROVOD_SSH_STRICT_HOST_KEY_CHECKING``,
    else ``accept-new`` (a host seen for the first time is remembered, a changed key is refused).

    Raises:
        ConfigError: not one of ``accept-new``, ``yes``, ``no``.
    """
    env = os.environ if environ is None else environ
    mode = (value or env.get(HOST_KEY_ENV) or "accept-new").strip().lower()
    if mode not in HOST_KEY_MODES:
        raise ConfigError(f"{HOST_KEY_ENV}={mode!r}: use accept-new, yes or no.", variable=HOST_KEY_ENV)
    return mode


def ssh_base_argv(host: str, port: int | None = None, identity_file: str | None = None,
                  connect_timeout: int = 10, host_keys: str | None = None) -> list[str]:
    """``ssh`` options shared by checks and launches: no password prompt, no tty, host keys checked
    as :func:`host_key_checking` says."""
    argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", f"StrictHostKeyChecking={host_key_checking(host_keys)}",
            "-o", f"ConnectTimeout={connect_timeout}", "-o", "LogLevel=ERROR"]
    if port:
        argv += ["-p", str(port)]
    if identity_file:
        argv += ["-i", identity_file]
    return argv + [host]


def ssh_command(plan: LaunchPlan, rank: RankPlan, settings: LaunchSettings,
                secret: str | None = None, cwd: str | None = None,
                python: str | None = None) -> Command:
    """The ssh command that starts one remote rank under the shim."""
    cwd = os.getcwd() if cwd is None else cwd
    env = dict(plan.forward_env)
    env.update(plan.job_env)
    env.update(rank.env)
    if secret is not None:
        env[SECRET_ENV] = secret
    remote = (f"cd {shlex.quote(cwd)} > /dev/null 2>&1 ; exec "
              + shlex.join(shim_argv(rank.argv, python=python or sys.executable, watch_stdin=True,
                                     stdin_env=True)))
    argv = ssh_base_argv(rank.slot.hostname, settings.ssh_port, settings.ssh_identity_file,
                         host_keys=settings.ssh_strict_host_key_checking) + [remote]
    blob = protocol.env_line(env)
    return Command(argv=argv, env=None, ranks=(rank.slot.rank,), host=rank.slot.hostname, stdin_data=blob,
                   lifeline=True, remote=True, shown_env={**plan.job_env, **rank.env})


class SshLauncher:
    """Remote processes over ssh."""

    name = "ssh"

    def __init__(self, settings: LaunchSettings, secret: str | None = None) -> None:
        self.settings = settings
        self.secret = secret

    def is_available(self) -> tuple[bool, str]:
        from shutil import which

        if which("ssh") is None:
            return False, "the ssh client is not installed (apt-get install openssh-client)"
        return True, ""

    def commands(self, plan: LaunchPlan) -> list[Command]:
        return [ssh_command(plan, r, self.settings, self.secret) for r in plan.ranks if not r.local]


@dataclass(frozen=True)
class HostCheck:
    """The result of checking one remote host."""

    host: str
    ok: bool
    message: str = ""
    program_found: bool = True


def check_hosts(hosts: list[str], settings: LaunchSettings, program: str | None = None,
                path: str | None = None, timeout: float = 30.0, attempts: int = 3) -> list[HostCheck]:
    """Check in parallel that each host accepts ssh and (optionally) has ``program``.

    The check runs ``command -v <program>`` in the job's working directory with the job's PATH, so
    a missing program is reported before anything starts.
    """
    cwd = os.getcwd()
    probe = f"cd {shlex.quote(cwd)} > /dev/null 2>&1 ; "
    if path is not None:
        probe += f"PATH={shlex.quote(path)} ; export PATH ; "
    probe += "echo __hvd_ssh_ok__ ; "
    if program:
        probe += f"command -v {shlex.quote(program)} > /dev/null 2>&1 || echo __hvd_no_program__"

    def one(host: str) -> HostCheck:
        connect_timeout = max(1, int(min(10, timeout)))
        argv = ssh_base_argv(host, settings.ssh_port, settings.ssh_identity_file,
                             connect_timeout=connect_timeout,
                             host_keys=settings.ssh_strict_host_key_checking) + [probe]
        last = ""
        for _ in range(attempts):
            try:
                res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                     stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                last = f"ssh did not answer within {timeout:g} s"
                continue
            if "__hvd_ssh_ok__" in res.stdout:
                return HostCheck(host, True, program_found="__hvd_no_program__" not in res.stdout)
            last = (res.stderr or res.stdout).strip() or f"ssh exited with code {res.returncode}"
            if "Host key verification failed" in last or "REMOTE HOST IDENTIFICATION HAS CHANGED" in last:
                return HostCheck(host, False, f"{last} ({host}'s key is not the one known_hosts holds, or "
                                 "it is unknown under StrictHostKeyChecking=yes: check the host and "
                                 "update known_hosts (ssh-keygen -R), or choose with "
                                 "--ssh-strict-host-key-checking / HOROVOD_SSH_STRICT_HOST_KEY_CHECKING)")
        return HostCheck(host, False, last)

    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return list(pool.map(one, hosts))
