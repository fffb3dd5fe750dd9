"""What this installation can use, found by looking, not by starting anything (build probes)."""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["nccl_built"]


def nccl_built() -> int:
    """NCCL version code (e.g. 22105) if PyTorch with CUDA and NCCL is installed, else 0."""
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        return 0
    try:
        import torch

        if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
            return 0
        major, minor, patch = torch.cuda.nccl.version()
        return major * 10000 + minor * 100 + patch
    except Exception:  # noqa: BLE001 - probing only
        return 0
