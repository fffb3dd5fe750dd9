"""The runner's dependency rules, checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

RUNNER = Path(__file__).resolve().parents[3] / "horovod" / "runner"
# lifecycle: the launcher classifies a rank's exception chain ("its own" or "a peer left") with the same
# rules the rank used; the module imports only exceptions at top level. refusals: the bounded,
# rate-limited refusal log of the rendezvous service and the store (standard library only).
ALLOWED_COMMON = {"horovod.common.config", "horovod.common.exceptions", "horovod.common.types",
                  "horovod.common.rendezvous", "horovod.common.lifecycle", "horovod.common.protocol",
                  "horovod.common.refusals"}


def imported_modules(path: Path) -> list[tuple[str, bool]]:
    """(module, at top level) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from package import module`` imports that module
            pkg = RUNNER.parents[1].joinpath(*node.module.split("."))
            subs = [a.name for a in node.names if (pkg / f"{a.name}.py").exists() or (pkg / a.name).is_dir()]
            out += [(f"{node.module}.{n}", id(node) in top) for n in subs] or [(node.module, id(node) in top)]
    return out


def test_runner_imports_only_config_exceptions_types_from_common() -> None:
    bad = [(p.name, m) for p in RUNNER.rglob("*.py") for m, _ in imported_modules(p)
           if m.startswith("horovod.common") and m not in ALLOWED_COMMON]
    assert not bad, f"runner modules import the engine side of horovod.common: {bad}"


def test_launch_path_does_not_import_the_engine() -> None:
    # The engine and NumPy cost 0.3 s on every horovodrun start: the launcher imports only the
    # stdlib-only modules of horovod.common (exceptions, the protocol package and its submodules), and
    # the package imports lazily.
    import subprocess
    import sys

    code = ("import sys, horovod.runner.launch.horovodrun, horovod.runner.cli, horovod.runner.elastic.workers;"
            "import horovod.common.exceptions, horovod.common.protocol;"
            "print(sorted(m for m in sys.modules if m.startswith(('horovod.common.', 'numpy', 'torch',"
            " 'yaml', 'psutil')) and not m.startswith('horovod.common.protocol.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(__import__("os").environ, PYTHONPATH=str(RUNNER.parents[1])))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['horovod.common.exceptions', 'horovod.common.protocol']", out.stdout


def test_shim_uses_only_the_standard_library() -> None:
    mods = {m.split(".")[0] for m, _ in imported_modules(RUNNER / "_shim.py")}
    assert mods <= {"json", "os", "signal", "socket", "subprocess", "sys", "threading", "time",
                    "ctypes", "importlib", "types", "typing", "__future__",
                    "collections"}, mods  # collections: for type checking only


def test_the_package_ships_no_test_fixture_that_installs_software() -> None:
    # tests/_fakehosts.py runs apt-get; it stays out of the wheel (horovod/). (Error messages may
    # still suggest "apt-get install ..." to the user.)
    import re

    runs = re.compile(r"""["']apt-get["']|["']apt["'],|["']dpkg["']""")
    bad = [str(p.relative_to(RUNNER.parents[1])) for p in RUNNER.parent.rglob("*.py")
           if runs.search(p.read_text())]
    assert not bad, f"modules of the package that run a package manager: {bad}"
