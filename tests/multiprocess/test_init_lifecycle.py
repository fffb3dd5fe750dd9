"""init()/shutdown() and the MPI lifetime: Horovod starts MPI when mpi4py is told not to, and
finalizes only what it started; a bad process-set list leaves Horovod connected for a retry."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from horovod.testing import run_mpi_script, run_ranks

pytestmark = pytest.mark.multiprocess


def _init_without_mpi4py_init():
    import mpi4py

    mpi4py.rc.initialize = False
    import numpy as np
    from mpi4py import MPI

    before = MPI.Is_initialized()
    import horovod.numpy as hvd

    hvd.init()
    total = hvd.allreduce(np.arange(3, dtype=np.float64) * (hvd.rank() + 1), op=hvd.Sum)
    out = {"before": before, "after": MPI.Is_initialized(), "rank": hvd.rank(), "size": hvd.size(),
           "sum": total.tolist(), "threads": MPI.Query_thread() == MPI.THREAD_MULTIPLE,
           "mpi_rank": MPI.COMM_WORLD.Get_rank()}
    hvd.shutdown()
    hvd.init()  # MPI stays up between shutdown and a new init
    out["again"] = float(hvd.allreduce(np.ones(1), op=hvd.Sum)[0])
    out["finalized_before_exit"] = MPI.Is_finalized()
    return out


@pytest.mark.parametrize("np_", [2, 3])
def test_horovod_initializes_mpi_when_mpi4py_does_not(np_):
    res = run_ranks(_init_without_mpi4py_init, np=np_, timeout=120)
    want = [sum(r + 1 for r in range(np_)) * i for i in range(3)]
    for r, out in enumerate(res):
        assert out["before"] is False and out["after"] is True, out
        assert out["rank"] == r == out["mpi_rank"] and out["size"] == np_, out
        assert out["sum"] == want, f"rank {r}: allreduce {out['sum']}, expected {want}"
        assert out["threads"], f"rank {r}: MPI not initialized with MPI_THREAD_MULTIPLE"
        assert out["again"] == np_ and out["finalized_before_exit"] is False, out


_FINALIZE_SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    import mpi4py
    mpi4py.rc.initialize = {initialize}
    from mpi4py import MPI
    import horovod.numpy as hvd
    hvd.init()
    hvd.allreduce([1.0], name="x")
    @atexit.register
    def check():
        # runs after the program, before Horovod's exit step: MPI is still up
        print(f"AT_EXIT rank={{MPI.COMM_WORLD.Get_rank()}} finalized={{MPI.Is_finalized()}}",
              flush=True)
    print(f"READY rank={{hvd.rank()}}", flush=True)
""")


@pytest.mark.parametrize("initialize", [False, True])
def test_mpi_finalized_at_exit_exactly_once(tmp_path, initialize):
    """Open MPI 5 fails a job whose rank exits without MPI_Finalize ("exiting improperly")."""
    script = tmp_path / "fin.py"
    script.write_text(_FINALIZE_SCRIPT.format(initialize=initialize))
    res = run_mpi_script([sys.executable, str(script)], np=2, timeout=120, check=False)
    assert res.returncode == 0, res.stdout
    assert sorted(line for line in res.stdout.splitlines() if line.startswith("READY")) == [
        "READY rank=0", "READY rank=1"], res.stdout
    assert res.stdout.count("finalized=False") == 2, res.stdout
    assert "improperly" not in res.stdout and "rror" not in res.stdout, res.stdout


def test_init_after_mpi_finalize_says_so(tmp_path):
    script = tmp_path / "after.py"
    script.write_text("import mpi4py\nmpi4py.rc.initialize = False\nfrom mpi4py import MPI\n"
                      "MPI.Init()\nMPI.Finalize()\nimport horovod.numpy as hvd\n"
                      "try:\n    hvd.init()\nexcept Exception as e:\n    print('ERR', type(e).__name__, e)\n")
    res = run_mpi_script([sys.executable, str(script)], np=2, timeout=120, check=False)
    assert res.stdout.count("ERR BackendUnavailableError MPI was already finalized") == 2, res.stdout


def _bad_then_good_process_sets():
    import horovod.numpy as hvd
    from horovod.common import basics

    size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    out = {}
    try:  # the global set again: a duplicate
        hvd.init(process_sets=[hvd.ProcessSet([0]), hvd.ProcessSet(range(size))])
        out["first"] = "no error"
    except ValueError as exc:
        out["first"] = str(exc)
    out["size_between"] = hvd.size()
    first, rest = hvd.ProcessSet([0]), hvd.ProcessSet(reversed(range(1, size)))
    hvd.init(process_sets=[first, rest])
    out["ids"] = [first.process_set_id, rest.process_set_id]
    out["table"] = basics._get_process_set_ids_and_ranks()
    import numpy as np

    if rest.included():
        out["sum"] = float(hvd.allreduce(np.ones(1), op=hvd.Sum, process_set=rest)[0])
    # no rank shuts down (which stops every engine) before the others are done
    hvd.allreduce(np.zeros(1), name="done")
    return out


@pytest.mark.parametrize("np_", [2, 3])
def test_bad_process_sets_leave_horovod_connected_for_a_retry(np_):
    res = run_ranks(_bad_then_good_process_sets, np=np_, timeout=120)
    for r, out in enumerate(res):
        assert "duplicate" in out["first"] and "global set" in out["first"], out
        assert out["size_between"] == np_
        assert out["ids"] == [1, 2], out
        assert out["table"] == {0: list(range(np_)), 1: [0], 2: list(range(1, np_))}, out
        if r > 0:
            assert out["sum"] == np_ - 1


def _per_rank_communicator_sets():
    from mpi4py import MPI

    import horovod.numpy as hvd
    from horovod.common import basics

    world = MPI.COMM_WORLD
    half = world.Split(color=world.rank % 2, key=world.rank)
    mine = hvd.ProcessSet(half)  # each rank passes its own half
    hvd.init(comm=world, process_sets=[mine, hvd.ProcessSet([0])] if world.size > 2 else [mine])
    return {"id": mine.process_set_id, "table": basics._get_process_set_ids_and_ranks(),
            "global_comm": hvd.global_process_set.mpi_comm is world}


@pytest.mark.parametrize("np_", [2, 3])
def test_communicator_sets_differing_per_rank_get_the_same_ids_everywhere(np_):
    res = run_ranks(_per_rank_communicator_sets, np=np_, timeout=120)
    evens, odds = list(range(0, np_, 2)), list(range(1, np_, 2))
    want = {0: list(range(np_)), 1: evens, 2: odds}
    if np_ > 2:
        want[3] = [0]
    for r, out in enumerate(res):
        assert out["table"] == want, f"rank {r}: {out['table']}, expected {want}"
        assert out["id"] == (1 if r % 2 == 0 else 2), out
        assert out["global_comm"], out


def _fail_fast_hook_state():
    import sys

    import horovod.numpy as hvd
    from horovod.common import lifecycle

    original = sys.exit
    hvd.init()
    state = (lifecycle.installed(), sys.exit is not original, hvd.size())
    hvd.shutdown()
    # shutdown removes the hook: Python's sys.exit is back
    return state + (lifecycle.installed(), sys.exit is original)


@pytest.mark.parametrize(("np_", "switch", "hooked"), [(3, None, True), (2, "0", False)])
def test_fail_fast_hook_in_workers_of_a_job_unless_switched_off(np_, switch, hooked):
    env = {"HOROVOD_FAIL_FAST": switch} if switch is not None else None
    res = run_ranks(_fail_fast_hook_state, np=np_, timeout=120, env=env)
    assert res == [(hooked, hooked, np_, False, True)] * np_, res
