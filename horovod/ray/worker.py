"""The class every Horovod rank runs as, inside a Ray actor (upstream's ``BaseHorovodWorker``).

The executor makes it a Ray actor (``ray.remote(BaseHorovodWorker)``), sets the rank's
environment with ``update_env_vars`` (what ``horovodrun`` gives a worker process: rank, sizes,
the rendezvous address and secret), and runs functions in it with ``execute``. ``hvd.init()``
called by such a function joins the job's Gloo world from that environment.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

from horovod.common.protocol import Exited, Raised, Returned, TaskOutcome

__all__ = ["BaseHorovodWorker"]


class BaseHorovodWorker:
    """One rank. ``executable`` is the object made by ``start_executable`` (or None)."""

    executable: Any = None

    def __init__(self, world_rank: int = 0, world_size: int = 1) -> None:
        os.environ["HOROVOD_HOSTNAME"] = self.hostname()
        os.environ["HOROVOD_RANK"] = str(world_rank)
        os.environ["HOROVOD_SIZE"] = str(world_size)

    def hostname(self) -> str:
        return socket.gethostname()

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def node_info(self) -> tuple[str, str, str, int]:
        """(node id, node IP, host name, process id) of this actor."""
        import ray

        return (str(ray.get_runtime_context().get_node_id()), ray.util.get_node_ip_address(),
                self.hostname(), os.getpid())

    def get_gpu_ids(self) -> list[Any]:
        """The CUDA devices Ray gave this worker."""
        import ray

        return list(ray.get_gpu_ids())

    def update_env_vars(self, env_vars: dict[str, Any]) -> None:
        """Set variables in this actor's process (values are turned into strings)."""
        os.environ.update({k: str(v) for k, v in env_vars.items()})

    def env_vars(self) -> dict[str, str]:
        return dict(os.environ)

    def start_executable(self, executable_cls: type | None = None,
                         executable_args: list[Any] | None = None,
                         executable_kwargs: dict[str, Any] | None = None) -> None:
        """Make ``executable_cls(*args, **kwargs)`` this worker's ``executable`` (None: none)."""
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or []), **(executable_kwargs or {}))

    def execute(self, func: Callable[[Any], Any]) -> Any:
        """``func(self.executable)``; its exception propagates (``run_remote``)."""
        return func(self.executable)

    def shutdown_horovod(self) -> None:
        """``hvd.shutdown()`` if this worker initialized Horovod (before its actor is killed, so
        that the other ranks do not see a lost peer)."""
        basics = sys.modules.get("horovod.common.basics")
        if basics is not None:
            basics.shutdown()

    def execute_reported(self, func: Callable[[Any], Any]) -> TaskOutcome:
        """``func(self.executable)``, its outcome as data, so that the driver can name the rank:
        ``Returned(value)``, ``Exited(code)`` for ``sys.exit`` (an elastic worker left out of the
        job exits 0), or ``Raised(exception, traceback text)``."""
        try:
            return Returned(func(self.executable))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) or exc.code is None else 1
            return Exited(code or 0)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the driver
            tb = traceback.format_exc()
            print(f"User function raised {exc!r}\n{tb}", file=sys.stderr, flush=True)
            try:
                import ray.cloudpickle as pickle

                pickle.dumps(exc)
            except Exception:  # noqa: BLE001 - an exception that cannot be pickled goes as text
                exc = RuntimeError(f"{type(exc).__name__}: {exc}")
            return Raised(exc, tb)
