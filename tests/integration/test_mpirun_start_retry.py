"""mpirun that fails before starting any rank (Open MPI's PMIx server could not start its listener
thread: seen on a loaded host, nothing of the job ran) is started again, by ``horovodrun`` and by
the test harness (``horovod.testing``); a job whose ranks ran and failed is never started again.

The failure is played by an ``mpirun`` first on ``PATH`` that prints Open MPI's message and exits
213 its first ``FAIL`` starts, then runs the real mpirun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from horovod.runner.job_outcome import JobOutcome, RankExit
from horovod.runner.launch.horovodrun import _mpirun_failed_to_start
from horovod.runner.launch.mpirun import failed_to_start
from horovod.testing import RanksFailed, run_ranks
from tests.integration.conftest import REPO, WORKER, launcher_env, tagged_json

pytestmark = pytest.mark.integration

_MESSAGE = ("--------------------------------------------------------------------------\n"
            "The PMIx server's listener thread failed to start. We cannot\ncontinue.\n"
            "--------------------------------------------------------------------------")


def _flaky_mpirun(tmp_path: Path, fail: int) -> tuple[str, Path]:
    """A bin directory whose ``mpirun`` fails to start ``fail`` times; its start counter."""
    real = shutil.which("mpirun")
    assert real is not None
    bindir, count = tmp_path / "bin", tmp_path / "starts"
    bindir.mkdir()
    script = bindir / "mpirun"
    script.write_text(
        "#!/bin/sh\n"
        f'case "$1" in --version|-V) exec {real} "$@";; esac\n'
        f"n=$(cat {count} 2>/dev/null || echo 0)\n"
        f"echo $((n + 1)) > {count}\n"
        f'if [ "$n" -lt {fail} ]; then\n'
        f"  cat >&2 <<'MSG'\n{_MESSAGE}\nMSG\n"
        "  exit 213\n"
        "fi\n"
        f'exec {real} "$@"\n')
    script.chmod(0o755)
    # horovodrun takes the mpirun installed beside its Python first (find_mpirun).
    (bindir / "python").symlink_to(sys.executable)
    return str(bindir), count


def _horovodrun(bindir: str, *args: str) -> subprocess.CompletedProcess[str]:
    """horovodrun started by the Python of ``bindir``, beside its flaky mpirun."""
    res = subprocess.run([os.path.join(bindir, "python"), "-m", "horovod.runner", *args],
                         capture_output=True, text=True, timeout=180, cwd=str(REPO),
                         env=launcher_env({"PATH": bindir + ":" + os.environ["PATH"]}))
    return res


def _starts(count: Path) -> int:
    return int(count.read_text())


def test_the_start_failure_is_told_from_other_failures() -> None:
    assert failed_to_start("noise\n" + _MESSAGE + "\n")
    assert not failed_to_start("ORTE was unable to reliably start one or more daemons.")
    ended = JobOutcome([RankExit(None, "localhost", 213, None, 0.0, None, [], None, "")], 213,
                       launcher_tail=_MESSAGE.splitlines())
    assert _mpirun_failed_to_start(ended)
    ran = JobOutcome([RankExit(0, "localhost", 1, None, 0.0, None, [], 0, "")], 1,
                     launcher_tail=_MESSAGE.splitlines())
    assert not _mpirun_failed_to_start(ran), "a rank ran: the job must not be started again"
    interrupted = JobOutcome([], 130, interrupted="SIGINT", launcher_tail=_MESSAGE.splitlines())
    assert not _mpirun_failed_to_start(interrupted)


def _ranks() -> tuple[int, int]:
    import torch

    import horovod.torch as hvd

    hvd.init()
    return hvd.rank(), int(hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item())


def test_harness_starts_mpirun_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir, count = _flaky_mpirun(tmp_path, fail=2)
    monkeypatch.setenv("PATH", bindir + ":" + os.environ["PATH"])
    assert run_ranks(_ranks, np=2, timeout=120) == [(0, 3), (1, 3)]
    assert _starts(count) == 3


def test_harness_gives_up_after_three_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir, count = _flaky_mpirun(tmp_path, fail=3)
    monkeypatch.setenv("PATH", bindir + ":" + os.environ["PATH"])
    with pytest.raises(RanksFailed, match="listener thread failed to start"):
        run_ranks(_ranks, np=2, timeout=120)
    assert _starts(count) == 3


def test_horovodrun_starts_mpirun_again(tmp_path: Path) -> None:
    bindir, count = _flaky_mpirun(tmp_path, fail=1)
    res = _horovodrun(bindir, "--mpi", "-np", "2", sys.executable, WORKER, "allreduce")
    assert res.returncode == 0, res.stderr
    assert "starting it again (2 of 3)" in res.stderr, res.stderr
    assert sorted(tagged_json(res.stdout, "RESULT")) == [0, 1], res.stdout
    assert _starts(count) == 2


def test_horovodrun_never_starts_a_job_whose_ranks_ran_again(tmp_path: Path) -> None:
    bindir, count = _flaky_mpirun(tmp_path, fail=0)
    res = _horovodrun(bindir, "--mpi", "-np", "2", sys.executable, "-c", "import sys; sys.exit(3)")
    assert res.returncode == 3, res.stderr
    assert "starting it again" not in res.stderr, res.stderr
    assert _starts(count) == 1
