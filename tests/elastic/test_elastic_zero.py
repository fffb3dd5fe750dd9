"""Elastic horovodrun with a ZeroRedundancyOptimizer (stage 1): a job of three workers loses one
(its host leaves discovery) and gains it back; the shards are re-partitioned at each change and
every rank ends with the weights and momentum of uninterrupted training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.elastic.conftest import check_training, run_elastic

pytestmark = pytest.mark.integration


def test_zero_optimizer_loses_a_worker_and_gains_it_back(tmp_path: Path) -> None:
    steps = 24
    res, _ = run_elastic(
        tmp_path, "localhost:2\n127.0.0.1:1\n", ["-np", "3", "--min-np", "2", "--max-np", "3"],
        {"STEPS": str(steps), "ZERO": "1",
         "HOSTS_AT": json.dumps({"6": "localhost:2\n", "12": "localhost:2\n127.0.0.1:1\n"}),
         "WAIT_FOR_SIZE": "2@10,3@18"})
    finals = check_training(res, steps, size=3)
    assert "127.0.0.1[0]" in {f["me"] for f in finals}
    sizes = [json.loads(line.split("RESET ", 1)[1])["size"]
             for line in res.stdout.splitlines() if "RESET " in line]
    assert 2 in sizes and 3 in sizes, sizes  # it did run at two workers, then three again


def test_fully_sharded_model_loses_a_worker_and_gains_it_back(tmp_path: Path) -> None:
    """hvd.fully_shard (ZeRO-3) under elastic: the rows of every parameter and of SGD's momentum
    are laid out again over 2, then 3 workers (the joining worker's fully_shard check is made
    with the others in the state's sync); every rank ends with the uninterrupted weights."""
    steps = 24
    res, _ = run_elastic(
        tmp_path, "localhost:2\n127.0.0.1:1\n", ["-np", "3", "--min-np", "2", "--max-np", "3"],
        {"STEPS": str(steps), "FULLY_SHARD": "1",
         "HOSTS_AT": json.dumps({"6": "localhost:2\n", "12": "localhost:2\n127.0.0.1:1\n"}),
         "WAIT_FOR_SIZE": "2@10,3@18"})
    finals = check_training(res, steps, size=3)
    assert "127.0.0.1[0]" in {f["me"] for f in finals}
    sizes = [json.loads(line.split("RESET ", 1)[1])["size"]
             for line in res.stdout.splitlines() if "RESET " in line]
    assert 2 in sizes and 3 in sizes, sizes
    # at the end each of the 3 ranks holds its rows only (parameters in order: unused (2,),
    # 0.weight (3, 4), 0.bias (3,), 2.weight (1, 3), 2.bias (1,); ceil(rows/3) rows per rank)
    rows = [json.loads(line.split("SHARDS ", 1)[1])["rows"] for line in res.stdout.splitlines()
            if "SHARDS " in line]
    assert sorted(rows) == [[0, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], rows
