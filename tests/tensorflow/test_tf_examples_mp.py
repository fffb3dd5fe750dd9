"""The seed recipes as runnable examples, at np=2 (and np=1 for the accuracy reference).

Checks: weights identical on every rank (ranks start from different random seeds), accuracy what
single-process training reaches, only rank 0 wrote a checkpoint. Slow: each run starts TensorFlow.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from horovod.testing import run_mpi_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _results(output: str, np_: int) -> dict:
    found = {}
    for m in re.finditer(r"RESULT (?:(\w+) )?rank=(\d+) accuracy=([\d.]+) weights=(\w+)", output):
        found[(m.group(1) or "", int(m.group(2)))] = (float(m.group(3)), m.group(4))
    return found


def _run(script: str, args: list[str], np_: int, env: dict | None = None) -> dict:
    res = run_mpi_script([sys.executable, os.path.join(ROOT, script), *args], np=np_, timeout=400, env=env)
    found = _results(res.stdout, np_)
    assert len({k[1] for k in found}) == np_, res.stdout[-3000:]
    return found


def _same_weights_on_every_rank(found: dict) -> None:
    for recipe in {k[0] for k in found}:
        digests = {v[1] for k, v in found.items() if k[0] == recipe}
        assert len(digests) == 1, f"{recipe}: weights differ between ranks: {found}"


def _only_rank0_wrote(tmp_path) -> None:
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["ckpt-rank0"], f"checkpoint directories written: {written}"
    assert any(tmp_path.joinpath("ckpt-rank0").iterdir())


def test_tf1_recipe_monitored_training_session(tmp_path):
    found = _run("examples/tensorflow/tensorflow_mnist.py",
                 ["--steps", "600", "--checkpoint-dir", str(tmp_path / "ckpt-rank{rank}")], 2)
    _same_weights_on_every_rank(found)
    assert all(acc >= 0.93 for acc, _ in found.values()), found
    _only_rank0_wrote(tmp_path)
    assert any(p.name.startswith("model.ckpt-300") for p in (tmp_path / "ckpt-rank0").iterdir())


@pytest.mark.parametrize("script,args", [
    ("examples/tensorflow2/tensorflow2_mnist.py", ["--steps", "400"]),
    ("examples/keras/keras_mnist.py", ["--epochs", "3", "--steps-per-epoch", "100"]),
], ids=["tf2-tape", "keras3-fit"])
def test_tf2_and_keras_recipes_match_single_process_accuracy(tmp_path, script, args):
    ck = ["--checkpoint-dir", str(tmp_path / "ckpt-rank{rank}")]
    two = _run(script, args + ck, 2)
    _same_weights_on_every_rank(two)
    _only_rank0_wrote(tmp_path)
    one = _run(script, args + ["--checkpoint-dir", str(tmp_path / "single")], 1)
    acc1 = one[("", 0)][0]
    acc2 = two[("", 0)][0]
    assert acc1 >= 0.9 and acc2 >= acc1 - 0.03, f"np=2 accuracy {acc2} vs single process {acc1}"


def test_seed_recipes_verbatim_under_keras2():
    found = _run("tests/tensorflow/bin/seeds_keras2.py", [], 2, env={"TF_USE_LEGACY_KERAS": "1"})
    _same_weights_on_every_rank(found)
    assert {k[0] for k in found} == {"tf2", "keras"}
    assert all(acc >= 0.85 for acc, _ in found.values()), found
