"""How a rank of ``horovod.testing.run_ranks`` ends (``horovod/testing/worker.py``): at once after
its result is written, without the interpreter's teardown (0.3-2 s of CPU per rank that imported
torch or TensorFlow), yet with what the launcher and the test need done: MPI finalized (``mpirun``
counts a rank that exits without it as failed) and output buffered in C's stdio flushed."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from typing import Any

import cloudpickle
import pytest

from horovod.testing import run_ranks

pytestmark = [pytest.mark.multiprocess]


def _body() -> int:
    import atexit
    import ctypes

    atexit.register(lambda: print("interpreter teardown ran", flush=True))
    # C stdio on a pipe is fully buffered: this stays in libc's buffer unless someone flushes it.
    ctypes.CDLL(None).printf(b"native output without a newline")
    return 7


def test_a_rank_ends_without_teardown_and_its_native_output_is_flushed(tmp_path: Any) -> None:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with open(tmp_path / "fn.pkl", "wb") as f:
        cloudpickle.dump((_body, ()), f)
    # PYTHONUNBUFFERED would make C's stdout unbuffered too, and the flush would go unchecked.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_WORLD", "HOROVOD_RANK")) and k != "PYTHONUNBUFFERED"}
    res = subprocess.run([sys.executable, "-m", "horovod.testing.worker", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    with open(tmp_path / "result.0", "rb") as f:
        assert pickle.load(f) == (True, 7)
    assert "native output without a newline" in res.stdout, res.stdout
    assert "interpreter teardown ran" not in res.stdout, res.stdout


def _mpi_body() -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return int(comm.allreduce(comm.Get_rank() + 1))


def test_ranks_that_started_mpi_end_cleanly_under_mpirun() -> None:
    # Without MPI_Finalize before the early exit, mpirun reports the job as failed.
    assert run_ranks(_mpi_body, np=2, timeout=120) == [3, 3]
