"""Hierarchical allreduce/allgather across real separate hosts (2 fake hosts x 2 ranks).

``horovodrun --hierarchical-allreduce --hierarchical-allgather`` runs
``bin/hierarchical_check.py`` on every rank, which checks the values of many allreduces and
allgathers on the hierarchical path and on the flat path (they must be equal).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests._fakehosts import FakeHosts
from tests.integration.conftest import REPO, launcher_env, tagged_json

pytestmark = [pytest.mark.integration, pytest.mark.fakehosts]

CHECK = str(Path(__file__).resolve().parent / "bin" / "hierarchical_check.py")


@pytest.mark.parametrize("mode", ["mpi", "gloo"])
def test_hierarchical_collectives_across_two_hosts(fakehosts_factory: Callable[..., FakeHosts],
                                                   mode: str) -> None:
    fh = fakehosts_factory(2)
    h1, h2 = fh.hosts
    env = launcher_env({"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    res = fh.run(h1, [sys.executable, "-m", "horovod.runner", f"--{mode}", "-np", "4", "-H", f"{h1}:2,{h2}:2",
                      "--hierarchical-allreduce", "--hierarchical-allgather", sys.executable, CHECK],
                 env=env, timeout=300, cwd=str(REPO))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    results = tagged_json(res.stdout, "RESULT")
    assert sorted(results) == [0, 1, 2, 3], res.stdout + res.stderr
    for r, got in results.items():
        assert got["bad"] == [], f"rank {r} ({mode}):\n" + "\n".join(got["bad"])
        assert got["hierarchy"] and got["contiguous"], got
        assert (got["local_rank"], got["local_size"], got["cross_size"]) == (r % 2, 2, 2), got
