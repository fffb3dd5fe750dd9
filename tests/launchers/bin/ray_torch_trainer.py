"""Ray Train's TorchTrainer (2 workers, local Ray) running an unchanged Horovod training function.

Ray Train initialises torch.distributed's default group before the function runs; hvd.init()
joins it. Every rank writes what it saw to a file; once the run ended, this driver prints
``TRAINER <rank> <json>`` for each: every rank's (rank, size, local rank, local size, launcher, sum).
(Not the workers' own prints: Ray's log monitor tails their log files and forwards the lines on its
own schedule, so a line printed as the run ends can miss a driver that shuts Ray down.)
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
    path = os.path.join(config["out"], f"rank{hvd.rank()}.json")
    hvd.shutdown()
    with open(path + ".tmp", "w") as f:
        json.dump(everyone, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    ray.init(address="local", num_cpus=n, include_dashboard=False, object_store_memory=100 * 1024 * 1024,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    with tempfile.TemporaryDirectory(prefix="hvd-ray-train-out-") as out:
        try:
            trainer = TorchTrainer(train, train_loop_config={"out": out},
                                   scaling_config=ScalingConfig(num_workers=n, use_gpu=False),
                                   run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="hvd-ray-train-")))
            trainer.fit()
        finally:
            ray.shutdown()
        for name in sorted(os.listdir(out)):
            with open(os.path.join(out, name)) as f:
                print(f"TRAINER {name[len('rank'):-len('.json')]} {f.read()}", flush=True)
