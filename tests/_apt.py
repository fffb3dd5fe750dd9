"""Install Debian packages a test fixture needs (sshd, Slurm, Chromium) with apt-get.

One policy for every fixture: no recommended packages, no system daemons started by the packages'
maintainer scripts (a fixture starts what it needs itself, its own way), one ``apt-get update``
retry when the package lists are stale, and a reason instead of an exception when it fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path


@contextlib.contextmanager
def _no_daemons() -> Iterator[None]:
    """Keep the packages' maintainer scripts from starting system-wide services."""
    policy = Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    if ours:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        yield
    finally:
        if ours:
            policy.unlink(missing_ok=True)


def install(pkgs: Sequence[str], need: str, still_missing: Callable[[], object]) -> str | None:
    """``apt-get install`` ``pkgs``; None when done, else why not, as "``need`` needs ...".

    ``still_missing()`` (true while something is still missing) is checked after the install.
    """
    names = ", ".join(pkgs)
    if shutil.which("apt-get") is None:
        return f"{need} needs {names} and there is no apt-get to install them"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=600", *pkgs]
    try:
        with _no_daemons():
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
            if res.returncode != 0:
                subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600, env=env)
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{need} needs {names}; apt-get install failed: {exc}"
    if res.returncode != 0 or still_missing():
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [""]
        return f"{need} needs {names}; apt-get install failed: {tail[0]}"
    return None


def missing_commands(packages: Mapping[str, str]) -> list[str]:
    """The commands of ``packages`` (command or absolute path -> the package providing it) that
    are not there."""
    return [c for c in packages if not (os.access(c, os.X_OK) if c.startswith("/") else shutil.which(c))]


def install_missing(packages: Mapping[str, str], need: str) -> str | None:
    """Install the packages of the commands that are missing; None when all are there."""
    missing = missing_commands(packages)
    if not missing:
        return None
    pkgs = sorted({packages[c] for c in missing})
    return install(pkgs, need, lambda: missing_commands(packages))
