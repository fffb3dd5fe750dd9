"""The TensorFlow/Keras modules are layered one way: no import cycle among ``horovod.tensorflow*``,
``horovod._keras*`` and ``horovod.keras*``, counting imports inside functions, and each layer imports
only the layers below it. Checked on the source (AST), no framework imported.

Layers, lowest first: ``horovod._keras.{backends,optimizer,state}`` (torch/JAX reductions for Keras 3,
the optimizer wrapper, elastic variable copies; no TensorFlow) <-
``horovod.tensorflow`` (package and modules, incl. the wrapper's TensorFlow reduction ``_keras_optimizer``) <-
``horovod._keras.{helpers,callbacks,elastic}`` <- ``horovod.tensorflow.keras``, ``horovod.keras``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("horovod.tensorflow", "horovod._keras", "horovod.keras")
# the Keras modules that import no TensorFlow (the lowest layer)
NEUTRAL = ("horovod._keras.backends", "horovod._keras.optimizer", "horovod._keras.state")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        base = ROOT / pkg.replace(".", "/")
        for path in base.rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _ours(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PACKAGES)


def _targets(module: str, path: Path) -> set[str]:
    """Modules of ours that importing ``module`` runs: explicit imports (top level or in functions)
    and the packages above them, except ``module``'s own packages (already running)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            names += [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
        for name in names:
            parts = name.split(".")
            for i in range(2, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in MODULES and target != module and not module.startswith(target + "."):
                    found.add(target)
    return found


GRAPH = {m: _targets(m, p) for m, p in MODULES.items()}


def _layer(module: str) -> int:
    if module in NEUTRAL:
        return 0
    if module == "horovod._keras":
        return 0  # imports nothing (checked below)
    if module.startswith(("horovod.tensorflow.keras", "horovod.keras")):
        return 3
    if module.startswith("horovod.tensorflow"):
        return 1
    return 2  # horovod._keras.helpers, callbacks, elastic


def test_no_import_cycles_among_tf_and_keras_modules() -> None:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_each_layer_imports_only_lower_layers() -> None:
    bad = [(m, t) for m, ts in GRAPH.items() for t in ts
           if _layer(t) > _layer(m) and not (_layer(m) == 3 and _layer(t) == 3 and t.startswith(m))]
    assert not bad, f"imports of a higher layer: {bad}"
    assert not GRAPH["horovod._keras"], "horovod._keras (package) must import nothing"


def test_the_graph_sees_the_known_edges() -> None:
    # guards against a checker that finds nothing
    assert "horovod.tensorflow._keras_optimizer" in GRAPH["horovod.tensorflow.optimizer"]
    assert "horovod._keras.optimizer" in GRAPH["horovod.tensorflow._keras_optimizer"]
    assert "horovod._keras.backends" in GRAPH["horovod._keras.optimizer"]
    assert "horovod._keras.helpers" in GRAPH["horovod.keras"]
    assert "horovod.tensorflow" in GRAPH["horovod._keras.callbacks"]
