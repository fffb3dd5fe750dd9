"""Start-up overhead of a 2-rank job started from a cluster engine, all variants in one run.

The same work everywhere: initialise, allreduce one number over the 2 ranks, return it. Timed from
the call to the results in the driver's hands, the variants interleaved (round 1: each variant
once, round 2: ...), on clusters that are already up: a local Spark ``local-cluster[2,1,1024]``
(two executor JVMs) and a local Ray instance (3 CPUs). The clusters' own start-up is reported
apart ("cluster start"): a Spark or Ray user has a cluster already and pays it once.

    horovod.run np=2 (gloo / mpirun)  what ``horovodrun -np 2`` runs (no cluster engine)
    horovod.spark.run np=2            one Horovod rank per barrier Spark task
    TorchDistributor np=2             pyspark.ml.torch.distributor, local_mode=False (torchrun in
                                      each task), torch.distributed on Gloo
    RayExecutor start+run+shutdown    horovod.ray (actors started, run, stopped); "warm": one
                                      more run on started actors
    Ray Train TorchTrainer.fit        ScalingConfig(num_workers=2)

    python benchmarks/cluster_startup.py [--repeats 3] [--out benchmarks/results/cluster_startup]

The Ray variants are those of ``benchmarks/ray_startup.py`` (imported from there); a variant whose
engine or package is missing is skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def hvd_fn() -> float:
    import torch

    import horovod.torch as hvd

    hvd.init()
    return float(hvd.allreduce(torch.ones(1) * (hvd.rank() + 1), op=hvd.Sum, name="x").item())


def distributor_fn() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return float(t.item())


def spark_variants(skipped: dict[str, str]) -> tuple[dict[str, Callable[[dict[str, Any]], Any]],
                                                     dict[str, float], Any]:
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        skipped["Spark variants"] = f"pyspark not importable: {exc}"
        return {}, {}, None
    t0 = time.perf_counter()
    spark = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("cluster-startup")
             .config("spark.ui.enabled", "false").config("spark.pyspark.python", sys.executable)
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    started = time.perf_counter() - t0
    # Executors register and start their Python workers on the first job: part of cluster start.
    spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(lambda it: [1]).collect()
    warmed = time.perf_counter() - t0

    def horovod_spark(state: dict[str, Any]) -> Any:
        import horovod.spark

        return horovod.spark.run(hvd_fn, num_proc=2, verbose=0, start_timeout=120)

    def torch_distributor(state: dict[str, Any]) -> Any:
        from pyspark.ml.torch.distributor import TorchDistributor

        return TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(distributor_fn)

    return ({"horovod.spark.run np=2": horovod_spark, "TorchDistributor np=2": torch_distributor},
            {"SparkSession local-cluster[2,1,1024]": started,
             "... and first job (executors up, Python workers started)": warmed}, spark)


def ray_variants(skipped: dict[str, str]) -> tuple[dict[str, Callable[[dict[str, Any]], Any]],
                                                   dict[str, float], Any]:
    try:
        import ray
        import ray.cloudpickle
    except ImportError as exc:
        skipped["Ray variants"] = f"ray not importable: {exc}"
        return {}, {}, None
    import cloudpickle
    import ray_startup

    # Ship the imported benchmark functions by value: the workers cannot import ray_startup.
    cloudpickle.register_pickle_by_value(ray_startup)
    ray.cloudpickle.register_pickle_by_value(ray_startup)
    variants: dict[str, Callable[[dict[str, Any]], Any]] = {}
    try:
        import horovod.ray  # noqa: F401

        variants["RayExecutor start+run+shutdown"] = ray_startup.ray_executor_cold
    except ImportError as exc:
        skipped["RayExecutor"] = f"horovod.ray not importable: {exc}"
    try:
        import ray.train.torch  # noqa: F401

        variants["Ray Train TorchTrainer.fit"] = ray_startup.torch_trainer
    except ImportError as exc:
        skipped["TorchTrainer"] = f"ray.train not importable: {exc}"
    t0 = time.perf_counter()
    # address="local": a new instance of our own, even where another Ray cluster runs here.
    ray.init(address="local", num_cpus=3, include_dashboard=False,
             object_store_memory=200 * 1024 * 1024,
             log_to_driver=False)
    return variants, {"ray.init (local instance, 3 CPUs)": time.perf_counter() - t0}, ray


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--no-spark", action="store_true")
    args = ap.parse_args()

    import horovod

    sys.path.insert(0, HERE)  # ray_startup: the Ray variants and the timing loop
    skipped: dict[str, str] = {}
    variants: dict[str, Callable[[dict[str, Any]], Any]] = {
        "horovod.run np=2 (gloo)": lambda state: horovod.run(hvd_fn, num_proc=2, use_gloo=True),
        "horovod.run np=2 (mpirun)": lambda state: horovod.run(hvd_fn, num_proc=2, use_mpi=True),
    }
    cluster: dict[str, float] = {}
    spark = ray = None
    if not args.no_spark:
        more, starts, spark = spark_variants(skipped)
        variants.update(more)
        cluster.update(starts)
    if not args.no_ray:
        more, starts, ray = ray_variants(skipped)
        variants.update(more)
        cluster.update(starts)
    from ray_startup import time_rounds

    try:
        times, warm = time_rounds(variants, args.repeats)
    finally:
        if ray is not None:
            ray.shutdown()
        if spark is not None:
            spark.stop()
    if warm:
        times["RayExecutor.run, warm actors"] = warm
    rows = {k: statistics.median(v) for k, v in times.items() if v}
    lines = ["| variant (2 ranks, init + one allreduce) | median (s) | all rounds (s) |",
             "|---|---:|---|"]
    lines += [f"| {k} | {v:.2f} | {', '.join(f'{x:.2f}' for x in times[k])} |" for k, v in rows.items()]
    lines += ["", "| cluster start (once, not counted above) | s |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in cluster.items()]
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in skipped.items())]
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"repeats": args.repeats, "median_s": rows, "all_s": times,
                       "cluster_start_s": cluster, "skipped": skipped}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(f"`python benchmarks/cluster_startup.py --repeats {args.repeats}` "
                    f"({os.cpu_count()} cores, shared)\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
