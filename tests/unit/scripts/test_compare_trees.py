"""benchmarks/compare_trees.py reads the figures a benchmark prints under mpirun and horovodrun."""

from __future__ import annotations

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _module():
    spec = importlib.util.spec_from_file_location("compare_trees", os.path.join(REPO, "benchmarks", "compare_trees.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_json_lines_are_read_bare_and_behind_horovodruns_rank_prefix():
    figures = _module()._figures(
        '{"np": 2, "grouped_ms": 0.25}\n'                            # mpirun: rank 0 prints bare
        '[0]<stdout>:{"hooks_ms": 1.5, "modes": {"floor_ms": 0.2}}\n'  # horovodrun --gloo
        "[1]<stderr>:warning: not a figure\n"
        "{not json}\n")
    assert figures == {"np": 2.0, "grouped_ms": 0.25, "hooks_ms": 1.5, "modes.floor_ms": 0.2}
