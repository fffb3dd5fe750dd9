"""Spark estimators, two measurements in one run.

1. Reader throughput: rows/s of one rank's ``ParquetReader`` (its share of the row groups,
   shuffled, decoded, batched by the background threads; three epochs of the endless stream)
   against pyarrow reading the same row groups three times into numpy with no shuffling or
   batching (the floor of any reader). Interleaved repetitions; the ratio of medians is reported
   (goal >= 0.9), by wall time and by the process's CPU time (the steadier one on a shared
   machine).
2. End to end: ``horovod.spark.torch.TorchEstimator.fit`` against ``pyspark.ml.torch.distributor.
   TorchDistributor`` running the same training (same model, optimizer, batch size, epochs, 2
   processes) on the same DataFrame; TorchDistributor gets the data by collecting the DataFrame
   to the driver (its usual recipe for data that fits there). Both timed from the DataFrame to a
   trained model, then accuracy on the same test rows.

    python benchmarks/spark_estimator_bench.py --rows 200000 --repeats 5 --scale 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np


def write_dataset(path: str, rows: int, width: int, row_group: int) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    files, per_file = [], row_group * 4
    for start in range(0, rows, per_file):
        n = min(per_file, rows - start)
        x = rng.random((n, width))
        table = pa.table({"features": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), width)
                          .cast(pa.list_(pa.float64())),
                          "label": pa.array(rng.integers(0, 10, n))})
        f = f"{path}/part-{start // per_file:05d}.parquet"
        pq.write_table(table, f, row_group_size=row_group)
        files.append(f)
    return files


def pyarrow_floor(files: list[str], rank: int, size: int,
                  passes: int = 3) -> tuple[int, float, float]:
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from horovod.spark.common.reader import _column, row_groups

    fs = pafs.LocalFileSystem()
    t0, c0, rows = time.perf_counter(), time.process_time(), 0
    mine = row_groups(fs, files)[rank::size]
    for path, i, _ in mine * passes:
        with fs.open_input_file(path) as fh:
            t = pq.ParquetFile(fh).read_row_group(i, columns=["features", "label"])
        _column(t.column("features"), t.num_rows)
        _column(t.column("label"), t.num_rows)
        rows += t.num_rows
    return rows, time.perf_counter() - t0, time.process_time() - c0


def reader_pass(files: list[str], rank: int, size: int, batch: int,
                passes: int = 3) -> tuple[int, float, float]:
    import pyarrow.fs as pafs

    from horovod.spark.common.reader import ParquetReader

    meta = {"features": {"kind": "array"}, "label": {"kind": "scalar"}}
    t0, c0 = time.perf_counter(), time.process_time()
    with ParquetReader(pafs.LocalFileSystem(), files, ["features", "label"], meta, batch,
                       rank=rank, size=size, seed=1) as r:
        it, rows = iter(r), 0
        while rows + batch <= r.rows * passes:
            rows += len(next(it)["label"])
    return rows, time.perf_counter() - t0, time.process_time() - c0


def bench_reader(rows: int, width: int, repeats: int, batch: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        files = write_dataset(d, rows, width, row_group=8192)
        ours, floor, ours_cpu, floor_cpu = [], [], [], []
        for _ in range(repeats):
            n, t, c = pyarrow_floor(files, 0, 2)
            floor.append(n / t)
            floor_cpu.append(n / c)
            n, t, c = reader_pass(files, 0, 2, batch)
            ours.append(n / t)
            ours_cpu.append(n / c)
    med = statistics.median
    return {"reader_rows_per_s": med(ours), "pyarrow_rows_per_s": med(floor),
            "ratio": med(ours) / med(floor),
            "reader_rows_per_cpu_s": med(ours_cpu), "pyarrow_rows_per_cpu_s": med(floor_cpu),
            "cpu_ratio": med(ours_cpu) / med(floor_cpu)}


def _net() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _distributor_train(x: np.ndarray, y: np.ndarray, epochs: int, batch: int, lr: float) -> Any:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    ds = TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long))
    sampler = DistributedSampler(ds, seed=1)
    loader = DataLoader(ds, batch_size=batch, sampler=sampler, drop_last=True)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    state = {k: v.cpu() for k, v in model.module.state_dict().items()}
    dist.destroy_process_group()
    return state


def bench_fit(spark: Any, scale: int, epochs: int, batch: int, store_dir: str) -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import Vectors
    from pyspark.ml.torch.distributor import TorchDistributor
    from sklearn.datasets import load_digits

    from horovod.spark.common.store import Store
    from horovod.spark.torch import TorchEstimator

    d = load_digits()
    x, y = np.tile(d.data / 16.0, (scale, 1)), np.tile(d.target, scale)
    df = spark.createDataFrame([(Vectors.dense(a), int(b)) for a, b in zip(x, y)],
                               ["features", "label"]).cache()
    df.count()
    test_x = torch.tensor(d.data / 16.0, dtype=torch.float32)

    def acc(model: Any) -> float:
        with torch.no_grad():
            return float((model(test_x).argmax(1).numpy() == d.target).mean())

    out: dict[str, float] = {}
    net = _net()
    t0 = time.perf_counter()
    est = TorchEstimator(num_proc=2, store=Store.create(store_dir), model=net,
                         optimizer=torch.optim.Adam(net.parameters(), lr=0.003),
                         loss=F.cross_entropy, feature_cols=["features"], label_cols=["label"],
                         batch_size=batch, epochs=epochs, random_seed=1, verbose=0)
    model = est.fit(df)
    out["estimator_fit_s"] = time.perf_counter() - t0
    out["estimator_acc"] = acc(model.getModel())

    t0 = time.perf_counter()
    pdf = df.select(vector_to_array("features").alias("f"), "label").toPandas()
    xs, ys = np.stack(pdf["f"].to_numpy()), pdf["label"].to_numpy()
    state = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        _distributor_train, xs, ys, epochs, batch, 0.003)
    out["distributor_fit_s"] = time.perf_counter() - t0
    m = _net()
    m.load_state_dict(state)
    out["distributor_acc"] = acc(m)
    df.unpersist()
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--scale", type=int, default=10, help="copies of digits in the fit DataFrame")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--master", default="local-cluster[2,1,1024]")
    p.add_argument("--skip-fit", action="store_true")
    args = p.parse_args(argv)

    res = bench_reader(args.rows, args.width, args.repeats, args.batch)
    print(f"reader, rank 0 of 2, {args.rows} rows x {args.width} float64, batch {args.batch}: "
          f"{res['reader_rows_per_s']:,.0f} rows/s vs pyarrow {res['pyarrow_rows_per_s']:,.0f} "
          f"rows/s = {res['ratio']:.2f}x (wall); per CPU second {res['reader_rows_per_cpu_s']:,.0f} "
          f"vs {res['pyarrow_rows_per_cpu_s']:,.0f} = {res['cpu_ratio']:.2f}x", flush=True)
    if not args.skip_fit:
        from pyspark.sql import SparkSession

        spark = (SparkSession.builder.master(args.master).appName("hvd-estimator-bench")
                 .config("spark.ui.enabled", "false").config("spark.pyspark.python", sys.executable)
                 .config("spark.ui.showConsoleProgress", "false").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        try:
            with tempfile.TemporaryDirectory() as d:
                fit = bench_fit(spark, args.scale, args.epochs, args.batch, d)
        finally:
            spark.stop()
        res.update(fit)
        print(f"fit, {args.scale}x digits ({1797 * args.scale} rows), {args.epochs} epochs, 2 "
              f"processes: TorchEstimator.fit {fit['estimator_fit_s']:.1f} s (accuracy "
              f"{fit['estimator_acc']:.3f}) vs TorchDistributor {fit['distributor_fit_s']:.1f} s "
              f"(accuracy {fit['distributor_acc']:.3f})", flush=True)
    return res


if __name__ == "__main__":
    main()
