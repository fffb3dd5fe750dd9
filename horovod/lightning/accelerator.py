"""``Trainer(accelerator="horovod")``, Lightning 1's spelling, answered with Lightning 2's.

In Lightning 2 an accelerator is a device type (``cpu``, ``cuda``, ...) and the distribution is
the strategy. An entry of the accelerator registry only builds an accelerator: the Trainer picks
the strategy from its ``strategy=`` flag alone (``"auto"`` becomes single-device or DDP, never
anything an accelerator asks for). So ``accelerator="horovod"`` cannot select the Horovod strategy;
its registry entry raises an error that gives the spelling that does.
"""

from __future__ import annotations

import importlib
from typing import Any

NAME = "horovod"

MESSAGE = (
    "Trainer(accelerator='horovod') is the Lightning 1.x spelling. In Lightning 2 Horovod is a "
    "strategy and the accelerator is the device: use Trainer(strategy='horovod', accelerator='cpu') "
    "on CPUs or Trainer(strategy='horovod', accelerator='gpu', devices=1) with one GPU per process "
    "(after `import horovod.lightning`), and start the script with `horovodrun -np N python train.py`."
)


class HorovodAcceleratorName:
    """The registry entry for ``accelerator="horovod"``: building it raises the fix."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(MESSAGE)

    @staticmethod
    def is_available() -> bool:
        return False  # never offered among the accelerators Lightning lists as usable

    @staticmethod
    def parse_devices(devices: Any) -> Any:
        raise ValueError(MESSAGE)

    @staticmethod
    def get_parallel_devices(devices: Any) -> Any:
        raise ValueError(MESSAGE)

    @staticmethod
    def auto_device_count() -> int:
        raise ValueError(MESSAGE)


def register_accelerator_name(package: str) -> None:
    """Put the ``"horovod"`` entry in ``package``'s accelerator registry (no entry is replaced)."""
    registry = importlib.import_module(package + ".accelerators").AcceleratorRegistry
    if NAME not in registry:
        registry.register(NAME, HorovodAcceleratorName,
                          description="Lightning 1's accelerator='horovod': raises, use strategy='horovod'")
