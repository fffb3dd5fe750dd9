"""One fresh interpreter per environment that imports TensorFlow, then Horovod's TensorFlow and
Keras modules, inits and shuts down, printing what changed at each point; run once per pytest
process and environment, for every test that reads its lines (each run costs TensorFlow's import,
about 10 s): test_tf_side_effects_unit.py (environment and autograph), test_tf_unit.py (no
torch imported) and test_tf_compat_unit.py (when the graph-error mapping is installed)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_CODE = """
    import os
    import tensorflow as tf  # TensorFlow's own import sets variables of its own
    before = dict(os.environ)
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras, horovod.keras  # noqa: F401
    import sys
    print("TORCH", "torch" in sys.modules)  # test_tf_unit.py: the TensorFlow bindings import no torch
    cls = tf.errors.InvalidArgumentError  # test_tf_compat_unit.py: no graph op yet, nothing mapped
    untouched = "__new__" not in cls.__dict__
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
    hvd.allreduce(tf.ones([2]))  # eager: nothing to map
    eager_untouched = "__new__" not in cls.__dict__
    tf.function(lambda t: hvd.allreduce(t, name="g"))(tf.ones([2]))  # the first graph op installs it
    installed = "__new__" in cls.__dict__
    other = cls(None, None, "a shape is wrong in the user's own op")
    ours = cls(None, None, "HorovodFailedPrecondition: HorovodAllreduce ('g'): Mismatched shapes")
    print("GRAPH ERRORS", untouched, eager_untouched, installed, type(other).__name__, type(ours).__name__)
    hvd.shutdown()
    hvd.init()
    print("AG AGAIN", rules())
    hvd.shutdown()
"""


def fresh_import(env: tuple[tuple[str, str], ...] = ()) -> subprocess.CompletedProcess[str]:
    """``_CODE``'s run in a fresh interpreter with the test process's environment less the
    variables of the pool, of a launcher's rank and of pytest's current test, plus ``env`` (name,
    value pairs); a run with the same environment is not repeated."""
    full = {k: v for k, v in os.environ.items()
            if k not in ("TF_NUM_INTEROP_THREADS", "HOROVOD_EXIT_RECORD", "PYTEST_CURRENT_TEST")
            and not k.startswith("OMPI_COMM")}
    full.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="3", **dict(env))
    return _run(tuple(sorted(full.items())))


@functools.cache
def _run(env: tuple[tuple[str, str], ...]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(_CODE)], capture_output=True, text=True,
                          timeout=300, env=dict(env))
