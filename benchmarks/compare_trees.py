"""Run one benchmark on two source trees alternately and compare their figures, run by run.

    python benchmarks/compare_trees.py --before ../main --after . --runs 3 -- \\
        mpirun -np 2 python benchmarks/step_cost.py --reps 200
    python benchmarks/compare_trees.py --before ../main --after . --env HOROVOD_TORCH_CPU_PLANE=1 -- \\
        mpirun -np 2 -x HOROVOD_TORCH_CPU_PLANE python benchmarks/step_cost.py --reps 200
    python benchmarks/compare_trees.py --before ../main --after . --runs 6 -- \\
        horovodrun --gloo -np 2 python benchmarks/step_cost.py --reps 200 --modes grouped,floor_rows

The command runs ``--runs`` times per tree, alternating (before, after, after, before, ...: neither
tree always goes first), with ``PYTHONPATH`` set to the tree; the script path in the command is
taken from the tree too when it names a file under ``benchmarks/``. Every line of the output that
is a JSON object is read, and each numeric key's values are reported per tree (each run's figure,
their median and the fastest) with the median over run pairs of after/before (the two runs of a
pair ran next to each other). Compare ratios, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from typing import Any

_RANK_PREFIX = re.compile(r"^\[\d+\]<std(?:out|err)>:")


def _figures(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = _RANK_PREFIX.sub("", line.strip())  # horovodrun's "[0]<stdout>:" before a rank's line
        if not (line.startswith("{") and line.endswith("}")):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        _flatten(obj, "", out)
    return out


def _flatten(obj: Any, prefix: str, out: dict[str, float]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}{k}." if isinstance(v, dict) else f"{prefix}{k}", out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix] = float(obj)


def _command(cmd: list[str], tree: str) -> list[str]:
    """``cmd`` with a ``benchmarks/...`` script path taken from ``tree``."""
    return [os.path.join(tree, a) if a.startswith("benchmarks/") and a.endswith(".py") else a for a in cmd]


def run(tree: str, cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, float]:
    full = {**os.environ, **env, "PYTHONPATH": os.path.abspath(tree)}
    proc = subprocess.run(_command(cmd, tree), env=full, capture_output=True, text=True, timeout=timeout)
    figures = _figures(proc.stdout)
    if proc.returncode != 0 or not figures:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-2000:])
        raise SystemExit(f"the command failed on {tree} (exit {proc.returncode})")
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for every run")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--keys", default="", help="comma-separated keys to report (default: all)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("give the command after --")
    env = dict(e.split("=", 1) for e in args.env)
    results: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    trees = {"before": args.before, "after": args.after}
    for i in range(args.runs):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for label in order:
            results[label].append(run(trees[label], cmd, env, args.timeout))
    keys = [k for k in results["after"][0] if k in results["before"][0]]
    if args.keys:
        keys = [k for k in keys if k in args.keys.split(",")]
    report: dict[str, Any] = {"runs": args.runs, "command": " ".join(cmd), "env": env, "figures": {}}
    for k in keys:
        b = [r[k] for r in results["before"] if k in r]
        a = [r[k] for r in results["after"] if k in r]
        mb, ma = statistics.median(b), statistics.median(a)
        # Run i of each tree ran next to each other: on a machine whose load moves, the median of
        # the pairs' ratios follows the code more than a ratio of medians over all runs does.
        pairs = [y / x for x, y in zip(b, a) if x]
        paired = round(statistics.median(pairs), 3) if pairs else None
        report["figures"][k] = {"before": b, "after": a, "ratio": round(ma / mb, 3) if mb else None,
                                "paired_ratio": paired, "min_before": min(b), "min_after": min(a)}
        print(f"{k:32s} median before {mb:9.3f} after {ma:9.3f} | fastest before {min(b):9.3f} "
              f"after {min(a):9.3f} | after/before paired {paired}", flush=True)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
