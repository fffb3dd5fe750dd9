"""The seed recipes as runnable examples, at np=2 (and np=1 for the accuracy reference).

Checks: weights identical on every rank (ranks start from different random seeds), accuracy what
single-process training reaches, only rank 0 wrote a checkpoint. Slow: each launch starts
TensorFlow, so the TF2 and Keras 3 recipes share their launches (np=2 and np=1).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import Any

import pytest

from horovod.testing import run_mpi_script
from tests._shared_launch import JOINT_TIMEOUT, joint_launch, run_as_main

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _results(output: str, np_: int) -> dict:
    found = {}
    for m in re.finditer(r"RESULT (?:(\w+) )?rank=(\d+) accuracy=([\d.]+) weights=(\w+)", output):
        found[(m.group(1) or "", int(m.group(2)))] = (float(m.group(3)), m.group(4))
    return found


def _same_weights_on_every_rank(found: dict) -> None:
    for recipe in {k[0] for k in found}:
        digests = {v[1] for k, v in found.items() if k[0] == recipe}
        assert len(digests) == 1, f"{recipe}: weights differ between ranks: {found}"


def _only_rank0_wrote(tmp_path) -> None:
    """Under ``tmp_path``, only rank 0's checkpoint directory exists, and it is not empty."""
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["ckpt-rank0"], f"checkpoint directories written: {written}"
    assert any(tmp_path.joinpath("ckpt-rank0").iterdir())


# The TF2 and Keras 3 recipes run one after the other in the same ranks (tests/tensorflow/bin/
# run_recipes.py): one TensorFlow start-up per rank for both, at np=2 and at np=1; at np=2 the TF1
# recipe (MonitoredTrainingSession) after them, last since it turns eager execution off.
_RECIPES = {
    "tf2tape": ("examples/tensorflow2/tensorflow2_mnist.py", ["--steps", "400"]),
    "keras3fit": ("examples/keras/keras_mnist.py", ["--epochs", "3", "--steps-per-epoch", "100"]),
}
_TF1 = {"tf1session": ("examples/tensorflow/tensorflow_mnist.py", ["--steps", "600"])}


def _run_recipes(np_: int, checkpoint_dir: Callable[[str], str], more: dict | None = None) -> tuple[dict, str]:
    """Every recipe of ``_RECIPES`` (then of ``more``) in one launch of ``np_`` ranks, each with its
    checkpoint directory ``checkpoint_dir(label)``: the RESULT lines found (labelled) and the output."""
    argv = [sys.executable, os.path.join(ROOT, "tests", "tensorflow", "bin", "run_recipes.py")]
    for label, (script, args) in {**_RECIPES, **(more or {})}.items():
        argv += [label, os.path.join(ROOT, script), *args, "--checkpoint-dir", checkpoint_dir(label), "--"]
    res = run_mpi_script(argv, np=np_, timeout=600)
    return _results(res.stdout, np_), res.stdout


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The recipes at np=2 (checkpoints under ``<dir>/<label>/ckpt-rank{rank}``; the TF1 recipe
    too) and at np=1."""
    two_dir = tmp_path_factory.mktemp("recipes-np2")
    one_dir = tmp_path_factory.mktemp("recipes-np1")
    two = _run_recipes(2, lambda label: str(two_dir / label / "ckpt-rank{rank}"), _TF1)
    one = _run_recipes(1, lambda label: str(one_dir / label))
    return {"two": two, "one": one, "two_dir": two_dir}


@pytest.mark.parametrize("label", ["tf2tape", "keras3fit"])
def test_tf2_and_keras_recipes_match_single_process_accuracy(recipe_runs: dict[str, Any], label: str) -> None:
    (two_all, out2), (one_all, out1) = recipe_runs["two"], recipe_runs["one"]
    two = {k: v for k, v in two_all.items() if k[0] == label}
    one = {k: v for k, v in one_all.items() if k[0] == label}
    assert sorted(k[1] for k in two) == [0, 1], out2[-3000:]
    assert sorted(k[1] for k in one) == [0], out1[-3000:]
    _same_weights_on_every_rank(two)
    _only_rank0_wrote(recipe_runs["two_dir"] / label)
    acc1 = one[(label, 0)][0]
    acc2 = two[(label, 0)][0]
    assert acc1 >= 0.9 and acc2 >= acc1 - 0.03, f"np=2 accuracy {acc2} vs single process {acc1}"


def test_tf1_recipe_monitored_training_session(recipe_runs: dict[str, Any]) -> None:
    two_all, out2 = recipe_runs["two"]
    found = {k: v for k, v in two_all.items() if k[0] == "tf1session"}
    assert sorted(k[1] for k in found) == [0, 1], out2[-3000:]
    _same_weights_on_every_rank(found)
    assert all(acc >= 0.93 for acc, _ in found.values()), found
    ckpts = recipe_runs["two_dir"] / "tf1session"
    _only_rank0_wrote(ckpts)
    assert any(p.name.startswith("model.ckpt-300") for p in (ckpts / "ckpt-rank0").iterdir())


def _seeds_under_keras2() -> str:
    """tests/tensorflow/bin/seeds_keras2.py as ``__main__`` in this rank: what it printed."""
    return run_as_main(os.path.join(ROOT, "tests", "tensorflow", "bin", "seeds_keras2.py"))


# A part of the Keras 2 launch at np=2 that other TensorFlow modules share (tests/_shared_launch.py):
# one TensorFlow start-up per rank for all of them.
_KERAS2 = joint_launch("tensorflow", 2, {"seeds_keras2": _seeds_under_keras2}, timeout=400,
                       env={"TF_USE_LEGACY_KERAS": "1"})


@JOINT_TIMEOUT
def test_seed_recipes_verbatim_under_keras2():
    found = _results("".join(_KERAS2.results("seeds_keras2")), 2)
    assert len({k[1] for k in found}) == 2, found
    _same_weights_on_every_rank(found)
    assert {k[0] for k in found} == {"tf2", "keras"}
    assert all(acc >= 0.85 for acc, _ in found.values()), found
