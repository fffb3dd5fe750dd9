"""Upstream's ``examples/spark/pytorch/pytorch_lightning_spark_mnist.py`` (v0.28.1) as a user runs
it, with only the edits Lightning 2 forces, on MNIST-shaped data this test writes where the
example looks for its download (``<data-dir>/mnist.bz2``, LIBSVM, 784 features of 0-255): it
trains through ``horovod.spark.lightning`` and reaches a test accuracy of at least 0.80.

Upstream's examples are not part of this repository: the test takes them from upstream's source
(``HOROVOD_UPSTREAM_SOURCE``: a checkout or GitHub's ``.tar.gz``), or from the cache that
``scripts/upstream_tests.py`` fills; without either it is skipped and says how to supply them."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.upstream, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "spark/pytorch/pytorch_lightning_spark_mnist.py"


def _scripts():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import upstream_examples
        import upstream_tests
    finally:
        sys.path.pop(0)
    return upstream_tests, upstream_examples


def examples_folder() -> Path:
    upstream_tests, _ = _scripts()
    source = os.environ.get("HOROVOD_UPSTREAM_SOURCE")
    cache = upstream_tests.default_cache()
    ref = upstream_tests.PINNED_REF
    cached = cache / ref / "examples"
    archive = cache / f"{ref}.tar.gz"
    if source is None and not cached.is_dir() and not archive.is_file():
        pytest.skip("upstream's examples are not available here: set HOROVOD_UPSTREAM_SOURCE to upstream's "
                    f"source (a checkout or GitHub's {ref} .tar.gz), or run scripts/upstream_tests.py once "
                    "with network access")
    return upstream_tests.fetch(ref, source, cache, "examples")


@pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None, reason="needs pytorch_lightning")
def test_upstream_lightning_spark_mnist_example(tmp_path: Path) -> None:
    import shutil

    pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'horovod-py[spark]')")
    if shutil.which("java") is None:
        pytest.skip("Spark needs Java (17), and no java is on PATH")
    script = tmp_path / "pytorch_lightning_spark_mnist.py"
    _, examples = _scripts()  # the edits Lightning 2 forces and the data: as scripts/upstream_examples.py's
    script.write_text(examples.apply_edits((examples_folder() / EXAMPLE).read_text(),
                                           examples.LIGHTNING_SPARK_EDITS))
    assert examples.write_mnist_libsvm(tmp_path / "mnist.bz2") == 8985
    (tmp_path / "work").mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(script), "--num-proc", "2", "--work-dir", str(tmp_path / "work"),
                          "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=1700,
                         env=env, cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    assert "Skip test" not in out, out[-2000:]  # MIN_PL_VERSION admits the installed Lightning
    # upstream's callback counted every epoch on both ranks (12 train + 12 validation epochs)
    assert len(re.findall(r"Training ends:epcoh_end_counter=24, train_epcoh_end_counter=12", out)) == 2, out[-3000:]
    acc = [float(a) for a in re.findall(r"Test accuracy: ([0-9.]+)", out)]
    assert len(acc) == 1 and acc[0] >= 0.80, out[-3000:]
    print(f"upstream {EXAMPLE}: test accuracy {acc[0]:.4f}")
