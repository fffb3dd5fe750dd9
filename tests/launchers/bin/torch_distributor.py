"""Spark's TorchDistributor (local mode, 2 processes) running an unchanged Horovod function.

Prints ``DISTRIBUTOR <json>``: every rank's (rank, size, local rank, local size, launcher, sum).
"""

import json
import sys


def train() -> list:
    import torch

    import horovod.torch as hvd
    from horovod.common.context import get_context

    hvd.init()
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
    mine = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), get_context().launch.launcher, total)
    everyone = hvd.allgather_object(mine)
    hvd.shutdown()
    return everyone


if __name__ == "__main__":
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("horovod-torch-distributor")
             .config("spark.ui.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("FATAL")
    try:
        n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
        out = TorchDistributor(num_processes=n, local_mode=True, use_gpu=False).run(train)
        print("DISTRIBUTOR " + json.dumps(out), flush=True)
    finally:
        spark.stop()
