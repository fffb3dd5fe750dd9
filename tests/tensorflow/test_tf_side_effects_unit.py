"""Importing the TensorFlow bindings changes one thing process-wide: it widens TensorFlow's inter-op
pool (``TF_NUM_INTEROP_THREADS`` and the setting) when the program chose none; ``init`` changes no
environment (docs/tensorflow.md, "TF1 sessions"), and tells autograph to leave Horovod's own
functions unconverted (once)."""

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
    from tensorflow.python.autograph.core import config as ag_config
    from tensorflow.python.autograph.impl import conversion
    def rules():
        return [getattr(r, "_prefix", None) for r in ag_config.CONVERSION_RULES].count("horovod")
    print("AG IMPORT", rules(), conversion.is_allowlisted(hvd.allreduce))
    hvd.init()
    changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
    print("INIT", changed, tf.config.threading.get_inter_op_parallelism_threads())
    print("AG INIT", rules(), conversion.is_allowlisted(hvd.allreduce))
    hvd.shutdown()
    hvd.init()
    print("AG AGAIN", rules())
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
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("IMPORT", "INIT", "AG"))]
    # An unset pool is widened at import (TensorFlow reads TF_NUM_INTEROP_THREADS once, maybe before
    # hvd.init()): the variable and the setting; the program's own TF_NUM_INTEROP_THREADS wins.
    # Autograph leaves Horovod's functions unconverted from hvd.init() on (one rule, not at import).
    assert res.returncode == 0 and lines == [f"IMPORT {import_sets}", "AG IMPORT 0 False",
                                             f"INIT {import_sets} {pool}", "AG INIT 1 True", "AG AGAIN 1"], (
        res.stdout, res.stderr[-3000:])
