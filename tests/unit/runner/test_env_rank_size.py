"""horovod.runner.common.util.env.get_env_rank_and_size: rank and size from each launcher's variables."""

from __future__ import annotations

import pytest

from horovod.runner.common.util.env import get_env_rank_and_size

_ALL = ("HOROVOD_RANK", "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    for var in _ALL:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env, want", [
    ({}, None),
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "3"}, (1, 3)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}, (2, 4)),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, (0, 2)),
    # horovodrun's variables win over the MPI ones (gloo launched under an MPI allocation)
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}, (1, 2)),
])
def test_rank_and_size_from_env(clean_env, env, want):
    for k, v in env.items():
        clean_env.setenv(k, v)
    assert get_env_rank_and_size() == want


def test_half_set_pair_names_both_variables(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "1")
    with pytest.raises(RuntimeError, match="OMPI_COMM_WORLD_SIZE"):
        get_env_rank_and_size()
