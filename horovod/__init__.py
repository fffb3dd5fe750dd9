"""Horovod: distributed deep learning training, re-built in Python.

Importing this package is cheap: it loads no framework and no MPI. Pick a binding
(``horovod.torch``, ``horovod.tensorflow``, ``horovod.tensorflow.keras``, ``horovod.keras`` or
``horovod.numpy``) and call ``hvd.init()``.
"""

from __future__ import annotations

from typing import Any

from horovod._version import __version__

__all__ = ["__version__", "run"]


def run(*args: Any, **kwargs: Any) -> Any:
    """Run a Python function on every rank of a new job; see ``horovod.runner.run``."""
    from horovod.runner import run as _run

    return _run(*args, **kwargs)
