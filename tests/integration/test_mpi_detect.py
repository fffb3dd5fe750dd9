"""MPI implementation detection through a real ``mpirun --version`` (and a fake one), with cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from horovod.common.exceptions import BackendUnavailableError
from horovod.runner.launch import mpirun as mpirun_mod

pytestmark = pytest.mark.integration


def fake_mpirun(tmp_path: Path, output: str, code: int = 0) -> str:
    """A fake mpirun that prints ``output`` and counts its runs in ``runs``."""
    path = tmp_path / "mpirun"
    path.write_text(f"#!/bin/sh\necho run >> {tmp_path / 'runs'}\necho '{output}'\nexit {code}\n")
    path.chmod(0o755)
    return str(path)


def runs(tmp_path: Path) -> int:
    p = tmp_path / "runs"
    return len(p.read_text().splitlines()) if p.exists() else 0


def test_installed_mpirun_is_open_mpi_5() -> None:
    impl = mpirun_mod.detect_mpi()
    assert impl.flavour.key == "openmpi" and impl.major >= 5, impl


def test_detection_is_cached_until_the_binary_changes(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_mpirun(tmp_path, "mpirun (Open MPI) 4.1.2")
    monkeypatch.setattr(mpirun_mod, "find_mpirun", lambda environ=None: fake)
    cache = tmp_path / "cache"
    for _ in range(3):
        impl = mpirun_mod.detect_mpi(cache_dir=str(cache))
        assert (impl.flavour.key, impl.major, impl.mpirun) == ("openmpi", 4, fake)
    assert runs(tmp_path) == 1, "a cached answer must not run mpirun again"
    assert list(json.loads((cache / "mpi_implementation.json").read_text()).values()) == [
        {"flavour": "openmpi", "major": 4}]
    # A different binary (new mtime) is asked again.
    st = os.stat(fake)
    os.utime(fake, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    mpirun_mod.detect_mpi(cache_dir=str(cache))
    assert runs(tmp_path) == 2
    # --disable-cache (no cache dir) asks every time.
    mpirun_mod.detect_mpi(cache_dir=None)
    mpirun_mod.detect_mpi(cache_dir=None)
    assert runs(tmp_path) == 4


def test_unknown_or_failing_mpirun_is_explained(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_mpirun(tmp_path, "SomeOtherMPI 1.0")
    monkeypatch.setattr(mpirun_mod, "find_mpirun", lambda environ=None: fake)
    with pytest.raises(BackendUnavailableError, match="Unknown MPI implementation"):
        mpirun_mod.detect_mpi()
    monkeypatch.setattr(mpirun_mod, "find_mpirun", lambda environ=None: None)
    with pytest.raises(BackendUnavailableError, match="horovod does not find an installed MPI"):
        mpirun_mod.detect_mpi()
