"""Where estimators run their training: ``SparkBackend`` runs it through ``horovod.spark.run``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Backend", "SparkBackend", "default_num_proc"]


def default_num_proc() -> int:
    """The active SparkContext's ``defaultParallelism`` (the backend's default ``num_proc``)."""
    from horovod.spark.runner import _spark_context

    return int(_spark_context().defaultParallelism)


class Backend:
    """Runs a training function on ``num_processes()`` Horovod ranks and returns their results."""

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> list[Any]:
        raise NotImplementedError

    def num_processes(self) -> int:
        raise NotImplementedError


class SparkBackend(Backend):
    """Upstream's ``SparkBackend(num_proc=None, env=None, **kwargs)``: the other keyword
    arguments (``start_timeout``, ``stdout``, ``stderr``, ``verbose``, ``nics``, ...) go to
    ``horovod.spark.run``."""

    def __init__(self, num_proc: int | None = None, env: dict[str, str] | None = None,
                 **kwargs: Any) -> None:
        self._num_proc = num_proc
        self._env = dict(env or {})
        self._kwargs = kwargs

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> list[Any]:
        from horovod.spark.runner import run

        full_env = {**self._env, **(env or {})}
        return run(fn, args=args, kwargs=kwargs or {}, num_proc=self.num_processes(),
                   env=full_env, **self._kwargs)

    def num_processes(self) -> int:
        if self._num_proc is None:
            self._num_proc = default_num_proc()
        return self._num_proc
