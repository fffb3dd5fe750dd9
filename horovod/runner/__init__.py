"""The launcher: ``horovodrun`` (``horovod.runner.launch``) and ``horovod.run()`` (``api.py``).

Importing this package is cheap; the pieces load when used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run"]


def run(*args: Any, **kwargs: Any) -> Any:
    """Run a Python function on every rank of a new job; see ``horovod.runner.api.run``."""
    from horovod.runner.api import run as _run

    return _run(*args, **kwargs)
