"""Horovod under a real Slurm (``tests/_slurm.py``: slurmctld, slurmd and munged on this machine).

Every test runs real ``srun``/``salloc``/``sbatch`` commands and checks every rank's values. No
``HOROVOD_SECRET_KEY`` is exported unless a test says so: the step's secret comes from MUNGE (or
a key file) as it would in a batch script that exports nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
JOB = str(Path(__file__).resolve().parent / "bin" / "job.py")
STRANGER = "hvdstranger"


def _env(slurm, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "SLURM_", "OMPI_COMM", "PMI", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(slurm.env())
    env.update(extra or {})
    return env


def _run(slurm, argv: list[str], timeout: float = 180, extra: dict[str, str] | None = None,
         ) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, env=_env(slurm, extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, cwd=str(REPO))
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        raise AssertionError(f"{argv} did not finish in {timeout} s:\n{out}") from None


def _job_lines(out: str) -> dict[int, dict]:
    lines = [json.loads(m.group(1)) for m in re.finditer(r"JOB (\{.*\})", out)]
    return {d["rank"]: d for d in lines}


def _check_values(out: str, np_: int, launcher: str = "slurm", local_size: int | None = None) -> None:
    got = _job_lines(out)
    assert sorted(got) == list(range(np_)), out[-3000:]
    local_size = np_ if local_size is None else local_size
    for r, d in got.items():
        assert d["size"] == np_ and d["launcher"] == launcher, d
        assert (d["local_rank"], d["local_size"], d["cross_size"]) == (r % local_size, local_size, 1), d
        if launcher == "slurm":
            assert (d["procid"], d["localid"]) == (str(r), str(r)), d
        assert d["sum"] == [sum(float(i + k) for k in range(np_)) for i in range(4)], d
        assert d["gather"] == [float(k) for k in range(np_) for _ in range(k + 1)], d
        assert d["bcast"] == float(np_ - 1), d


@pytest.mark.parametrize("np_", [2, 3])
def test_srun_tasks_form_one_job(slurm, np_):
    """``srun -n N python job.py``: one job of size N, the ranks and local ranks Slurm gave."""
    res = _run(slurm, ["srun", "-n", str(np_), sys.executable, JOB, "values"])
    assert res.returncode == 0, res.stdout[-3000:]
    _check_values(res.stdout, np_)


def test_srun_ntasks_per_node(slurm):
    """``srun -N 1 --ntasks-per-node=3``: local rank and local size follow Slurm's node."""
    res = _run(slurm, ["srun", "-N", "1", "--ntasks-per-node=3", sys.executable, JOB, "values"])
    assert res.returncode == 0, res.stdout[-3000:]
    _check_values(res.stdout, 3)


def test_srun_failing_task_ends_the_step_naming_it(slurm):
    """Task 1 raises after init: the step ends (no hang); the output names rank 1 as the cause and
    every other rank as stopping because of it."""
    res = _run(slurm, ["srun", "-n", "3", sys.executable, JOB, "fail", "1"], timeout=240)
    out = res.stdout
    assert res.returncode != 0, out[-3000:]
    assert "horovod: rank 1 of 3 failed, ending the job: ValueError: task 1 fails on purpose" in out, out[-3000:]
    causes = re.findall(r"horovod: rank (\d) of 3 failed, ending the job", out)
    assert causes == ["1"], out[-3000:]
    stopped = sorted(re.findall(r"horovod: rank (\d) of 3 stops because another rank failed or left", out))
    assert stopped == ["0", "2"], out[-3000:]
    assert re.search(r"srun: error: \S+: tasks? [0-9,-]+: Exited with exit code [1-9]", out), out[-3000:]
    assert not _job_lines(out), out[-3000:]
