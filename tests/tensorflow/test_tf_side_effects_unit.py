"""Importing the TensorFlow bindings changes one thing process-wide: it widens TensorFlow's inter-op
pool (``TF_NUM_INTEROP_THREADS`` and the setting) when the program chose none; ``init`` changes no
environment (docs/tensorflow.md, "TF1 sessions")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_CODE = """
    import os
    import tensorflow as tf  # TensorFlow's own import sets variables of its own
    before = dict(os.environ)
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras, horovod.keras  # noqa: F401
    changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
    print("IMPORT", changed)
    hvd.init()
    changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
    print("INIT", changed, tf.config.threading.get_inter_op_parallelism_threads())
    hvd.shutdown()
"""


@pytest.mark.parametrize(("env", "import_sets", "pool"), [({}, ["TF_NUM_INTEROP_THREADS"], 64),
                                                         ({"TF_NUM_INTEROP_THREADS": "3"}, [], 0)])
def test_import_widens_only_an_unset_pool_and_init_changes_no_environment(env, import_sets, pool):
    full = {k: v for k, v in os.environ.items()
            if k not in ("TF_NUM_INTEROP_THREADS", "HOROVOD_EXIT_RECORD") and not k.startswith("OMPI_COMM")}
    full.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="3", **env)
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(_CODE)], capture_output=True, text=True,
                         timeout=300, env=full)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("IMPORT", "INIT"))]
    # An unset pool is widened at import (TensorFlow reads TF_NUM_INTEROP_THREADS once, maybe before
    # hvd.init()): the variable and the setting; the program's own TF_NUM_INTEROP_THREADS wins.
    assert res.returncode == 0 and lines == [f"IMPORT {import_sets}", f"INIT {import_sets} {pool}"], (
        res.stdout, res.stderr[-3000:])
