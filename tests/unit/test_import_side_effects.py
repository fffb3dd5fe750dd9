"""Importing Horovod changes nothing process-wide, but for the documented exceptions below: no
environment variable written, no warnings filter installed, no exit, excepthook or signal handler
replaced, no logging handler added to the root logger, no default socket timeout, no import hook
(``sys.meta_path``, ``sys.path_hooks``), no rule of TensorFlow's autograph, no framework internal
that costs seconds to load (``torch._dynamo``, ``triton``). (Horovod's own hooks come with
``hvd.init()`` and go with ``hvd.shutdown()``: ``tests/unit/common/test_lifecycle.py``; the autograph
rule for Horovod's own code comes with ``horovod.tensorflow.init()``; an elastic torch worker loads
``torch._dynamo`` in ``hvd.init()``: ``tests/unit/common/test_elastic_warm_up.py``.)

The documented exceptions, each unavoidable where it is (CONTRIBUTING.md, "Import-time effects"):
- ``horovod.tensorflow`` sets ``TF_NUM_INTEROP_THREADS`` when the program set no inter-op pool size:
  TensorFlow reads it once, possibly before ``hvd.init()`` (docs/tensorflow.md, "TF1 sessions").
- ``horovod.lightning`` registers ``strategy="horovod"`` in Lightning's registry (what importing it
  is for); for a Lightning package installed but not yet imported it adds one ``sys.meta_path``
  finder that registers the name when that import ends and then removes itself, so as not to
  import Lightning (seconds) itself.

One fresh interpreter imports the frameworks first (their own import-time effects are theirs),
takes a snapshot, imports every module of the package, and compares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._ci_record import once_under_ci  # noqa: F401 - the fixture, used by pytestmark

pytestmark = pytest.mark.usefixtures("once_under_ci")

REPO = Path(__file__).resolve().parents[2]


_CODE = r"""
import builtins, importlib, json, logging, os, pkgutil, signal, socket, sys, threading, warnings

# The frameworks' own import-time effects are not Horovod's: take them before the snapshot.
for name in ("numpy", "torch", "tensorflow", "keras", "tf_keras", "jax", "jax.numpy", "optax",
             "pyspark", "pyspark.sql", "pyspark.ml", "pyarrow", "pyarrow.parquet", "pandas", "ray",
             "ray.util", "ray.train", "lightning", "pytorch_lightning", "cloudpickle", "psutil", "yaml",
             "fsspec"):
    try:
        importlib.import_module(name)
    except Exception:
        pass


def autograph_rules():
    try:
        from tensorflow.python.autograph.core import config
    except Exception:
        return None
    return [repr(r) for r in config.CONVERSION_RULES]


def snapshot():
    sigs = {}
    for s in signal.valid_signals():
        try:
            sigs[int(s)] = signal.getsignal(s)
        except (ValueError, OSError):
            pass
    return {"environ": dict(os.environ), "filters": list(warnings.filters),
            "hooks": (sys.excepthook, threading.excepthook, sys.unraisablehook, sys.exit,
                      getattr(builtins, "exit", None), getattr(builtins, "quit", None),
                      sys.displayhook, sys.breakpointhook),
            "signals": sigs, "root_handlers": list(logging.getLogger().handlers),
            "root_level": logging.getLogger().level, "socket_timeout": socket.getdefaulttimeout(),
            "recursion": sys.getrecursionlimit(), "meta_path": [repr(f) for f in sys.meta_path],
            "path_hooks": [repr(h) for h in sys.path_hooks], "autograph_rules": autograph_rules(),
            "heavy_modules": sorted(m for m in HEAVY if m in sys.modules)}


# framework internals that cost seconds (torch._dynamo pulls in triton): loaded only when used
HEAVY = ("torch._dynamo", "torch._inductor", "triton")
before = snapshot()
import horovod

imported, failed = [], {}
for mod in pkgutil.walk_packages(horovod.__path__, "horovod."):
    try:
        importlib.import_module(mod.name)
        imported.append(mod.name)
    except Exception as exc:  # an optional framework missing here: reported, judged by the test
        failed[mod.name] = f"{type(exc).__name__}: {exc}"
after = snapshot()

changed = {}
env_b, env_a = before.pop("environ"), after.pop("environ")
diff = {k: (env_b.get(k), env_a.get(k)) for k in set(env_b) | set(env_a) if env_b.get(k) != env_a.get(k)}
if diff:
    changed["environ"] = diff
if before["filters"] != after["filters"]:
    changed["warnings.filters"] = [repr(f) for f in after["filters"] if f not in before["filters"]]
names = ("sys.excepthook", "threading.excepthook", "sys.unraisablehook", "sys.exit", "builtins.exit",
         "builtins.quit", "sys.displayhook", "sys.breakpointhook")
for name, b, a in zip(names, before["hooks"], after["hooks"]):
    if a is not b:
        changed[name] = repr(a)
sig = {signal.Signals(s).name: repr(after["signals"].get(s)) for s in before["signals"]
       if after["signals"].get(s) != before["signals"][s]}
if sig:
    changed["signals"] = sig
for key in ("root_handlers", "root_level", "socket_timeout", "recursion", "meta_path", "path_hooks",
            "autograph_rules", "heavy_modules"):
    if before[key] != after[key]:
        changed[key] = repr(after[key])
print("RESULT " + json.dumps({"imported": imported, "failed": failed, "changed": changed}))
"""

# Modules whose framework is an optional extra: the only ones that may fail to import here.
_OPTIONAL = ("horovod.spark", "horovod.ray", "horovod.lightning", "horovod.tensorflow", "horovod.keras",
             "horovod._keras", "horovod.jax", "horovod.torch")


@pytest.mark.timeout(900)  # every framework imported in one process: 35 s of CPU, minutes on a loaded machine
def test_importing_every_module_changes_nothing_process_wide() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="3")
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(_CODE)], capture_output=True, text=True,
                         timeout=600, env=env, cwd=REPO)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert len(result["imported"]) > 100, result  # the walk did reach the package
    unexpected = {m: e for m, e in result["failed"].items() if not m.startswith(_OPTIONAL)}
    assert not unexpected, f"modules that do not import without an optional framework: {unexpected}"
    # The one exception (docs/tensorflow.md, "TF1 sessions"): horovod.tensorflow widens TensorFlow's
    # inter-op pool when the program chose none, before TensorFlow reads the variable once.
    changed = result["changed"]
    if "horovod.tensorflow" in result["imported"] and "TF_NUM_INTEROP_THREADS" not in env:
        assert changed.get("environ", {}).pop("TF_NUM_INTEROP_THREADS", None) == [None, "64"], changed
        if not changed["environ"]:
            del changed["environ"]
    assert not changed, (
        f"importing horovod changed process-wide state: {result['changed']} (do it in hvd.init() and "
        "undo it in hvd.shutdown(), or scope it with a context manager)")


_LIGHTNING_CODE = r"""
import importlib.util, json, sys
import torch  # not Horovod's effect
before = list(sys.meta_path)
import horovod.lightning as hl
added = [f for f in sys.meta_path if f not in before]
removed = [f for f in before if f not in sys.meta_path]
result = {"added": [type(f).__qualname__ + " " + type(f).__module__ for f in added], "removed": len(removed),
          "lightning_imported": [p for p in ("lightning", "pytorch_lightning") if p in sys.modules],
          "installed": [p for p in ("lightning", "pytorch_lightning") if importlib.util.find_spec(p)]}
for package in result["installed"]:
    importlib.import_module(package + (".pytorch" if package == "lightning" else ""))
result["registered"] = hl.registered_packages()
result["left"] = [type(f).__qualname__ for f in sys.meta_path  # Lightning's own (six's) are not ours
                  if f not in before and type(f).__module__.startswith("horovod")]
print("RESULT " + json.dumps(result))
"""


@pytest.mark.timeout(900)
def test_horovod_lightning_adds_only_its_documented_import_hook_and_removes_it() -> None:
    """The one import hook (see the module's docstring): one finder, only while a Lightning package
    that is installed is not imported yet, gone once they are, and the name registered in each."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env.update(PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(_LIGHTNING_CODE)], capture_output=True,
                         text=True, timeout=600, env=env, cwd=REPO)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if res.returncode != 0 and "No module named 'torch'" in res.stderr:
        pytest.skip("PyTorch is not installed")
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["lightning_imported"] == [], result  # importing horovod.lightning imports no Lightning
    assert result["removed"] == 0, result
    if result["installed"]:
        assert result["added"] == ["_RegisterAfterImport horovod.lightning"], result
    else:
        assert result["added"] == [], result
    assert result["left"] == [], result  # the finder removed itself once every package was imported
    want = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}
    assert sorted(result["registered"]) == sorted(want[p] for p in result["installed"]), result
