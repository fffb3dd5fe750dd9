"""Hierarchical allreduce/allgather on one machine, 4 ranks with simulated hosts (HOROVOD_HOSTNAME).

Two layouts: hosts of consecutive ranks (a: 0,1; b: 2,3) and interleaved hosts (a: 0,2; b: 1,3),
whose allgather must put the hosts' blocks back in rank order. The check itself
(``tests/integration/bin/hierarchical_check.py``) also runs across real fake hosts in
``tests/integration/test_hierarchical_fakehosts.py``.
"""

from __future__ import annotations

import pytest

from horovod.testing import run_ranks
from tests.integration.bin.hierarchical_check import check

pytestmark = pytest.mark.multiprocess

ENV = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_HIERARCHICAL_ALLGATHER": "1",
       "HOROVOD_DYNAMIC_PROCESS_SETS": "1"}


def _on_simulated_hosts(interleaved: bool) -> dict:
    import os

    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    os.environ["HOROVOD_HOSTNAME"] = "host-" + "ab"[rank % 2 if interleaved else rank // 2]
    return check()


@pytest.mark.parametrize("interleaved", [False, True], ids=["consecutive", "interleaved"])
def test_hierarchical_values_on_simulated_hosts(interleaved: bool) -> None:
    results = run_ranks(_on_simulated_hosts, np=4, timeout=240, env=ENV, args=(interleaved,))
    for res in results:
        assert res["bad"] == [], "\n".join(res["bad"])
        assert res["hierarchy"] and (res["local_size"], res["cross_size"]) == (2, 2), res
        assert res["contiguous"] is (not interleaved), res
