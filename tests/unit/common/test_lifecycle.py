"""How a process ends: error classification, sys.exit detection, exit without waiting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from horovod.common import lifecycle
from horovod.common.exceptions import (
    CollectiveMismatchError,
    HorovodInternalError,
    HorovodShutdownError,
)

REPO = Path(__file__).resolve().parents[3]


def _raise_from(outer: BaseException, inner: BaseException | None) -> BaseException:
    try:
        try:
            if inner is not None:
                raise inner
        except BaseException as e:  # noqa: BLE001
            raise outer from e
        raise outer
    except BaseException as e:  # noqa: BLE001
        return e


def _program_error() -> RuntimeError:
    try:
        raise RuntimeError("the program's own")
    except RuntimeError as e:
        return e


def test_classify() -> None:
    assert lifecycle.classify(RuntimeError("x")) == "cause"
    assert lifecycle.classify(CollectiveMismatchError("shapes differ")) == "cause"
    assert lifecycle.classify(HorovodShutdownError("peer left")) == "consequence"
    assert lifecycle.classify(HorovodInternalError("MPI failed")) == "consequence"
    # the program wraps Horovod's error: still only a consequence of the peer leaving
    assert lifecycle.classify(_raise_from(RuntimeError("training failed"),
                                          HorovodShutdownError("peer left"))) == "consequence"
    # the engine stopped because of this rank's own exception (raised inside a collective)
    own = _raise_from(HorovodShutdownError("Cause on rank 1: x"), _program_error())
    assert lifecycle.classify(own) == "cause"
    shown = lifecycle._classify(own)[1]
    assert shown is not None and shown.args == ("the program's own",)
    # the transport failed: HorovodInternalError wrapping the library's plain RuntimeError
    transport = _raise_from(HorovodShutdownError("stopped"),
                            _raise_from(HorovodInternalError("Gloo failed"), None))
    assert lifecycle.classify(transport) == "consequence"


def _run(code: str, tmp_path: Path, env: dict[str, str] | None = None,
         timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], dict | None, float]:
    record = tmp_path / "record.json"
    full = dict(os.environ, PYTHONPATH=str(REPO), HOROVOD_EXIT_RECORD=str(record), **(env or {}))
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=timeout, env=full)
    took = time.monotonic() - t0
    data = json.loads(record.read_text()) if record.exists() and record.read_text() else None
    return res, data, took


def _finished(rec: dict | None) -> bool:
    """A normal end: the record says the program finished (code 0), which is no failure."""
    return rec is not None and rec.get("kind") == "finished" and rec.get("code") == 0


PRELUDE = """
    import atexit, sys, time
    from horovod.common import lifecycle
    lifecycle.install()
    lifecycle.note_multi_rank()
    atexit.register(lifecycle.end_process, lambda: print("SHUTDOWN", flush=True))
"""


def test_uncaught_sys_exit_is_recorded_and_leaves_at_once(tmp_path: Path) -> None:
    code = ("import atexit, time\n"
            "atexit.register(time.sleep, 120)  # registered first: runs last, skipped on failure\n"
            + textwrap.dedent(PRELUDE) + "sys.exit(3)\n")
    res, rec, took = _run(code, tmp_path, timeout=200)
    assert res.returncode == 3, res.stderr
    assert rec is not None and rec["code"] == 3 and rec["kind"] == "cause", rec
    assert "SHUTDOWN" not in res.stdout and took < 90  # not after the 120 s exit step


def test_caught_sys_exit_is_not_a_failure(tmp_path: Path) -> None:
    code = textwrap.dedent(PRELUDE) + textwrap.dedent("""
        try:
            sys.exit(3)
        except SystemExit:
            pass
        exit_after = 0
    """)
    res, rec, _ = _run(code, tmp_path)
    assert res.returncode == 0 and _finished(rec), (res.stderr, rec)
    assert "SHUTDOWN" in res.stdout  # the normal exit path ran


def test_sys_exit_zero_and_builtin_exit(tmp_path: Path) -> None:
    res, rec, _ = _run(textwrap.dedent(PRELUDE) + "sys.exit(0)\n", tmp_path)
    assert res.returncode == 0 and _finished(rec) and "SHUTDOWN" in res.stdout, (res.stderr, rec)
    res, rec, _ = _run(textwrap.dedent(PRELUDE) + "exit(4)\n", tmp_path)
    assert res.returncode == 4 and rec is not None and rec["code"] == 4, (res.stderr, rec)


def test_uncaught_exception_recorded_with_its_kind_and_marker(tmp_path: Path) -> None:
    code = textwrap.dedent(PRELUDE) + textwrap.dedent("""
        from horovod.common.exceptions import HorovodShutdownError
        raise HorovodShutdownError("Horovod has been shut down.")
    """)
    res, rec, _ = _run(code, tmp_path, env={"HOROVOD_RANK": "2"})
    assert res.returncode == 1
    assert rec is not None and rec["kind"] == "consequence" and "HorovodShutdownError" in rec["error"]
    marker = [line for line in res.stderr.splitlines() if line.startswith(lifecycle.ERROR_MARKER)]
    assert len(marker) == 1 and json.loads(marker[0][len(lifecycle.ERROR_MARKER):])["rank"] == 2
    assert "Traceback" in res.stderr  # the traceback is still printed


def test_single_rank_failure_takes_the_normal_exit_path(tmp_path: Path) -> None:
    code = textwrap.dedent(PRELUDE).replace("lifecycle.note_multi_rank()", "") + (
        "raise RuntimeError('alone')\n")
    res, rec, _ = _run(code, tmp_path)
    assert res.returncode == 1 and "SHUTDOWN" in res.stdout
    assert rec is not None and rec["error"] == "RuntimeError: alone"


def test_error_line_a_failing_rank_writes_is_read_back_by_the_launcher(tmp_path: Path) -> None:
    # The rank's side (record_failure writing its stderr line, after output it left unterminated)
    # against the launcher's side (strip_markers on each line it reads): the record travels whole,
    # the rank's own text stays, and no marker text reaches the user.
    from horovod.common.protocol import ERROR_MARKER, FailureRecord, strip_markers

    code = """
        import sys
        from horovod.common import lifecycle
        sys.stderr.write("half a line")
        lifecycle.record_failure(3, "cause", "ValueError: boom")
    """
    res, record, _ = _run(code, tmp_path, env={"HOROVOD_RANK": "1"})
    assert res.returncode == 0 and record is not None, res.stderr
    parsed = [strip_markers(line) for line in res.stderr.splitlines()]
    errors = [m.error for m in parsed if m.error is not None]
    # the file the shim reads and the stderr line carry the same record, the line with the rank
    assert errors == [FailureRecord(3, "cause", "ValueError: boom", record["time"], rank=1)], (res.stderr, record)
    assert FailureRecord.from_wire(record) == FailureRecord(3, "cause", "ValueError: boom", record["time"])
    shown = "".join(m.text for m in parsed)
    assert "half a line" in shown and ERROR_MARKER.strip() not in shown, shown


@pytest.mark.parametrize("level", ["single", "multiple"])
def test_thread_level_of_mpi_init_follows_config(level: str, tmp_path: Path) -> None:
    """Horovod's own MPI init asks for MPI_THREAD_MULTIPLE unless HOROVOD_MPI_THREADS_DISABLE."""
    code = textwrap.dedent("""
        import mpi4py
        mpi4py.rc.initialize = False
        from mpi4py import MPI
        from horovod.common.backends.factories import create_mpi
        from horovod.common.config import EngineConfig
        import os
        b = create_mpi(EngineConfig.from_env(os.environ), os.environ)
        print("LEVEL", MPI.Query_thread() == MPI.THREAD_MULTIPLE)
        b.close()
    """)
    env = {"HOROVOD_MPI_THREADS_DISABLE": "1"} if level == "single" else {}
    res, _, _ = _run(code, tmp_path, env=env)
    assert f"LEVEL {level == 'multiple'}" in res.stdout, res.stdout + res.stderr
    assert res.returncode == 0, res.stderr


def test_sys_exit_caught_and_kept_is_not_a_failure(tmp_path: Path) -> None:
    """As pytest.raises(SystemExit) does: the exception stays referenced but never left the
    program's own frames, so the normal exit path runs."""
    code = textwrap.dedent(PRELUDE) + textwrap.dedent("""
        kept = []
        def check():
            try:
                sys.exit(3)
            except SystemExit as e:
                kept.append(e)
        check()
    """)
    res, rec, _ = _run(code, tmp_path)
    assert res.returncode == 0 and _finished(rec) and "SHUTDOWN" in res.stdout, (res.stderr, rec)


_HOOKS = """
    import builtins, sys
    before = (sys.exit, sys.excepthook, builtins.exit, builtins.quit)
    import horovod.numpy as hvd
    hvd.init()
    from horovod.common import lifecycle
    after = (sys.exit, sys.excepthook, builtins.exit, builtins.quit)
    print("SAME" if all(a is b for a, b in zip(before, after)) else "PATCHED", lifecycle.installed())
    hvd.shutdown()  # the hook goes with Horovod: Python's own functions are back
    gone = (sys.exit, sys.excepthook, builtins.exit, builtins.quit)
    print("RESTORED" if all(a is b for a, b in zip(before, gone)) else "LEFT", lifecycle.installed())
    hvd.init()  # and comes back with it
    print("PATCHED" if sys.exit is not before[0] else "SAME", lifecycle.installed())
"""


@pytest.mark.parametrize(("env", "want"), [({}, "SAME False\nRESTORED False\nSAME False"),
                                           ({"HOROVOD_EXIT_RECORD": "x"}, "PATCHED True\nRESTORED False\nPATCHED True"),
                                           ({"HOROVOD_EXIT_RECORD": "x", "HOROVOD_FAIL_FAST": "0"},
                                            "SAME False\nRESTORED False\nSAME False")])
def test_fail_fast_hook_only_in_a_launched_worker(env: dict[str, str], want: str) -> None:
    # A process of its own (notebook, script, unit test) keeps Python's sys.exit, exit/quit and
    # excepthook; a worker started by horovodrun gets the hook unless HOROVOD_FAIL_FAST=0.
    full = {k: v for k, v in os.environ.items() if k not in ("HOROVOD_EXIT_RECORD", "HOROVOD_FAIL_FAST")}
    full.update(PYTHONPATH=str(REPO), **env)
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(_HOOKS)], capture_output=True, text=True,
                         timeout=120, env=full)
    assert res.returncode == 0 and res.stdout.strip() == want, (res.stdout, res.stderr[-2000:])


def test_fail_fast_switch() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("HOROVOD_EXIT_RECORD", "HOROVOD_FAIL_FAST")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "environ", env)
        assert lifecycle.wanted(2) and not lifecycle.wanted(1)
        env["HOROVOD_FAIL_FAST"] = "0"
        assert not lifecycle.wanted(2)


@pytest.mark.parametrize(("kind", "line"), [
    ("cause", "horovod: rank 1 of 3 failed, ending the job: ValueError: boom"),
    ("consequence", "horovod: rank 1 of 3 stops because another rank failed or left (ValueError: boom)"),
])
def test_failure_line_without_a_horovod_launcher(monkeypatch, capfd, kind, line) -> None:
    """srun, torchrun, a bare mpirun: nothing collects the exit record, so the failing rank says
    who it is (one line on stderr); under horovodrun (HOROVOD_EXIT_RECORD) it does not."""
    monkeypatch.delenv(lifecycle.EXIT_RECORD_ENV, raising=False)
    monkeypatch.setattr(lifecycle, "_failure", None)
    monkeypatch.setattr(lifecycle, "_multi_rank", False)
    monkeypatch.setattr(lifecycle, "_rank_size", None)
    lifecycle.note_multi_rank(1, 3)
    lifecycle.record_failure(1, kind, "ValueError: boom")
    assert capfd.readouterr().err == line + "\n"
    lifecycle.record_failure(1, "cause", "second failure")  # only the first is reported
    assert capfd.readouterr().err == ""


def test_no_failure_line_under_horovodrun(monkeypatch, capfd, tmp_path) -> None:
    monkeypatch.setenv(lifecycle.EXIT_RECORD_ENV, str(tmp_path / "exit.json"))
    monkeypatch.setattr(lifecycle, "_failure", None)
    monkeypatch.setattr(lifecycle, "_rank_size", None)
    monkeypatch.setattr(lifecycle, "_multi_rank", False)
    lifecycle.note_multi_rank(1, 3)
    lifecycle.record_failure(1, "cause", "ValueError: boom")
    assert "horovod: rank" not in capfd.readouterr().err
    assert json.loads((tmp_path / "exit.json").read_text())["kind"] == "cause"
