"""``horovod.run(fn, np=..., min_np=..., max_np=..., host_discovery_script=...)``: elastic from
Python, results of the final round's first ``min_np`` ranks."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

from tests.elastic.conftest import REPO

pytestmark = pytest.mark.integration


def test_run_elastic_returns_results_in_rank_order(tmp_path: Path, monkeypatch) -> None:
    import horovod

    # Defined here so that cloudpickle sends it by value (the workers cannot import this file).
    def train_fn(steps: int) -> tuple[int, int, float]:
        import torch

        import horovod.torch as hvd

        hvd.init()
        w = torch.zeros(3)

        @hvd.elastic.run
        def train(state: hvd.elastic.TorchState) -> None:
            while state.step < steps:
                state.w = state.w + hvd.allreduce(torch.ones(3), op=hvd.Sum)
                state.step += 1
                state.commit()

        state = hvd.elastic.TorchState(w=w, step=0)
        train(state)
        return hvd.rank(), hvd.size(), float(state.w.sum())

    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        results = horovod.run(train_fn, args=(5,), np=2, min_np=2, max_np=2,
                              host_discovery_script=str(script), executable=sys.executable)
    assert results == [(0, 2, 30.0), (1, 2, 30.0)]


def test_run_elastic_failure_names_the_root_cause_worker(tmp_path: Path, monkeypatch) -> None:
    """A failed elastic ``horovod.run`` raises the one failure text of every launcher: why the
    job gave up, the root-cause worker with what it raised (each worker's result is stored under
    its slot, so even a worker that failed in an earlier round is named), its traceback."""
    import re

    import horovod
    from horovod.common.exceptions import WorkerFailedError

    def train_fn() -> None:
        import horovod.numpy as hvd

        hvd.init()
        raise ValueError(f"bad input on rank {hvd.rank()}")

    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "10")
    with pytest.raises(WorkerFailedError) as info:
        horovod.run(train_fn, num_proc=2, min_num_proc=2, max_num_proc=2, reset_limit=0,
                    host_discovery_script=str(script), executable=sys.executable)
    err, lines = info.value, str(info.value).splitlines()
    assert lines[0].startswith("horovod.run: the elastic job failed: "), lines
    root = re.fullmatch(r"  root cause: worker localhost\[(\d)\] \(rank (\d)\) raised ValueError: "
                        r"bad input on rank \2", lines[2])
    assert root is not None, lines
    assert f"Traceback of worker localhost[{root[1]}] (rank {root[2]}):" in lines, lines
    assert isinstance(err.exception, ValueError) and err.__cause__ is err.exception
    assert (err.rank, err.host) == (int(root[2]), "localhost")
