"""horovod.run(): functions on every rank, results in rank order, errors naming the rank."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.integration.conftest import REPO, launcher_env

pytestmark = pytest.mark.integration


def run_script(body: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh interpreter (horovod.run installs signal handlers, starts workers)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True,
                          text=True, timeout=timeout, env=launcher_env(), cwd=str(REPO))


# One size per mode, the other in test_launch_local.py's horovodrun twin: each mode at an even and
# an odd world size across the two.
@pytest.mark.parametrize(("use_gloo", "np_"), [(False, 3), (True, 2)])
def test_run_returns_results_in_rank_order(use_gloo: bool, np_: int) -> None:
    res = run_script(f"""
        import horovod

        def fn(base, scale=1):
            import numpy as np
            import horovod.numpy as hvd
            hvd.init()
            total = hvd.allreduce(np.array([float(hvd.rank())]), op=hvd.Sum)
            out = (hvd.rank(), hvd.size(), hvd.local_rank(), float(total[0]) * scale + base)
            hvd.shutdown()
            return out

        print("RESULTS", horovod.run(fn, args=(1,), kwargs={{"scale": 10}}, num_proc={np_},
                                     use_gloo={use_gloo}, use_mpi={not use_gloo}))
    """)
    assert res.returncode == 0, res.stderr
    total = sum(range(np_)) * 10 + 1.0
    want = [(r, np_, r, total) for r in range(np_)]
    assert f"RESULTS {want}" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("use_gloo", [False, True])
def test_run_raises_naming_the_failing_rank(use_gloo: bool) -> None:
    res = run_script(f"""
        import os
        import horovod
        from horovod.common.exceptions import WorkerFailedError

        def fn():
            rank = int(os.environ.get("HOROVOD_RANK") or os.environ["OMPI_COMM_WORLD_RANK"])
            if rank == 1:
                raise KeyError("missing thing on rank 1")
            return rank

        try:
            horovod.run(fn, num_proc=2, use_gloo={use_gloo})
        except WorkerFailedError as exc:
            print("CAUGHT", exc.rank, type(exc.exception).__name__, isinstance(exc, RuntimeError))
            print("MESSAGE", str(exc).splitlines()[0])
            print("LAST", str(exc).splitlines()[-1])
    """)
    assert res.returncode == 0, res.stderr
    assert "CAUGHT 1 KeyError True" in res.stdout, res.stdout + res.stderr
    # upstream's sentence, after our report (upstream's tests and log scrapers match it)
    assert ("LAST Horovod detected that one or more processes exited with non-zero status, thus causing "
            "the job to be terminated.") in res.stdout
    assert "MESSAGE horovod.run: rank 1 on host localhost raised KeyError" in res.stdout
    assert "[1]<stderr>:User function raise error: KeyError" in res.stdout + res.stderr


def test_run_rejects_conflicting_arguments() -> None:
    import horovod
    from horovod.common.exceptions import ConfigError

    with pytest.raises(ConfigError, match="not both"):
        horovod.run(len, num_proc=1, hosts="a:1", hostfile="f")
    with pytest.raises(ConfigError, match="not both"):
        horovod.run(len, num_proc=1, use_gloo=True, use_mpi=True)
    with pytest.raises(ConfigError, match="runs on Gloo"):
        horovod.run(len, num_proc=1, min_num_proc=1, use_mpi=True)
    with pytest.raises(ConfigError, match="larger than -np"):
        horovod.run(len, num_proc=1, min_num_proc=3, max_num_proc=4)
    assert os.environ.get("HOROVOD_SECRET_KEY") is None
