"""Importing the TensorFlow bindings changes one thing process-wide: it widens TensorFlow's inter-op
pool (``TF_NUM_INTEROP_THREADS`` and the setting) when the program chose none; ``init`` changes no
environment (docs/tensorflow.md, "TF1 sessions"), and tells autograph to leave Horovod's own
functions unconverted (once)."""

from __future__ import annotations

import pytest

from tests.tensorflow._fresh_import import fresh_import


@pytest.mark.parametrize(("env", "import_sets", "pool"), [({}, ["TF_NUM_INTEROP_THREADS"], 64),
                                                         ({"TF_NUM_INTEROP_THREADS": "3"}, [], 0)])
def test_import_widens_only_an_unset_pool_and_init_changes_no_environment(env, import_sets, pool):
    res = fresh_import(tuple(sorted(env.items())))
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("IMPORT", "INIT", "AG"))]
    # An unset pool is widened at import (TensorFlow reads TF_NUM_INTEROP_THREADS once, maybe before
    # hvd.init()): the variable and the setting; the program's own TF_NUM_INTEROP_THREADS wins.
    # Autograph leaves Horovod's functions unconverted from hvd.init() on (one rule, not at import).
    assert res.returncode == 0 and lines == [f"IMPORT {import_sets}", "AG IMPORT 0 False",
                                             f"INIT {import_sets} {pool}", "AG INIT 1 True", "AG AGAIN 1"], (
        res.stdout, res.stderr[-3000:])
