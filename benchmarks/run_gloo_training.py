"""Training with Gloo on both sides: hvd.DistributedOptimizer against DDP (Gloo), three launchers.

    python benchmarks/run_gloo_training.py --nps 2,3 [--iters 7] [--model resnet_small] [--out FILE]

For each world size, ``benchmarks/torch_synthetic.py --modes hvd,ddp,local`` runs under

* ``horovodrun --gloo`` (a static job: Horovod's data plane is Gloo),
* elastic ``horovodrun`` (``--min-np N --max-np N``: the elastic driver and rounds, Gloo),
* ``torchrun --standalone`` (Horovod initialised from torchrun's environment, on Gloo),

and in every run both sides train the same model on the same batch in the same processes, modes
rotated every iteration (``torch_synthetic.py``), so each hvd/DDP ratio comes from one run. Prints
a Markdown table (samples/s per rank, the ratio, the load average before and after each run) and
appends it to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
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


def command(launcher: str, np_: int, args: argparse.Namespace) -> list[str]:
    bench = [SCRIPT, "--modes", "hvd,ddp,local", "--iters", str(args.iters), "--model", args.model]
    bench += args.extra.split()
    if launcher == "gloo":
        return [sys.executable, "-m", "horovod.runner", "--gloo", "-np", str(np_), sys.executable] + bench
    if launcher == "elastic":
        return [sys.executable, "-m", "horovod.runner", "-np", str(np_), "--min-np", str(np_), "--max-np", str(np_),
                "-H", f"localhost:{np_}", sys.executable] + bench
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(np_)] + bench
    raise SystemExit(f"unknown launcher {launcher!r}")


def run(launcher: str, np_: int, args: argparse.Namespace) -> dict[str, float]:
    cmd = command(launcher, np_, args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    rates: dict[str, float] = {}
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
    if proc.returncode != 0 or not rates:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return rates


def main() -> None:
    args = parser.parse_args()
    lines = ["| np | launcher | hvd | ddp | local | hvd / ddp | load (1 min) before, after |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for np_ in (int(x) for x in args.nps.split(",")):
        for launcher in args.launchers.split(","):
            before = os.getloadavg()[0]
            t0 = time.time()
            r = run(launcher, np_, args)
            after = os.getloadavg()[0]
            line = (f"| {np_} | {launcher} | {r['hvd']:.1f} | {r['ddp']:.1f} | {r['local']:.1f} | "
                    f"**{r['hvd'] / r['ddp']:.2f}x** | {before:.1f}, {after:.1f} ({time.time() - t0:.0f} s) |")
            lines.append(line)
            print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n<!-- {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}: "
                    f"{' '.join(sys.argv)} -->\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
