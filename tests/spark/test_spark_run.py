"""horovod.spark.run and run_elastic on a real local-cluster (two executor JVMs): results in rank
order with the right topology, output on the driver, identical parameters after training, a
raising rank, too few task slots, a killed executor (static: clear error; elastic: survived)."""

from __future__ import annotations

import importlib.util
import io
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import horovod.spark
from horovod.common.exceptions import WorkerFailedError
from horovod.spark.runner import SparkStartTimeoutError
from tests._averaging import averaged_params

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]

# The ranks unpickle the functions below: ship them by value (this test module is not importable
# in the executors). Functions in a user's __main__ or notebook need nothing of the kind.
import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "spark"


def _topology(tag: str) -> tuple:
    import hvd_spark_shipped  # shipped with SparkContext.addPyFile: on the task's path only
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)
    print(f"hello from rank {hvd.rank()}", flush=True)
    out = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
           hvd.cross_size(), float(total[0]), tag, os.environ.get("MY_SPARK_TEST_VAR"),
           hvd_spark_shipped.VALUE)
    hvd.shutdown()
    return out


def _raise_on_rank_1() -> None:
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("boom on rank 1")
    hvd.allreduce(np.array([1.0]))


def _kill_my_executor() -> None:
    """Kill the executor JVM this rank runs under (the Spark task's executor)."""
    import psutil

    p = psutil.Process()
    while p is not None:
        if "CoarseGrainedExecutorBackend" in " ".join(p.cmdline()):
            p.kill()
            return
        p = p.parent()
    raise RuntimeError("no executor JVM among this process's ancestors")


def _static_kill_rank_1() -> int:
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    if hvd.rank() == 1:
        time.sleep(0.5)
        _kill_my_executor()
        time.sleep(60)
    for _ in range(600):
        hvd.allreduce(np.array([1.0]))
        time.sleep(0.1)
    return hvd.rank()


def _elastic_train(steps: int, marker: str) -> tuple:
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())  # different weights: the state sync makes them equal
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0, step_sizes=[])

    @hvd.elastic.run
    def loop(state: hvd.elastic.TorchState) -> tuple:
        while state.step < steps:
            # each rank on its own batch: the weights show whether every step averaged every rank
            state.step_sizes = state.step_sizes + [hvd.size()]
            x, y = _batch(state.step, hvd.rank())
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            state.step += 1
            if state.step == 10 and hvd.rank() == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                _kill_my_executor()
                time.sleep(60)
            time.sleep(0.05)
            state.commit()
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        return hvd.rank(), hvd.size(), state.step, params.numpy(), list(state.step_sizes)

    return loop(state)


def _batch(step: int, rank: int) -> tuple:
    import torch

    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 4, generator=gen) + rank, torch.randn(8, 1, generator=gen)


def _expected_params(step_sizes: list[int]) -> np.ndarray:
    """``_elastic_train`` in one process (``tests/_averaging.py``), its parameters flattened."""
    return np.concatenate([p.ravel() for p in averaged_params(step_sizes, _batch, lr=0.01)])


def _elastic_raise() -> None:
    import torch

    import horovod.torch as hvd

    hvd.init()
    state = hvd.elastic.TorchState(torch.nn.Linear(1, 1), step=0)

    @hvd.elastic.run
    def loop(state: hvd.elastic.TorchState) -> None:
        raise ValueError("elastic boom")

    loop(state)


def test_run_results_in_rank_order_topology_and_output(spark, tmp_path):
    shipped = tmp_path / "hvd_spark_shipped.py"
    shipped.write_text("VALUE = 'shipped'\n")
    spark.sparkContext.addPyFile(str(shipped))
    out, err = io.StringIO(), io.StringIO()
    results = horovod.spark.run(_topology, args=("x",), num_proc=2, stdout=out, stderr=err,
                                env={"MY_SPARK_TEST_VAR": "42"}, start_timeout=60)
    # both executors are on this machine: one host, local ranks 0 and 1
    assert results == [(0, 2, 0, 2, 0, 1, 3.0, "x", "42", "shipped"),
                       (1, 2, 1, 2, 0, 1, 3.0, "x", "42", "shipped")]
    lines = out.getvalue().splitlines()
    assert "[0]<stdout>:hello from rank 0" in lines
    assert "[1]<stdout>:hello from rank 1" in lines
    assert "Running 2 processes..." in err.getvalue()


def test_run_pytorch_example_trains_identical_parameters(spark):
    spec = importlib.util.spec_from_file_location("pytorch_spark_digits",
                                                  EXAMPLES / "pytorch_spark_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not in sys.modules: cloudpickle ships train() by value
    out = io.StringIO()
    results = horovod.spark.run(module.train, kwargs={"epochs": 2}, num_proc=2, stdout=out,
                                start_timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 for r in results)
    np.testing.assert_array_equal(results[0]["params"], results[1]["params"])
    assert results[0]["accuracy"] > 0.5  # it learned (chance is 0.1)
    assert "[0]<stdout>:epoch 1: test accuracy" in out.getvalue()


def test_run_raising_rank_fails_with_its_traceback(spark):
    with pytest.raises(WorkerFailedError) as info:
        horovod.spark.run(_raise_on_rank_1, num_proc=2, stdout=io.StringIO(),
                          stderr=io.StringIO(), start_timeout=60)
    err = info.value
    assert err.rank == 1
    assert isinstance(err.exception, ValueError)
    assert "rank 1" in str(err) and "boom on rank 1" in str(err)
    assert "_raise_on_rank_1" in str(err)  # the rank's traceback


def test_run_too_few_slots_is_an_error_within_start_timeout(spark):
    t0 = time.monotonic()
    with pytest.raises(SparkStartTimeoutError) as info:
        horovod.spark.run(_raise_on_rank_1, num_proc=3, start_timeout=3,
                          stderr=io.StringIO())
    elapsed = time.monotonic() - t0
    assert elapsed < 60  # start_timeout (3 s) and the report, not a hang (holds at load 10)
    text = str(info.value)
    assert "0 of 3 started" in text and "2 free task slot(s)" in text


def test_run_killed_executor_fails_clearly(spark):
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        horovod.spark.run(_static_kill_rank_1, num_proc=2, stdout=io.StringIO(),
                          stderr=io.StringIO(), start_timeout=60)
    assert time.monotonic() - t0 < 60
    text = str(info.value)
    print(text)
    assert info.value.rank == 1
    assert "rank 1 (partition" in text and "executor was lost" in text
    assert "run_elastic" in text


def test_run_elastic_raising_worker_fails_with_its_traceback(spark):
    with pytest.raises(WorkerFailedError) as info:
        horovod.spark.run_elastic(_elastic_raise, num_proc=2, elastic_timeout=60,
                                  stdout=io.StringIO(), stderr=io.StringIO())
    assert isinstance(info.value.exception, ValueError)
    assert "elastic boom" in str(info.value) and "_elastic_raise" in str(info.value)


def test_run_elastic_survives_a_killed_executor(spark, tmp_path):
    import logging

    marker = str(tmp_path / "killed")
    events = io.StringIO()
    handler = logging.StreamHandler(events)
    logging.getLogger("horovod.runner.elastic").addHandler(handler)
    try:
        results = horovod.spark.run_elastic(_elastic_train, args=(120, marker), num_proc=2,
                                            min_num_proc=1, max_num_proc=2, elastic_timeout=60,
                                            stdout=io.StringIO(), stderr=io.StringIO())
    finally:
        logging.getLogger("horovod.runner.elastic").removeHandler(handler)
    assert os.path.exists(marker)  # rank 1 did kill its executor
    assert results and [r[0] for r in results] == list(range(len(results)))
    assert all(r[2] == 120 for r in results)
    step_sizes = results[0][4]
    # every step taken once (committed steps replayed after the reset are not counted twice),
    # the first ones by the two ranks together
    assert len(step_sizes) == 120 and step_sizes[0] == 2, step_sizes
    for r in results:
        assert r[4] == step_sizes  # the state (and its history) synced from rank 0 after the reset
        # no committed step lost, applied twice or left unaveraged across the reset: every rank
        # holds the weights of one process that averaged each step's batches of all the ranks
        np.testing.assert_allclose(r[3], _expected_params(step_sizes), rtol=1e-5, atol=1e-6)
    log = events.getvalue()
    # the lost executor's worker counted as killed; the job went on after a reset
    # the driver learns of the loss either from the worker's end (SIGKILL with its executor) or,
    # when the worker's heartbeats stop first, by removing it (its end then follows the removal)
    assert ("failed (killed by signal 9 (SIGKILL))" in log
            or "after being removed from the job" in log), log
    assert "(reset 1; state synced from rank 0)" in log
