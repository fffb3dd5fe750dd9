"""The function a launcher runs on every rank, as it sends it to the workers."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FunctionCall", "function_call"]


# ``horovod.run``, ``horovod.spark.run`` and ``run_elastic`` store one, pickled with cloudpickle,
# under FUNC_SCOPE/FUNC_KEY of the job's rendezvous service; ``horovod.runner.run_task`` reads it
# (``function_call`` checks what it read). ``RayExecutor.run`` sends one through Ray's object
# store as the function each actor calls with its executable (``on_executable``).
@dataclass(frozen=True)
class FunctionCall:
    """``fn(*args, **kwargs)``, to be run on a rank."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, fn: Callable[..., Any], args: Sequence[Any] | None = None,
           kwargs: Mapping[str, Any] | None = None) -> FunctionCall:
        """The call with ``args``/``kwargs`` as a launcher's caller gives them (None: none)."""
        return cls(fn, tuple(args or ()), dict(kwargs or {}))

    def __call__(self) -> Any:
        return self.fn(*self.args, **self.kwargs)

    def on_executable(self, _executable: Any) -> Any:
        """The call made by a Ray worker, which passes its executable (unused here)."""
        return self()


def function_call(item: object, who: str = "a worker") -> FunctionCall:
    """``item`` if it is a :class:`FunctionCall`, for the worker reading it.

    Raises:
        HorovodInternalError: anything else (a launcher of another horovod-py version).
    """
    if isinstance(item, FunctionCall):
        return item
    from horovod.common.exceptions import HorovodInternalError  # the worker reads; the shim never

    raise HorovodInternalError(f"{who} read {type(item).__name__} {item!r:.200} as the function to run, not a "
                    "FunctionCall: the launcher and this worker run different horovod-py versions?")
