"""Helpers for launcher end-to-end tests: run ``horovodrun`` as a real process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(__file__).resolve().parent / "bin"
WORKER = str(BIN / "worker.py")


def launcher_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.update(extra or {})
    return env


def horovodrun_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "horovod.runner", *args]


def horovodrun(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
               cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run horovodrun to completion (with a hard timeout) and capture its output."""
    res = subprocess.run(horovodrun_argv(*args), capture_output=True, timeout=timeout,
                         env=launcher_env(env), cwd=cwd or str(REPO))
    # Decoded by hand: text=True would turn the workers' carriage returns into newlines.
    return subprocess.CompletedProcess(res.args, res.returncode, res.stdout.decode(),
                                       res.stderr.decode())


def tagged_json(stdout: str, tag: str) -> dict[int, dict]:
    """Parse ``[r]<stdout>:TAG {json}`` lines into {rank: dict}, checking the prefix matches."""
    out: dict[int, dict] = {}
    for m in re.finditer(rf"^\[(\d+)\]<stdout>:{tag} (.*)$", stdout, re.MULTILINE):
        data = json.loads(m.group(2))
        assert data["rank"] == int(m.group(1)), f"line of rank {data['rank']} prefixed [{m.group(1)}]"
        out[int(m.group(1))] = data
    return out


@pytest.fixture(params=["mpi", "gloo"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)
