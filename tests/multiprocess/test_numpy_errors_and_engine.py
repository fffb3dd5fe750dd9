"""Bad input, faults and engine features on real ranks: every error is raised on every rank
with the tensor, the ranks and the values; the engine keeps serving later operations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from horovod.testing import RanksFailed, run_mpi_script, run_ranks
from tests._shared_launch import JOINT_TIMEOUT, joint_launch, own_init, under_settings

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _mismatches():
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common.exceptions import CollectiveMismatchError

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    seen = {}
    cases = {
        "shape": lambda: hvd.allreduce(np.ones(3 + (r == n - 1)), name="shape"),
        "dtype": lambda: hvd.allreduce(np.ones(3, np.float32 if r else np.float64), name="dtype"),
        "op": lambda: hvd.allreduce(np.ones(3), name="op", op=hvd.Max if r else hvd.Sum),
        "root": lambda: hvd.broadcast(np.ones(3), root_rank=r % 2, name="root"),
        "kind": lambda: (hvd.allgather if r else hvd.broadcast_object)(np.ones((1, 3)), name="kind"),
        "scale": lambda: hvd.allreduce(np.ones(3), name="scale", prescale_factor=1.0 + r),
        "gather_dims": lambda: hvd.allgather(np.ones((2, 2 + r)), name="gather_dims"),
    }
    for case, fn in cases.items():
        if case == "kind":
            continue
        t0 = time.monotonic()
        try:
            fn()
            seen[case] = "no error"
        except CollectiveMismatchError as e:
            seen[case] = {"type": type(e).__name__, "is_runtime": isinstance(e, RuntimeError),
                          "name": e.tensor_name, "field": e.field, "ranks": e.ranks,
                          "values": {k: v for k, v in e.values.items()}, "msg": str(e),
                          "seconds": time.monotonic() - t0}
        # The engine keeps working after each error.
        ok = hvd.allreduce(np.ones(2), op=hvd.Sum, name=f"after.{case}")
        assert np.allclose(ok, n), (r, case, ok)
    return seen


@pytest.mark.parametrize("np_", [2, 3])
def test_mismatches_raise_on_every_rank_with_fields_and_engine_survives(np_):
    results = _launch(np_).results("mismatches")
    for r, seen in enumerate(results):
        for case, info in seen.items():
            assert info != "no error", f"rank {r}: {case} mismatch raised nothing"
            assert info["is_runtime"] and info["seconds"] < 1.0, (r, case, info)
            assert info["ranks"] == list(range(np_)), (r, case, info)
            assert f"allreduce.{case}" in info["msg"] or case in info["msg"], (r, case, info["msg"])
        assert seen["shape"]["field"] == "shape" and "Mismatched ALLREDUCE tensor shapes" in seen["shape"]["msg"]
        assert seen["dtype"]["field"] == "dtype" and "float32" in seen["dtype"]["msg"]
        assert seen["op"]["field"] == "reduce_op" and "Max" in seen["op"]["msg"]
        assert seen["root"]["field"] == "root_rank"
        assert seen["scale"]["field"] == "scale"
        assert seen["gather_dims"]["field"] == "shape"
        assert seen["shape"]["values"] == ({"(3,) float64": list(range(np_ - 1)), "(4,) float64": [np_ - 1]})


def _bad_arguments():
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    _r, n = hvd.rank(), hvd.size()
    errors = {}

    def expect(case, exc_type, fn):
        try:
            fn()
            errors[case] = "no error"
        except exc_type as e:
            errors[case] = str(e)

    expect("root_out_of_range", ValueError, lambda: hvd.broadcast(np.ones(2), root_rank=n + 5))
    expect("splits_length", ValueError, lambda: hvd.alltoall(np.ones(4), splits=[4]))
    expect("splits_too_many_rows", ValueError, lambda: hvd.alltoall(np.ones(4), splits=[3] * n))
    expect("no_splits_uneven", ValueError, lambda: hvd.alltoall(np.ones(n + 1)))
    expect("reducescatter_scalar", ValueError, lambda: hvd.reducescatter(np.float64(3.0)))
    expect("reducescatter_max", NotImplementedError, lambda: hvd.reducescatter(np.ones(4), op=hvd.Max))
    expect("allgather_scalar", ValueError, lambda: hvd.allgather(np.float32(1)))
    expect("adasum", NotImplementedError, lambda: hvd.allreduce(np.ones(2), op=hvd.Adasum))
    expect("unsupported_dtype", ValueError, lambda: hvd.allreduce(np.ones(2, np.complex64)))
    expect("bool_allreduce", ValueError, lambda: hvd.allreduce(np.ones(2, bool)))
    expect("op_and_average", ValueError, lambda: hvd.allreduce(np.ones(2), average=True, op=hvd.Sum))
    # A name still in flight on this rank is refused; the first op still completes.
    h = hvd.allreduce_async(np.ones(2), name="dup")
    expect("duplicate_name", ValueError, lambda: hvd.allreduce_async(np.ones(2), name="dup"))
    first = hvd.synchronize(h)
    assert np.allclose(first, 1.0)
    # Every rank still works after all of this.
    assert np.allclose(hvd.allreduce(np.ones(3), op=hvd.Sum, name="after"), n)
    return errors


def test_bad_arguments_are_clear_errors_on_every_rank_and_nothing_hangs():
    results = _launch(3).results("bad_arguments")
    for r, errors in enumerate(results):
        for case, msg in errors.items():
            assert msg != "no error", f"rank {r}: {case} raised nothing"
        assert "root_rank 8" in errors["root_out_of_range"]
        assert "3 ranks" in errors["splits_length"]
        assert "even multiple" in errors["no_splits_uneven"]
        assert "AVERAGE and SUM" in errors["reducescatter_max"]
        assert "not supported yet" in errors["adasum"]
        assert "same name" in errors["duplicate_name"] and "allreduce.dup" in errors["duplicate_name"]
        assert "complex64" in errors["unsupported_dtype"]


def _join_body():
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    r, _n = hvd.rank(), hvd.size()
    out = {}
    if r == 0:
        time.sleep(0.2)
        out["last"] = hvd.join()
    else:
        # Rank 0 has joined: it contributes zeros, Average still divides by the full size.
        out["avg"] = hvd.allreduce(np.full(4, 6.0), name="during_join").tolist()
        out["sum"] = hvd.allreduce(np.full(2, 1.0), op=hvd.Sum, name="during_join_sum").tolist()
        try:
            hvd.allgather(np.ones((1, 2)), name="gather_during_join")
            out["allgather"] = "no error"
        except RuntimeError as e:
            out["allgather"] = str(e)
        out["last"] = hvd.join()
    # The job goes on normally after everyone joined.
    out["after"] = hvd.allreduce(np.ones(2), op=hvd.Sum, name="after_join").tolist()
    hvd.barrier()
    return out


@pytest.mark.parametrize("np_", [2, 3])
def test_join_zero_contributions_and_last_rank(np_):
    results = _launch(np_).results("join")
    lasts = {res["last"] for res in results}
    assert len(lasts) == 1 and lasts != {0}, results  # rank 0 joined first, so it is not the last
    for r, res in enumerate(results):
        assert res["after"] == [np_] * 2, (r, res)
        if r:
            assert res["avg"] == [6.0 * (np_ - 1) / np_] * 4, (r, res)
            assert res["sum"] == [float(np_ - 1)] * 2, (r, res)
            assert "not supported with Join" in res["allgather"], (r, res)


def _join_in_turn_with_unnamed_calls():
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = []
    for first in range(n):
        # The rank that joins first skips the unnamed calls the others make while it waits.
        if r != first:
            hvd.allreduce(np.ones(3), op=hvd.Sum)
            try:
                hvd.allgather(np.ones((2, 2)))
            except RuntimeError:
                pass
        last = hvd.join()
        out.append((last, hvd.allreduce(np.full(2, float(r)), op=hvd.Sum).tolist()))
    return out


@pytest.mark.parametrize("np_", [2, 3])
def test_unnamed_calls_stay_in_step_when_each_rank_joins_first_in_turn(np_):
    # At np=3 the two ranks that did not join first used to number their unnamed calls apart
    # from the rank that joined (it skipped them), and the next round hung.
    results = _launch(np_).results("join_in_turn")
    total = float(sum(range(np_)))
    for step in range(np_):
        assert len({res[step][0] for res in results}) == 1, results
        assert all(res[step][1] == [total, total] for res in results), results


def _process_sets():
    import numpy as np

    import horovod.numpy as hvd

    evens = hvd.ProcessSet([0, 2])
    odd = hvd.ProcessSet([1])
    hvd.init(process_sets=[evens, odd])
    r = hvd.rank()
    out = {"ids": (evens.process_set_id, odd.process_set_id), "included": evens.included()}
    if evens.included():
        out["sum"] = hvd.allreduce(np.full(2, float(r)), op=hvd.Sum, name="ps", process_set=evens).tolist()
        out["gather"] = hvd.allgather(np.array([r]), process_set=evens).tolist()
        out["bcast"] = hvd.broadcast(np.array([r]), root_rank=2, process_set=evens).tolist()
        out["set_rank"] = evens.rank()
        try:
            hvd.broadcast(np.ones(1), root_rank=1, process_set=evens)
        except ValueError as e:
            out["root_not_member"] = str(e)
        hvd.barrier(process_set=evens)
    else:
        try:
            hvd.allreduce(np.ones(1), process_set=evens)
        except ValueError as e:
            out["not_member"] = str(e)
    # Same name in two sets at once, then a global op: all ranks keep going.
    out["world"] = hvd.allreduce(np.ones(1), op=hvd.Sum, name="world").tolist()
    return out


def test_static_process_sets():
    res = _LAUNCHES[3].results("static_sets")
    for out in res:
        assert out["ids"] == (1, 2) and out["world"] == [3.0], out
    for r in (0, 2):
        assert res[r]["sum"] == [2.0, 2.0] and res[r]["gather"] == [0, 2] and res[r]["bcast"] == [2]
        assert res[r]["set_rank"] == r // 2
        assert "not a rank of the process set" in res[r]["root_not_member"]
    assert "Rank 1 is not a member of the provided process set" in res[1]["not_member"]


def _dynamic_sets():
    import numpy as np

    import horovod.numpy as hvd

    hvd.init(process_sets="dynamic")
    hvd.rank()
    ps = hvd.add_process_set([0, 1])
    out = {"id": ps.process_set_id}
    if ps.included():
        out["sum"] = hvd.allreduce(np.ones(2), op=hvd.Sum, process_set=ps, name="d").tolist()
    try:
        hvd.add_process_set([1, 0])
    except ValueError as e:
        out["dup"] = str(e)
    out["removed"] = hvd.remove_process_set(ps)
    out["id_after"] = ps.process_set_id
    out["removed_global"] = hvd.remove_process_set(hvd.global_process_set)
    ps2 = hvd.add_process_set(hvd.ProcessSet([1, 2]))
    out["id2"] = ps2.process_set_id
    if ps2.included():
        out["sum2"] = hvd.allreduce(np.ones(1), op=hvd.Sum, process_set=ps2, name="d").tolist()
    return out


def test_dynamic_process_sets():
    res = _LAUNCHES[3].results("dynamic_sets")
    for _r, out in enumerate(res):
        assert out["id"] == 1 and out["removed"] is True and out["id_after"] is None, out
        assert out["removed_global"] is False and "duplicate" in out["dup"] and out["id2"] == 2
    assert res[0]["sum"] == [2.0, 2.0] and res[1]["sum"] == [2.0, 2.0] and "sum" not in res[2]
    assert res[1]["sum2"] == [2.0] and res[2]["sum2"] == [2.0]


def _dynamic_sets_off():
    import horovod.numpy as hvd

    hvd.init()
    try:
        hvd.add_process_set([0])
    except ValueError as e:
        return str(e)
    return "no error"


def test_add_process_set_needs_dynamic_mode():
    (msg,) = run_ranks(_dynamic_sets_off, np=1, timeout=60)
    assert "HOROVOD_DYNAMIC_PROCESS_SETS=1" in msg


def _timeline_body(path):
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    for _step in range(3):
        hs = [hvd.allreduce_async(np.ones(10), name=f"test_allreduce.{k}") for k in range(4)]
        for h in hs:
            hvd.synchronize(h)
    hvd.allreduce(np.ones(1 << 18), name="big")
    hvd.shutdown()
    return True


def test_timeline_is_written_by_rank_0_as_valid_chrome_trace(tmp_path):
    path = str(tmp_path / "timeline.json")
    run_ranks(_timeline_body, np=2, timeout=60, args=(path,),
              env={"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    events = json.loads(open(path).read())
    names = {e.get("name") for e in events}
    procs = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert "allreduce.test_allreduce.0" in procs
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START", "MPI_ALLREDUCE",
            "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"} <= names, names
    assert any("start_time_since_epoch_in_micros" in e.get("args", {}) for e in events)


def _stall_body():
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    if hvd.rank() == 1:
        time.sleep(4)  # rank 1 never submits 'stalled' until much later
    try:
        hvd.allreduce(np.ones(2), name="stalled")
        return "completed"
    except RuntimeError as e:
        return str(e)


def test_stall_inspector_warns_and_shuts_down_naming_missing_ranks(tmp_path):
    # rank 1 submits only once rank 0 has failed 'stalled' (a file rank 0 writes then): no sleep
    # decides the order, however slow the machine
    flag = tmp_path / "rank0_failed"
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2",
           "STALL_FLAG": str(flag)}
    res = run_mpi_script([sys.executable, "-c", (
        "import os, time, numpy as np, horovod.numpy as hvd\n"
        "hvd.init()\n"
        "flag = os.environ['STALL_FLAG']\n"
        "if hvd.rank() == 1:\n"
        "    while not os.path.exists(flag): time.sleep(0.05)\n"
        "try:\n"
        "    hvd.allreduce(np.ones(2), name='stalled'); print('rank', hvd.rank(), 'completed')\n"
        "except RuntimeError as e:\n"
        "    print('rank', hvd.rank(), 'ERROR', type(e).__name__, flush=True)\n"
        "if hvd.rank() == 0: open(flag, 'w').close()\n")], np=2, timeout=120, env=env)
    out = res.stdout
    assert "allreduce.stalled" in out and "rank 1 did not submit it" in out, out
    assert "Missing ranks:" in out and "1!: [allreduce.stalled]" in out, out
    assert "rank 0 ERROR HorovodShutdownError" in out and "rank 1 ERROR HorovodShutdownError" in out, out


def test_a_rank_that_dies_ends_the_job_quickly():
    t0 = time.monotonic()
    res = run_mpi_script([sys.executable, "-c", (
        "import os, numpy as np, horovod.numpy as hvd\n"
        "hvd.init()\n"
        "hvd.allreduce(np.ones(1), name='warmup')\n"
        "if hvd.rank() == 1: os._exit(17)\n"
        "hvd.allreduce(np.ones(1), name='never')\n")], np=3, timeout=180, check=False)
    assert res.returncode != 0
    # the others would wait in 'never' until the launch timeout; the bound holds at load 10
    assert time.monotonic() - t0 < 120


def _config_variants():
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    n = hvd.size()
    outs = []
    for _step in range(3):
        hs = [hvd.allreduce_async(np.full(k + 1, float(hvd.rank())), name=f"v{k}", op=hvd.Sum)
              for k in range(20)]
        outs.append(all(np.allclose(hvd.synchronize(h), sum(range(n))) for h in hs))
    return outs


# Each a body of the NumPy launch at np=3, from its own init under its settings (_SETTINGS_BODIES).
_ENGINE_SETTINGS = {
    "no-cache": {"HOROVOD_CACHE_CAPACITY": "0"},
    "tiny-cache": {"HOROVOD_CACHE_CAPACITY": "3"},
    "no-fusion": {"HOROVOD_FUSION_THRESHOLD": "0"},
    "tiny-fusion": {"HOROVOD_FUSION_THRESHOLD": "64", "HOROVOD_CYCLE_TIME": "5"},
}


@pytest.mark.parametrize("label", list(_ENGINE_SETTINGS))
def test_engine_settings_keep_results_correct(label):
    res = _SETTINGS_LAUNCHES[3].results(f"settings-{label}")
    assert all(all(r) for r in res), res


def test_bad_setting_fails_init_naming_the_variable():
    with pytest.raises(RanksFailed, match="HOROVOD_FUSION_THRESHOLD='abc'"):
        run_ranks(_config_variants, np=2, timeout=60, env={"HOROVOD_FUSION_THRESHOLD": "abc"})


def test_plain_python_is_a_job_of_size_one_and_reinit_works():
    code = ("import numpy as np, horovod.numpy as hvd\n"
            "try:\n    hvd.rank()\nexcept ValueError as e:\n    print('before:', e)\n"
            "hvd.init(); print('size', hvd.size(), 'rank', hvd.rank(), 'local', hvd.local_rank())\n"
            "print('sum', hvd.allreduce(np.ones(3), op=hvd.Sum).tolist())\n"
            "hvd.shutdown(); hvd.init(); print('again', hvd.allreduce(np.ones(1), name='x').tolist())\n"
            "hvd.shutdown(); print('initialized', hvd.is_initialized())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "before: Horovod has not been initialized; use hvd.init()." in out.stdout
    assert "size 1 rank 0 local 0" in out.stdout and "sum [1.0, 1.0, 1.0]" in out.stdout
    assert "again [1.0]" in out.stdout and "initialized False" in out.stdout


def _reinit():
    import numpy as np

    import horovod.numpy as hvd

    vals = []
    for _i in range(3):
        hvd.init()
        vals.append(float(hvd.allreduce(np.ones(1), op=hvd.Sum, name="r")[0]))
        hvd.shutdown()
    return vals


def test_init_after_shutdown_under_mpi():
    assert run_ranks(_reinit, np=2, timeout=60) == [[2.0] * 3] * 2


def _shutdown_propagates():
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    if hvd.rank() == 0:
        hvd.shutdown()
        return "shut down"
    time.sleep(1.0)
    try:
        hvd.allreduce(np.ones(1), name="late")
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_shutdown_on_one_rank_fails_later_ops_on_the_others():
    res = run_ranks(_shutdown_propagates, np=2, timeout=60)
    assert res[1].startswith("Horovod has been shut down"), res


def _cache_churn():
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    n = hvd.size()
    arrs = [np.full(8, float(hvd.rank())) for _ in range(400)]
    ok = []
    for _step in range(4):
        for a in arrs:
            a[:] = hvd.rank()
        hs = [hvd.allreduce_async_(a, name=f"churn.{i}", op=hvd.Sum) for i, a in enumerate(arrs)]
        for h in hs:
            hvd.synchronize(h)
        ok.append(all(np.allclose(a, sum(range(n))) for a in arrs))
    return ok


@pytest.mark.parametrize("np_", [2, 3])
def test_more_tensors_than_cache_slots_never_diverges(np_):
    # Once a step's tensors overflow the response cache, evictions happen while requests wait on
    # the evicted slots; every rank must still run every tensor exactly once, step after step.
    res = _SETTINGS_LAUNCHES[np_].results("cache_churn")
    assert res == [[True] * 4] * np_, res


# The plain-init bodies above are parts of the launch per world size that the NumPy modules'
# plain-init bodies share (tests/_shared_launch.py), among the last (errors on purpose), and so are
# the process-set bodies at np=3, between shutdowns of their own (own_init); the bodies that need a
# process of their own (a shutdown or death on one rank, a setting that fails init) keep their launches.
_LAUNCHES = {n: joint_launch("numpy", n, {"join": _join_body, "join_in_turn": _join_in_turn_with_unnamed_calls,
                                          "mismatches": _mismatches}
                             | ({"bad_arguments": _bad_arguments, "static_sets": own_init(_process_sets),
                                 "dynamic_sets": own_init(_dynamic_sets)} if n == 3 else {}),
                             timeout=420 + 180 * (n == 3), late=True)
             for n in (2, 3)}


# The bodies with settings of their own (read at init) join those launches too, each from an init of
# its own under its settings, put back after it (tests/_shared_launch.py).
_SETTINGS_LAUNCHES = {n: joint_launch("numpy", n, {
    "cache_churn": under_settings(_cache_churn, {"HOROVOD_CACHE_CAPACITY": "64"}),
    **({f"settings-{label}": under_settings(_config_variants, env) for label, env in _ENGINE_SETTINGS.items()}
       if n == 3 else {}),
}, timeout=120 + 360 * (n == 3), late=True) for n in (2, 3)}


def _launch(np_: int):
    return _LAUNCHES[np_]
