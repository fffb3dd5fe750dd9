"""Helpers of the elastic end-to-end tests: run horovodrun in elastic mode with a discovery file,
react to the driver's log, and check the training outcome."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "bin" / "elastic_worker.py"

sys.path.insert(0, str(WORKER.parent))
from elastic_worker import reference  # noqa: E402


def write_hosts(hosts_file: Path, content: str) -> None:
    """Replace the discovery file atomically: the driver runs the discovery script on its own
    schedule, and a plain rewrite lets it read an empty file in between, which removes every
    host (the job then rightly stops)."""
    tmp = hosts_file.with_name(hosts_file.name + ".tmp")
    tmp.write_text(content)
    os.replace(tmp, hosts_file)


def run_elastic(tmp_path: Path, hosts: str, args: list[str], env: dict[str, str],
                timeout: float = 150, on_log: dict[str, str] | None = None,
                popen: Callable[..., Any] | None = None,
                on_stdout: Callable[[str], None] | None = None, worker: Path = WORKER,
                worker_args: list[str] | None = None,
                on_stderr: Callable[[str], None] | None = None,
                ) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run horovodrun in elastic mode; ``on_log`` maps a driver log text to the hosts-file
    content written as soon as the driver logs it (once); ``on_stdout`` sees every output line;
    ``popen`` starts the launcher (default: here)."""
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(hosts)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    script.chmod(0o755)
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update({"HOSTS_FILE": str(hosts_file), "HOROVOD_GLOO_TIMEOUT_SECONDS": "20"})
    full_env.update(env)
    argv = [sys.executable, "-m", "horovod.runner", *args, "--host-discovery-script", str(script),
            sys.executable, str(worker), *(worker_args or [])]
    start = popen or subprocess.Popen
    proc = start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 env=full_env, cwd=str(tmp_path))
    pending = dict(on_log or {})
    err_lines: list[str] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err_lines.append(line)
            if on_stderr is not None:
                on_stderr(line)
            for text in list(pending):
                if line.startswith("horovodrun:") and text in line:
                    write_hosts(hosts_file, pending.pop(text))

    out_chunks: list[str] = []

    def read_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out_chunks.append(line)
            if on_stdout is not None:
                on_stdout(line)

    readers = [threading.Thread(target=read_stderr, daemon=True),
               threading.Thread(target=read_stdout, daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        for t in readers:
            t.join(5)
        pytest.fail(f"horovodrun did not end within {timeout} s:\n{''.join(err_lines)[-6000:]}")
    for t in readers:
        t.join(10)
    return (subprocess.CompletedProcess(argv, proc.returncode, "".join(out_chunks),
                                        "".join(err_lines)), hosts_file)


def tagged(stdout: str, tag: str) -> list[dict]:
    return [json.loads(m.group(1)) for m in re.finditer(rf"^\[\d+\]<stdout>:{tag} (.*)$", stdout,
                                                        re.MULTILINE)]


def check_training(res: subprocess.CompletedProcess[str], steps: int, size: int) -> list[dict]:
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    finals = tagged(res.stdout, "FINAL")
    assert len(finals) == size, f"expected {size} survivors to finish, got {finals}\n{out[-4000:]}"
    assert sorted(f["rank"] for f in finals) == list(range(size))
    # Every rank trained on its own data: the weights equal the reference only if each committed
    # step averaged the gradients of all the ranks of its time (``sizes``), once.
    sizes = finals[0]["sizes"]
    assert len(sizes) == steps and all(f["sizes"] == sizes for f in finals), [f["sizes"] for f in finals]
    want = reference(sizes)
    for f in finals:
        assert f["step"] == steps and f["size"] == size, f
        assert f["w"] == finals[0]["w"], f"rank {f['rank']} ({f['me']}) ends with other weights than rank 0"
        for got, exp in zip(f["w"], want):
            assert got == pytest.approx(exp, abs=1e-5), (
                f"rank {f['rank']} ({f['me']}) ends with weights {f['w']}, but {steps} steps at sizes "
                f"{sizes} give {want}: a committed step was lost, applied twice or not averaged")
        assert f["momentum"] == finals[0]["momentum"], "momentum differs between ranks"
    # Steps are committed in order on every worker; after a reset they resume from the last
    # commit, so at most the uncommitted step is redone.
    for me in {f["me"] for f in finals}:
        seen = [c["step"] for c in tagged(res.stdout, "COMMIT") if c["me"] == me]
        assert seen == sorted(seen), f"{me} committed steps out of order: {seen}"
        assert seen[-1] == steps
    return finals


def driver_log(res: subprocess.CompletedProcess[str]) -> str:
    return "\n".join(line for line in res.stderr.splitlines() if line.startswith("horovodrun:"))




def _gone(pid: int) -> bool:
    """The process no longer exists, not even as a zombie (it was reaped)."""
    return not Path(f"/proc/{pid}").exists()


def no_worker_left(res: subprocess.CompletedProcess[str], extra: list[int]) -> None:
    """No worker that committed a step (nor any of the ``extra`` pids) outlived the job."""
    pids = {c["pid"] for c in tagged(res.stdout, "COMMIT")} | set(extra)
    deadline = time.monotonic() + 10  # reaping is asynchronous only within the kernel's exit
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    left = sorted(p for p in pids if not _gone(p))
    assert not left, f"worker processes outlived the job: {left}"
