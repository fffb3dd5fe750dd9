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


# .ci/run builds the site strict (its static checks) before the suite and names the directory here:
# the test then checks that build instead of building the same tree a second time (10-60 s).
BUILT_SITE = "HVD_TEST_BUILT_SITE"


def _sources() -> list[Path]:
    """What a build of the site reads: its configuration, its pages and the package's docstrings."""
    return [REPO / "mkdocs.yml", *(REPO / "docs").rglob("*"), *(REPO / "horovod").rglob("*.py")]


def _prebuilt_site() -> Path | None:
    """The site that .ci/run built (``HVD_TEST_BUILT_SITE``), once it is known to be a complete
    build of this tree as it is now; None where the variable is unset."""
    given = os.environ.get(BUILT_SITE)
    if not given:
        return None
    site = Path(given)
    pages = list(site.rglob("*.html"))
    assert (site / "index.html").is_file(), f"{BUILT_SITE}={given} is not a built site (no index.html)"
    built = min(p.stat().st_mtime for p in pages)  # the build's first page
    newer = [str(p.relative_to(REPO)) for p in _sources() if p.is_file() and p.stat().st_mtime > built]
    assert not newer, f"{BUILT_SITE}={given} was built before these files changed: {newer[:10]}"
    return site


def test_a_prebuilt_site_older_than_its_sources_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BUILT_SITE, str(tmp_path))
    with pytest.raises(AssertionError, match="not a built site"):
        _prebuilt_site()
    for page in ("index.html", "api/torch.html"):
        (tmp_path / page).parent.mkdir(exist_ok=True)
        (tmp_path / page).write_text("")
    os.utime(tmp_path / "api" / "torch.html", (0, 0))  # one page written "in 1970": every source is newer
    with pytest.raises(AssertionError, match="built before these files changed: .*mkdocs.yml"):
        _prebuilt_site()
    os.utime(tmp_path / "api" / "torch.html")  # written now
    assert _prebuilt_site() == tmp_path
    monkeypatch.delenv(BUILT_SITE)
    assert _prebuilt_site() is None


def test_ci_names_its_strict_build_to_the_suite() -> None:
    """.ci/run exports HVD_TEST_BUILT_SITE as the directory its strict build wrote, after the build
    (a failed build stops .ci/run before the suite: ``set -e``)."""
    lines = [ln.split(" #", 1)[0].strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()]
    build = next(i for i, ln in enumerate(lines) if ln.startswith("NO_MKDOCS_2_WARNING=1 mkdocs build --strict"))
    target = re.search(r'-d "?\$(\w+)"?', lines[build])
    assert target, lines[build]
    exports = [i for i, ln in enumerate(lines) if re.match(rf'export {BUILT_SITE}="?\${target.group(1)}"?$', ln)]
    assert exports and exports[0] > build, f".ci/run does not export {BUILT_SITE} after its site build"


@pytest.mark.slow  # a build of the whole site: 10-60 s, unless .ci/run built it (HVD_TEST_BUILT_SITE)
def test_the_site_builds_strict_with_the_api_reference(tmp_path: Path) -> None:
    missing = _docs_extra_missing()
    if missing:
        pytest.skip(f"the docs extra is not installed (no {', '.join(missing)}): pip install -e '.[docs]'")
    site = _prebuilt_site()
    if site is None:
        site = tmp_path / "site"
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                              "-f", str(REPO / "mkdocs.yml"), "-d", str(site)],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    absent = {}
    for page, names in API_NAMES.items():
        html = (site / "api" / f"{page}.html").read_text()
        absent.update({name: page for name in names if f'id="{name}"' not in html})
    assert not absent, f"the API reference does not document {absent}"
    # the generated reference carries the docstrings, not only the names
    torch_page = (site / "api" / "torch.html").read_text()
    assert "named_parameters" in torch_page
    runner_page = (site / "api" / "runner.html").read_text()
    undocumented = [p for p in RUN_PARAMETERS if f"<b><code>{p}</code></b>" not in runner_page
                    and f"<code>{p}</code>" not in runner_page]
    assert not undocumented, f"the horovod.runner page does not document run()'s {undocumented}"
