"""An explicit transport (HOROVOD_CONTROLLER / HOROVOD_CPU_OPERATIONS) under a launcher that cannot
give it: every rank fails at hvd.init() naming the launcher, the variable and the fix; no rank runs
alone. Real launchers (mpirun, torchrun); every rank's output is checked.
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


@pytest.mark.parametrize("variable", ["HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS"])
def test_mpi_transport_under_torchrun_fails_every_rank(variable, tmp_path):
    """torchrun of 2 with HOROVOD_CONTROLLER=mpi: MPI_Init would make each worker a world of one."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "--tee", "3", f"--log-dir={tmp_path}", SCRIPT]
    res = _run(argv, {variable: "mpi"})
    files = sorted(tmp_path.glob("**/attempt_*/*/stdout.log"))
    out = "".join(f.read_text(errors="replace") for f in files)
    assert res.returncode != 0 and "JOINED" not in out, res.stdout[-3000:] + out
    refused = _refusals(out)
    assert sorted(refused) == ["0", "1"], res.stdout[-3000:] + out
    for msg in refused.values():
        assert f"{variable}=mpi asks for the MPI transport" in msg and "started by torchrun" in msg, msg
        assert "WORLD_SIZE=2" in msg and "missing: OMPI_COMM_WORLD_SIZE" in msg, msg
        assert f"unset {variable}" in msg and "`mpirun`" in msg, msg


@pytest.mark.parametrize("variable", ["HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS"])
def test_gloo_transport_under_mpirun_fails_every_rank(variable):
    """mpirun -np 2 -x HOROVOD_CONTROLLER=gloo: mpirun gives Gloo no rank, size or store."""
    res = _run(mpirun_command(2, [sys.executable, SCRIPT], env_names=[variable]), {variable: "gloo"})
    assert res.returncode != 0 and "JOINED" not in res.stdout, res.stdout[-3000:]
    refused = _refusals(res.stdout)
    assert sorted(refused) == ["0", "1"], res.stdout[-3000:]
    for msg in refused.values():
        assert f"{variable}=gloo asks for the Gloo transport" in msg and "mpirun" in msg, msg
        assert "OMPI_COMM_WORLD_SIZE=2" in msg and "missing: HOROVOD_GLOO_RENDEZVOUS_ADDR" in msg, msg
        assert f"unset {variable}" in msg and "`horovodrun --gloo`" in msg, msg
