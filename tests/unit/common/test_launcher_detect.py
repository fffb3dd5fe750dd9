"""Launcher detection (horovod.common.launcher_detection): pure logic on environment dicts."""

from __future__ import annotations

import pytest

from horovod.common.backends.registry import detect_launch, select_backend_name
from horovod.common.config import EngineConfig
from horovod.common.launcher_detection import LauncherError, detect, expand_nodelist, first_node

# Exactly what torchrun (torch 2.13, --nproc_per_node=2, one node) sets for its second worker.
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2", "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}

# Exactly the variables `srun -N 2 -n 3` sets for task 2 (second node), as documented by Slurm.
SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1", "SLURM_NTASKS": "3", "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NNODES": "2", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NODELIST": "gpu[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_TASKS_PER_NODE": "2,1", "SLURMD_NODENAME": "gpu08"}


def test_nothing_means_one_process():
    launch = detect({})
    assert (launch.launcher, launch.transport, launch.size) == ("none", "local", 1)


def test_torchrun_variables():
    launch = detect(TORCHRUN)
    assert (launch.launcher, launch.transport) == ("torchrun", "gloo")
    assert (launch.rank, launch.size, launch.local_rank, launch.local_size, launch.node_rank) == (1, 2, 1, 2, 0)
    assert (launch.master_addr, launch.master_port, launch.master_is_store) == ("127.0.0.1", 29500, True)
    assert "WORLD_SIZE=2" in launch.describe()


def test_plain_env_rank_zero_opens_the_store():
    env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    launch = detect(env)
    assert launch.launcher == "torchrun" and not launch.master_is_store and launch.size == 3


def test_world_size_one_is_alone_without_error():
    assert detect({"WORLD_SIZE": "1", "RANK": "0"}).transport == "local"


@pytest.mark.parametrize("drop", ["MASTER_ADDR", "MASTER_PORT", "RANK"])
def test_torchrun_without_address_names_what_is_missing(drop):
    env = {k: v for k, v in TORCHRUN.items() if k != drop}
    with pytest.raises(LauncherError) as info:
        detect(env)
    msg = str(info.value)
    assert f"Missing: {drop}" in msg and "WORLD_SIZE=2" in msg and "cannot join" in msg


def test_elastic_agent_without_world_size_is_an_error():
    with pytest.raises(LauncherError, match="Missing: WORLD_SIZE"):
        detect({"TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "0", "RANK": "0"})


def test_bad_integer_names_the_variable():
    with pytest.raises(LauncherError, match="WORLD_SIZE='two'"):
        detect({"WORLD_SIZE": "two", "RANK": "0"})


def test_srun_variables_and_compressed_nodelist():
    launch = detect(SRUN)
    assert (launch.launcher, launch.transport) == ("slurm", "gloo")
    assert (launch.rank, launch.size, launch.local_rank, launch.node_rank) == (2, 3, 0, 1)
    assert launch.master_addr == "gpu07" and 20000 <= (launch.master_port or 0) < 32768
    # Every task of the step computes the same port.
    assert detect({**SRUN, "SLURM_PROCID": "0"}).master_port == launch.master_port
    assert detect({**SRUN, "MASTER_PORT": "1234", "MASTER_ADDR": "x"}).master_addr == "x"


def test_slurm_batch_script_is_not_a_step():
    env = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")}
    assert detect(env).launcher == "none"


def test_srun_without_nodelist_is_an_error():
    env = {k: v for k, v in SRUN.items() if "NODELIST" not in k}
    with pytest.raises(LauncherError, match="Missing: SLURM_STEP_NODELIST"):
        detect(env)


def test_expand_nodelist():
    assert expand_nodelist("n[01-03,7],gpu5") == ["n01", "n02", "n03", "n7", "gpu5"]
    assert expand_nodelist("r[1-2]n[8-9]") == ["r1n8", "r1n9", "r2n8", "r2n9"]
    assert expand_nodelist("a,b-c,d[009-011]") == ["a", "b-c", "d009", "d010", "d011"]
    assert first_node("node-[0012-0020]") == "node-0012"
    for bad in ("n[1-", "n]1[", "n[3-1]", "n[a-b]"):
        with pytest.raises(ValueError):
            expand_nodelist(bad)


def test_precedence_horovod_first_then_mpi_then_torch_group_then_torchrun_then_slurm():
    hvd = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "a", "HOROVOD_GLOO_RENDEZVOUS_PORT": "1", "HOROVOD_RANK": "0",
           "HOROVOD_SIZE": "2"}
    mpi = {"OMPI_COMM_WORLD_SIZE": "2"}
    everything = {**hvd, **mpi, **TORCHRUN, **SRUN}
    assert detect(everything, torch_group=(0, 2)).launcher == "horovod"
    assert detect({**mpi, **TORCHRUN, **SRUN}, torch_group=(0, 2)).launcher == "mpi"
    group = detect({**TORCHRUN, **SRUN}, torch_group=(1, 2))
    assert (group.launcher, group.rank, group.size) == ("torch-group", 1, 2)
    assert detect({**TORCHRUN, **SRUN}).launcher == "torchrun"
    assert detect(SRUN).launcher == "slurm"


def test_explicit_controller_keeps_the_launcher():
    cfg = EngineConfig.from_env({"HOROVOD_CONTROLLER": "gloo"})
    launch = detect_launch(cfg, TORCHRUN)
    assert (launch.launcher, launch.transport, launch.rank) == ("torchrun", "gloo", 1)
    assert select_backend_name(EngineConfig.from_env({"HOROVOD_CONTROLLER": "mpi"}),
                               {**TORCHRUN, **MPIRUN}) == "mpi"


def test_torch_group_of_one_is_local():
    assert detect({}, torch_group=(0, 1)).transport == "local"


def test_diagnose_command_reports_the_launcher(monkeypatch, capsys):
    from horovod import diagnose

    for k in list(__import__("os").environ):
        if k.startswith(("HOROVOD_", "OMPI_", "PMI", "SLURM_", "TORCHELASTIC")) or k in TORCHRUN:
            monkeypatch.delenv(k, raising=False)
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    assert diagnose.main([]) == 0
    assert "launcher torchrun (transport gloo) rank 1 of 2" in capsys.readouterr().out
    monkeypatch.delenv("MASTER_ADDR")
    assert diagnose.main([]) == 1
    assert "Missing: MASTER_ADDR" in capsys.readouterr().out


# ------------------------------------------------------------------ explicit transport x launcher
HVD_GLOO = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "1", "HOROVOD_RANK": "1",
            "HOROVOD_SIZE": "2"}
# What Open MPI's mpirun -np 2 sets for its second rank (the variables detect reads).
MPIRUN = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
          "PMIX_RANK": "1"}
LAUNCHES = {"horovod": (HVD_GLOO, None), "mpi": (MPIRUN, None), "torch-group": ({}, (1, 2)),
            "torchrun": (TORCHRUN, None), "slurm": (SRUN, None), "none": ({}, None)}
# (launcher, explicit) -> joinable. Gloo meets under mpirun through MPI (create_gloo); MPI cannot join
# a job of more than one process that no MPI launcher started (every rank would be a world of one).
JOINABLE = {("horovod", "gloo"): True, ("mpi", "gloo"): True, ("torch-group", "gloo"): True,
            ("torchrun", "gloo"): True, ("slurm", "gloo"): True, ("none", "gloo"): True,
            ("horovod", "mpi"): False, ("mpi", "mpi"): True, ("torch-group", "mpi"): False,
            ("torchrun", "mpi"): False, ("slurm", "mpi"): False, ("none", "mpi"): True}


@pytest.mark.parametrize("variable", ["HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS"])
@pytest.mark.parametrize("launcher,explicit", sorted(JOINABLE))
def test_explicit_transport_under_every_launcher(launcher, explicit, variable):
    env, group = LAUNCHES[launcher]
    cfg = EngineConfig.from_env({variable: explicit.upper()})
    if JOINABLE[(launcher, explicit)]:
        launch = detect(env, group, explicit, explicit_variable=variable)
        assert (launch.launcher, launch.transport) == (launcher, explicit)
        return
    with pytest.raises(LauncherError) as info:
        detect(env, group, explicit, explicit_variable=variable)
    msg = str(info.value)
    other = "gloo" if explicit == "mpi" else "mpi"
    # The launcher, the variable that asked, what is missing, and the fix.
    assert f"{variable}={explicit}" in msg and "missing: " in msg and f"unset {variable}" in msg, msg
    assert {"mpi": "mpirun", "horovod": "horovodrun --gloo", "torch-group": "torch.distributed group",
            "torchrun": "torchrun", "slurm": "srun"}[launcher] in msg, msg
    assert "`mpirun`" in msg, msg
    assert (info.value.launcher, info.value.variable) == (launcher, variable)
    assert other not in msg.split("asks for")[0]
    # The same through the registry (hvd.init()'s path), naming the variable that was set.
    with pytest.raises(LauncherError, match=f"{variable}={explicit}"):
        if group is None:
            detect_launch(cfg, env)
        else:
            detect(env, group, explicit, explicit_variable=variable)


def test_explicit_mpi_under_a_launcher_of_one_or_with_mpi_variables():
    assert detect({"WORLD_SIZE": "1", "RANK": "0"}, None, "mpi").transport == "mpi"
    assert detect({}, (0, 1), "mpi").transport == "mpi"
    assert detect({**SRUN, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"}, None, "mpi").transport == "mpi"
    # srun --mpi=pmix and horovodrun's MPI mode under a torch environment: MPI variables too.
    assert detect({**TORCHRUN, **MPIRUN}, None, "mpi").launcher == "mpi"
    assert detect({**HVD_GLOO, **MPIRUN}, None, "mpi").transport == "mpi"


def test_controller_wins_over_cpu_operations_in_the_message():
    cfg = EngineConfig.from_env({"HOROVOD_CONTROLLER": "MPI", "HOROVOD_CPU_OPERATIONS": "MPI"})
    with pytest.raises(LauncherError, match="HOROVOD_CONTROLLER=mpi"):
        detect_launch(cfg, TORCHRUN)
    cfg = EngineConfig.from_env({"HOROVOD_CPU_OPERATIONS": "MPI"})
    with pytest.raises(LauncherError, match="HOROVOD_CPU_OPERATIONS=mpi"):
        detect_launch(cfg, TORCHRUN)


def test_gloo_under_mpirun_store_host():
    from horovod.common.rendezvous_handlers import MPIHandler

    assert MPIHandler.store_host({}, ["n1", "n1", "n1"]) == "127.0.0.1"
    assert MPIHandler.store_host({}, ["n1", "localhost"]) == "127.0.0.1"  # routes to the other host
    # A peer name this host cannot resolve: still an address of this host, no error.
    assert MPIHandler.store_host({}, ["n1", "no-such-host.invalid"])
    assert MPIHandler.store_host({"HOROVOD_GLOO_IFACE": "lo"}, ["n1", "n2"]) == "127.0.0.1"
