"""Functions the Ray tests run on their ranks (sent to the actors by value, see conftest)."""

from __future__ import annotations

import os


def identity(tag):
    """The rank's view of the job, and one allreduce over it."""
    import ray
    import torch

    import horovod.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="ranks").item()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
            "cross_size": hvd.cross_size(), "sum": total, "tag": tag,
            "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
