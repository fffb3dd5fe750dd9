"""hvd.init() joins the job of the launcher that started it: torchrun, a torch group, srun (issue 22).

Real processes; every rank's values are checked. Spark's TorchDistributor and Ray Train are in
test_launchers_spark_ray.py.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from horovod.testing import run_ranks
from tests._ports import held_step_ports, reserved_port

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[2]
BIN = Path(__file__).resolve().parent / "bin"
RECIPE = REPO / "tests" / "gpu" / "bin" / "torch_recipe.py"
RECIPE_LINE = re.compile(r"rank (\d) device (\S+) loss ([\d.]+) -> ([\d.]+) spread (\S+)")
BINDING_LINE = re.compile(r"BINDING (\w+) rank (\d) size (\d) local (\d)/(\d) cross (\d)/(\d) sum (\S+) bcast (\S+)")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "OMPI_COMM", "PMI", "SLURM_", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") or k == "SLURM_CONF"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _run(argv: list[str], timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{argv} did not finish in {timeout} s:\n{exc.stdout}") from None


def torchrun(np_: int, log_dir: Path, *args: str) -> list[str]:
    # --tee 3 --log-dir: each worker's output goes to its own file, which the tests read once the agent
    # ended; the agent's copy on its stdout is only for the failure messages (its tailer threads read
    # the files while they grow, so a line can reach that copy split or not at all).
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={np_}", "--tee", "3",
            f"--log-dir={log_dir}", *args]


def _workers_output(log_dir: Path) -> str:
    """Every worker's stdout as torchrun's agents wrote it under ``log_dir``, whole lines only."""
    files = sorted(log_dir.glob("**/attempt_*/*/stdout.log"))
    assert files, f"no worker output under {log_dir}"
    return "".join(f.read_text(errors="replace") for f in files)


def _recipe_lines(out: str, np_: int) -> dict[int, tuple[float, float, float]]:
    lines = {int(r): (float(a), float(b), float(s)) for r, _, a, b, s in RECIPE_LINE.findall(out)}
    assert sorted(lines) == list(range(np_)), out[-3000:]
    return lines


def test_torchrun_runs_the_seed_recipe_like_horovodrun(tmp_path):
    """The unchanged seed script under torchrun: size N, identical parameters, horovodrun's losses
    (N=3, an odd size; torchrun with two workers on a node is the two-node test's)."""
    np_ = 3
    res = _run(torchrun(np_, tmp_path, str(RECIPE)))
    assert res.returncode == 0, res.stdout[-3000:]
    mine = _recipe_lines(_workers_output(tmp_path), np_)
    ref = _run([sys.executable, "-m", "horovod.runner", "--gloo", "-np", str(np_), sys.executable, str(RECIPE)])
    assert ref.returncode == 0, ref.stdout[-3000:]
    theirs = _recipe_lines(ref.stdout, np_)
    for r in range(np_):
        first, last, spread = mine[r]
        assert spread == 0.0 and last < first, res.stdout[-2000:]
        assert mine[r][:2] == pytest.approx(theirs[r][:2], abs=2e-4), (mine, theirs)


@pytest.mark.parametrize(("binding", "np_"), [("numpy", 3), ("tensorflow", 2)])
def test_numpy_and_tensorflow_bindings_under_torchrun(binding, np_, tmp_path):
    res = _run(torchrun(np_, tmp_path, str(BIN / "bindings.py"), binding), timeout=180)
    assert res.returncode == 0, res.stdout[-3000:]
    lines = sorted(BINDING_LINE.findall(_workers_output(tmp_path)), key=lambda x: int(x[1]))
    assert [int(x[1]) for x in lines] == list(range(np_)), res.stdout[-3000:]
    for name, rank, size, lr, ls, cr, cs, s, b in lines:
        assert (name, int(size), int(lr), int(ls), int(cr), int(cs)) == (binding, np_, int(rank), np_, 0, 1)
        assert float(s) == np_ * (np_ + 1) / 2 and float(b) == np_ - 1


def test_unreachable_torchrun_store_fails_every_rank_naming_the_variables():
    """WORLD_SIZE=2 and torchrun's variables, but nobody serves MASTER_ADDR:MASTER_PORT: no rank runs alone."""
    with reserved_port() as port:  # held, never listened on: no other process serves it meanwhile
        procs = []
        start = time.monotonic()
        for rank in range(2):
            env = _env({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "TORCHELASTIC_RUN_ID": "t", "TORCHELASTIC_USE_AGENT_STORE": "True",
                        "HOROVOD_GLOO_TIMEOUT_SECONDS": "3"})
            procs.append(subprocess.Popen([sys.executable, str(BIN / "bindings.py"), "torch"], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outs = [p.communicate(timeout=90)[0] for p in procs]
        elapsed = time.monotonic() - start
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode != 0 and "BINDING" not in out, out
        assert f"Rank {rank} of a job started by torchrun cannot reach the job's store at 127.0.0.1:{port}" in out, out
        assert "WORLD_SIZE=2" in out and f"MASTER_PORT={port}" in out and "LauncherError" in out, out
    assert elapsed < 60, f"took {elapsed:.0f} s"


def test_missing_master_addr_fails_at_once_with_what_is_missing():
    res = _run([sys.executable, str(BIN / "bindings.py"), "numpy"], timeout=60,
               env={"RANK": "1", "WORLD_SIZE": "3", "MASTER_PORT": "29500"})
    assert res.returncode != 0 and "BINDING" not in res.stdout
    assert "Missing: MASTER_ADDR" in res.stdout and "WORLD_SIZE=3" in res.stdout, res.stdout[-2000:]


def _in_torch_group(port: int) -> tuple:
    """Under an already-initialised default Gloo group (as Ray Train / Lightning DDP leave it)."""
    import torch
    import torch.distributed as dist

    import horovod.torch as hvd

    rank, size = int(os.environ["HOROVOD_TEST_RANK"]), int(os.environ["HOROVOD_TEST_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    hvd.init()
    got = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())
    total = hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum).item()
    hvd.shutdown()
    hvd.init()  # a second init on the same store (new prefix)
    again = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    hvd.shutdown()
    t = torch.tensor([1.0])
    dist.all_reduce(t)  # the user's own group still works
    dist.destroy_process_group()
    return got, total, again, t.item()


def _spawned(i: int, port: int, size: int, q) -> None:  # noqa: ANN001
    os.environ["HOROVOD_TEST_RANK"], os.environ["HOROVOD_TEST_SIZE"] = str(i), str(size)
    q.put((i, _in_torch_group(port)))


def test_already_initialised_gloo_group_from_torch_multiprocessing_spawn():
    """torch.multiprocessing.spawn + init_process_group('gloo'), then hvd.init(): np=3."""
    with reserved_port() as port:  # for rank 0's store (torch binds it with SO_REUSEADDR)
        code = f"""
import os, sys
sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})
import torch.multiprocessing as mp
from test_run_anywhere import _spawned
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.spawn(_spawned, args=({port}, 3, q), nprocs=3, join=True)
    print("SPAWN", sorted(q.get() for _ in range(3)), flush=True)
"""
        res = _run([sys.executable, "-c", code], timeout=150)
    assert res.returncode == 0, res.stdout[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("SPAWN"))
    got = eval(line[len("SPAWN "):])  # noqa: S307 - our own repr of tuples of numbers
    assert got == [(r, ((r, 3, r, 3), 6.0, 3.0, 3.0)) for r in range(3)], res.stdout[-3000:]


# Exactly the variables Slurm's srun sets for each task of a one-node step of `srun -n 2`
# (names and formats from srun(1), "OUTPUT ENVIRONMENT VARIABLES" / sbatch(1)).
def _srun_env(task: int, ntasks: int, node: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "77", "SLURM_JOBID": "77", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
            "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task), "SLURM_NODEID": "0",
            "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
            "SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1",
            "SLURM_STEP_NODELIST": node, "SLURM_NODELIST": node, "SLURM_JOB_NODELIST": node,
            "SLURM_STEP_TASKS_PER_NODE": str(ntasks), "SLURM_TASKS_PER_NODE": str(ntasks),
            "SLURMD_NODENAME": node, "SLURM_TOPOLOGY_ADDR": node, "SLURM_CPUS_ON_NODE": "2"}


def _srun_available() -> bool:
    import shutil

    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "idle" in out.stdout


def test_slurm_tasks():
    """Real `srun -n N` where a Slurm controller runs here; else exactly the variables srun sets
    (N=3; tests/slurm runs real steps of 2 and 3 tasks)."""
    np_ = 3
    node = socket.gethostname()
    if _srun_available():
        res = _run(["srun", "--overcommit", "-n", str(np_), sys.executable, str(BIN / "bindings.py"), "torch"],
                   timeout=120)
        out = res.stdout
        assert res.returncode == 0, out[-3000:]
    else:
        procs = [subprocess.Popen([sys.executable, str(BIN / "bindings.py"), "torch"],
                                  env=_env(_srun_env(t, np_, node)), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for t in range(np_)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), "\n".join(outs)[-3000:]
        out = "\n".join(outs)
    lines = sorted(BINDING_LINE.findall(out), key=lambda x: int(x[1]))
    assert [int(x[1]) for x in lines] == list(range(np_)), out[-3000:]
    for _, rank, size, lr, ls, cr, cs, s, b in lines:
        assert (int(size), int(lr), int(ls), int(cr), int(cs)) == (np_, int(rank), np_, 0, 1)
        assert float(s) == np_ * (np_ + 1) / 2 and float(b) == np_ - 1


_MET = """
import numpy as np

import horovod.numpy as hvd
from horovod.common.context import get_context

hvd.init()
s = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)[0]
print("MET", hvd.rank(), get_context().launch.master_port, s, flush=True)
hvd.shutdown()
"""


def test_slurm_tasks_name_the_store_port_task_0_bound(tmp_path):
    """The srun step's first candidate port is held by another process (a listening socket): task 0
    binds the next one, and every task's ``hvd.init()`` names that port (the launch it logs and a
    job reads), not the first candidate it derived (variables as srun sets them)."""
    step, ports, held = held_step_ports(taken=1, free=1, first_job=7700)
    node = socket.gethostname()
    try:
        procs = [subprocess.Popen([sys.executable, "-c", _MET], text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT,
                                  env=_env({**_srun_env(t, 2, node), **step, "SLURM_JOBID": step["SLURM_JOB_ID"],
                                            "SLURM_STEPID": step["SLURM_STEP_ID"], "HOROVOD_SLURM_KEY": "file",
                                            "HOROVOD_SLURM_KEY_DIR": str(tmp_path / "keys")}))
                 for t in range(2)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for sock in held:
            sock.close()
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)[-3000:]
    met = sorted(x.split()[1:] for o in outs for x in o.splitlines() if x.startswith("MET "))
    assert met == [["0", str(ports[1]), "3.0"], ["1", str(ports[1]), "3.0"]], "\n".join(outs)[-3000:]


def _detected() -> str:
    import horovod.torch as hvd
    from horovod.common.context import get_context

    hvd.init()
    return get_context().launch.launcher


def test_horovod_variables_take_precedence_over_torchrun_variables():
    """horovodrun's ranks that inherited a torchrun environment still join horovodrun's job."""
    stale = {"RANK": "5", "WORLD_SIZE": "9", "MASTER_ADDR": "10.255.255.1", "MASTER_PORT": "1",
             "SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NODELIST": "x"}
    assert run_ranks(_detected, np=2, timeout=90, env=stale) == ["mpi", "mpi"]


@pytest.mark.spark
@pytest.mark.slow
def test_spark_torch_distributor_local_mode():
    """TorchDistributor(num_processes=2, local_mode=True) on a local Spark runs torchrun: hvd joins it."""
    pytest.importorskip("pyspark")
    res = _run([sys.executable, str(BIN / "torch_distributor.py"), "2"], timeout=240)
    assert res.returncode == 0, res.stdout[-3000:]
    line = next((x for x in res.stdout.splitlines() if x.startswith("DISTRIBUTOR ")), None)
    assert line is not None, res.stdout[-3000:]
    assert json.loads(line[len("DISTRIBUTOR "):]) == [[r, 2, r, 2, "torchrun", 3.0] for r in range(2)]


@pytest.mark.ray
@pytest.mark.slow
def test_ray_train_torch_trainer_two_workers():
    """Ray Train's TorchTrainer initialises torch.distributed; hvd.init() uses that group's store."""
    pytest.importorskip("ray.train.torch")
    res = _run([sys.executable, str(BIN / "ray_torch_trainer.py"), "2"], timeout=240)
    assert res.returncode == 0, res.stdout[-3000:]
    found = {int(m.group(1)): json.loads(m.group(2)) for m in re.finditer(r"TRAINER (\d) (\[.*\])", res.stdout)}
    want = [[r, 2, r, 2, "torch-group", 3.0] for r in range(2)]
    assert found == {0: want, 1: want}, res.stdout[-3000:]


def test_torchrun_two_nodes_local_and_cross_ranks(tmp_path):
    """Two torchrun agents (--nnodes=2, static rendezvous) of 2 workers each on this machine:
    local ranks follow torchrun's nodes (GROUP_RANK), cross ranks join the nodes."""
    with reserved_port() as port:  # for the agents' store (torch binds it with SO_REUSEADDR)
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", "--tee", "3",
                "--master_addr=127.0.0.1", f"--master_port={port}"]
        procs = [subprocess.Popen([*argv, f"--node_rank={n}", f"--log-dir={tmp_path / str(n)}",
                                   str(BIN / "bindings.py"), "torch"], env=_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in range(2)]
        outs = [p.communicate(timeout=150)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)[-3000:]
    lines = sorted(BINDING_LINE.findall(_workers_output(tmp_path)), key=lambda x: int(x[1]))
    got = [tuple(int(v) for v in x[1:7]) for x in lines]
    # (rank, size, local rank, local size, cross rank, cross size)
    assert got == [(0, 4, 0, 2, 0, 2), (1, 4, 1, 2, 0, 2), (2, 4, 0, 2, 1, 2), (3, 4, 1, 2, 1, 2)], outs
    assert all(float(x[7]) == 10 and float(x[8]) == 3 for x in lines)
