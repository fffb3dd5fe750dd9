"""An explicit transport (HOROVOD_CONTROLLER / HOROVOD_CPU_OPERATIONS) under a launcher that did not
choose it. Gloo under mpirun: the ranks meet through MPI and run on Gloo. MPI under torchrun: every
rank fails at hvd.init() naming the launcher, the variable and the fix; no rank runs alone. Real
mpirun; torchrun's exact variables; every rank's output is checked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from horovod.testing import mpirun_command

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).resolve().parent / "bin" / "explicit_transport.py")
REFUSED = re.compile(r"REFUSED (\S+) (.*)")
JOINED = re.compile(r"JOINED rank (\d+) size (\d+) sum (\S+) transport (\w+)")


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "OMPI_COMM", "PMI", "SLURM_", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _run(argv: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, cwd=str(REPO))
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{argv} did not finish in {timeout} s:\n{exc.stdout}") from None


def _refusals(out: str) -> dict[str, str]:
    return {rank: msg for rank, msg in REFUSED.findall(out)}


def test_mpi_transport_under_torchrun_fails_every_rank():
    """torchrun's variables for 2 workers with HOROVOD_CONTROLLER=mpi: MPI_Init would make each worker
    a world of one (HOROVOD_CPU_OPERATIONS and the other launchers: tests/unit/common/
    test_launcher_detect.py). The workers are started with the exact variables torchrun sets, not by
    torchrun: its agent ends the other worker when the first fails, maybe before it printed."""
    variable = "HOROVOD_CONTROLLER"
    port = "29999"  # nothing listens: detection refuses before any store is used
    procs = []
    for rank in range(2):
        env = _env({variable: "mpi", "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": "t", "TORCHELASTIC_USE_AGENT_STORE": "True"})
        procs.append(subprocess.Popen([sys.executable, SCRIPT], env=env, text=True, cwd=str(REPO),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a worker did not end in 120 s: {outs}") from None
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 3 and "JOINED" not in out, out
        refused = _refusals(out)
        assert list(refused) == [str(rank)], out
        msg = refused[str(rank)]
        assert msg.startswith(f"LauncherError: {variable}=mpi asks for the MPI transport"), msg
        assert "started by torchrun for a job of 2 processes" in msg, msg
        assert "WORLD_SIZE=2" in msg and "missing: OMPI_COMM_WORLD_SIZE" in msg, msg
        assert f"unset {variable}" in msg and "`mpirun`" in msg, msg


@pytest.mark.parametrize(("variable", "np_", "inits"), [("HOROVOD_CONTROLLER", 2, 2),
                                                        ("HOROVOD_CPU_OPERATIONS", 3, 1)])
def test_gloo_transport_under_mpirun_meets_through_mpi(variable, np_, inits):
    """mpirun -np N -x HOROVOD_CONTROLLER=gloo (as upstream): the ranks meet through MPI and run on
    Gloo, size N on every rank (each init of an init/shutdown/init program too)."""
    res = _run(mpirun_command(np_, [sys.executable, SCRIPT, str(inits)], env_names=[variable]),
               {variable: "gloo"})
    assert res.returncode == 0 and "REFUSED" not in res.stdout, res.stdout[-3000:]
    joined = sorted(JOINED.findall(res.stdout))
    want = sorted((str(r), str(np_), str(np_ * (np_ + 1) // 2), "gloo") for r in range(np_)) * inits
    assert joined == sorted(want), res.stdout[-3000:]


def test_gloo_under_mpirun_whose_rank_0_cannot_open_the_store_fails_every_rank():
    """Rank 0 cannot open the store (HOROVOD_GLOO_IFACE names no interface): no rank waits or runs alone."""
    env = {"HOROVOD_CONTROLLER": "gloo", "HOROVOD_GLOO_IFACE": "nosuchif0"}
    res = _run(mpirun_command(2, [sys.executable, SCRIPT], env_names=list(env)), env)
    assert res.returncode != 0 and "JOINED" not in res.stdout, res.stdout[-3000:]
    refused = _refusals(res.stdout)
    assert sorted(refused) == ["0", "1"], res.stdout[-3000:]
    assert "HOROVOD_GLOO_IFACE='nosuchif0': no such interface" in refused["0"], refused
    assert refused["1"].startswith("LauncherError: Rank 1 of a job started by mpirun cannot join Gloo: "
                                   "rank 0 could not open the job's store"), refused
    assert "nosuchif0" in refused["1"], refused
