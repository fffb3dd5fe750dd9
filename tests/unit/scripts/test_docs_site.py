"""The documentation site builds with warnings as errors, with its API reference, and lists every page."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
SITE_PACKAGES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")

# One public name per API page that the reference must document (generated from docstrings).
API_NAMES = {
    "torch": ["horovod.torch.DistributedOptimizer", "horovod.torch.allreduce", "horovod.torch.broadcast_parameters"],
    "tensorflow": ["horovod.tensorflow.DistributedGradientTape", "horovod.tensorflow.allreduce"],
    "keras": ["horovod.keras.DistributedOptimizer",
              "horovod.tensorflow.keras.callbacks.BroadcastGlobalVariablesCallback"],
    "jax": ["horovod.jax.DistributedOptimizer", "horovod.jax.allreduce"],
    "lightning": ["horovod.lightning.HorovodStrategy"],
    "spark": ["horovod.spark.run", "horovod.spark.run_elastic", "horovod.spark.lightning.TorchEstimator",
              "horovod.spark.common.store.Store"],
    "ray": ["horovod.ray.RayExecutor", "horovod.ray.elastic.ElasticRayExecutor"],
    "runner": ["horovod.runner.run"],
    "numpy": ["horovod.numpy.allreduce", "horovod.numpy.size"],  # size: built by a factory
    "checkpoint": ["horovod.torch.checkpoint.save", "horovod.torch.checkpoint.load"],
    "elastic": ["horovod.torch.elastic.run", "horovod.torch.elastic.TorchState", "horovod.torch.elastic.ElasticSampler",
                "horovod.tensorflow.elastic.TensorFlowKerasState", "horovod.keras.elastic.KerasState",
                "horovod.common.elastic.State", "horovod.common.elastic.ObjectState"],
    "common": ["horovod.common.process_sets.ProcessSet", "horovod.common.exceptions.HorovodInternalError"],
}
# horovod.run()'s parameters, each documented on the runner page (not a bare run(*args, **kwargs))
RUN_PARAMETERS = ("num_proc", "min_num_proc", "max_num_proc", "hosts", "hostfile", "host_discovery_script",
                  "cooldown_range", "use_gloo", "use_mpi", "env", "monitor_port", "executable")
# Built by a factory in a module that imports TensorFlow: documented where the docs build can import it.
if importlib.util.find_spec("tensorflow") and importlib.util.find_spec("keras"):
    API_NAMES["keras"] += ["horovod.keras.allreduce", "horovod.tensorflow.keras.PartialDistributedOptimizer"]


def _docs_extra_missing() -> list[str]:
    return [name for name in SITE_PACKAGES if importlib.util.find_spec(name.split(".")[0]) is None
            or importlib.util.find_spec(name) is None]


def test_every_docs_page_is_in_the_site_navigation() -> None:
    config = (REPO / "mkdocs.yml").read_text()
    nav = set(re.findall(r":\s*([\w./-]+\.md)\s*$", config, re.M))
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert not pages - nav, f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert not nav - pages, f"mkdocs.yml's nav names pages that do not exist: {sorted(nav - pages)}"


@pytest.mark.slow  # a build of the whole site: 10-60 s (.ci/run also builds it before the suite)
def test_the_site_builds_strict_with_the_api_reference(tmp_path: Path) -> None:
    missing = _docs_extra_missing()
    if missing:
        pytest.skip(f"the docs extra is not installed (no {', '.join(missing)}): pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                          "-f", str(REPO / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    absent = {}
    for page, names in API_NAMES.items():
        html = (tmp_path / "site" / "api" / f"{page}.html").read_text()
        absent.update({name: page for name in names if f'id="{name}"' not in html})
    assert not absent, f"the API reference does not document {absent}"
    # the generated reference carries the docstrings, not only the names
    torch_page = (tmp_path / "site" / "api" / "torch.html").read_text()
    assert "named_parameters" in torch_page
    runner_page = (tmp_path / "site" / "api" / "runner.html").read_text()
    undocumented = [p for p in RUN_PARAMETERS if f"<b><code>{p}</code></b>" not in runner_page
                    and f"<code>{p}</code>" not in runner_page]
    assert not undocumented, f"the horovod.runner page does not document run()'s {undocumented}"
