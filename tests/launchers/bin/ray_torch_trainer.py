"""Ray Train's TorchTrainer (2 workers, local Ray) running an unchanged Horovod training function.

Ray Train initialises torch.distributed's default group before the function runs; hvd.init()
joins it. Every rank prints ``TRAINER <rank> <json>``: every rank's (rank, size, local rank, local size, launcher, sum).
"""

import json
import os
import sys
import tempfile


def train(config: dict) -> None:
    import torch

    import horovod.torch as hvd
    from horovod.common.context import get_context

    hvd.init()
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
    mine = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), get_context().launch.launcher, total)
    everyone = hvd.allgather_object(mine)
    hvd_rank = hvd.rank()
    hvd.shutdown()
    print(f"TRAINER {hvd_rank} " + json.dumps(everyone), flush=True)  # forwarded by Ray to the driver


if __name__ == "__main__":
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    ray.init(address="local", num_cpus=n, include_dashboard=False, object_store_memory=100 * 1024 * 1024,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    try:
        trainer = TorchTrainer(train, scaling_config=ScalingConfig(num_workers=n, use_gpu=False),
                               run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="hvd-ray-train-")))
        trainer.fit()
    finally:
        ray.shutdown()
