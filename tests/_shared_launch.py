"""Several rank bodies in one launch: ``SharedLaunch(np, bodies)``.

Starting ranks that import TensorFlow costs 10-20 s on a 2-core machine, far more than most rank
bodies themselves. Bodies that need the same world size and environment (and the default
``hvd.init()``) can run one after the other in the same ranks: the first test that asks for any of
them starts the ranks once, and every test then checks its own body's result, with its own name,
as before. A body that raises is reported with its traceback to its own test only; a body that
hangs or crashes a rank fails every test of its launch (with the launch's output).

Order the bodies so that those that provoke errors on purpose come last.

``joint_launch(group, np, bodies, timeout, env)`` goes one step further: every module that
registers bodies for the same group (say "tensorflow"), world size and environment (at import,
i.e. while pytest collects) gets its part of one launch shared by all of them; bodies registered
with ``late=True`` (errors on purpose) run after every other body of the launch. A body that starts
Horovod with process sets of its own joins a launch wrapped in ``own_init`` (and ``late``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle
import pytest

from horovod.testing import run_ranks


def _run_bodies(bodies: list[tuple[str, Callable[[], Any]]]) -> dict[str, tuple[bool, Any, float]]:
    """Each body's (returned, value or traceback, seconds) in this rank."""
    import time
    import traceback

    out: dict[str, tuple[bool, Any, float]] = {}
    for name, body in bodies:
        t0 = time.monotonic()
        try:
            out[name] = (True, body(), time.monotonic() - t0)
        except Exception:  # noqa: BLE001 - reported to that body's test
            out[name] = (False, traceback.format_exc(), time.monotonic() - t0)
    return out


# Every launch that has run in this process, for the suite's summary of where their time went
# (tests/conftest.py: ``pytest_terminal_summary``).
LAUNCHED: list[SharedLaunch] = []


class SharedLaunch:
    """``np`` ranks that run ``bodies`` (name -> function) in order, started on first use."""

    def __init__(self, np: int, bodies: Mapping[str, Callable[[], Any]], timeout: float,
                 env: Mapping[str, str] | None = None, launcher: list[str] | None = None) -> None:
        self.np, self.bodies, self.timeout, self.env = np, dict(bodies), timeout, env
        self.launcher = launcher  # run_ranks' command prefix (default: mpirun)
        self.label = f"np={np} " + ", ".join(self.bodies)
        self.seconds = 0.0  # the launch's wall time, start-up included, once it has run
        self._late: set[str] = set()
        self._results: list[dict[str, tuple[bool, Any, float]]] | None = None
        self._error: BaseException | None = None

    def add(self, bodies: Mapping[str, Callable[[], Any]], timeout: float, late: bool = False) -> None:
        """More bodies (after the others if ``late``), and ``timeout`` more seconds for the launch;
        only before the launch has started."""
        assert self._results is None and self._error is None, "the launch has already run"
        clash = set(bodies) & set(self.bodies)
        assert not clash, f"bodies registered twice: {sorted(clash)}"
        self.bodies.update(bodies)
        self.timeout += timeout
        if late:
            self._late.update(bodies)

    def results(self, name: str) -> list[Any]:
        """Body ``name``'s return value on every rank (rank order); fails the calling test if
        the launch failed or the body raised on any rank."""
        assert name in self.bodies, name
        if self._results is None and self._error is None:
            for body in self.bodies.values():  # the ranks cannot import the test modules
                module = sys.modules.get(body.__module__)
                if module is not None:
                    cloudpickle.register_pickle_by_value(module)
            t0 = time.monotonic()
            try:
                self._results = run_ranks(_run_bodies, np=self.np, timeout=self.timeout,
                                          env=self.env, args=(self._ordered(),), launcher=self.launcher)
            except BaseException as exc:
                self._error = exc
            self.seconds = time.monotonic() - t0
            LAUNCHED.append(self)
        if self._error is not None:
            raise AssertionError(f"the shared launch of {sorted(self.bodies)} at np={self.np} "
                                 f"failed:\n{self._error}") from None
        assert self._results is not None
        raised = [f"rank {r} raised in {name}:\n{res[name][1]}"
                  for r, res in enumerate(self._results) if not res[name][0]]
        assert not raised, "\n".join(raised)
        return [res[name][1] for res in self._results]

    def timings(self) -> tuple[float, list[tuple[float, str]]]:
        """The launch's wall seconds and each body's seconds on its slowest rank (slowest body
        first); no bodies if the launch failed."""
        if self._results is None:
            return self.seconds, []
        return self.seconds, sorted(((max(res[name][2] for res in self._results), name)
                                     for name in self.bodies), reverse=True)

    def _ordered(self) -> list[tuple[str, Callable[[], Any]]]:
        items = list(self.bodies.items())
        return [i for i in items if i[0] not in self._late] + [i for i in items if i[0] in self._late]


def own_init(body: Callable[[], Any]) -> Callable[[], Any]:
    """``body`` between two ``hvd.shutdown()`` calls, for a body that starts Horovod with settings
    of its own (``hvd.init(process_sets=...)``: static or dynamic process sets) in a launch shared
    with plain-init bodies: it starts from a fresh ``init``, and the bodies after it init afresh in
    turn (tests/multiprocess/test_init_lifecycle.py: init after shutdown under MPI). Register it
    ``late``, with the bodies that provoke errors."""

    def fresh() -> Any:
        from horovod.common import basics

        basics.shutdown()
        try:
            return body()
        finally:
            basics.shutdown()

    fresh.__module__, fresh.__qualname__ = body.__module__, f"own_init({body.__qualname__})"
    return fresh


def under_settings(fn: Callable[[], Any], env: Mapping[str, str | None],
                   spied: Callable[[], Sequence[tuple[Any, str]]] = lambda: ()) -> Callable[[], Any]:
    """``own_init(fn)`` under settings of its own: the ``HOROVOD_*`` variables of ``env`` (None:
    unset), which Horovod reads at ``init``, set after the first shutdown; they and the methods
    ``fn`` spies on (``spied``, called in the rank: (class or module, name) pairs) are put back
    before the second, so that the bodies after it find the process as it was. Register it
    ``late``, as ``own_init``."""

    def settled() -> Any:
        import os

        def apply(values: Mapping[str, str | None]) -> None:
            for k, v in values.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

        pairs = list(spied())
        methods = [getattr(owner, name) for owner, name in pairs]
        saved = {k: os.environ.get(k) for k in env}
        apply(env)
        try:
            return fn()
        finally:
            apply(saved)
            for (owner, name), method in zip(pairs, methods):
                setattr(owner, name, method)

    settled.__module__, settled.__qualname__ = fn.__module__, f"under_settings({fn.__qualname__})"
    return own_init(settled)


# The test that starts a joint launch waits for every module's bodies: more than the suite's
# default per-test timeout. The launch's own timeout (the sum of its parts', at most a minute less
# than this) ends a hang first, with the ranks' output.
_JOINT_TIMEOUT_S = 900
JOINT_TIMEOUT = pytest.mark.timeout(_JOINT_TIMEOUT_S)

_JOINT: dict[tuple[str, int, tuple[tuple[str, str], ...], bool], SharedLaunch] = {}
_OWNERS: dict[tuple[str, tuple[str, ...]], str] = {}  # (file, body names) -> the module name it registered as


class JointPart:
    """One module's bodies in a launch shared across modules: ``results(name)`` as SharedLaunch's."""

    def __init__(self, launch: SharedLaunch, owner: str) -> None:
        self.launch, self.owner = launch, owner

    def results(self, name: str) -> list[Any]:
        return self.launch.results(f"{self.owner}:{name}")


def joint_launch(group: str, np: int, bodies: Mapping[str, Callable[[], Any]], timeout: float,
                 env: Mapping[str, str] | None = None, *, late: bool = False, gloo: bool = False) -> JointPart:
    """Register a module's ``bodies`` (name -> function) in the one launch of ``group`` (the
    framework the ranks import) at world size ``np`` and environment ``env`` that every module
    registering for them shares. Call it at import: a launch takes the bodies registered before its
    first test asks for results. The launch's timeout is the sum of its parts' (at most 840 s; its
    tests carry ``JOINT_TIMEOUT``); ``late`` bodies run after the others; ``gloo``: the ranks are
    started by ``horovodrun --gloo`` instead of mpirun (a launch of its own)."""
    owner = next(iter(bodies.values())).__module__  # names are per module
    source = getattr(sys.modules.get(owner), "__file__", None) or owner
    first = _OWNERS.setdefault((source, tuple(bodies)), owner)
    assert first == owner, (
        f"{source} registered its bodies twice, imported as {first!r} and as {owner!r}: another "
        "module imports this test module (the bodies would run twice); move what it imports into "
        "a helper module that is not a test module")
    key = (group, np, tuple(sorted((env or {}).items())), gloo)
    named = {f"{owner}:{name}": body for name, body in bodies.items()}
    launch = _JOINT.get(key)
    if launch is None:
        launcher = [sys.executable, "-m", "horovod.runner", "--gloo", "-np", str(np)] if gloo else None
        launch = _JOINT[key] = SharedLaunch(np, {}, timeout=0, env=dict(env) if env else None, launcher=launcher)
        launch.label = f"{group} np={np}" + " gloo" * gloo + "".join(f" {k}={v}" for k, v in key[2])
    launch.add(named, timeout, late=late)
    launch.timeout = min(launch.timeout, _JOINT_TIMEOUT_S - 60)
    return JointPart(launch, owner)


def in_turn(fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> Callable[[], list[Any]]:
    """A rank body (for ``run_ranks``): ``[fn(*args) for args in calls]``, each call from a fresh
    ``hvd.init()`` (between two ``hvd.shutdown()`` calls, as ``own_init``). Runs that differ only in
    settings read at ``init`` (``HOROVOD_*`` variables that ``fn`` sets before it) then share one
    launch, whose ranks start and import their framework once instead of once per run."""
    module = sys.modules.get(fn.__module__)
    if module is not None:  # a test module: the ranks cannot import it
        cloudpickle.register_pickle_by_value(module)

    def body() -> list[Any]:
        from horovod.common import basics

        out = []
        for args in calls:
            basics.shutdown()
            try:
                out.append(fn(*args))
            finally:
                basics.shutdown()
        return out

    body.__module__, body.__qualname__ = fn.__module__, f"in_turn({fn.__qualname__})"
    return body


def in_a_directory(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """A rank body: ``fn(*args, directory)``, where ``fn`` starts Horovod itself and ``directory``
    is a fresh one every rank of the launch shares (in the place of a test's ``tmp_path``, which a
    body registered at import has not got); removed once every rank's ``fn`` has returned (by
    rank 0), or at once by a rank whose ``fn`` raised."""
    import os
    import tempfile
    import uuid

    module = sys.modules.get(fn.__module__)
    if module is not None:  # a test module: the ranks cannot import it
        cloudpickle.register_pickle_by_value(module)
    # the name only: made in the ranks, so that a launch that never runs leaves nothing behind
    directory = os.path.join(tempfile.gettempdir(), f"hvd-body-{uuid.uuid4().hex}")

    def body() -> Any:
        import os
        import shutil

        os.makedirs(directory, exist_ok=True)
        try:
            out = fn(*args, directory)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        from horovod.common import basics
        from horovod.common.objects import allgather_object

        allgather_object(None, name=f"in_a_directory.{os.path.basename(directory)}")  # every rank is done
        if basics.rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
        return out

    body.__module__, body.__qualname__ = fn.__module__, f"in_a_directory({fn.__qualname__})"
    return body


def run_as_main(script: str, *args: str) -> str:
    """Run ``script`` as ``__main__`` in this rank with ``args`` as its command line (as ``python
    script args`` would, inside a shared launch's rank); return what it printed."""
    import contextlib
    import io
    import runpy

    argv, out = sys.argv, io.StringIO()
    sys.argv = [script, *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()
