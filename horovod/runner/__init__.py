"""The launcher: ``horovodrun`` (``horovod.runner.launch.horovodrun``) and ``horovod.run()`` (``api.py``).

Importing this package is cheap (``api.py`` loads the launch machinery when ``run`` is called).
"""

from __future__ import annotations

from horovod.runner.api import run

__all__ = ["run"]
