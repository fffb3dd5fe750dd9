"""Start-up overhead of a 2-rank job on Ray: ``RayExecutor.run`` against Ray Train's ``TorchTrainer``
and ``horovod.run`` (what ``horovodrun -np 2`` runs), the same function, in one run.

The function: initialise, allreduce one number over the 2 ranks, return it. Each variant is timed
from nothing (no workers running) to the results in the driver's hands, the variants interleaved
(round 1: each variant once, round 2: ...) on one Ray instance started first (its own start-up
is reported apart: a Ray user has a cluster already). ``RayExecutor`` is timed cold (``start`` +
``run`` + ``shutdown``) and warm (one more ``run`` on the started actors).

    python benchmarks/ray_startup.py [--repeats 3] [--json benchmarks/results/ray_startup.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any


def hvd_fn() -> float:
    import torch

    import horovod.torch as hvd

    hvd.init()
    return float(hvd.allreduce(torch.ones(1) * (hvd.rank() + 1), op=hvd.Sum, name="x").item())


def train_loop(config: dict[str, Any]) -> float:
    import ray.train
    import torch
    import torch.distributed as dist

    t = torch.ones(1) * (ray.train.get_context().get_world_rank() + 1)
    dist.all_reduce(t)
    return float(t.item())


def ray_executor_cold(state: dict[str, Any]) -> Any:
    from horovod.ray import RayExecutor

    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    ex.start()
    try:
        out = ex.run(hvd_fn)
        t0 = time.perf_counter()
        again = ex.run(hvd_fn)
        state["warm"] = time.perf_counter() - t0
        assert again == out
    finally:
        ex.shutdown()
    return out


def torch_trainer(state: dict[str, Any]) -> Any:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(train_loop, scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="hvd-bench-")))
    result = trainer.fit()
    if result.error is not None:
        raise RuntimeError(result.error)
    return getattr(result, "return_value", None)


def horovod_run(mode: str) -> Callable[[dict[str, Any]], Any]:
    def go(state: dict[str, Any]) -> Any:
        import horovod

        return horovod.run(hvd_fn, num_proc=2, use_gloo=mode == "gloo", use_mpi=mode == "mpi")

    return go


def time_rounds(variants: dict[str, Callable[[dict[str, Any]], Any]], repeats: int,
                ) -> tuple[dict[str, list[float]], list[float]]:
    """Time each variant once per round, interleaved; also what variants put in ``state["warm"]``."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    warm: list[float] = []
    for rnd in range(repeats):
        for name, fn in variants.items():
            state: dict[str, Any] = {}
            start = time.perf_counter()
            out = fn(state)
            times[name].append(time.perf_counter() - start)
            if "warm" in state:
                warm.append(state["warm"])
            print(f"round {rnd}: {name}: {times[name][-1]:.2f} s -> {out}", flush=True)
    return times, warm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here as JSON")
    args = ap.parse_args()

    import ray

    t0 = time.perf_counter()
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=200 * 1024 * 1024,
             log_to_driver=False)
    ray_init = time.perf_counter() - t0
    variants: dict[str, Callable[[dict[str, Any]], Any]] = {
        "horovod.run np=2 (mpirun)": horovod_run("mpi"),
        "horovod.run np=2 (gloo)": horovod_run("gloo"),
        "RayExecutor start+run+shutdown": ray_executor_cold,
        "Ray Train TorchTrainer.fit": torch_trainer,
    }
    try:
        times, warm = time_rounds(variants, args.repeats)
    finally:
        ray.shutdown()
    rows = {k: statistics.median(v) for k, v in times.items()}
    rows["RayExecutor.run, warm actors"] = statistics.median(warm)
    print(f"\nray.init (local instance, 3 CPUs): {ray_init:.2f} s (not counted below)")
    print(f"{'variant':40s} median of {args.repeats} (s)   all")
    for k, v in rows.items():
        all_ = times.get(k, warm)
        print(f"{k:40s} {v:8.2f}              {', '.join(f'{x:.2f}' for x in all_)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ray_init_s": ray_init, "median_s": rows, "all_s": {**times, "warm": warm}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
