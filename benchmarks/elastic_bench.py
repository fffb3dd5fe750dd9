"""Elastic training figures: recovery after a worker dies, joining of a new host, commit cost.

* ``recovery``: ``horovodrun -np 3 --min-np 2`` on hosts ``localhost:2`` and ``127.0.0.1:1`` (this
  machine under two names); the worker of ``127.0.0.1`` SIGKILLs itself at step 20. Figure: from
  its death (the time it printed just before) to the first step committed by the survivors in the
  new round, and the driver's own view (its log line times).
* ``join``: ``-np 2 --max-np 3`` on ``localhost:2``; the benchmark adds ``127.0.0.1:1`` to the
  discovery file. Figure: from that write to the first step the new worker commits (discovery
  poll of 1 s, process start with ``import torch``, rendezvous and state sync included), and the
  longest pause of the other workers; ``--only join`` compares the default (members told at
  once, as upstream) with ``HOROVOD_ELASTIC_NOTIFY_WHEN_READY=1``, interleaved.
* ``commit``: ``TorchState.commit()`` of a model with ResNet-50's parameter count (25.6 M float32)
  and its SGD momentum, in one process, against upstream's way (``copy.deepcopy`` of the state
  dicts), interleaved.

* ``points`` (``--only points``): recovery per failure point. ``horovodrun -np 3 --min-np 1
  --max-np 3`` on ``localhost:1``, ``127.0.0.1:1`` and ``127.0.0.2:1`` (this machine under three
  names, so each worker is its own host), running the tests' worker (``tests/elastic/bin/
  elastic_worker.py``, whose ``KILL_AT`` hook SIGKILLs a chosen worker at a chosen point: in
  training, inside ``commit()``, while a round forms, in the state sync of a newly added host,
  when a host notice reaches it). Figure: from the worker's "KILLING" line to the first step
  committed after the survivors' reset (stdout read live), median and worst of ``--repeats``
  runs. Interleaved in the same run: ``torchrun --max-restarts 1`` (3 processes, Gloo, a
  checkpoint file written every step, the same model) on the same failure, in training and
  while saving the checkpoint: from the kill to the first step after torchrun restarted every
  process and they reloaded the checkpoint.

    python benchmarks/elastic_bench.py [--repeats 3] [--json out.json]
    python benchmarks/elastic_bench.py --only points --repeats 5 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent('''
    import json, os, signal, sys, time
    import torch
    import horovod.torch as hvd

    hvd.init()
    me = os.environ["HOROVOD_ELASTIC_HOST"] + "[" + os.environ["HOROVOD_ELASTIC_SLOT"] + "]"
    kill = os.environ.get("KILL", "")
    steps = int(os.environ.get("STEPS", "60"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            if kill == me + "@" + str(state.step):
                print("DIED " + json.dumps({"t": time.time()}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            model(torch.randn(32, 256)).sum().backward()
            opt.step()
            state.step += 1
            state.commit()
            print("COMMIT " + json.dumps({"t": time.time(), "me": me, "step": state.step,
                                          "size": hvd.size()}), flush=True)
            time.sleep(float(os.environ.get("STEP_SLEEP", "0.05")))

    train(hvd.elastic.TorchState(model, opt, step=0))
''')


def _run(tmp: str, hosts: str, args: list[str], env: dict[str, str],
         on_line: object = None, worker_src: str | None = None) -> tuple[str, str, int]:
    hosts_file = os.path.join(tmp, "hosts")
    with open(hosts_file, "w") as fh:
        fh.write(hosts)
    script = os.path.join(tmp, "discover.sh")
    with open(script, "w") as fh:
        fh.write(f"#!/bin/sh\ncat {hosts_file}\n")
    os.chmod(script, 0o755)
    worker = worker_src or os.path.join(tmp, "worker.py")
    if worker_src is None:
        with open(worker, "w") as fh:
            fh.write(WORKER)
    full = dict(os.environ, PYTHONPATH=REPO, **env)
    argv = [sys.executable, "-m", "horovod.runner", *args, "--host-discovery-script", script,
            sys.executable, worker]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full)
    err: list[str] = []
    t = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    t.start()
    out: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if on_line is not None:
            on_line(line, hosts_file)  # type: ignore[operator]
    proc.wait(timeout=300)
    t.join(5)
    return "".join(out), "".join(err), proc.returncode


def _events(out: str, tag: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(rf"{tag} (\{{.*\}})", out)]


def recovery(tmp: str) -> dict[str, float]:
    out, err, rc = _run(tmp, "localhost:2\n127.0.0.1:1\n", ["-np", "3", "--min-np", "2"],
                        {"KILL": "127.0.0.1[0]@20", "STEPS": "40"})
    if rc != 0:
        raise SystemExit(f"recovery run failed:\n{err[-3000:]}")
    died = _events(out, "DIED")[0]["t"]
    after = [c for c in _events(out, "COMMIT") if c["t"] > died and c["size"] == 2]
    return {"death_to_first_step_s": min(c["t"] for c in after) - died}


def join(tmp: str, when_ready: bool = False) -> dict[str, float]:
    written: dict[str, float] = {}

    def on_line(line: str, hosts_file: str) -> None:
        if "t" not in written and '"step": 10,' in line:
            with open(hosts_file, "w") as fh:
                fh.write("localhost:2\n127.0.0.1:1\n")
            written["t"] = time.time()

    out, err, rc = _run(tmp, "localhost:2\n", ["-np", "2", "--max-np", "3"],
                        {"STEPS": "400", "STEP_SLEEP": "0.02",
                         "HOROVOD_ELASTIC_NOTIFY_WHEN_READY": "1" if when_ready else "0"}, on_line)
    if rc != 0:
        raise SystemExit(f"join run failed:\n{err[-3000:]}")
    first_new = min(c["t"] for c in _events(out, "COMMIT") if c["me"] == "127.0.0.1[0]")
    survivors_paused = [c["t"] for c in _events(out, "COMMIT") if c["me"] == "localhost[0]"]
    gaps = [b - a for a, b in zip(survivors_paused, survivors_paused[1:])]
    return {"discovery_to_new_worker_step_s": first_new - written["t"],
            "longest_pause_of_the_others_s": max(gaps)}


TEST_WORKER = os.path.join(REPO, "tests", "elastic", "bin", "elastic_worker.py")
POINT_HOSTS = ["localhost", "127.0.0.1", "127.0.0.2"]

# point -> (KILL_AT, extra environment): np=3 on three one-slot "hosts".
POINTS: dict[str, tuple[str, dict[str, str]]] = {
    "training": ("127.0.0.2[0]@step@12", {}),
    "commit": ("127.0.0.2[0]@commit@12", {}),
    # a first failure (rank 2 raises at step 6) makes round 1; 127.0.0.1 dies once placed in it
    "round forming": ("127.0.0.1[0]@join@1", {"RAISE": "127.0.0.2[0]@6"}),
    # start with two, add the third host at step 6: it dies in its first state sync
    "new host's state sync": ("127.0.0.2[0]@sync@1", {"HOSTS_AT": json.dumps(
        {"6": "localhost:1\n127.0.0.1:1\n127.0.0.2:1\n"})}),
    # start with two, add the third host at step 6: rank 1 dies when the notice reaches it
    "host notice": ("127.0.0.1[0]@notice@1", {"HOSTS_AT": json.dumps(
        {"6": "localhost:1\n127.0.0.1:1\n127.0.0.2:1\n"})}),
}


def point_recovery(tmp: str, point: str) -> float:
    """Seconds from the KILLING line to the first commit after the survivors' reset."""
    kill_at, extra = POINTS[point]
    start_two = "HOSTS_AT" in extra
    hosts = "".join(f"{h}:1\n" for h in POINT_HOSTS[:2 if start_two else 3])
    stamps: dict[str, float] = {}

    def on_line(line: str, hosts_file: str) -> None:
        now = time.monotonic()
        if "KILLING" in line and "kill" not in stamps:
            stamps["kill"] = now
        elif "kill" in stamps and "RESET" in line and "reset" not in stamps:
            stamps["reset"] = now
        elif "reset" in stamps and "COMMIT" in line and "resumed" not in stamps:
            stamps["resumed"] = now

    env = {"STEPS": "24", "STEP_SLEEP": "0.05", "KILL_AT": kill_at,
           "HOSTS_FILE": os.path.join(tmp, "hosts"), **extra}
    out, err, rc = _run(tmp, hosts, ["-np", "2" if start_two else "3", "--min-np", "1",
                                     "--max-np", "3"], env, on_line, worker_src=TEST_WORKER)
    if rc != 0 or "resumed" not in stamps:
        raise SystemExit(f"{point}: run failed (rc {rc}, {sorted(stamps)}):\n{err[-3000:]}")
    return stamps["resumed"] - stamps["kill"]


TORCHRUN_WORKER = textwrap.dedent('''
    import os, signal, sys, time
    import torch
    import torch.distributed as dist

    import datetime
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # The agent's store, under a prefix per attempt (the default one kept the dead attempt's
    # Gloo addresses here: connection refused after the restart).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank,
                            world_size=world)
    point, at = os.environ["KILL_POINT"], int(os.environ["KILL_STEP"])
    ckpt = os.environ["CKPT"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    if os.path.exists(ckpt):
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        step = saved["step"]
        if rank == 0:
            print(f"RESUMED {step}", flush=True)
    while step < int(os.environ["STEPS"]):
        die = attempt == 0 and rank == 2 and step == at
        if die and point == "training":
            print("KILLING training", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True) * 0.5).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        step += 1
        if die and point == "commit":
            print("KILLING commit", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()
        print(f"COMMIT {step}", flush=True)
        time.sleep(float(os.environ.get("STEP_SLEEP", "0.05")))
''')


def torchrun_recovery(tmp: str, point: str) -> float:
    """torchrun --max-restarts 1: from the kill to the first step after the whole job restarted."""
    worker = os.path.join(tmp, "torchrun_worker.py")
    with open(worker, "w") as fh:
        fh.write(TORCHRUN_WORKER)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", KILL_POINT=point, KILL_STEP="12", STEPS="24", STEP_SLEEP="0.05",
               CKPT=os.path.join(tmp, "ckpt.pt"), PYTHONPATH=REPO)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
            "--max-restarts", "1", "--monitor-interval", "0.1", "--standalone", worker]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    err: list[str] = []
    t = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    t.start()
    stamps: dict[str, float] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.monotonic()
        if "KILLING" in line and "kill" not in stamps:
            stamps["kill"] = now
        elif "RESUMED" in line and "kill" in stamps:
            stamps["restarted"] = now
        elif "COMMIT" in line and "restarted" in stamps and "resumed" not in stamps:
            stamps["resumed"] = now
    proc.wait(timeout=300)
    t.join(5)
    if proc.returncode != 0 or "resumed" not in stamps:
        raise SystemExit(f"torchrun {point}: failed (rc {proc.returncode}, {sorted(stamps)}):\n"
                         f"{''.join(err)[-3000:]}")
    return stamps["resumed"] - stamps["kill"]


def points(repeats: int) -> dict[str, dict[str, float | list[float]]]:
    """Recovery per failure point, horovod-py and torchrun interleaved run by run."""
    runs: dict[str, list[float]] = {}
    for i in range(repeats):
        for point in POINTS:
            with tempfile.TemporaryDirectory() as tmp:
                runs.setdefault(point, []).append(point_recovery(tmp, point))
            if point in ("training", "commit"):
                with tempfile.TemporaryDirectory() as tmp:
                    runs.setdefault(f"torchrun: {point}", []).append(torchrun_recovery(tmp, point))
        print(f"run {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()),
              flush=True)
    return {k: {"median_s": statistics.median(v), "worst_s": max(v), "runs_s": v}
            for k, v in runs.items()}


def commit_cost(repeats: int) -> dict[str, float]:
    import copy

    import torch

    import horovod.torch as hvd

    hvd.init()
    layers = [torch.nn.Linear(2048, 2048) for _ in range(6)]  # 6 x 4.2 M
    layers.append(torch.nn.Linear(2048, 185))  # total 25.56 M parameters, as ResNet-50
    model = torch.nn.Sequential(*layers)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    state = hvd.elastic.TorchState(model, opt, step=0)
    ours, upstream = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state.commit()
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _ = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        upstream.append(time.perf_counter() - t0)
    hvd.shutdown()
    return {"parameters_millions": n / 1e6, "state_mb": 2 * n * 4 / 1e6,
            "commit_s_median": statistics.median(ours),
            "deepcopy_s_median": statistics.median(upstream)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here as JSON")
    ap.add_argument("--only", choices=["commit", "join", "points"],
                    help="measure only this figure")
    args = ap.parse_args()
    if args.only == "points":
        result = points(args.repeats)
        for k, v in result.items():
            print(f"{k:>24}: median {v['median_s']:.2f} s, worst {v['worst_s']:.2f} s")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"points": result}, fh, indent=2)
        return 0
    figures: dict[str, list[dict[str, float]] | dict[str, float]] = {"recovery": [], "join": []}
    if args.only == "join":
        figures = {"join": [], "join_notify_when_ready": []}
        for _ in range(args.repeats):
            for key, ready in (("join", False), ("join_notify_when_ready", True)):
                with tempfile.TemporaryDirectory() as tmp:
                    figures[key].append(join(tmp, ready))  # type: ignore[union-attr]
                print(key, figures[key][-1], flush=True)  # type: ignore[index]
    for i in range(0 if args.only else args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            figures["recovery"].append(recovery(tmp))  # type: ignore[union-attr]
        with tempfile.TemporaryDirectory() as tmp:
            figures["join"].append(join(tmp))  # type: ignore[union-attr]
        print(f"run {i + 1}: {figures['recovery'][-1]} {figures['join'][-1]}",  # type: ignore[index]
              flush=True)
    if args.only != "join":
        figures["commit"] = commit_cost(max(5, args.repeats * 3))
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
