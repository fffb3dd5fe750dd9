"""The real Slurm cluster of the ``srun`` tests (``tests/_slurm.py``), once per session: its own
``slurmctld`` and ``slurmd`` on free ports with a ``slurm.conf`` and cluster name of its own, checked
to be the daemons answering before any test submits to it (never a Slurm already on the machine).

Skipped, with the reason, where it cannot run (not root, no apt to install ``slurm-wlm``/``munge``;
a cluster that is installed but does not come up is a failure);
``HVD_TEST_REQUIRE_SLURM=1`` turns that skip into a failure (CI sets it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests._slurm import SlurmCluster, SlurmError, unavailable_reason


def _unavailable(reason: str) -> None:
    if os.environ.get("HVD_TEST_REQUIRE_SLURM", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"HVD_TEST_REQUIRE_SLURM is set but no Slurm cluster can run here: {reason}",
                    pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    reason = unavailable_reason()
    if reason:
        _unavailable(reason)
    cluster = SlurmCluster()
    try:
        cluster.acquire()
    except SlurmError as exc:  # the packages are there but the cluster does not come up: a failure
        cluster.release()
        pytest.fail(f"the Slurm test cluster did not come up: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.release()
