"""Sharded elastic commits under elastic horovodrun (three fake hosts of one slot, so the ring is
ranks 0 -> 1 -> 2 -> 0 and each rank's part is replicated on the next): a worker SIGKILLed at
np=3 whose part only its ring successor holds, the job going on at np=2 with the restored
parameters and momentum equal to the committed ones (1e-6) and the uninterrupted run's weights;
two ring neighbours killed together: the survivor fails naming the old rank whose part is lost,
and points to hvd.checkpoint, instead of going on with a wrong state."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.elastic.conftest import check_training, driver_log, run_elastic, tagged

pytestmark = pytest.mark.integration

HOSTS = "localhost:1\n127.0.0.1:1\n127.0.0.2:1\n"


def _close(a: list, b: list) -> float:
    """The largest difference between two nested lists of floats."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        worst = max(worst, _close(x, y) if isinstance(x, list) else abs(x - y))
    return worst


@pytest.mark.parametrize("mode", ["ZERO", "FULLY_SHARD"])
def test_sharded_commit_survives_a_killed_worker(tmp_path: Path, mode: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 (127.0.0.1) dies before step 8: its committed part is held only by rank 2
    (127.0.0.2, its ring successor), which becomes rank 1 of the new world of 2. Every survivor
    starts again from exactly the committed step-8 weights and momentum (gathered whole, 1e-6),
    and the job ends with the uninterrupted run's weights. The hidden layer has 6 rows (2 per rank
    at np=3, 3 at np=2), so new rows come from the middle of an old rank's part."""
    steps, kill = 14, 8
    monkeypatch.setenv("HIDDEN", "6")  # the workers' model and the reference alike
    res, _ = run_elastic(tmp_path, HOSTS, ["-np", "3", "--min-np", "2", "--max-np", "3"],
                         {"STEPS": str(steps), mode: "1", "CHECK_RESTORE": "1", "HIDDEN": "6",
                          "KILL": f"127.0.0.1[0]@{kill}"}, timeout=240)
    finals = check_training(res, steps, size=2)
    assert {f["me"] for f in finals} == {"localhost[0]", "127.0.0.2[0]"}
    assert "worker 127.0.0.1[0] (rank 1) failed (killed by signal 9" in driver_log(res), driver_log(res)
    committed = [c for c in tagged(res.stdout, "COMMITTED") if c["step"] == kill]
    assert committed, res.stdout[-3000:]
    restored = [r for r in tagged(res.stdout, "RESTORED") if r["step"] == kill]
    # both survivors, in the new world of two
    assert sorted((r["me"], r["rank"], r["size"]) for r in restored) == [
        ("127.0.0.2[0]", 1, 2), ("localhost[0]", 0, 2)], restored
    for r in restored:
        for c in committed:
            assert _close(r["w"], c["w"]) <= 1e-6, (r["me"], r["w"], c["w"])
            assert _close(r["momentum"], c["momentum"]) <= 1e-6, (r["me"], r["momentum"], c["momentum"])
    assert committed[0]["momentum"], "no momentum committed: nothing tested"


def test_two_ring_neighbours_lost_fails_naming_the_lost_rank(tmp_path: Path) -> None:
    """Ranks 1 and 2 die together: rank 1's part was kept by itself and by rank 2, so nobody holds
    it; the survivor (rank 0, which holds its own part and rank 2's replica) raises naming old
    rank 1 and hvd.checkpoint, and the job fails."""
    res, _ = run_elastic(tmp_path, HOSTS, ["-np", "3", "--min-np", "1", "--max-np", "3"],
                         {"STEPS": "12", "FULLY_SHARD": "1",
                          "KILL": "127.0.0.1[0]@5,127.0.0.2[0]@5"}, timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-4000:]
    assert "LostRowsError" in out and "of old rank 1 (of 3) is held by no surviving rank" in out, out[-4000:]
    assert "old rank 1: kept by itself and by old rank 2" in out, out[-4000:]
    assert "hvd.checkpoint" in out
    assert not tagged(res.stdout, "FINAL"), "a worker finished with a lost state"
