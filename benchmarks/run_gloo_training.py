"""Training with Gloo on both sides: hvd.DistributedOptimizer against DDP (Gloo), three launchers.

    python benchmarks/run_gloo_training.py --nps 2,3 [--iters 7] [--model resnet_small] [--out FILE]
    python benchmarks/run_gloo_training.py --nps 2 --modes hvd,hvd-separate,ddp,local --breakdown

For each world size, ``benchmarks/torch_synthetic.py --modes hvd,ddp,local`` runs under

* ``horovodrun --gloo`` (a static job: Horovod's data plane is Gloo),
* elastic ``horovodrun`` (``--min-np N --max-np N``: the elastic driver and rounds, Gloo),
* ``torchrun --standalone`` (Horovod initialised from torchrun's environment, on Gloo),

and in every run both sides train the same model on the same batch in the same processes, modes
rotated every iteration (``torch_synthetic.py``), so each hvd/DDP ratio comes from one run. Prints
a Markdown table (samples/s per rank, the ratio of the medians, the paired ratio: the median over
the iterations of hvd / DDP within the iteration, where the two ran back to back; the load average
before and after each run) and appends it to ``--out``. ``--modes`` adds ``torch_synthetic.py``'s other modes as columns
(``hvd-separate``: every gradient its own tensor, ``HOROVOD_FLAT_GRADIENTS=0``; ``hvd-overlap``,
``hvd-held``); the ratio is always ``hvd`` / ``ddp``. ``--breakdown`` also prints, per run and mode,
the mean over ranks of each step's phases in ms (zero_grad, forward, backward, step; for the hvd
modes the hooks and the gradient sync inside backward) and the process's CPU ms per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "torch_synthetic.py")

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--nps", default="2,3")
parser.add_argument("--iters", type=int, default=7)
parser.add_argument("--model", default="resnet_small")
parser.add_argument("--extra", default="", help="more arguments for torch_synthetic.py")
parser.add_argument("--launchers", default="gloo,elastic,torchrun")
parser.add_argument("--timeout", type=float, default=1200)
parser.add_argument("--out", default=None)
parser.add_argument("--modes", default="hvd,ddp,local", help="torch_synthetic.py modes (hvd and ddp required)")
parser.add_argument("--breakdown", action="store_true", help="print each mode's step phases too")


def command(launcher: str, np_: int, args: argparse.Namespace) -> list[str]:
    bench = [SCRIPT, "--modes", args.modes, "--iters", str(args.iters), "--model", args.model]
    if args.breakdown:
        bench.append("--breakdown")
    bench += args.extra.split()
    if launcher == "gloo":
        return [sys.executable, "-m", "horovod.runner", "--gloo", "-np", str(np_), sys.executable] + bench
    if launcher == "elastic":
        return [sys.executable, "-m", "horovod.runner", "-np", str(np_), "--min-np", str(np_), "--max-np", str(np_),
                "-H", f"localhost:{np_}", sys.executable] + bench
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(np_)] + bench
    raise SystemExit(f"unknown launcher {launcher!r}")


def run(launcher: str, np_: int, args: argparse.Namespace) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    cmd = command(launcher, np_, args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    rates: dict[str, float] = {}
    phases: dict[str, dict[str, float]] = {}
    iters: dict[str, list[float]] = {}
    for line in proc.stdout.splitlines():
        at = line.find("{")
        if at < 0:
            continue
        try:
            row = json.loads(line[at:])
        except ValueError:
            continue
        if row.get("bench") == "torch_synthetic":
            rates[row["mode"]] = row["img_per_sec_per_rank"]
            iters[row["mode"]] = row.get("img_per_sec_iters", [])
        elif row.get("bench") == "torch_synthetic.breakdown":
            per_rank = row["ms_per_step_per_rank"]
            keys = sorted({k for r in per_rank for k in r})
            phases[row["mode"]] = {k: sum(r.get(k, 0.0) for r in per_rank) / len(per_rank) for k in keys}
    if proc.returncode != 0 or not rates:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    # The paired ratio: hvd / ddp within each iteration (the two ran back to back, so a change of
    # the machine's load between iterations cancels), then the median over the iterations.
    pairs = [h / d for h, d in zip(iters.get("hvd", []), iters.get("ddp", [])) if d > 0]
    rates["paired"] = statistics.median(pairs) if pairs else float("nan")
    return rates, phases


def main() -> None:
    args = parser.parse_args()
    modes = args.modes.split(",")
    lines = ["| np | launcher | " + " | ".join(modes) + " | hvd / ddp | paired | load (1 min) before, after |",
             "|---|---|" + "---|" * len(modes) + "---|---|---|"]
    print("\n".join(lines), flush=True)
    breakdown: list[str] = []
    for np_ in (int(x) for x in args.nps.split(",")):
        for launcher in args.launchers.split(","):
            before = os.getloadavg()[0]
            t0 = time.time()
            r, phases = run(launcher, np_, args)
            after = os.getloadavg()[0]
            line = (f"| {np_} | {launcher} | " + " | ".join(f"{r[m]:.1f}" for m in modes) + " | "
                    f"**{r['hvd'] / r['ddp']:.2f}x** | {r['paired']:.2f}x | "
                    f"{before:.1f}, {after:.1f} ({time.time() - t0:.0f} s) |")
            lines.append(line)
            print(line, flush=True)
            for mode, ph in phases.items():
                text = ", ".join(f"{k} {v:.1f}" for k, v in ph.items())
                print(f"<!-- np={np_} {launcher} {mode} ms/step (mean of ranks): {text} -->", flush=True)
                breakdown.append(f"<!-- np={np_} {launcher} {mode}: {text} -->")
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n<!-- {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}: "
                    f"{' '.join(sys.argv)} -->\n" + "\n".join(lines + breakdown) + "\n")


if __name__ == "__main__":
    main()
