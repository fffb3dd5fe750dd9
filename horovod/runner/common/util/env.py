"""Rank and size of this process as the launcher put them in the environment (upstream's helper)."""

from __future__ import annotations

import os

__all__ = ["get_env_rank_and_size"]

from horovod.common.protocol import RANK_SIZE_VARS as _PAIRS


def get_env_rank_and_size() -> tuple[int, int] | None:
    """Return ``(rank, size)`` from horovodrun's, Open MPI's or PMI's variables, or None if unset.

    Raises:
        RuntimeError: a launcher set only one of its two variables.
    """
    for rank_var, size_var in _PAIRS:
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"Could not determine process rank and size: only one of {rank_var} and "
                               f"{size_var} is set ({rank_var}={rank!r}, {size_var}={size!r}).")
    return None
