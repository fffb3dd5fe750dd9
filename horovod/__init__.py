"""Horovod: distributed deep learning training, re-built in Python.

Importing this package is cheap: it loads no framework and no MPI. Pick a binding
(``horovod.torch``, ``horovod.tensorflow``, ``horovod.tensorflow.keras``, ``horovod.keras`` or
``horovod.numpy``) and call ``hvd.init()``.
"""

from __future__ import annotations

from typing import Any

from horovod._version import __version__

__all__ = ["__version__", "run"]


def __getattr__(name: str) -> Any:
    """``horovod.run`` is ``horovod.runner.run`` (its signature and docstring), loaded when first used."""
    if name == "run":
        from horovod.runner.api import run

        return run
    raise AttributeError(f"module 'horovod' has no attribute {name!r}")
