"""The runner's dependency rules, checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

RUNNER = Path(__file__).resolve().parents[3] / "horovod" / "runner"
# lifecycle: the launcher classifies a rank's exception chain ("its own" or "a peer left") with the same
# rules the rank used; the module imports only exceptions at top level.
ALLOWED_COMMON = {"horovod.common.config", "horovod.common.exceptions", "horovod.common.types",
                  "horovod.common.rendezvous", "horovod.common.lifecycle",
                  "horovod.common.elastic_rounds"}


def imported_modules(path: Path) -> list[tuple[str, bool]]:
    """(module, at top level) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, id(node) in top))
    return out


def test_runner_imports_only_config_exceptions_types_from_common() -> None:
    bad = [(p.name, m) for p in RUNNER.rglob("*.py") for m, _ in imported_modules(p)
           if m.startswith("horovod.common") and m not in ALLOWED_COMMON]
    assert not bad, f"runner modules import the engine side of horovod.common: {bad}"


def test_launch_path_does_not_import_common_at_module_level() -> None:
    # horovod.common's package import loads the engine and NumPy: 0.3 s on every horovodrun start.
    launch_path = ["launch.py", "cli.py", "settings.py", "hosts.py", "plan.py", "execute.py",
                   "failures.py", "output.py", "network.py", "errors.py", "launchers/base.py",
                   "launchers/mpirun.py", "launchers/local.py", "launchers/ssh.py"]
    bad = [(f, m) for f in launch_path for m, top in imported_modules(RUNNER / f)
           if top and m.startswith(("horovod.common", "numpy", "torch", "yaml", "psutil"))]
    assert not bad, f"modules on horovodrun's start path import heavy modules eagerly: {bad}"


def test_shim_uses_only_the_standard_library() -> None:
    mods = {m.split(".")[0] for m, _ in imported_modules(RUNNER / "_shim.py")}
    assert mods <= {"json", "os", "signal", "socket", "subprocess", "sys", "threading", "time",
                    "ctypes"}, mods
