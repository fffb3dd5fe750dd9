"""Wall time of ``horovodrun -np 2 python -c pass`` against the equivalent bare ``mpirun``.

Both variants run in the same process, interleaved (bare, horovodrun, bare, ...), so that machine
noise hits both alike. The target (issue 3): horovodrun adds at most 0.5 s.

    python benchmarks/launcher_overhead.py [--repeats 15] [--np 2] [--gloo] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    res = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
    elapsed = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({res.returncode}):\n{res.stderr.decode()}")
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--gloo", action="store_true", help="also time horovodrun --gloo")
    ap.add_argument("--json", help="write the figures here as JSON")
    args = ap.parse_args()

    sys.path.insert(0, REPO)
    from horovod.runner.launch.mpirun import find_mpirun

    mpirun = find_mpirun()
    if mpirun is None:
        raise SystemExit("no mpirun found")
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # As after `pip install`: the package's bytecode is compiled once (by the warm-up runs), not
    # on every start. PYTHONDONTWRITEBYTECODE in a developer's shell would add ~70 ms per start.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    py = sys.executable
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    variants = {
        "bare mpirun": [mpirun, *root, "-np", str(args.np), py, "-c", "pass"],
        "horovodrun (python -m horovod.runner)": [py, "-m", "horovod.runner", "-np", str(args.np),
                                                  py, "-c", "pass"],
    }
    script = shutil.which("horovodrun")
    if script:
        variants["horovodrun (console script)"] = [script, "-np", str(args.np), py, "-c", "pass"]
    if args.gloo:
        variants["horovodrun --gloo"] = [py, "-m", "horovod.runner", "--gloo", "-np", str(args.np),
                                         py, "-c", "pass"]
    for argv in variants.values():  # warm the page cache
        timed(argv, env)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):
        for name, argv in variants.items():
            times[name].append(timed(argv, env))
    base = statistics.median(times["bare mpirun"])
    base_min = min(times["bare mpirun"])
    load = os.getloadavg()
    report = {"np": args.np, "repeats": args.repeats, "cpus": os.cpu_count(), "loadavg": load,
              "variants": {}}
    print(f"np={args.np}, {args.repeats} interleaved runs each, {os.cpu_count()} CPUs, "
          f"load average {load[0]:.1f}")
    print(f"{'variant':40s} {'median s':>9s} {'min s':>7s} {'max s':>7s} {'overhead (median)':>18s}"
          f" {'overhead (min)':>15s}")
    for name, ts in times.items():
        med = statistics.median(ts)
        report["variants"][name] = {"median": med, "min": min(ts), "max": max(ts),
                                    "overhead_median": med - base,
                                    "overhead_min": min(ts) - base_min}
        print(f"{name:40s} {med:9.3f} {min(ts):7.3f} {max(ts):7.3f} {med - base:+18.3f}"
              f" {min(ts) - base_min:+15.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    worst = max(v["overhead_median"] for k, v in report["variants"].items() if "gloo" not in k)
    print(f"largest horovodrun (MPI) overhead: {worst:+.3f} s (target: <= 0.5 s)")
    return 0 if worst <= 0.5 else 1


if __name__ == "__main__":
    sys.exit(main())
