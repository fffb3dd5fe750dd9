"""Importing Horovod changes nothing process-wide (but for TensorFlow's inter-op pool size, widened by
``horovod.tensorflow`` when unset: see the test): no environment variable written, no warnings
filter installed, no exit, excepthook or signal handler replaced, no logging handler added to the
root logger, no default socket timeout. (Horovod's own hooks come with ``hvd.init()`` and go with
``hvd.shutdown()``: ``tests/unit/common/test_lifecycle.py``.)

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
            "recursion": sys.getrecursionlimit()}


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
for key in ("root_handlers", "root_level", "socket_timeout", "recursion"):
    if before[key] != after[key]:
        changed[key] = repr(after[key])
print("RESULT " + json.dumps({"imported": imported, "failed": failed, "changed": changed}))
"""

# Modules whose framework is an optional extra: the only ones that may fail to import here.
_OPTIONAL = ("horovod.spark", "horovod.ray", "horovod.lightning", "horovod.tensorflow", "horovod.keras",
             "horovod._keras", "horovod.jax", "horovod.torch")


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
