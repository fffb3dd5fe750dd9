"""ssh's host key policy: accept-new unless the flag or HOROVOD_SSH_STRICT_HOST_KEY_CHECKING says."""

from __future__ import annotations

import pytest

from horovod.common.exceptions import ConfigError
from horovod.runner.cli import parse_args, settings_from_args
from horovod.runner.launch.ssh import HOST_KEY_ENV, host_key_checking, ssh_base_argv


def _opt(argv: list[str]) -> str:
    return next(a for a in argv if a.startswith("StrictHostKeyChecking="))


def test_default_is_accept_new(monkeypatch):
    monkeypatch.delenv(HOST_KEY_ENV, raising=False)
    assert _opt(ssh_base_argv("h")) == "StrictHostKeyChecking=accept-new"


def test_environment_and_flag(monkeypatch):
    monkeypatch.setenv(HOST_KEY_ENV, "no")
    assert _opt(ssh_base_argv("h")) == "StrictHostKeyChecking=no"
    assert _opt(ssh_base_argv("h", host_keys="yes")) == "StrictHostKeyChecking=yes"
    monkeypatch.setenv(HOST_KEY_ENV, "maybe")
    with pytest.raises(ConfigError, match="use accept-new, yes or no"):
        host_key_checking()


def test_cli_flag_reaches_the_settings(monkeypatch):
    monkeypatch.delenv(HOST_KEY_ENV, raising=False)
    args = parse_args(["-np", "2", "-H", "a:1,b:1", "--ssh-strict-host-key-checking", "yes", "python", "x.py"])
    assert settings_from_args(args, {}).ssh_strict_host_key_checking == "yes"
    with pytest.raises(SystemExit):
        parse_args(["-np", "2", "--ssh-strict-host-key-checking", "maybe", "python", "x.py"])
