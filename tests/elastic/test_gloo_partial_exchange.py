"""A member stopped half-way through a point-to-point exchange (``bin/gloo_partial_exchange.py``).

The elastic heartbeat test's stopped worker once cost the survivors the whole Gloo timeout (60 s)
instead of the heartbeat's 5 s: the worker had stopped (SIGSTOP) in the middle of the negotiation's
point-to-point exchange (``GlooBackend.exchange_rows``) with its row delivered to one survivor and
not to the other. The first survivor went on to the next exchange and waited for the second; the
second failed when the stopped worker was killed and closed its backend, but its failed exchange's
frame (kept by the error's traceback) still held the process group's connections open, so the
first waited out the Gloo timeout. Here the first survivor must fail within seconds of the kill.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests._ports import reserved_port

pytestmark = [pytest.mark.integration]

SCRIPT = Path(__file__).resolve().parent / "bin" / "gloo_partial_exchange.py"
REPO = Path(__file__).resolve().parents[2]
GLOO_TIMEOUT = 60.0  # the script's HOROVOD_GLOO_TIMEOUT_SECONDS


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_survivor_waiting_on_a_peer_that_failed_and_closed_fails_at_once() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with reserved_port() as held:  # for rank 0's store (torch binds it with SO_REUSEADDR)
        _survivors_on(env, str(held))


def _survivors_on(env: dict[str, str], port: str) -> None:
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(r), port], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(3)]
    out: list[list[str]] = [[], [], []]

    def pump(r: int) -> None:
        for line in procs[r].stdout:  # type: ignore[union-attr]
            out[r].append(line)

    threads = [threading.Thread(target=pump, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while not ("STOPPING\n" in out[2] and _stopped(procs[2].pid)):
            assert procs[2].poll() is None and time.monotonic() < deadline, "".join(sum(out, []))
            time.sleep(0.05)
        procs[2].kill()
        killed = time.monotonic()
        procs[1].wait(GLOO_TIMEOUT + 40)
        threads[1].join(10)
        text = "".join(f"[{r}] {line}" for r in range(3) for line in out[r])
        assert procs[1].returncode == 0, text
        assert "EXCHANGED\n" in out[1], text
        failed = re.search(r"^FAILED ([\d.]+) (.*)", "".join(out[1]), re.M)
        assert failed, text
        assert "Gloo negotiation failed on rank 1" in failed.group(2), text
        # rank 0 failed at the kill and closed: rank 1 fails then, not after Gloo's 60 s timeout
        # (the bound leaves room for a loaded machine)
        took = float(failed.group(1)) - killed
        assert took < 20, f"rank 1 failed {took:.1f} s after the kill (Gloo timeout {GLOO_TIMEOUT:.0f} s)\n{text}"
        assert re.search(r"^CLOSED [\d.]+ Gloo negotiation failed on rank 0", "".join(out[0]), re.M), text
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)
