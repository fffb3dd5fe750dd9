"""Several rank bodies in one launch: ``SharedLaunch(np, bodies)``.

Starting ranks that import TensorFlow costs 10-20 s on a 2-core machine, far more than most rank
bodies themselves. Bodies that need the same world size and environment (and the default
``hvd.init()``) can run one after the other in the same ranks: the first test that asks for any of
them starts the ranks once, and every test then checks its own body's result, with its own name,
as before. A body that raises is reported with its traceback to its own test only; a body that
hangs or crashes a rank fails every test of its launch (with the launch's output).

Order the bodies so that those that provoke errors on purpose come last.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import cloudpickle

from horovod.testing import run_ranks


def _run_bodies(bodies: list[tuple[str, Callable[[], Any]]]) -> dict[str, tuple[bool, Any]]:
    import traceback

    out: dict[str, tuple[bool, Any]] = {}
    for name, body in bodies:
        try:
            out[name] = (True, body())
        except Exception:  # noqa: BLE001 - reported to that body's test
            out[name] = (False, traceback.format_exc())
    return out


class SharedLaunch:
    """``np`` ranks that run ``bodies`` (name -> function) in order, started on first use."""

    def __init__(self, np: int, bodies: Mapping[str, Callable[[], Any]], timeout: float,
                 env: Mapping[str, str] | None = None) -> None:
        self.np, self.bodies, self.timeout, self.env = np, dict(bodies), timeout, env
        self._results: list[dict[str, tuple[bool, Any]]] | None = None
        self._error: BaseException | None = None

    def results(self, name: str) -> list[Any]:
        """Body ``name``'s return value on every rank (rank order); fails the calling test if
        the launch failed or the body raised on any rank."""
        assert name in self.bodies, name
        if self._results is None and self._error is None:
            for body in self.bodies.values():  # the ranks cannot import the test modules
                module = sys.modules.get(body.__module__)
                if module is not None:
                    cloudpickle.register_pickle_by_value(module)
            try:
                self._results = run_ranks(_run_bodies, np=self.np, timeout=self.timeout,
                                          env=self.env, args=(list(self.bodies.items()),))
            except BaseException as exc:
                self._error = exc
        if self._error is not None:
            raise AssertionError(f"the shared launch of {sorted(self.bodies)} at np={self.np} "
                                 f"failed:\n{self._error}") from None
        assert self._results is not None
        raised = [f"rank {r} raised in {name}:\n{res[name][1]}"
                  for r, res in enumerate(self._results) if not res[name][0]]
        assert not raised, "\n".join(raised)
        return [res[name][1] for res in self._results]
