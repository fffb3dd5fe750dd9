"""Run ``gradsync_limit.py`` for every case at np=2 and np=3 and write ``results/limit.md`` and ``limit.png``.

    python benchmarks/run_limit.py [--nps 2,3] [--cases resnet50,bert_base,single64,latency] [--reps 15]
    python benchmarks/run_limit.py --report-only     # rebuild the table and plot from results/limit.json

Every case runs in its own mpirun (``--oversubscribe --bind-to none``); inside it all bindings and the raw
schedules are interleaved repetition by repetition. Results are appended to ``results/limit.json``
(one object per run); the report uses each (case, np)'s latest run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
JSON = os.path.join(RESULTS, "limit.json")
YMAX = 3.0  # taller bars (raw flat, unchunked) are clipped and labelled
BINDINGS = ["schedule", "oop-floor", "numpy", "torch-async", "torch-grouped", "torch-flat", "tf-sync",
            "numpy-unchunked", "torch-bf16", "tf-sync-bf16"]

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--nps", default="2,3")
parser.add_argument("--cases", default="resnet50,bert_base,single64,latency")
parser.add_argument("--reps", type=int, default=15)
parser.add_argument("--frameworks", default="numpy,torch,tf")
parser.add_argument("--timeout", type=int, default=900)
parser.add_argument("--report-only", action="store_true")
parser.add_argument("--jemalloc", default="", metavar="LIB",
                    help="also run the gradient-set cases with this libjemalloc.so preloaded and "
                         "MALLOC_CONF=thp:always (e.g. /usr/lib/x86_64-linux-gnu/libjemalloc.so.2)")


def run(case: str, np_: int, reps: int, frameworks: str, timeout: int, jemalloc: str = "") -> None:
    env = dict(os.environ)
    exports = ["THP_MEM_ALLOC_ENABLE"]
    if jemalloc:
        env["LD_PRELOAD"] = jemalloc
        env["MALLOC_CONF"] = "thp:always,metadata_thp:auto"
        exports += ["LD_PRELOAD", "MALLOC_CONF"]
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as horovodrun sets it for its workers
    env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none"]
    for name in exports:
        cmd += ["-x", name]
    cmd += [sys.executable,
           os.path.join(HERE, "gradsync_limit.py"), "--case", case, "--reps", str(reps),
           "--frameworks", frameworks, "--json", JSON]
    start = cmd.index(sys.executable)
    print("$", " ".join([f"{k}={env[k]}" for k in exports] + cmd[:start] + ["python", "benchmarks/gradsync_limit.py"]
                        + cmd[start + 2:-2]), flush=True)
    res = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    print("\n".join(line for line in res.stdout.splitlines() if not line.startswith("[")), flush=True)
    if res.returncode != 0:
        print(res.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{case} np={np_} failed with {res.returncode}")


def latest() -> dict[tuple[str, int, str], dict]:
    runs: dict[tuple[str, int, str], dict] = {}
    with open(JSON) as fh:
        for line in fh:
            if line.strip():
                r = json.loads(line)
                runs[(r["case"], r["np"], r.get("malloc", "default"))] = r
    return runs


def _cell(r: dict, k: str) -> str:
    med, mn = r["median"], r["min"]
    if k not in med:
        return "-"
    bm, bn = r["best_raw"]["median"], r["best_raw"]["min"]
    return f"{med[k]:.1f} {r['unit']} **{med[k] / med[bm]:.2f}x** ({mn[k] / mn[bn]:.2f}x)"


def report() -> None:
    runs = latest()
    order = ["resnet50", "bert_base", "single64", "latency"]
    keys = sorted(runs, key=lambda k: (k[2] != "default", order.index(k[0]) if k[0] in order else 9, k[1]))
    lines = [
        "# Gradient sync against the machine's limit",
        "",
        f"Written by `python benchmarks/run_limit.py` on {platform.machine()}, {os.cpu_count()} CPU cores "
        "(no other job while measured), Open MPI via mpi4py. On this VM each `mpirun` lands in one "
        "of two speeds, decided at launch and not by the code (the raw 2 MiB-piece schedule of "
        "97.5 MiB takes either ~10 or ~17 ms for the whole run), so compare ratios within a row. "
        "Each row is one `mpirun` in "
        "which every binding and every raw mpi4py schedule ran interleaved, repetition by repetition "
        "(`benchmarks/gradsync_limit.py`). *Best raw* is the fastest raw schedule of that run: one flat "
        "in-place Allreduce, or the flat buffer in 1-32 MiB pieces, each reduced in place and divided "
        "while hot. Ratios are binding / best raw, **median** of the repetitions, and in brackets the "
        "fastest repetition of each (the least disturbed by the other jobs on the machine). "
        "`tf-sync` is the DistributedGradientTape step minus the plain GradientTape step. "
        "*Schedule* is no binding: it is the engine's piece schedule written directly in mpi4py on "
        "separately allocated arrays (small ones packed into a 2 MiB buffer, large ones in 2 MiB "
        "pieces in place), so binding / schedule is what the engine itself adds, and schedule / best "
        "raw what a gradient set of separate tensors costs against one flat buffer. *Raw out of place* "
        "is no binding either: the flat buffer reduced by mpi4py into a second flat buffer (2 MiB "
        "pieces, `Allreduce(sendbuf, recvbuf)`, divided in the output while hot), the floor of the "
        "out-of-place bindings (numpy, TF), whose every result is new memory. *Torch grouped, "
        "one flat tensor* is `grouped_allreduce_` on a gradient set kept as views of one flat tensor "
        "(as DDP's `gradient_as_bucket_view`, apex and DeepSpeed keep gradients). Torch runs with "
        "`THP_MEM_ALLOC_ENABLE=1`, as `horovodrun` sets it. Rows marked *jemalloc thp* ran with "
        "jemalloc preloaded and `MALLOC_CONF=thp:always` (`--jemalloc`): every block of 2 MiB or more, "
        "NumPy's and torch's alike, then lies on huge pages, where glibc gives each its own unaligned "
        "mapping whose ends are 4 KiB pages.",
        "",
        "| case | np | MiB | raw flat | best raw | schedule (no engine) | raw out of place | numpy | torch async "
        "| torch grouped | torch grouped, one flat tensor | TF tape | numpy, HOROVOD_CHUNK_BYTES=0 "
        "| torch async, Compression.bf16 | TF tape, Compression.bf16 | measured |",
        "|" + "---|" * (6 + len(BINDINGS)),
    ]
    for key in keys:
        r = runs[key]
        med, bm, unit = r["median"], r["best_raw"]["median"], r["unit"]
        best_name = bm.replace("raw-chunk-", "").replace("raw-", "")
        cells = " | ".join(_cell(r, k) for k in BINDINGS)
        label = r["case"] if key[2] == "default" else f"{r['case']}, {key[2]}"
        lines.append(f"| {label} | {r['np']} | {r['mib']:.1f} | {med['raw-flat']:.1f} {unit} | "
                     f"{med[bm]:.1f} {unit} ({best_name}) | {cells} | {r['time'][:16]} |")
    lines += ["", "![horovod vs best raw](limit.png)", ""]
    with open(os.path.join(RESULTS, "limit.md"), "w") as fh:
        fh.write("\n".join(lines))
    plot(runs, keys)


def plot(runs: dict[tuple[str, int], dict], keys: list[tuple[str, int]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    keys = [k for k in keys if k[0] != "latency"]
    labels = [f"{c}\nnp={n}" + ("" if m == "default" else f"\n{m}") for c, n, m in keys]
    series = ["raw-flat", "best raw"] + BINDINGS
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(keys)), 4.5))
    width = 0.8 / len(series)
    x = np.arange(len(keys))
    for i, s in enumerate(series):
        vals = []
        for k in keys:
            r = runs[k]
            ref = r["median"][r["best_raw"]["median"]]
            name = r["best_raw"]["median"] if s == "best raw" else s
            vals.append(r["median"].get(name, float("nan")) / ref)
        pos = x + (i - len(series) / 2 + 0.5) * width
        ax.bar(pos, [min(v, YMAX) for v in vals], width, label=s)
        for p, v in zip(pos, vals):
            if v > YMAX:  # clipped: the value is written on top of the bar
                ax.text(p, YMAX, f"{v:.1f}", ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_ylim(0, YMAX * 1.12)
    ax.axhline(1.15, color="k", linestyle="--", linewidth=0.8, label="goal 1.15x")
    ax.set_xticks(x, labels)
    ax.set_ylabel("time / best raw schedule (median)")
    ax.set_title("Gradient sync: horovod bindings vs the best raw mpi4py schedule, same run")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "limit.png"), dpi=110)


def main() -> None:
    args = parser.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    if not args.report_only:
        for np_ in (int(n) for n in args.nps.split(",")):
            for case in args.cases.split(","):
                run(case, np_, args.reps, args.frameworks, args.timeout)
        if args.jemalloc:
            for np_ in (int(n) for n in args.nps.split(",")):
                for case in args.cases.split(","):
                    if case in ("resnet50", "bert_base"):
                        run(case, np_, args.reps, args.frameworks, args.timeout, args.jemalloc)
    report()
    print(f"wrote {RESULTS}/limit.md and limit.png ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)")


if __name__ == "__main__":
    main()
