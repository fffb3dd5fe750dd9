"""hvd.checkpoint never loses data: a save killed (SIGKILL) at every file-system step of its commit
and at 50 random moments always leaves a loadable checkpoint, the newest committed one; a path
holding anything that is not a checkpoint of ours is refused and left untouched (and the user's
files next to a checkpoint are never touched); leftovers of crashed saves are ignored by load and
removed by the next save; checkpoints of the first format (a flat directory, or the `.old` a
crash left) still load and are replaced safely; overlapping non-blocking saves to one path are
serialized; a non-blocking save never waited for commits at exit, or the exit says loudly that
it did not (one process, and np=2 under mpirun); another optimizer class is refused before
anything loads."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import horovod.torch as hvd
from horovod.torch import _checkpoint_dir as layout

STEPS = 3  # tensors per model: a checkpoint holds several entries


def _model(step: int) -> torch.nn.Module:
    m = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(STEPS)])
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(float(step))
    return m


def _loaded_step(path: str) -> int:
    """The step of the newest checkpoint at ``path``, checked to be complete and consistent: the
    tensors all hold the step that ``extra`` names."""
    m = _model(-1)
    extra = hvd.checkpoint.load(path, model=m)
    step = extra["step"]
    for name, p in m.named_parameters():
        assert torch.all(p == float(step)), f"{name} holds {p.flatten()[:3]} in the checkpoint of step {step}"
    return step


def _tree(root: str) -> dict[str, str]:
    """Every file under ``root`` with a hash of its content (directories as entries too)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for x in dirs:
            out[os.path.relpath(os.path.join(d, x), root) + "/"] = "dir"
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), root)] = hashlib.sha1(fh.read()).hexdigest()
    return out


def _user_files(root: str) -> None:
    os.makedirs(os.path.join(root, "sub"))
    with open(os.path.join(root, "notes.txt"), "w") as f:
        f.write("my notes")
    with open(os.path.join(root, "sub", "y.txt"), "w") as f:
        f.write("y")


# ------------------------------------------------------------------ crashes
_FS_CALLS = ("rename", "replace", "mkdir", "makedirs", "fsync", "remove", "unlink", "rmdir")


def _child_saves(path: str, first: int, kill_at: int | None, report: int) -> None:
    """In a forked child: save steps first, first+1, ... (forever), writing each committed step
    to the pipe ``report``; with ``kill_at``, SIGKILL itself just before its kill_at-th
    file-system call (counting the calls of every save)."""
    try:
        if kill_at is not None:
            count = [0]
            for name in _FS_CALLS:
                original = getattr(os, name)

                def patched(*a, _orig=original, **kw):
                    count[0] += 1
                    if count[0] == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return _orig(*a, **kw)
                setattr(os, name, patched)
        os.write(report, b"R\n")
        step = first
        while True:
            hvd.checkpoint.save(path, model=_model(step), extra={"step": step})
            os.write(report, f"{step}\n".encode())
            step += 1
            if kill_at is not None:
                os._exit(0)  # a whole save without reaching kill_at: past its end
    finally:
        os._exit(1)


def _run_child(path: str, first: int, kill_at: int | None, delay: float | None) -> tuple[list[int], bool]:
    """Fork a child saving into ``path``; kill it after ``delay`` seconds (random kills) or let
    it kill itself (fault injection). Returns the steps it reported committed and whether it
    was killed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child_saves(path, first, kill_at, w)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        if delay is not None:
            assert pipe.readline() == b"R\n"
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
        data = pipe.read().decode().split()
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert killed or (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0), status
    return [int(x) for x in data if x != "R"], killed


def _check_after_crash(path: str, last: int, reported: list[int], label: str) -> int:
    """The newest committed step after a crash: the last reported one, or the one in flight when
    the child died (its commit may have happened before it could report)."""
    newest = max(reported, default=last)
    step = _loaded_step(path)
    assert step in (newest, newest + 1), f"{label}: load found step {step}, newest committed {newest}"
    return step


def test_killed_at_every_step_of_a_save_leaves_a_checkpoint(tmp_path):
    """Fault injection: the K-th file-system call of a save (mkdir, fsync, rename, remove, ...)
    never happens, the process being SIGKILLed just before it, for K = 1, 2, ... until a save
    completes; after each, load finds the newest committed checkpoint, and the next save works
    on top of the leftovers."""
    path = str(tmp_path / "ckpt")
    _user_files(str(tmp_path))  # next to the checkpoint: never touched
    before = _tree(str(tmp_path / "sub")), (tmp_path / "notes.txt").read_text()
    hvd.checkpoint.save(path, model=_model(0), extra={"step": 0})
    last, k, points = 0, 0, []
    while True:
        k += 1
        reported, killed = _run_child(path, last + 1, kill_at=k, delay=None)
        if not killed:
            break
        last = _check_after_crash(path, last, reported, f"killed before file-system call {k}")
        points.append((k, last, sorted(layout.describe(path)["partial"])))
        assert k < 200, "a save made more than 200 file-system calls"
    # the kill points covered the whole commit: before it (old step) and after it (new step)
    assert {s for _, s, _ in points} >= {points[0][1], points[-1][1]} and points[0][1] < points[-1][1], points
    assert len(points) >= 8, points  # mkdir, fsyncs, data files, index, rename, removal...
    # leftovers are removed by the next clean save; the user's files are untouched
    hvd.checkpoint.save(path, model=_model(last + 1), extra={"step": last + 1})
    assert layout.describe(path) == {"committed": [os.path.basename(hvd.checkpoint.latest(path))],
                                     "partial": [], "deleting": []}
    assert sorted(os.listdir(path)) == sorted([layout.MARKER, os.path.basename(hvd.checkpoint.latest(path))])
    assert _loaded_step(path) == last + 1
    assert (_tree(str(tmp_path / "sub")), (tmp_path / "notes.txt").read_text()) == before


def test_fifty_random_kills_always_leave_the_newest_checkpoint(tmp_path):
    """50 children, each saving in a loop and SIGKILLed after a random delay (0 to about two
    saves' time): after every kill, load finds a complete checkpoint, the newest committed one
    (the last reported, or the one whose commit happened just before the kill)."""
    path = str(tmp_path / "ckpt")
    _user_files(str(tmp_path))
    before = _tree(str(tmp_path))
    t0 = time.perf_counter()
    hvd.checkpoint.save(path, model=_model(0), extra={"step": 0})
    one_save = time.perf_counter() - t0
    rng = random.Random(46)
    last, kills, progressed = 0, 0, 0
    deadline = time.monotonic() + 50
    for i in range(50):
        delay = rng.uniform(0, 2.5 * one_save)
        reported, killed = _run_child(path, last + 1, kill_at=None, delay=delay)
        kills += killed
        step = _check_after_crash(path, last, reported, f"kill {i} after {delay:.3f} s")
        progressed += step > last
        last = step
        assert time.monotonic() < deadline, f"50 kills took too long (at {i})"
    assert kills == 50
    assert progressed >= 1, "no child ever committed a save: the kills never reached a commit"
    hvd.checkpoint.save(path, model=_model(last + 1), extra={"step": last + 1})
    assert _loaded_step(path) == last + 1
    after = _tree(str(tmp_path))
    assert {k: v for k, v in after.items() if not k.startswith("ckpt")} == \
        {k: v for k, v in before.items() if not k.startswith("ckpt")}


# ------------------------------------------------------------------ what save may touch
def test_a_foreign_directory_or_file_is_refused_and_untouched(tmp_path):
    m = _model(1)
    user = tmp_path / "user"
    _user_files(str(user))
    before = _tree(str(user))
    with pytest.raises(FileExistsError) as exc:
        hvd.checkpoint.save(str(user), model=m)
    msg = str(exc.value)
    assert repr(str(user)) in msg and "notes.txt" in msg and "sub/" in msg and "nothing was changed" in msg, msg
    assert _tree(str(user)) == before
    assert not os.path.exists(f"{user}.old") and not os.path.exists(f"{user}.partial")
    # a plain file at the path
    f = tmp_path / "file"
    f.write_text("data")
    with pytest.raises(FileExistsError, match="it is a file"):
        hvd.checkpoint.save(str(f), model=m)
    assert f.read_text() == "data" and not os.path.exists(f"{f}.old")
    # one of our checkpoints that the user put a file into
    ours = str(tmp_path / "ours")
    hvd.checkpoint.save(ours, model=m, extra={"step": 1})
    version = hvd.checkpoint.latest(ours)
    (tmp_path / "ours" / "README").write_text("mine")
    with open(os.path.join(version, "mine.txt"), "w") as fh:
        fh.write("mine too")
    before = _tree(ours)
    with pytest.raises(FileExistsError) as exc:
        hvd.checkpoint.save(ours, model=_model(2), extra={"step": 2})
    assert "README" in str(exc.value) and f"{os.path.basename(version)}/mine.txt" in str(exc.value), str(exc.value)
    assert _tree(ours) == before and _loaded_step(ours) == 1
    # someone else's torch.distributed.checkpoint directory is not ours either
    import torch.distributed.checkpoint as dcp

    other = str(tmp_path / "dcp")
    dcp.save({"w": torch.zeros(3)}, checkpoint_id=other, no_dist=True)
    before = _tree(other)
    with pytest.raises(FileExistsError, match="without hvd.checkpoint's 'horovod' entry"):
        hvd.checkpoint.save(other, model=m)
    assert _tree(other) == before
    # an empty directory is taken; a failed first save leaves no directory behind
    empty = tmp_path / "empty"
    empty.mkdir()
    hvd.checkpoint.save(str(empty), model=m, extra={"step": 1})
    assert _loaded_step(str(empty)) == 1


def test_failed_first_save_leaves_nothing(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    def broken(self, plan, planner):
        raise OSError("disk full (injected)")
    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    path = str(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="disk full"):
        hvd.checkpoint.save(path, model=_model(1))
    assert not os.path.exists(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        hvd.checkpoint.load(path, model=_model(1))


def test_load_ignores_leftovers_and_reads_the_first_format(tmp_path):
    """A crashed save's ``.partial`` and a half-removed ``.deleting`` are ignored; a checkpoint of
    the first format (flat), and the ``.old`` its crashed commit left, load; saving over a flat
    one replaces it only after the new version is committed."""
    path = str(tmp_path / "ckpt")
    hvd.checkpoint.save(path, model=_model(1), extra={"step": 1})
    v1 = hvd.checkpoint.latest(path)
    os.makedirs(os.path.join(path, "v000009.partial"))  # a newer save that crashed while writing
    with open(os.path.join(path, "v000009.partial", "__0_0.distcp"), "wb") as f:
        f.write(b"half")
    os.makedirs(os.path.join(path, "v000000.deleting"))
    assert hvd.checkpoint.latest(path) == v1 and _loaded_step(path) == 1
    hvd.checkpoint.save(path, model=_model(2), extra={"step": 2})  # numbered after the leftover
    assert os.path.basename(hvd.checkpoint.latest(path)) == "v000010"
    assert sorted(os.listdir(path)) == [layout.MARKER, "v000010"] and _loaded_step(path) == 2
    # the first format: a flat directory; written here as it was (the files of one version)
    flat = str(tmp_path / "flat")
    os.rename(hvd.checkpoint.latest(path), flat)
    assert hvd.checkpoint.latest(flat) == flat and _loaded_step(flat) == 2
    hvd.checkpoint.save(flat, model=_model(3), extra={"step": 3})
    assert sorted(os.listdir(flat)) == [layout.MARKER, "v000001"] and _loaded_step(flat) == 3
    # the first format's crash between its two renames: only <path>.old is left
    os.rename(hvd.checkpoint.latest(flat), str(tmp_path / "gone.old"))
    with pytest.warns(UserWarning, match="crashed between its two renames"):
        assert _loaded_step(str(tmp_path / "gone")) == 3
    # nothing committed: named as such
    os.makedirs(str(tmp_path / "only_partial" / "v000001.partial"))
    with pytest.raises(ValueError, match="only uncommitted saves: v000001.partial"):
        hvd.checkpoint.load(str(tmp_path / "only_partial"), model=_model(0))


# ------------------------------------------------------------------ non-blocking saves
def test_overlapping_non_blocking_saves_are_serialized(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    h1 = hvd.checkpoint.save(path, model=_model(1), extra={"step": 1}, blocking=False)
    h2 = hvd.checkpoint.save(path, model=_model(2), extra={"step": 2}, blocking=False)
    assert h1.done() and h1.version is not None  # committed before the second one started
    assert h2.wait() == path and h1.wait() == path
    assert _loaded_step(path) == 2 and layout.describe(path)["committed"] == [os.path.basename(h2.version)]
    # a failed earlier save: the later one says so and does not start; the earlier handle
    # raises the same error again
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def broken(self, plan, planner):
        raise OSError("disk full (injected)")
    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    h3 = hvd.checkpoint.save(path, model=_model(3), extra={"step": 3}, blocking=False)
    with pytest.raises(RuntimeError, match="earlier non-blocking save to the same path.*disk full"):
        hvd.checkpoint.save(path, model=_model(4), extra={"step": 4}, blocking=False)
    monkeypatch.setattr(FileSystemWriter, "write_data", original)
    with pytest.raises(RuntimeError, match="disk full"):
        h3.wait()
    assert _loaded_step(path) == 2
    assert layout.describe(path) == {"committed": [os.path.basename(h2.version)], "partial": [], "deleting": []}


def _script(body: str) -> str:
    return textwrap.dedent(body)


def _run_python(code: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    script = tmp_path / "script.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)


_EXIT_SCRIPT = """
import sys, torch
import horovod.torch as hvd
m = torch.nn.Linear(4, 4)
with torch.no_grad():
    m.weight.fill_(7.0)
hvd.checkpoint.save(sys.argv[1] if len(sys.argv) > 1 else {path!r}, model=m, extra={{"step": 7}}, blocking=False)
{after}
"""


def test_a_save_never_waited_for_commits_at_exit(tmp_path):
    """One process: the script ends after save(blocking=False) without wait(); the checkpoint is
    committed at exit (said on stderr), also when the script ends with an uncaught exception."""
    path = str(tmp_path / "ckpt")
    res = _run_python(_script(_EXIT_SCRIPT.format(path=path, after="print('done')")), tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "committed the non-blocking save" in res.stderr and "wait() was never called" in res.stderr, res.stderr
    m = torch.nn.Linear(4, 4)
    assert hvd.checkpoint.load(path, model=m) == {"step": 7} and torch.all(m.weight == 7.0)
    path2 = str(tmp_path / "ckpt2")
    res = _run_python(_script(_EXIT_SCRIPT.format(path=path2, after="raise RuntimeError('boom')")), tmp_path)
    assert res.returncode != 0 and "boom" in res.stderr
    assert hvd.checkpoint.load(path2, model=m) == {"step": 7}


_MPI_EXIT = """
import sys, torch
import horovod.torch as hvd
hvd.init()
path = sys.argv[1]
m = torch.nn.Linear(4, 4)
with torch.no_grad():
    m.weight.fill_(float(hvd.rank() + 1))
hvd.checkpoint.save(path, model=m, extra={"step": 1})
with torch.no_grad():
    m.weight.fill_(9.0)
hvd.checkpoint.save(path, model=m, extra={"step": 2}, blocking=False)
if sys.argv[2] == "fail" and hvd.rank() == 1:
    raise RuntimeError("rank 1 fails after the non-blocking save")
print("rank", hvd.rank(), "leaves without wait()")
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_np2_exit_without_wait_commits_or_says_so(tmp_path):
    """np=2: ranks that leave normally commit the pending save at exit; a rank leaving after an
    error says on stderr that it did not commit, and the previous checkpoint stays."""
    from horovod.testing import run_mpi_script

    script = tmp_path / "exit.py"
    script.write_text(_MPI_EXIT)
    ok = str(tmp_path / "ok")
    res = run_mpi_script([sys.executable, str(script), ok, "ok"], np=2, timeout=180)
    assert "committed the non-blocking save" in res.stdout, res.stdout[-3000:]
    m = torch.nn.Linear(4, 4)
    assert hvd.checkpoint.load(ok, model=m) == {"step": 2} and torch.all(m.weight == 9.0)
    bad = str(tmp_path / "bad")
    res = run_mpi_script([sys.executable, str(script), bad, "fail"], np=2, timeout=180, check=False)
    assert res.returncode != 0
    assert "ERROR (rank 1): the non-blocking save to" in res.stdout and "NOT committed at exit" in res.stdout, \
        res.stdout[-3000:]
    assert "still the previous one" in res.stdout
    assert hvd.checkpoint.load(bad, model=m) == {"step": 1}


# ------------------------------------------------------------------ optimizer checks
def test_another_optimizer_class_is_refused_before_anything_loads(tmp_path):
    path = str(tmp_path / "ckpt")
    m = _model(1)
    adamw = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.ones(2, 16)).sum().backward()
    adamw.step()
    hvd.checkpoint.save(path, model=m, optimizer=adamw)
    m2 = _model(5)
    sgd = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError) as exc:
        hvd.checkpoint.load(path, model=m2, optimizer=sgd)
    msg = str(exc.value)
    assert "torch.optim.adamw.AdamW" in msg and "torch.optim.sgd.SGD" in msg, msg
    assert "'betas'" in msg and "'momentum'" in msg and "Nothing was loaded" in msg, msg
    assert all(torch.all(p == 5.0) for p in m2.parameters()) and not sgd.state
    # the wrapped class counts: a DistributedOptimizer of AdamW (a class made as
    # hvd.DistributedOptimizer makes it) is an AdamW
    from horovod.torch._checkpoint_parts import _algorithm
    from horovod.torch.optimizer import _DistributedOptimizer

    wrapped = type("AdamW", (_DistributedOptimizer, torch.optim.AdamW), {})
    assert _algorithm(object.__new__(wrapped)) is torch.optim.AdamW
    m3 = _model(5)
    a2 = torch.optim.AdamW(m3.parameters(), lr=0.5)
    hvd.checkpoint.load(path, model=m3, optimizer=a2)
    assert a2.param_groups[0]["lr"] == 0.1 and len(a2.state) == len(list(m3.parameters()))


def test_a_load_racing_a_newer_commit_reads_the_newer_version(tmp_path, monkeypatch):
    """A reader (another process in practice) resolves version 1, then a save commits version 2
    and removes version 1 before the reader reads its files: load reads version 2, whole."""
    from horovod.torch import _checkpoint_load

    path = str(tmp_path / "ckpt")
    hvd.checkpoint.save(path, model=_model(1), extra={"step": 1})
    original, calls = _checkpoint_load._read, []

    def racing(where, request, *regions):
        if not calls:
            hvd.checkpoint.save(path, model=_model(2), extra={"step": 2})  # removes `where`
            assert not os.path.exists(where)
        calls.append(where)
        return original(where, request, *regions)
    monkeypatch.setattr(_checkpoint_load, "_read", racing)
    assert _loaded_step(path) == 2
    assert [os.path.basename(c) for c in calls] == ["v000001", "v000002", "v000002"], calls
