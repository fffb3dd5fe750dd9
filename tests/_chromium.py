"""Headless Chromium for tests that check a page as a browser renders it.

``chromium()`` returns the browser's path, installing the Debian package ``chromium`` with apt-get
when it is missing (as ``tests/_fakehosts.py`` installs sshd), or skips the test with the reason
it cannot be had. ``dump_dom`` and ``screenshot`` run it headless with a throwaway profile and
no network of its own (no component updates, sync or background requests).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile

import pytest

from tests import _apt

_NAMES = ("chromium", "chromium-browser")


def _find() -> str | None:
    for name in _NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


@functools.cache
def _install() -> str | None:
    """Install the ``chromium`` package; the reason it failed, or None."""
    return _apt.install(["chromium"], "the page test", lambda: _find() is None)


def chromium() -> str:
    path = _find()
    if path is None:
        reason = _install()
        path = _find()
        if path is None:
            pytest.skip(reason or "Chromium is not installed")
    return path


def _run(url: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="hvd-chromium-") as profile:
        argv = [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--no-first-run", "--disable-component-update",
                "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
                "--virtual-time-budget=3000", *args, url]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def dump_dom(url: str) -> str:
    """The DOM after the page's scripts ran (its first poll answered)."""
    res = _run(url, "--dump-dom")
    assert res.returncode == 0, f"chromium failed ({res.returncode}): {res.stderr[-2000:]}"
    return res.stdout


def screenshot(url: str, path: str, size: tuple[int, int] = (1200, 640)) -> None:
    res = _run(url, f"--window-size={size[0]},{size[1]}", f"--screenshot={path}")
    assert res.returncode == 0 and os.path.getsize(path) > 0, res.stderr[-2000:]
