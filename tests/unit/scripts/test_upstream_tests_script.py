"""scripts/upstream_tests.py: fetch a source archive's test/ once into the cache, run one file on
every rank, summarize. Here the archive is a small one built by the test (this machine cannot reach
GitHub); downloading upstream's real archive is a manual check (see CONTRIBUTING.md)."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "upstream_tests.py"

FAKE_TEST = '''
import unittest

import numpy as np

import horovod.numpy as hvd
from horovod.runner.util.threads import in_thread  # an upstream-internal helper the plugin supplies


class FakeUpstreamTests(unittest.TestCase):
    def test_allreduce(self):
        hvd.init()
        in_thread(lambda: None).join()
        out = hvd.allreduce(np.ones(3) * (hvd.rank() + 1), op=hvd.Sum)
        self.assertEqual(out.tolist(), [sum(range(1, hvd.size() + 1))] * 3)

    def test_skipped(self):
        self.skipTest("like upstream's GPU tests")
'''


def _archive(path: Path, with_tests: bool = True) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        files = {"horovod-x/setup.py": ""}
        if with_tests:
            files["horovod-x/test/parallel/test_fake.py"] = FAKE_TEST
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=240, cwd=REPO)


def test_fetches_once_and_runs_a_file_on_every_rank(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "src.tar.gz")
    cache = tmp_path / "cache"
    res = _run("--source", str(archive), "--cache", str(cache), "--ref", "vX", "--list")
    assert res.returncode == 0 and res.stdout.split() == ["parallel/test_fake.py"], res
    archive.unlink()  # from now on the cache alone serves
    res = _run("--cache", str(cache), "--ref", "vX", "--np", "2", "parallel/test_fake.py")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "parallel/test_fake.py np=2 (mpirun): 1 passed, 0 failed, 1 skipped of 2" in res.stdout, res.stdout
    res = _run("--cache", str(cache), "--ref", "vX", "--single", "parallel/test_fake.py")
    assert "parallel/test_fake.py np=1 (single): 1 passed, 0 failed, 1 skipped of 2" in res.stdout, res.stdout
    res = _run("--cache", str(cache), "--ref", "vX", "parallel/test_none.py")
    assert res.returncode == 2 and "no such upstream test file" in res.stderr


def test_an_archive_without_tests_is_named(tmp_path: Path) -> None:
    res = _run("--source", str(_archive(tmp_path / "sdist.tar.gz", with_tests=False)), "--cache",
               str(tmp_path / "c"), "--list")
    assert res.returncode != 0 and "has no test/ folder" in res.stderr, res
