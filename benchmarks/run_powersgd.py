"""PowerSGD vs uncompressed and fp16 on a slow link: 2 fake hosts whose link is limited with tc.

    python benchmarks/run_powersgd.py [--rate 100mbit] [--reps 5] [--modes mpi,gloo]

Needs what ``tests/_fakehosts.py`` needs (root, network namespaces, OpenSSH) and ``tc``. The two
hosts are network namespaces joined by a Linux bridge; a token bucket (``tc qdisc add dev VETH
root tbf rate RATE burst 32kbit latency 400ms``) on the machine's side of each host's veth limits
the traffic into each host, so each direction of the link carries at most RATE. One rank per
host (np=2) runs ``benchmarks/powersgd_bench.py`` on ResNet-18's gradient shapes (variants
interleaved, medians). Writes ``results/powersgd_slowlink.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--rate", default="100mbit")
parser.add_argument("--reps", type=int, default=5)
parser.add_argument("--modes", default="mpi")
parser.add_argument("--variants", default="none,fp16,powersgd-2,powersgd-4")


def main() -> None:
    args = parser.parse_args()
    sys.path.insert(0, REPO)
    from tests._fakehosts import FakeHosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"cannot make fake hosts here: {reason}")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    results = []
    with FakeHosts(2) as fh:
        h1, h2 = fh.hosts
        for veth in fh._record["veths"]:
            subprocess.run(["tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", args.rate,
                            "burst", "32kbit", "latency", "400ms"], check=True)
        for mode in args.modes.split(","):
            cmd = [sys.executable, "-m", "horovod.runner", f"--{mode}", "-np", "2", "-H", f"{h1}:1,{h2}:1",
                   sys.executable, os.path.join(HERE, "powersgd_bench.py"), "--model", "resnet18",
                   "--reps", str(args.reps), "--warmup", "1", "--variants", args.variants]
            res = fh.run(h1, cmd, env=env, timeout=3000, cwd=REPO)
            m = re.search(r"PSGD_RESULT (.*)$", res.stdout, re.MULTILINE)
            if res.returncode != 0 or m is None:
                raise SystemExit(f"{mode} run failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
            r = json.loads(m.group(1))
            r["transport"], r["rate"] = mode, args.rate
            print(json.dumps(r), flush=True)
            results.append(r)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "powersgd_slowlink.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [f"# Gradient compression on a {args.rate} link, 2 hosts x 1 rank, ResNet-18's gradients", "",
             f"Written by `python benchmarks/run_powersgd.py --rate {args.rate} --reps {args.reps} "
             f"--modes {args.modes}` (fake hosts: "
             "network namespaces of one 2-core machine joined by a bridge, each host's side limited with "
             "`tc ... tbf`; the machine was shared with other jobs while measured). Medians of "
             f"{args.reps} interleaved steps after one warm-up step.", "",
             "| transport | variant | bytes per step (per rank) | step time | time / uncompressed | speed-up |",
             "|---|---|---|---|---|---|"]
    for r in results:
        for v, ms in r["median_ms"].items():
            ratio = r["time_vs_none"].get(v, float("nan"))
            lines.append(f"| {r['transport']} | {v} | {r['bytes_per_step'][v] / 2**20:.2f} MiB | {ms:.0f} ms | "
                         f"{ratio:.3f} | {1 / ratio:.1f}x |")
    with open(os.path.join(RESULTS, "powersgd_slowlink.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}/powersgd_slowlink.md")


if __name__ == "__main__":
    main()
