"""Where an srun step's secret comes from without HOROVOD_SECRET_KEY (horovod.common.slurm_secret).

The MUNGE path runs against a real munged in tests/slurm/test_srun.py; here the rules and the key
file, in one process (task 0 and another task as two threads).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from horovod.common import slurm_secret
from horovod.common.launcher_detection import LauncherError, detect


def _env(tmp_path, **extra: str) -> dict[str, str]:
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "localhost",
           "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_NODES": "1",
           "HOROVOD_SLURM_KEY": "file", "HOROVOD_SLURM_KEY_DIR": str(tmp_path / "keys")}
    env.update(extra)
    return env


def test_exported_secret_wins(tmp_path):
    env = _env(tmp_path, HOROVOD_SECRET_KEY="cd" * 32)
    assert slurm_secret.step_secret(env, detect(env), 0, "127.0.0.1", 1) == ("cd" * 32, None)
    assert not (tmp_path / "keys").exists()


def test_key_file_shared_by_the_tasks_of_one_node(tmp_path):
    env = _env(tmp_path)
    got: dict[int, str] = {}

    def other() -> None:
        got[1] = slurm_secret.step_secret(env, detect(env), 1, "127.0.0.1", 30, seq=2)[0]

    t = threading.Thread(target=other)
    t.start()
    secret, service = slurm_secret.step_secret(env, detect(env), 0, "127.0.0.1", 30, seq=2)
    t.join(60)
    assert got == {1: secret} and len(secret) == 64
    key = tmp_path / "keys" / "slurm-42.3.2.key"
    assert (tmp_path / "keys").stat().st_mode & 0o777 == 0o700
    assert key.stat().st_mode & 0o777 == 0o600 and key.read_text().strip() == secret
    assert service is not None
    service.close()
    assert not key.exists()
    # A second init of the same step draws a new secret.
    t = threading.Thread(target=other)
    t.start()
    again, service = slurm_secret.step_secret(env, detect(env), 0, "127.0.0.1", 30, seq=2)
    t.join(60)
    assert again != secret and got[1] == again
    service.close()


def test_stale_key_file_of_an_earlier_step_is_not_taken(tmp_path):
    env = _env(tmp_path)
    key = tmp_path / "keys" / "slurm-42.3.0.key"
    key.parent.mkdir(mode=0o700)
    key.write_text("ee" * 32 + "\n")
    old = time.time() - 24 * 3600  # left by a job of the same id a day ago
    os.utime(key, (old, old))
    with pytest.raises(LauncherError, match="waited 0.5 s for task 0's key file"):
        slurm_secret.step_secret(env, detect(env), 1, "127.0.0.1", 0.5)


def test_key_directory_open_to_others_is_refused(tmp_path):
    env = _env(tmp_path)
    (tmp_path / "keys").mkdir(mode=0o755)
    os.chmod(tmp_path / "keys", 0o755)
    with pytest.raises(LauncherError, match="mode 0700"):
        slurm_secret.step_secret(env, detect(env), 0, "127.0.0.1", 1)


def test_multi_node_step_without_munge_or_shared_directory_is_refused(tmp_path):
    env = _env(tmp_path, SLURM_STEP_NUM_NODES="2", SLURM_STEP_NODELIST="n[1-2]")
    del env["HOROVOD_SLURM_KEY_DIR"]
    with pytest.raises(LauncherError) as err:
        slurm_secret.step_secret(env, detect(env), 1, "127.0.0.1", 1)
    msg = str(err.value)
    assert "spans several nodes" in msg and "HOROVOD_SECRET_KEY" in msg and "HOROVOD_SLURM_KEY_DIR" in msg
    assert "rank 1" in msg


def test_munge_forced_where_it_cannot_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no munge on PATH
    env = _env(tmp_path, HOROVOD_SLURM_KEY="munge")
    with pytest.raises(LauncherError, match="HOROVOD_SLURM_KEY=munge but MUNGE cannot be used"):
        slurm_secret.step_secret(env, detect(env), 0, "127.0.0.1", 1)
    with pytest.raises(LauncherError, match="use auto, munge or file"):
        slurm_secret.step_secret(_env(tmp_path, HOROVOD_SLURM_KEY="none"), detect(env), 0, "127.0.0.1", 1)


def test_key_ports() -> None:
    ports = slurm_secret.key_ports({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3"})
    assert ports[0] == 20000 + 2 * 297 + 1 and all(p % 2 == 1 and 20000 < p < 32768 for p in ports)
    assert slurm_secret.key_ports({"MASTER_PORT": "29500", "SLURM_JOB_ID": "42"}) == [29501]
