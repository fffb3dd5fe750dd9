"""The GPU tier: ``pytest -m gpu tests/gpu`` on a machine with a CUDA GPU.

Without one every test here is skipped with the reason, unless ``HVD_TEST_REQUIRE_GPU=1`` (a GPU
lane), which makes a missing GPU fail instead of skipping everything.
"""

from __future__ import annotations

import os

import pytest


def _reason() -> str:
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (torch.cuda.is_available() is False); the GPU path is " \
               "tested here through its CPU twin (tests/torch/test_device_plane.py)"
    if not torch.distributed.is_nccl_available():
        return "this PyTorch has no NCCL"
    return ""


@pytest.fixture(autouse=True)
def _needs_gpu() -> None:
    reason = _reason()
    if reason:
        if os.environ.get("HVD_TEST_REQUIRE_GPU") == "1":
            pytest.fail(f"HVD_TEST_REQUIRE_GPU=1 but {reason}")
        pytest.skip(reason)
