"""Where one rank sits in its job: the one rank-identity type."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RankIdentity"]

@dataclass(frozen=True)
class RankIdentity:
    """Where one rank sits in its job: its host, and its global, local (on its host) and cross
    (across hosts, among the ranks of its local rank) numbers.

    A launcher's slot (``horovod.runner.hosts.SlotInfo`` is this type), an elastic round's member
    (:attr:`RoundInfo.slot`) and an initialised rank's place (``horovod.common.topology``).
    """

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int

    def env(self) -> dict[str, str]:
        """The identity variables a launcher gives the worker of this slot (upstream's names)."""
        return {"HOROVOD_HOSTNAME": self.hostname, "HOROVOD_RANK": str(self.rank),
                "HOROVOD_SIZE": str(self.size), "HOROVOD_LOCAL_RANK": str(self.local_rank),
                "HOROVOD_LOCAL_SIZE": str(self.local_size), "HOROVOD_CROSS_RANK": str(self.cross_rank),
                "HOROVOD_CROSS_SIZE": str(self.cross_size)}
