"""``under_settings(fn, env, spied)``: a rank body (tests/_shared_launch.py) that runs ``fn`` from a
fresh ``hvd.init()`` under settings of its own, in ranks that run other bodies before and after it.

Settings that Horovod reads at ``init`` (``HOROVOD_*`` variables) differ between runs that could
otherwise share one launch; this sets them (None: unset) between two ``hvd.shutdown()`` calls and
puts back, afterwards, the variables and the methods ``fn`` spies on (``spied``: (class, name)
pairs: a class or module and a name), so that the bodies after it find the process as it was. Register it ``late``, as
``own_init``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any


def under_settings(fn: Callable[[], Any], env: Mapping[str, str | None],
                   spied: Callable[[], Sequence[tuple[Any, str]]] = lambda: ()) -> Callable[[], Any]:
    """``fn`` under ``env``; ``spied`` (called in the rank) names the methods to put back."""

    def body() -> Any:
        import os

        from horovod.common import basics

        pairs = list(spied())
        methods = [getattr(owner, name) for owner, name in pairs]
        saved = {k: os.environ.get(k) for k in env}

        def apply(values: Mapping[str, str | None]) -> None:
            for k, v in values.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

        basics.shutdown()
        try:
            apply(env)
            return fn()
        finally:
            basics.shutdown()
            apply(saved)
            for (owner, name), method in zip(pairs, methods):
                setattr(owner, name, method)

    # named as fn (its module is pickled by value for the ranks, and owns the body's name)
    body.__module__, body.__qualname__ = fn.__module__, f"under_settings({fn.__qualname__})"
    return body


def runs_in_turn(fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], settings: Sequence[str],
                 spied: Callable[[], Sequence[tuple[Any, str]]] = lambda: ()) -> Callable[[], Any]:
    """A rank body: ``[fn(*args) for args in calls]``, each from a fresh ``hvd.init()``, where ``fn``
    sets the ``settings`` variables itself (per rank, say) before its ``init``: as ``in_turn``
    (tests/_shared_launch.py), but for ranks that run other bodies afterwards (the variables and
    the ``spied`` methods put back, as ``under_settings``)."""

    def runs() -> list[Any]:
        from horovod.common import basics

        out = []
        for args in calls:
            basics.shutdown()
            out.append(fn(*args))
        return out

    runs.__module__, runs.__qualname__ = fn.__module__, f"runs_in_turn({fn.__qualname__})"
    return under_settings(runs, dict.fromkeys(settings), spied)
