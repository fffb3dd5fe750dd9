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

    python benchmarks/elastic_bench.py [--repeats 3] [--json out.json]
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
         on_line: object = None) -> tuple[str, str, int]:
    hosts_file = os.path.join(tmp, "hosts")
    with open(hosts_file, "w") as fh:
        fh.write(hosts)
    script = os.path.join(tmp, "discover.sh")
    with open(script, "w") as fh:
        fh.write(f"#!/bin/sh\ncat {hosts_file}\n")
    os.chmod(script, 0o755)
    worker = os.path.join(tmp, "worker.py")
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
    ap.add_argument("--only", choices=["commit", "join"], help="measure only this figure")
    args = ap.parse_args()
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
