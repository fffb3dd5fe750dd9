"""Measure hierarchical vs flat collectives across 2 fake hosts x 2 ranks; write ``results/hierarchical.md``.

    python benchmarks/run_hierarchical.py [--modes mpi,gloo] [--reps 7]

Needs what ``tests/_fakehosts.py`` needs (root, network namespaces, OpenSSH). The hosts are
network namespaces of this machine joined by a Linux bridge: traffic between them goes through
the kernel's TCP stack (as between machines, minus the wire), traffic inside a host through
shared memory (MPI) or loopback TCP (Gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--modes", default="mpi,gloo")
parser.add_argument("--reps", type=int, default=7)


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
        for mode in args.modes.split(","):
            cmd = [sys.executable, "-m", "horovod.runner", f"--{mode}", "-np", "4", "-H", f"{h1}:2,{h2}:2",
                   sys.executable, os.path.join(HERE, "hierarchical_bench.py"), "--reps", str(args.reps)]
            res = fh.run(h1, cmd, env=env, timeout=900, cwd=REPO)
            m = re.search(r"HIER_RESULT (.*)$", res.stdout, re.MULTILINE)
            if res.returncode != 0 or m is None:
                raise SystemExit(f"{mode} run failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
            r = json.loads(m.group(1))
            r["transport"] = mode
            print(json.dumps(r), flush=True)
            results.append(r)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "hierarchical.json"), "w") as fh_:
        json.dump(results, fh_, indent=1)
    lines = ["# Hierarchical vs flat collectives, 2 hosts x 2 ranks", "",
             "Written by `python benchmarks/run_hierarchical.py` (fake hosts: network namespaces of one 2-core "
             "machine joined by a bridge, so cross-host traffic is kernel TCP; shared with other jobs while "
             "measured). `benchmarks/hierarchical_bench.py` switches hierarchy on and off on every rank "
             "between repetitions, interleaved; medians.", "",
             "| transport | case | flat | hierarchical | hierarchical / flat |", "|---|---|---|---|---|"]
    for r in results:
        for case, d in r["median_ms"].items():
            lines.append(f"| {r['transport']} | {case} | {d['flat']:.1f} ms | {d['hierarchical']:.1f} ms | "
                         f"{d['hierarchical'] / d['flat']:.2f}x |")
    with open(os.path.join(RESULTS, "hierarchical.md"), "w") as fh_:
        fh_.write("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}/hierarchical.md")


if __name__ == "__main__":
    main()
