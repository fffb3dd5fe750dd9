"""Elastic horovodrun with a ZeroRedundancyOptimizer (stage 1) and with hvd.fully_shard: a job of
three workers loses one (its host leaves discovery) and gains it back; the shards are laid out
again at each change and every rank ends with the weights and momentum of uninterrupted training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.elastic.conftest import check_training, run_elastic

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode", ["ZERO", "FULLY_SHARD"])
def test_sharded_training_loses_a_worker_and_gains_it_back(tmp_path: Path, mode: str) -> None:
    """ZERO: the optimizer's shards are re-partitioned at each change. FULLY_SHARD
    (hvd.fully_shard, ZeRO-3): the rows of every parameter and of SGD's momentum are laid out
    again over 2, then 3 workers (the joining worker's fully_shard check is made with the others
    in the state's sync). Either way every rank ends with the uninterrupted weights."""
    steps = 24
    res, _ = run_elastic(
        tmp_path, "localhost:2\n127.0.0.1:1\n", ["-np", "3", "--min-np", "2", "--max-np", "3"],
        {"STEPS": str(steps), mode: "1",
         "HOSTS_AT": json.dumps({"6": "localhost:2\n", "12": "localhost:2\n127.0.0.1:1\n"}),
         "WAIT_FOR_SIZE": "2@10,3@18"})
    finals = check_training(res, steps, size=3)
    assert "127.0.0.1[0]" in {f["me"] for f in finals}
    sizes = [json.loads(line.split("RESET ", 1)[1])["size"]
             for line in res.stdout.splitlines() if "RESET " in line]
    assert 2 in sizes and 3 in sizes, sizes  # it did run at two workers, then three again
