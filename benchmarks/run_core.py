"""Run the core benchmark at several world sizes and write a report (Markdown table + plots).

    python benchmarks/run_core.py                # np = 2, 3, 4; writes benchmarks/results/
    python benchmarks/run_core.py --np 2 --quick

Every ratio in the report compares Horovod with raw mpi4py measured in the same processes, in the
same run, interleaved repetition by repetition (machines here are shared and noisy: compare ratios,
not absolute times across runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SUPERSEDED = ("> The gradient-set comparison below is against raw *one flat buffer* / *one call per tensor*, "
              "not the best raw schedule; since piecewise reductions (HOROVOD_CHUNK_BYTES) the comparison that "
              "counts is [limit.md](limit.md) (`benchmarks/run_limit.py`: every binding vs the best raw "
              "schedule, same run).\n\n")


def run(np_: int, suite: str, reps: int, models: str) -> list[dict]:
    sys.path.insert(0, ROOT)
    from horovod.testing import mpirun_command

    cmd = mpirun_command(np_, [sys.executable, os.path.join(HERE, "core_bench.py"), "--suite", suite,
                               "--reps", str(reps), "--models", models])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"benchmark failed at np={np_}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def table(rows: list[dict]) -> str:
    lines = []
    lat = [r for r in rows if r["suite"] == "latency"]
    if lat:
        lines += ["### Single blocking allreduce (float32, Sum), median per call", "",
                  "Out of place, an allreduce returns new memory; raw MPI into a new buffer each call pays "
                  "the same first-touch page faults, so `hvd.allreduce` compares with the *fresh* column and "
                  "`hvd.allreduce_` (in place, the optimizers' path) with the *reused* one.", "",
                  "| np | bytes | raw, reused output | raw, fresh output | hvd.allreduce | vs fresh | "
                  "hvd.allreduce_ | vs reused |", "|---|---|---|---|---|---|---|---|"]
        for r in lat:
            fresh = r.get("raw_mpi_fresh", float("nan"))
            inpl = r.get("horovod_inplace", float("nan"))
            lines.append(f"| {r['np']} | {r['bytes']:,} | {r['raw_mpi']:.1f} us | {fresh:.1f} us | "
                         f"{r['horovod']:.1f} us | {r['horovod'] / fresh:.2f}x | {inpl:.1f} us | "
                         f"{inpl / r['raw_mpi']:.2f}x |")
        lines.append("")
    gs = [r for r in rows if r["suite"] == "gradsync"]
    if gs:
        lines += ["### Gradient-set sync (average every gradient of a model), median per step", "",
                  "| np | model | tensors | MiB | raw, one flat buffer | raw, one call per tensor | "
                  "horovod async + synchronize | horovod grouped | async / flat | grouped / flat |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in gs:
            lines.append(
                f"| {r['np']} | {r['model']} | {r['tensors']} | {r['MiB']:.1f} | {r['raw_mpi_flat']:.1f} ms | "
                f"{r['raw_mpi_each']:.1f} ms | {r['horovod_async']:.1f} ms | {r['horovod_grouped']:.1f} ms | "
                f"{r['horovod_async'] / r['raw_mpi_flat']:.2f}x | {r['horovod_grouped'] / r['raw_mpi_flat']:.2f}x |")
        lines.append("")
    nt = [r for r in rows if r["suite"] == "ntensors"]
    if nt:
        lines += ["### Many small tensors (1 KiB each), async + synchronize vs one raw call per tensor", "",
                  "| np | tensors | raw mpi4py | horovod | per tensor (horovod) | ratio |",
                  "|---|---|---|---|---|---|"]
        for r in nt:
            lines.append(f"| {r['np']} | {r['tensors']:,} | {r['raw_mpi_each']:.2f} ms | {r['horovod_async']:.2f} ms | "
                         f"{r['horovod_async'] / r['tensors'] * 1e3:.1f} us | "
                         f"{r['horovod_async'] / r['raw_mpi_each']:.2f}x |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    lat = [r for r in rows if r["suite"] == "latency"]
    for np_ in sorted({r["np"] for r in lat}):
        rs = [r for r in lat if r["np"] == np_]
        axes[0].loglog([r["bytes"] for r in rs], [r["raw_mpi"] for r in rs], "o--", label=f"raw mpi4py np={np_}")
        axes[0].loglog([r["bytes"] for r in rs], [r["horovod"] for r in rs], "s-", label=f"horovod np={np_}")
    axes[0].set(title="Blocking allreduce latency", xlabel="bytes", ylabel="us per call")
    axes[0].legend(fontsize=7)
    gs = [r for r in rows if r["suite"] == "gradsync"]
    labels = [f"{r['model']}\nnp={r['np']}" for r in gs]
    keys = ["raw_mpi_flat", "raw_mpi_each", "horovod_async", "horovod_grouped"]
    width = 0.2
    for i, k in enumerate(keys):
        axes[1].bar([j + i * width for j in range(len(gs))], [r[k] for r in gs], width, label=k)
    axes[1].set_xticks([j + 1.5 * width for j in range(len(gs))], labels, fontsize=7)
    axes[1].set(title="Gradient-set sync (lower is better)", ylabel="ms per step")
    axes[1].legend(fontsize=7)
    nt = [r for r in rows if r["suite"] == "ntensors"]
    for np_ in sorted({r["np"] for r in nt}):
        rs = [r for r in nt if r["np"] == np_]
        axes[2].loglog([r["tensors"] for r in rs], [r["raw_mpi_each"] for r in rs], "o--", label=f"raw np={np_}")
        axes[2].loglog([r["tensors"] for r in rs], [r["horovod_async"] for r in rs], "s-", label=f"horovod np={np_}")
    axes[2].set(title="Cost vs number of 1 KiB tensors", xlabel="tensors", ylabel="ms per step")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--np", default="2,3,4")
    p.add_argument("--quick", action="store_true", help="fewer repetitions, ResNet-50 only")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--from-json", action="store_true", help="redraw the report from results/core.json")
    p.add_argument("--suite", default="all", help="measure only this suite; rows of others are kept")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    reps = 5 if a.quick else 15
    models = "resnet50" if a.quick else "resnet50,bert_base"
    if a.from_json:
        with open(os.path.join(a.out, "core.json")) as f:
            saved = json.load(f)
        rows, stamp = saved["rows"], saved["when"]
    else:
        rows = []
        if a.suite != "all" and os.path.exists(os.path.join(a.out, "core.json")):
            with open(os.path.join(a.out, "core.json")) as f:
                rows = [r for r in json.load(f)["rows"] if r["suite"] != a.suite]
        for np_ in [int(x) for x in a.np.split(",")]:
            rows += run(np_, a.suite, reps, models if np_ == 2 else "resnet50")
        stamp = time.strftime("%Y-%m-%d %H:%M")
        with open(os.path.join(a.out, "core.json"), "w") as f:
            json.dump({"when": stamp, "host": platform.node(), "cpus": os.cpu_count(), "rows": rows}, f,
                      indent=1)
    md = (f"# Core engine vs raw mpi4py\n\n{SUPERSEDED}Measured {stamp} on {os.cpu_count()} CPU cores "
          f"({platform.machine()}), Open MPI via mpi4py, `python benchmarks/run_core.py --np {a.np}`.\n\n"
          + table(rows) + "\n![core benchmark](core.png)\n")
    with open(os.path.join(a.out, "core.md"), "w") as f:
        f.write(md)
    plot(rows, os.path.join(a.out, "core.png"))
    print(md)


if __name__ == "__main__":
    main()
