"""The launcher<->worker protocol (horovod.common.protocol) and every reader that strips its markers."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from horovod.common import protocol

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def test_strip_markers_keeps_text_before_a_marker_and_returns_the_records() -> None:
    rec = protocol.FailureRecord(1, "cause", "RuntimeError: x", 1.0, rank=1)
    got = protocol.strip_markers(protocol.error_line(rec).rstrip("\n"))
    assert got.error == rec and got.exit is None and got.empty and got.text == ""
    report = protocol.ExitReport(0, "h", 42, 1, None, 2.0, "received SIGTERM", rec, "h.example")
    got = protocol.strip_markers("progress 50%" + protocol.exit_line(report).rstrip("\n"), "\r")
    assert got.text == "progress 50%" and got.exit == report and got.terminator == "\n"
    assert not got.empty
    # an older shim's shorter report: the fields it has, the rest unknown
    got = protocol.strip_markers(protocol.EXIT_MARKER + '{"rank": 0, "code": 0}')
    assert got.exit == protocol.ExitReport(0, code=0) and got.text == ""
    # a program printing the word (no JSON object, or no failure record, after it) is shown as is
    for text in (protocol.ERROR_MARKER + "oops", protocol.EXIT_MARKER + "[1, 2]", "plain",
                 protocol.ERROR_MARKER + '{"kind": "mine"}'):
        got = protocol.strip_markers(text, "")
        assert (got.text, got.terminator, got.error, got.exit) == (text, "", None, None)


def test_rank_and_signal_lines() -> None:
    assert protocol.env_rank({"PMI_RANK": "3", "OMPI_COMM_WORLD_RANK": "2"}) == "2"
    assert protocol.env_rank({}) is None
    assert protocol.parse_signal_line(protocol.signal_line(signal.SIGINT)) == int(signal.SIGINT)
    assert protocol.parse_signal_line(b"signal x\n") is None
    from horovod.runner.common.util.env import _PAIRS

    assert _PAIRS == protocol.RANK_SIZE_VARS


def test_protocol_and_shim_import_only_the_standard_library() -> None:
    # The shim runs by path and loads the protocol package by path: neither may import horovod
    # (or NumPy), and the package loaded that way has every name the package imported as usual has.
    code = ("import sys, runpy; g = runpy.run_path(sys.argv[1]);"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('horovod', 'numpy')));"
            "print(sorted(g['protocol'].__all__))")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(REPO / "horovod/runner/_shim.py")],
                         capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    imported, names = out.stdout.splitlines()
    assert imported == "[]", out.stdout
    assert names == str(sorted(protocol.__all__))
    assert len(protocol.__all__) == len(set(protocol.__all__)) and "MonitorReport" in protocol.__all__


def test_elastic_worker_output_hides_both_markers(tmp_path: Path) -> None:
    # Defect: runner/elastic/workers.py (elastic and Spark jobs) stripped only the shim's exit
    # marker and printed the rank's internal error record to the user's stderr.
    from horovod.runner.elastic.workers import WorkerProcess
    from horovod.runner.launch.commands import Command, shim_argv

    script = textwrap.dedent("""
        import sys
        from horovod.common import lifecycle
        lifecycle.record_failure(1, "cause", "RuntimeError: boom")
        print("visible", file=sys.stderr, flush=True)
        sys.exit(1)
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO), HOROVOD_RANK="0")
    cmd = Command(argv=shim_argv([sys.executable, "-c", script]), env=env, ranks=(0,), host="localhost")
    out, err = io.StringIO(), io.StringIO()
    done = threading.Event()
    ended: list[tuple[int | None, int | None]] = []
    records: list[object] = []

    def on_exit(code: int | None, sig: int | None, record: object) -> None:
        ended.append((code, sig))
        records.append(record)
        done.set()

    proc = WorkerProcess(cmd, "w0", lambda: 0, on_exit, stdout=out, stderr=err)
    assert done.wait(60), err.getvalue()
    text = err.getvalue()
    assert ended == [(1, None)], text
    assert "[0]<stderr>:visible" in text, text
    assert protocol.ERROR_MARKER.strip() not in text and protocol.EXIT_MARKER.strip() not in text, text
    assert proc.exit_info is not None and proc.exit_info.rank == 0 and proc.exit_info.code == 1
    assert proc.exit_info.error is not None and proc.exit_info.error.error == "RuntimeError: boom"
    assert proc.error_record is not None and proc.error_record.rank == 0
    # the launcher gets the record with the exit (the elastic root cause reads it)
    assert records == [proc.exit_record] and proc.exit_record is proc.exit_info.error, records
    assert proc.exit_record.kind == "cause" and proc.exit_record.code == 1


def test_slot_identity_is_what_the_worker_side_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from horovod.runner.common.util.env import get_env_rank_and_size
    from horovod.runner.hosts import SlotInfo

    slot = SlotInfo(hostname="h1", rank=3, local_rank=1, cross_rank=1, size=4, local_size=2, cross_size=2)
    env = slot.env()
    assert env["HOROVOD_CROSS_SIZE"] == "2"
    for key in [k for k in os.environ if k.endswith(("_RANK", "_SIZE"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert get_env_rank_and_size() == (3, 4) and protocol.env_rank() == "3"


def test_a_remote_shim_takes_its_workers_environment_from_its_first_stdin_line() -> None:
    # What the ssh launcher sends (protocol.env_line): the worker sees the variables, the
    # command line never carried them; a malformed line is refused before anything starts.
    from horovod.runner.launch.commands import shim_argv

    argv = shim_argv([sys.executable, "-c", "import os; print(os.environ['HVD_WIRE_TEST'])"],
                     stdin_env=True)
    line = protocol.env_line({"HVD_WIRE_TEST": "from the launcher", "HOROVOD_RANK": "0"})
    res = subprocess.run(argv, input=line, capture_output=True, timeout=120)
    assert res.returncode == 0 and res.stdout.decode().strip() == "from the launcher", res.stderr
    bad = subprocess.run(argv, input=b'{"environ": {}}\n', capture_output=True, timeout=120)
    assert bad.returncode == 2 and b"bad environment line from the launcher" in bad.stderr, bad.stderr


def test_a_shim_whose_mpirun_died_before_it_started_starts_nothing(tmp_path: Path) -> None:
    # On a loaded host a shim's interpreter starts in seconds; mpirun (killed with horovodrun)
    # may be gone by then, the shim handed to another parent: it must not start its command.
    import socket

    from horovod.runner._shim import _orphaned_at_start
    from horovod.runner.launch.commands import shim_argv

    host = socket.gethostname()
    assert _orphaned_at_start(1, {}, host)
    assert not _orphaned_at_start(4242, {}, host)  # horovodrun or ssh's shell: its own parent
    started_here = {"PMIX_NAMESPACE": f"prterun-{host}-4242@1"}
    assert not _orphaned_at_start(4242, started_here, host)  # mpirun, alive, is the parent
    assert _orphaned_at_start(77, started_here, host)  # someone else's child now
    assert not _orphaned_at_start(77, {"PMIX_NAMESPACE": "prterun-otherhost-4242@1"}, host)  # prted's
    assert not _orphaned_at_start(77, {"PMIX_NAMESPACE": "slurm.pmix.12.0"}, host)

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that was mpirun's, now no process's
    marker = tmp_path / "ran"
    argv = shim_argv([sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"], mpirun=True)
    res = subprocess.run(argv, capture_output=True, timeout=120,
                         env={**os.environ, "PMIX_NAMESPACE": f"prterun-{host}-{gone.pid}@1"})
    assert res.returncode == 1 and b"had already died; not starting the command" in res.stderr, res.stderr
    assert not marker.exists()
    ok = subprocess.run(argv, capture_output=True, timeout=120,
                        env={**os.environ, "PMIX_NAMESPACE": f"prterun-{host}-{os.getpid()}@1"})
    assert ok.returncode == 0 and marker.exists(), ok.stderr
    marker.unlink()  # not started by mpirun (horovod.run inside an mpirun job): its variables are not the shim's
    local = subprocess.run(shim_argv(argv[argv.index("--") + 1:]), capture_output=True, timeout=120,
                           env={**os.environ, "PMIX_NAMESPACE": f"prterun-{host}-{gone.pid}@1"})
    assert local.returncode == 0 and marker.exists(), local.stderr
