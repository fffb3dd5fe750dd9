"""Launch plans (pure): per rank host, command and environment."""

from __future__ import annotations

import pytest

from horovod.common.exceptions import ConfigError
from horovod.runner.hosts import parse_hosts
from horovod.runner.launch.plan import build_plan, exportable_env, format_plan
from horovod.runner.settings import LaunchSettings

ENV = {"PATH": "/bin", "HOME": "/root", "OLDPWD": "/x", "HOROVOD_SECRET_KEY": "s", "SSH_CLIENT": "1",
       "BASH_FUNC_foo%%": "() {}", "CUDA_VISIBLE_DEVICES": "0", "OMPI_COMM_WORLD_RANK": "3", "FOO": "1"}


def plan_for(mode: str = "gloo", np: int = 4, hosts: str = "a:2,b:2", local: set[str] | None = None,
             **kw):
    s = LaunchSettings(command=["python", "train.py"], np=np, **kw)
    return build_plan(s, parse_hosts(hosts), ENV, local if local is not None else {"a"}, mode,
                      ("10.0.0.1", "4242") if mode == "gloo" else None)


def test_gloo_plan_per_rank_identity_and_rendezvous() -> None:
    plan = plan_for()
    assert [(r.slot.rank, r.slot.hostname, r.local) for r in plan.ranks] == [
        (0, "a", True), (1, "a", True), (2, "b", False), (3, "b", False)]
    assert plan.remote_hosts == ["b"]
    r2 = plan.ranks[2].env
    assert r2["HOROVOD_HOSTNAME"] == "b" and r2["HOROVOD_RANK"] == "2"
    assert (r2["HOROVOD_LOCAL_RANK"], r2["HOROVOD_CROSS_RANK"], r2["HOROVOD_CROSS_SIZE"]) == ("0", "1", "2")
    assert plan.job_env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.1"
    assert plan.job_env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "4242"
    assert plan.job_env["HOROVOD_CONTROLLER"] == "gloo"
    assert plan.job_env["PYTHONUNBUFFERED"] == "1"


def test_mpi_plan_has_no_per_rank_env() -> None:
    plan = plan_for("mpi")
    assert all(r.env == {} for r in plan.ranks)
    assert "HOROVOD_GLOO_RENDEZVOUS_ADDR" not in plan.job_env


def test_exported_env_drops_unsafe_variables() -> None:
    fwd = exportable_env(ENV)
    assert fwd == {"PATH": "/bin", "HOME": "/root", "FOO": "1"}


def test_extra_env_tunables_and_nics() -> None:
    plan = plan_for(extra_env={"FOO": None, "BAR": "x"}, tunable_env={"HOROVOD_CYCLE_TIME": "5"},
                    nics=["eth1", "eth2"])
    assert plan.job_env["FOO"] == "1" and plan.job_env["BAR"] == "x"
    assert plan.job_env["HOROVOD_CYCLE_TIME"] == "5"
    assert plan.job_env["NCCL_SOCKET_IFNAME"] == "eth1,eth2"
    assert plan.job_env["HOROVOD_GLOO_IFACE"] == "eth1"


def test_extra_env_missing_variable_is_named() -> None:
    with pytest.raises(ConfigError) as err:
        plan_for(extra_env={"NOPE": None})
    assert err.value.variable == "NOPE"


def test_np_above_slots_and_missing_command() -> None:
    with pytest.raises(ConfigError, match="more processes"):
        plan_for(np=5)
    with pytest.raises(ConfigError, match="No command"):
        build_plan(LaunchSettings(np=1), parse_hosts("a:1"), {}, {"a"}, "mpi")


def test_format_plan_lists_every_rank_and_hides_nothing_secret() -> None:
    text = format_plan(plan_for(), ["cmd0", "cmd1"])
    for r in range(4):
        assert f"rank {r}: host {'a' if r < 2 else 'b'}" in text
    assert "HOROVOD_RANK=3" in text and "remote (ssh)" in text and "cmd1" in text
    assert "HOROVOD_SECRET_KEY" not in text


def test_cidr_network_interface_is_not_a_gloo_interface() -> None:
    plan = plan_for(nics=["10.200.0.0/24"])
    assert "HOROVOD_GLOO_IFACE" not in plan.job_env
    assert plan.job_env["NCCL_SOCKET_IFNAME"] == "10.200.0.0/24"


@pytest.mark.parametrize("mode", ["gloo", "mpi"])
def test_workers_get_torch_huge_pages_unless_the_user_chose(mode: str) -> None:
    assert plan_for(mode).job_env["THP_MEM_ALLOC_ENABLE"] == "1"
    s = LaunchSettings(command=["python", "train.py"], np=2)
    plan = build_plan(s, parse_hosts("a:2"), {**ENV, "THP_MEM_ALLOC_ENABLE": "0"}, {"a"}, mode,
                      ("10.0.0.1", "4242") if mode == "gloo" else None)
    assert "THP_MEM_ALLOC_ENABLE" not in plan.job_env
    assert plan.forward_env.get("THP_MEM_ALLOC_ENABLE") == "0"
