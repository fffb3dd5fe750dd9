"""No class in ``horovod/common/engine/`` longer than 300 lines (read from the source with ``ast``).

The engine is split by role (CONTRIBUTING.md, "How a round runs"): the loop, the round controller,
the batch runner, the executor, the coordinator, the observers. A class that grows past this bound
has taken on a second role; split it the same way instead of raising the bound.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ENGINE = Path(__file__).resolve().parents[3] / "horovod" / "common" / "engine"
MAX_LINES = 300


def class_sizes(root: Path = ENGINE) -> list[tuple[str, str, int]]:
    """(module, class, lines including its docstring and decorators) for every class under ``root``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                assert node.end_lineno is not None
                out.append((str(path.relative_to(root)), node.name, node.end_lineno - start + 1))
    return out


def test_the_engine_modules_are_found():
    names = {cls for _, cls, _ in class_sizes()}
    assert {"Engine", "Executor", "Coordinator"} <= names, names


def test_no_engine_class_over_300_lines():
    big = [f"{mod}: class {cls} is {n} lines" for mod, cls, n in class_sizes() if n > MAX_LINES]
    assert not big, (f"classes over {MAX_LINES} lines in horovod/common/engine (split them by role, "
                     "see CONTRIBUTING.md): " + "; ".join(big))


def test_the_measure_counts_a_long_class(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"@dataclass\nclass Big:\n{body}\n")
    assert class_sizes(tmp_path) == [("m.py", "Big", MAX_LINES + 2)]
