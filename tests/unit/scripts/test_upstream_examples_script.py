"""scripts/upstream_examples.py without upstream's source: the data it generates reads back in the
formats the examples load (IDX, Keras' npz, LIBSVM, ImageFolder), an edit that no longer applies
is named, metrics are found in the examples' output, and every listed example says how it runs or
why it does not. Running the examples themselves needs upstream's source (see CONTRIBUTING.md)."""

from __future__ import annotations

import bz2
import gzip
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
try:
    import upstream_examples as ue
finally:
    sys.path.pop(0)


def _idx(path: Path) -> np.ndarray:
    data = path.read_bytes()
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    assert (zero, dtype) == (0, 0x08)
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    return np.frombuffer(data[4 + 4 * ndim:], np.uint8).reshape(shape)


def test_mnist_idx_files_are_mnist_shaped(tmp_path: Path) -> None:
    ue.write_mnist_idx(tmp_path)
    raw = tmp_path / "MNIST" / "raw"
    images, labels = _idx(raw / "train-images-idx3-ubyte"), _idx(raw / "train-labels-idx1-ubyte")
    assert images.shape == (7985, 28, 28) and labels.shape == (7985,)
    assert _idx(raw / "t10k-images-idx3-ubyte").shape == (1000, 28, 28)
    assert set(labels.tolist()) == set(range(10)) and images.max() == 255
    assert gzip.decompress((raw / "train-labels-idx1-ubyte.gz").read_bytes()) == \
        (raw / "train-labels-idx1-ubyte").read_bytes()


def test_keras_npz_under_every_name_the_examples_ask_for(tmp_path: Path) -> None:
    ue.write_keras_mnist(tmp_path)
    for name in ue.KERAS_NAMES:
        with np.load(tmp_path / "datasets" / name) as f:
            assert f["x_train"].shape == (7985, 28, 28) and f["x_train"].dtype == np.uint8
            assert f["y_test"].shape == (1000,)


def test_libsvm_rows_are_one_based_nonzero_pixels(tmp_path: Path) -> None:
    assert ue.write_mnist_libsvm(tmp_path / "mnist.bz2") == 8985
    first = bz2.decompress((tmp_path / "mnist.bz2").read_bytes()).decode().splitlines()[0].split()
    x, y = ue.mnist_like()
    row = x[0].reshape(-1)
    assert int(first[0]) == y[0]
    assert {int(k) - 1: int(v) for k, v in (p.split(":") for p in first[1:])} == \
        {i: int(row[i]) for i in np.nonzero(row)[0]}


def test_imagefolder_tree_has_a_folder_per_class(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    ue.write_imagefolder(tmp_path, classes=3, train=2, val=1)
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["n00000000", "n00000001", "n00000002"]
    assert len(list((tmp_path / "validation").rglob("*.JPEG"))) == 3


def test_an_edit_that_no_longer_applies_is_named() -> None:
    assert ue.apply_edits("a = opt.variables()\n", [ue.OPT_VARIABLES]) == "a = opt.variables\n"
    with pytest.raises(ValueError, match="no longer applies"):
        ue.apply_edits("nothing here\n", [ue.OPT_VARIABLES])


def test_metrics_come_from_the_examples_output() -> None:
    assert ue.metric("[0]<stdout>:Test accuracy: 0.9599\n") == "test accuracy 0.9599"
    assert ue.metric("\nTest set: Average loss: 0.21, Accuracy: 93.10%\n") == "test accuracy 93.10%"
    assert ue.metric("Total img/sec on 2 CPU(s): 4.6 +-0.3\n") == "img/sec 4.6 +-0.3"
    assert ue.metric("no figure") == ""


def test_every_example_runs_or_says_why_not() -> None:
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "upstream_examples.py"), "--list"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == len(ue.EXAMPLES) and not any(line.startswith("mxnet/") for line in lines)
    for ex in ue.EXAMPLES:
        assert ex.skip or ex.launch in ("horovodrun", "elastic", "python"), ex.path
