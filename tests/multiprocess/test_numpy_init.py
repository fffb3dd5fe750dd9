"""init() variants: an mpi4py communicator, a list of ranks, communicator process sets, the
runtime timeline switch and capability queries."""

from __future__ import annotations

import json
import os

import pytest

from horovod.testing import run_ranks

pytestmark = pytest.mark.multiprocess


def _init_with_comm():
    import numpy as np
    from mpi4py import MPI

    import horovod.numpy as hvd

    world = MPI.COMM_WORLD
    sub = world.Split(world.rank % 2, key=world.rank)
    hvd.init(comm=sub)
    out = {"size": hvd.size(), "rank": hvd.rank(),
           "sum": float(hvd.allreduce(np.array([world.rank], np.float64), op=hvd.Sum)[0]),
           "mpi_enabled": hvd.mpi_enabled(), "threads": hvd.mpi_threads_supported()}
    hvd.shutdown()
    hvd.init(comm=[0, 1])
    out["list_size"] = hvd.size()
    out["list_sum"] = float(hvd.allreduce(np.array([world.rank], np.float64), op=hvd.Sum)[0])
    return out


def test_init_with_mpi_communicator_and_rank_list():
    res = run_ranks(_init_with_comm, np=2, timeout=60)
    # comm = ranks split by parity: with 2 ranks each is alone.
    for r, out in enumerate(res):
        assert out["size"] == 1 and out["rank"] == 0 and out["sum"] == r, out
        assert out["mpi_enabled"] and out["threads"] is True
        assert out["list_size"] == 2 and out["list_sum"] == 1.0


def _init_with_bad_comm():
    import horovod.numpy as hvd

    try:
        hvd.init(comm="world")
    except ValueError as e:
        return str(e)
    return "no error"


def test_init_with_wrong_comm_type_is_a_clear_error():
    (msg,) = run_ranks(_init_with_bad_comm, np=1, timeout=60)
    assert "Invalid type of argument comm" in msg




def _comm_process_set_static():
    import numpy as np
    from mpi4py import MPI

    import horovod.numpy as hvd

    world = MPI.COMM_WORLD
    sub = world.Split(0 if world.rank < 2 else 1, key=world.rank)
    # Every rank passes a set built from *its* communicator; ranks 0,1 share one, rank 2 another.
    ps_low = hvd.ProcessSet(sub) if world.rank < 2 else hvd.ProcessSet([0, 1])
    ps_high = hvd.ProcessSet(sub) if world.rank >= 2 else hvd.ProcessSet([2])
    hvd.init(comm=world, process_sets=[ps_low, ps_high])
    mine = ps_low if world.rank < 2 else ps_high
    return {"ranks_low": ps_low.ranks, "ranks_high": ps_high.ranks,
            "sum": float(hvd.allreduce(np.ones(1), op=hvd.Sum, process_set=mine)[0])}


def test_process_sets_from_mpi_communicators():
    res = run_ranks(_comm_process_set_static, np=3, timeout=60)
    for r, out in enumerate(res):
        assert out["ranks_low"] == [0, 1] and out["ranks_high"] == [2], out
        assert out["sum"] == (2.0 if r < 2 else 1.0)


def _dynamic_timeline(path_a, path_b):
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    hvd.allreduce(np.ones(4), name="before_start")
    hvd.start_timeline(path_a, mark_cycles=True)
    hvd.allreduce(np.ones(4), name="in_a")
    hvd.start_timeline(path_b)
    hvd.allreduce(np.ones(4), name="in_b")
    hvd.stop_timeline()
    hvd.stop_timeline()  # harmless when already stopped
    hvd.allreduce(np.ones(4), name="after_stop")
    return hvd.rank()


def test_start_and_stop_timeline_at_run_time(tmp_path):
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    run_ranks(_dynamic_timeline, np=2, timeout=60, args=(a, b), env={"HOROVOD_TIMELINE": "DYNAMIC"})
    names_a = {e["args"]["name"] for e in json.load(open(a)) if e.get("name") == "process_name"}
    names_b = {e["args"]["name"] for e in json.load(open(b)) if e.get("name") == "process_name"}
    assert "allreduce.in_a" in names_a and "allreduce.in_b" not in names_a
    assert "allreduce.in_b" in names_b and "allreduce.after_stop" not in names_b
    assert not any("before_start" in n for n in names_a | names_b)


def _timeline_not_enabled():
    import horovod.numpy as hvd

    hvd.init()
    try:
        hvd.start_timeline("/tmp/never.json")
    except ValueError as e:
        return str(e)
    return "no error"


def test_start_timeline_needs_horovod_timeline():
    (msg,) = run_ranks(_timeline_not_enabled, np=1, timeout=60)
    assert msg == "Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage."


def test_capability_queries_and_not_initialized_errors():
    import horovod.numpy as hvd

    assert hvd.mpi_built() is True
    assert hvd.rocm_built() is False and hvd.ddl_built() is False and hvd.ccl_built() is False
    assert isinstance(hvd.nccl_built(), int)
    for fn in (hvd.size, hvd.rank, hvd.local_rank, hvd.local_size, hvd.cross_rank, hvd.cross_size,
               hvd.is_homogeneous, hvd.mpi_threads_supported, hvd.mpi_enabled, hvd.gloo_enabled):
        with pytest.raises(ValueError, match=r"Horovod has not been initialized; use hvd.init\(\)."):
            fn()
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.allreduce(__import__("numpy").ones(1))
    assert hvd.is_initialized() is False
    assert os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") is None
