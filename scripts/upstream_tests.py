#!/usr/bin/env python3
"""Run upstream Horovod's own test files against the installed ``horovod`` package.

Upstream's tests are not part of this project (and not in upstream's PyPI sdist). This script
downloads upstream's source archive at a pinned tag once into a cache, then runs one test file the
way upstream's CI does: every rank runs the same pytest session, under ``mpirun`` or
``horovodrun --gloo``::

    python scripts/upstream_tests.py parallel/test_torch.py
    python scripts/upstream_tests.py --gloo --np 3 parallel/test_torch.py -k allreduce
    TF_USE_LEGACY_KERAS=1 python scripts/upstream_tests.py parallel/test_tensorflow2_keras.py
    python scripts/upstream_tests.py --list            # the test files of the pinned tag
    python scripts/upstream_tests.py --single single/test_ray.py   # one process: the file starts its own job

Options: ``--ref`` (a tag or commit of github.com/horovod/horovod, default the pinned tag),
``--source`` (a ``.tar.gz`` file, a URL or an unpacked directory instead of GitHub, e.g. a mirror),
``--cache`` (default ``$XDG_CACHE_HOME/horovod-py/upstream``, else ``~/.cache/...``),
``--timeout`` (seconds per test, default 120). It prints the failing tests and
``FILE np=N (launcher): P passed, F failed, S skipped of T``; per-rank logs and JUnit XML stay in the
printed directory. Exit status: 0 when nothing failed.

Upstream's files import three test helpers of upstream's own package (``in_thread``,
``is_version_greater_equal_than``, ``_executing_eagerly``) and the ``mock`` backport; a small
pytest plugin written next to the copied tests supplies them when the installed packages lack them
(``mock`` as the standard library's ``unittest.mock``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

PINNED_REF = "v0.28.1"  # the release whose API this project follows
ARCHIVE_URL = "https://github.com/horovod/horovod/archive/{ref}.tar.gz"

PLUGIN = '''"""Test helpers upstream's test files import from upstream's package, where it lacks them."""
import contextlib, importlib, os, sys, threading, types


def _module(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        mod = sys.modules[name] = types.ModuleType(name)
        parent, _, child = name.rpartition(".")
        if parent:
            with contextlib.suppress(ImportError):
                setattr(importlib.import_module(parent), child, mod)
        return mod


def _supply(name, **attrs):
    mod = _module(name)
    for key, value in attrs.items():
        if not hasattr(mod, key):
            setattr(mod, key, value)


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


def is_version_greater_equal_than(ver, target):
    from packaging import version
    return version.parse(ver) >= version.parse(target)


@contextlib.contextmanager
def env(**values):
    values = {k: v for k, v in values.items() if v is not None}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _NotProvided:
    """An upstream internal this project does not provide: importing it works (so that the rest of
    the test file runs), using it fails and says so."""

    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self.name} is an upstream internal that horovod-py does not provide")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _NotProvided(f"{self.name}.{attr}")


RAY_INTERNALS = {"horovod.ray.runner": ["Coordinator"], "horovod.ray.strategy": ["create_placement_group"]}


def supply_ray_internals():
    """Also run in every Ray worker (ray.init's worker_process_setup_hook), where the test module
    is imported again to unpickle its functions."""
    for module, names in RAY_INTERNALS.items():
        _supply(module, **{n: _NotProvided(f"{module}.{n}") for n in names})


def _ray_init_of_today(init):
    def ray_init(*args, **kwargs):
        # Ray keeps its state in the GCS without Redis now and refuses this argument of upstream's fixture
        kwargs.pop("_redis_max_memory", None)
        if not args and "address" not in kwargs and not os.environ.get("RAY_ADDRESS"):
            kwargs["address"] = "local"  # a cluster of its own, as the fixture means, not another one running here
        runtime_env = dict(kwargs.get("runtime_env") or {})
        runtime_env.setdefault("worker_process_setup_hook", "hvd_upstream_plugin.supply_ray_internals")
        kwargs["runtime_env"] = runtime_env
        return init(*args, **kwargs)

    return ray_init


def executing_eagerly():
    import tensorflow as tf
    return tf.executing_eagerly()


def pytest_configure(config):
    try:
        import mock  # noqa: F401 - upstream's tests import the PyPI backport of unittest.mock
    except ImportError:
        import unittest.mock
        sys.modules["mock"] = unittest.mock
    _supply("horovod.runner.util")
    _supply("horovod.runner.util.threads", in_thread=in_thread)
    _supply("horovod.common.util", is_version_greater_equal_than=is_version_greater_equal_than, env=env)
    if any("test_ray" in str(a) for a in config.args):
        import ray

        supply_ray_internals()
        ray.init = _ray_init_of_today(ray.init)
    if any("tensorflow" in str(a) or "keras" in str(a) for a in config.args):
        _supply("horovod.tensorflow.util", _executing_eagerly=executing_eagerly)
        _supply("horovod.tensorflow", _executing_eagerly=executing_eagerly)
'''


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "horovod-py" / "upstream"


def fetch(ref: str, source: str | None, cache: Path, folder: str = "test") -> Path:
    """The ``folder`` (``test``, ``examples``) of upstream's source at ``ref``, downloaded and
    unpacked once into ``cache/<ref>/<folder>``."""
    target = cache / ref.replace("/", "_")
    if (target / folder).is_dir():
        return target / folder
    cache.mkdir(parents=True, exist_ok=True)
    target.mkdir(exist_ok=True)
    if source is not None and Path(source).is_dir():
        found = Path(source) / folder
        if not found.is_dir():
            if folder == "test" and Path(source).name == "test":
                found = Path(source)  # the test folder itself
            else:
                raise SystemExit(f"{source} has no {folder}/ folder: give upstream's source checkout")
        tmp = Path(tempfile.mkdtemp(dir=cache))
        shutil.copytree(found, tmp / folder, symlinks=True)  # upstream links examples to each other
        os.replace(tmp / folder, target / folder)
        shutil.rmtree(tmp, ignore_errors=True)
        return target / folder
    archive = Path(source) if source is not None and Path(source).is_file() else None
    if archive is None:
        url = source or ARCHIVE_URL.format(ref=ref)
        print(f"fetching {url} ...", file=sys.stderr)
        archive = cache / f"{ref.replace('/', '_')}.tar.gz"
        if not archive.is_file():
            try:
                with urllib.request.urlopen(url, timeout=120) as resp, open(archive, "wb") as fh:  # noqa: S310
                    shutil.copyfileobj(resp, fh)
            except OSError as exc:
                archive.unlink(missing_ok=True)
                raise SystemExit(f"cannot download {url}: {exc}\nGive a local copy with --source "
                                 "FILE.tar.gz or an unpacked source directory.") from None
    tmp = Path(tempfile.mkdtemp(dir=cache))
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers()
                   if len(Path(m.name).parts) > 1 and Path(m.name).parts[1] == folder]
        if not members:
            shutil.rmtree(tmp)
            raise SystemExit(f"{archive} has no {folder}/ folder (upstream's PyPI sdist does not ship "
                             "its tests and examples; use the GitHub archive or a git checkout)")
        try:
            tar.extractall(tmp, members=members, filter="data")
        except TypeError:  # Python without extraction filters (before 3.10.12 / 3.11.4)
            tar.extractall(tmp, members=members)  # noqa: S202 - members are under folder/ only
    top = next(tmp.iterdir())
    os.replace(top / folder, target / folder)
    shutil.rmtree(tmp, ignore_errors=True)
    return target / folder


def summarize(work: Path, file: str, np_: int, launcher: str, rc: int) -> int:
    try:
        root = ET.parse(work / "rank0.xml").getroot()
    except (OSError, ET.ParseError) as exc:
        print(f"{file} np={np_} ({launcher}): no result ({exc}); launcher exit {rc}; logs in {work}")
        return 1
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    total, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors",
                                                                         "skipped"))
    for case in suite.iter("testcase"):
        for tag in ("failure", "error"):
            bad = case.find(tag)
            if bad is not None:
                first = (bad.get("message") or "").splitlines()[:1]
                print(f"FAILED {case.get('name')}: {first[0][:160] if first else ''}")
    passed = total - failures - errors - skipped
    print(f"{file} np={np_} ({launcher}): {passed} passed, {failures + errors} failed, {skipped} "
          f"skipped of {total} (launcher exit {rc}; logs in {work})")
    return 0 if failures + errors == 0 and rc == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gloo", action="store_true", help="launch with horovodrun --gloo, not mpirun")
    parser.add_argument("--single", action="store_true",
                        help="one pytest process, no launcher (files that start their own jobs, e.g. Ray's)")
    parser.add_argument("--np", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test (default 120)")
    parser.add_argument("--ref", default=PINNED_REF, help=f"upstream tag or commit (default {PINNED_REF})")
    parser.add_argument("--source", help="a .tar.gz, URL or unpacked directory instead of GitHub")
    parser.add_argument("--cache", type=Path, default=None, help="cache folder")
    parser.add_argument("--list", action="store_true", help="list the test files and exit")
    parser.add_argument("file", nargs="?", help="a path under upstream's test/, e.g. parallel/test_torch.py")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="passed on to pytest")
    args = parser.parse_args(argv)

    tests = fetch(args.ref, args.source, args.cache or default_cache())
    if args.list or not args.file:
        for path in sorted(tests.rglob("test_*.py")):
            print(path.relative_to(tests))
        return 0 if args.list else 2
    if not (tests / args.file).is_file():
        print(f"no such upstream test file: {args.file} (see --list)", file=sys.stderr)
        return 2

    work = Path(tempfile.mkdtemp(prefix="upstream-"))
    shutil.copytree(tests, work / "test")
    (work / "hvd_upstream_plugin.py").write_text(PLUGIN)
    rundir = work / "test" / Path(args.file).parent
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(work), os.environ.get("PYTHONPATH")) if p))
    rank = "${HOROVOD_RANK:-${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}}"
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
              "-p", "hvd_upstream_plugin", f"--timeout={args.timeout}", Path(args.file).name,
              *args.pytest_args]
    body = (" ".join(_quote(a) for a in pytest) + f" --junitxml={work}/rank{rank}.xml"
            f" > {work}/rank{rank}.log 2>&1")
    if args.single:
        launch, args.np = [], 1
        body = body.replace("${HOROVOD_RANK:-${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}}", "0")
    elif args.gloo:
        launch = [shutil.which("horovodrun") or "horovodrun", "--gloo", "-np", str(args.np)]
    else:
        launch = ["mpirun", "--oversubscribe", "-np", str(args.np), "-x", "PATH", "-x", "PYTHONPATH",
                  "-x", "PYTHONUNBUFFERED"]
    with open(work / "launcher.log", "w") as log:
        rc = subprocess.call([*launch, "sh", "-c", body], cwd=rundir, env=env, stdout=log,
                             stderr=subprocess.STDOUT)
    return summarize(work, args.file, args.np, "single" if args.single else "gloo" if args.gloo else "mpirun", rc)


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


if __name__ == "__main__":
    sys.exit(main())
