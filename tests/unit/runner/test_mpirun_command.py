"""The mpirun command for each MPI flavour (pure: no mpirun is run)."""

from __future__ import annotations

import pytest

from horovod.common.exceptions import ConfigError
from horovod.runner.hosts import parse_hosts
from horovod.runner.launch.commands import SHIM_PATH
from horovod.runner.launch.mpirun import FLAVOURS, MpiImplementation, mpirun_command, parse_mpi_version
from horovod.runner.launch.plan import build_plan
from horovod.runner.settings import LaunchSettings

ENV = {"PATH": "/usr/bin", "FOO": "1"}


def command(flavour: str, major: int = 5, hosts: str = "a:2,b:2", np: int = 4, is_root: bool = True,
            secret: str | None = None, **kw):
    s = LaunchSettings(command=["python", "train.py"], np=np, **kw)
    plan = build_plan(s, parse_hosts(hosts), ENV, {"a"}, "mpi")
    impl = MpiImplementation(FLAVOURS[flavour], major, "/opt/mpi/bin/mpirun")
    return mpirun_command(plan, s, impl, ENV, is_root=is_root, python="/py", secret=secret)


def after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("output, key, major", [
    ("mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org", "openmpi", 5),
    ("mpirun (Open MPI) 4.1.5", "openmpi", 4),
    ("mpirun (IBM Spectrum MPI) 10.4.0", "spectrum", 10),
    ("HYDRA build details:\n    Version:                                 4.1.2", "mpich", 4),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10", "intel", 2021),
    ("something else", None, 0),
])
def test_parse_mpi_version(output: str, key: str | None, major: int) -> None:
    assert parse_mpi_version(output) == (key, major)


def test_open_mpi_5_command() -> None:
    cmd = command("openmpi", nics=["eth0"], ssh_port=2222, ssh_identity_file="/k",
                  output_filename="/out", mpi_args="--mca foo bar", secret="s3cret")
    a = cmd.argv
    assert a[:5] == ["/opt/mpi/bin/mpirun", "--allow-run-as-root", "--tag-output", "-np", "4"]
    assert after(a, "-H") == "a:2,b:2"
    assert a[a.index("--bind-to"):a.index("--bind-to") + 4] == ["--bind-to", "none", "--map-by", "slot"]
    assert ["--mca", "pml", "ob1"] == a[a.index("pml") - 1:a.index("pml") + 2]
    assert after(a, "btl_tcp_if_include") == "eth0" and after(a, "oob_tcp_if_include") == "eth0"
    assert a[a.index("oob_tcp_if_include") - 1] == "--prtemca"
    assert after(a, "plm_ssh_args") == "-p 2222 -i /k"
    assert after(a, "--output-filename") == "/out"
    # every forwarded and job variable is exported by name; values stay out of the command line
    exported = {a[i + 1] for i, x in enumerate(a) if x == "-x"}
    assert {"PATH", "FOO", "PYTHONUNBUFFERED", "NCCL_SOCKET_IFNAME", "HOROVOD_SECRET_KEY"} <= exported
    assert "s3cret" not in " ".join(a) and "s3cret" not in cmd.text()
    assert cmd.env is not None and cmd.env["HOROVOD_SECRET_KEY"] == "s3cret"
    assert a[-11:-8] == ["--mca", "foo", "bar"]  # --mpi-args go last before the program
    # the shim, told that mpirun started it (its parent is mpirun: _shim._orphaned_at_start)
    assert a[-5:] == [SHIM_PATH, "--mpirun", "--", "python", "train.py"]
    assert cmd.tagged == "openmpi" and cmd.ranks == (0, 1, 2, 3)


def test_open_mpi_4_uses_mca_names_and_no_root_flag_for_users() -> None:
    a = command("openmpi", major=4, is_root=False, nics=["eth0"], ssh_port=22).argv
    assert "--allow-run-as-root" not in a
    assert after(a, "plm_rsh_args") == "-p 22"
    assert a[a.index("oob_tcp_if_include") - 1] == "--mca"


def test_open_mpi_large_cluster_disables_tree_spawn() -> None:
    hosts = ",".join(f"h{i}:1" for i in range(64))
    a = command("openmpi", hosts=hosts, np=64).argv
    assert after(a, "plm_ssh_no_tree_spawn") == "1" and after(a, "plm_ssh_num_concurrent") == "64"


def test_binding_args_override() -> None:
    a = command("openmpi", binding_args="--bind-to core --map-by core").argv
    assert "none" not in a and after(a, "--bind-to") == "core"


def test_spectrum_mpi_socket_binding_and_tcp() -> None:
    a = command("spectrum", tcp=True).argv
    assert "--allow-run-as-root" not in a
    assert a[a.index("-bind-to"):a.index("-bind-to") + 6] == [
        "-bind-to", "socket", "-map-by", "socket", "-rank-by", "core"]
    assert "-tcp" in a


@pytest.mark.parametrize("flavour", ["mpich", "intel"])
def test_hydra_command(flavour: str) -> None:
    cmd = command(flavour, nics=["ib0", "eth0"], ssh_port=2222, output_filename="/o", secret="zz")
    a = cmd.argv
    assert "-l" in a and "--tag-output" not in a and "-x" not in a
    assert after(a, "-hosts") == "a,b" and after(a, "-ppn") == "2"
    assert after(a, "-iface") == "ib0" and after(a, "-bootstrap-exec-args") == "-p 2222"
    assert after(a, "-outfile-pattern") == "/o"
    assert a[a.index("NCCL_SOCKET_IFNAME") - 1] == "-genv"
    assert after(a, "-genvlist") == "HOROVOD_SECRET_KEY" and "zz" not in " ".join(a)
    assert cmd.tagged == "mpich"


def test_hydra_needs_equal_slots() -> None:
    with pytest.raises(ConfigError, match="same number of slots"):
        command("mpich", hosts="a:2,b:1", np=3)
