"""torch's per-job state in ``Context.state``: ``hvd.join(device)``'s device and the checkpoint
saves' numbers end with the job (``shutdown``) and start from nothing at the next ``init``."""

from __future__ import annotations

import torch

import horovod.torch as hvd
from horovod.torch._device_tensor import join_device, set_join_device


def test_join_device_and_save_numbers_belong_to_the_job(tmp_path) -> None:
    hvd.shutdown()
    hvd.init()
    try:
        set_join_device(1)
        assert join_device() == torch.device("cuda", 1)
        model = torch.nn.Linear(2, 2)
        hvd.checkpoint.save(str(tmp_path / "a"), model)
        from horovod.common.job_state import next_number

        assert next_number("checkpoint.save") == 2  # the save above took number 1
        hvd.shutdown()
        assert join_device() is None  # no job
        hvd.init()
        assert join_device() is None
        assert next_number("checkpoint.save") == 1
    finally:
        hvd.shutdown()
