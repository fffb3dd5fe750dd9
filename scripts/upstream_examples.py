#!/usr/bin/env python3
"""Run upstream Horovod's own examples against the installed ``horovod`` package.

Upstream's ``examples/`` folder (GitHub's source archive at a pinned tag, never the PyPI sdist) is
fetched once into the cache that ``scripts/upstream_tests.py`` uses. Every example that applies to
this project (PyTorch, TensorFlow 2, Keras, elastic, Spark, Ray, Adasum; MXNet is not provided) runs
as a user runs it, on data this script generates in the format the example reads:

- MNIST as IDX files where torchvision looks (``<data-dir>/MNIST/raw``), as Keras' ``mnist.npz``
  (and the per-rank names the examples ask for) under ``$KERAS_HOME/datasets``, and as LIBSVM
  ``mnist.bz2`` where the Spark examples look: scikit-learn's digits drawn at MNIST's size;
- ImageNet as a small ImageFolder tree of JPEG files (``train/`` and ``validation/``);
- nothing for the synthetic benchmarks.

Runs are short (the example's own flags for epochs and batches where it has them), at np=2 under
``horovodrun`` (elastic examples in elastic mode with a discovery script; Spark and Ray examples
start their own jobs, Ray's on a local cluster this script starts and stops), each with a timeout.
The only edits are the ones today's frameworks force; each is a text patch listed in ``EXAMPLES``
with the framework change that forces it, and is applied only where its text is found exactly once
(an edit that no longer applies fails the example, naming it)::

    python scripts/upstream_examples.py                       # every example, the table at the end
    python scripts/upstream_examples.py --source horovod-0.28.1.tar.gz pytorch/pytorch_mnist.py
    python scripts/upstream_examples.py --list                # the examples and their status

Options: ``--source`` (a ``.tar.gz``, URL or unpacked checkout instead of GitHub), ``--ref``,
``--cache``, ``--out DIR`` (work folders, logs and ``results.md``; default a new temporary folder),
``--timeout`` (seconds per example, default each example's own). Keras verifies the SHA-256 of its
MNIST download, which a generated file cannot match: the runs' ``sitecustomize`` (in ``--out``)
accepts the files under the generated ``$KERAS_HOME`` and nothing else. Exit status: 0 when every
example that applies passed.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import upstream_tests  # noqa: E402 - the fetch and cache of upstream's source

# (what the example has, what it needs instead, the framework change that forces it)
Edit = tuple[str, str, str]

KERAS_OPT_LR = "Keras 3 optimizers take `learning_rate`; the `lr` alias is gone"
LIGHTNING_EPOCH_END = ("Lightning 2.0 removed LightningModule.validation_epoch_end and refuses a module "
                       "defining it")
LIGHTNING_ON_EPOCH_END = ("Lightning 2.0 no longer calls Callback.on_epoch_end; the example's callback "
                          "asserts on its count")

LIGHTNING_SPARK_EDITS: list[Edit] = [
    ("""        def validation_epoch_end(self, outputs):
            avg_loss = torch.stack([x['val_loss'] for x in outputs]).mean() if len(outputs) > 0 else float('inf')
            self.log('avg_val_loss', avg_loss)
""", "", LIGHTNING_EPOCH_END),
    ("""            print('A train epoch ended.')
""", """            print('A train epoch ended.')
            self.on_epoch_end(trainer, model)
""", LIGHTNING_ON_EPOCH_END),
    ("""            print('A val epoch ended.')
""", """            print('A val epoch ended.')
            self.on_epoch_end(trainer, model)
""", LIGHTNING_ON_EPOCH_END + " (validation epochs)"),
]


LIGHTNING_MNIST_EDITS: list[Edit] = [
    ("""import horovod.torch as hvd
""", """import horovod.torch as hvd
import horovod.lightning  # noqa: F401
""", "Lightning 2.0 removed its built-in Horovod strategy; `import horovod.lightning` registers "
     "`strategy=\"horovod\"`"),
    ("""    def validation_epoch_end(self, outputs):
        avg_loss = torch.stack([x['val_loss'] for x in outputs]).mean()
        tensorboard_logs = {'val_loss': avg_loss}
        return {'avg_val_loss': avg_loss, 'log': tensorboard_logs}
""", "", LIGHTNING_EPOCH_END),
    ("""                print('A train epoch ended.')
                self.train_epcoh_end_counter += 1
""", """                print('A train epoch ended.')
                self.train_epcoh_end_counter += 1
                self.on_epoch_end(trainer, model)

            def on_validation_epoch_end(self, trainer, model):
                self.on_epoch_end(trainer, model)
""", LIGHTNING_ON_EPOCH_END + " (training and validation epochs)"),
    ("""        trainer = Trainer(accelerator='horovod',
                          gpus=(1 if args.cuda else 0),
""", """        trainer = Trainer(strategy='horovod',
                          accelerator=('gpu' if args.cuda else 'cpu'), devices=1,
""", "Lightning 2.0 removed `Trainer(gpus=)`, and its `accelerator=` names a device type, so the "
     "strategy is `strategy=`"),
]


TF_SESSION: Edit = (
    """config = tf.ConfigProto()
config.gpu_options.allow_growth = True
config.gpu_options.visible_device_list = str(hvd.local_rank())
K.set_session(tf.Session(config=config))
""", """gpus = tf.config.experimental.list_physical_devices('GPU')
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')
""", "TensorFlow 2 has no `tf.ConfigProto`/`tf.Session` and Keras 3 no `backend.set_session`: the GPU "
    "pinning is TensorFlow 2's `tf.config` calls (as upstream's tensorflow2 examples write it)")
H5_CHECKPOINT: Edit = ("'./checkpoint-{epoch}.h5'", "'./checkpoint-{epoch}.keras'",
                       "Keras 3's ModelCheckpoint saves a whole model only to a `.keras` file")
OPT_VARIABLES: Edit = ("opt.variables()", "opt.variables",
                       "Keras 3's `Optimizer.variables` is a property (a list), no longer a method")


def no_run_tf_function(indent: str) -> Edit:
    return (f",\n{indent}experimental_run_tf_function=False)", ")",
            "Keras 3's `Model.compile` has no `experimental_run_tf_function` (it never runs eagerly "
            "unless told `run_eagerly=True`)")


def steps(old: str, new: str) -> Edit:
    return (old, new, "shortened: the example has no flag for its length")


def lr_attribute(old: str, new: str) -> Edit:
    return (old, new, "Keras 3 optimizers have no `lr` attribute; it is `learning_rate`")


@dataclass
class Example:
    path: str                          # under upstream's examples/
    launch: str = "horovodrun"         # horovodrun | elastic | python (Spark, Ray: their own launcher)
    args: str = ""                     # {data} {work} are filled in
    data: str = ""                     # mnist_idx | keras_npz | libsvm | imagefolder | ""
    edits: list[Edit] = field(default_factory=list)
    timeout: int = 600
    ray: tuple[dict[str, float], ...] = ()  # Ray nodes (num_cpus, num_gpus): the example needs a cluster
    skip: str = ""                     # why it does not apply (then it is listed, never run)
    metric: tuple[str, str] | None = None  # (label, pattern) where METRICS does not fit its output
    shorten: list[Edit] = field(default_factory=list)  # fewer steps where the example has no flag for it


SYNTHETIC = "--model {model} --batch-size 8 --num-warmup-batches 2 --num-batches-per-iter 2 --num-iters 3"
DATA_SERVICE_MODULE = "a module of tensorflow2_mnist_data_service.py, not a program"
KERAS_GENERATORS = ("Keras 3 removed `ImageDataGenerator` and `Model.fit_generator`/`evaluate_generator`, "
                    "on which the example's whole input pipeline is built (and TensorFlow 2 has no "
                    "`tf.Session` for its GPU set-up): porting it is a rewrite, not an edit")
TF1 = ("written for TensorFlow 1 (`tf.Session`, `tf.placeholder`, `tf.ConfigProto`, `tf.app`, "
       "`tf.train.*Optimizer`, `tf.enable_eager_execution`, `tf.estimator`): TensorFlow 2 keeps these only "
       "under `tf.compat.v1`, and `tf.estimator` not at all since 2.16; porting it is a rewrite, not an edit")

EXAMPLES: list[Example] = [
    Example("pytorch/pytorch_mnist.py", args="--epochs 4 --data-dir {data}", data="mnist_idx"),
    Example("pytorch/pytorch_synthetic_benchmark.py",
            args=SYNTHETIC.format(model="resnet18")),
    Example("pytorch/pytorch_lightning_mnist.py", args="--epochs 4 --data-dir {data}", data="mnist_idx",
            edits=LIGHTNING_MNIST_EDITS),
    Example("pytorch/pytorch_imagenet_resnet50.py",
            args="--train-dir {data}/train --val-dir {data}/validation --batch-size 8 --val-batch-size 8 "
                 "--epochs 1 --warmup-epochs 0", data="imagefolder", timeout=900),
    Example("tensorflow2/tensorflow2_mnist.py", data="keras_npz", edits=[OPT_VARIABLES],
            shorten=[steps("dataset.take(10000 // hvd.size())", "dataset.take(600 // hvd.size())")]),
    Example("tensorflow2/tensorflow2_keras_mnist.py", data="keras_npz",
            edits=[no_run_tf_function(" " * 24), H5_CHECKPOINT],
            shorten=[steps("epochs=24, verbose=verbose", "epochs=2, verbose=verbose")]),
    Example("tensorflow2/tensorflow2_synthetic_benchmark.py",
            args=SYNTHETIC.format(model="ResNet50"),
            edits=[OPT_VARIABLES]),
    Example("tensorflow2/tensorflow2_keras_synthetic_benchmark.py",  # it has no --num-warmup-batches
            args="--model ResNet50 --batch-size 8 --num-batches-per-iter 2 --num-iters 3",
            edits=[no_run_tf_function(" " * 14)]),
    Example("tensorflow2/tensorflow2_mnist_data_service.py",
            skip="needs `horovod.tensorflow.data.compute_service` (tf.data service workers run by "
                 "Horovod), which this project does not provide"),
    Example("tensorflow2/tensorflow2_mnist_data_service_train_fn_compute_side_dispatcher.py",
            skip=DATA_SERVICE_MODULE),
    Example("tensorflow2/tensorflow2_mnist_data_service_train_fn_training_side_dispatcher.py",
            skip=DATA_SERVICE_MODULE),
    Example("keras/keras_mnist.py", data="keras_npz", edits=[TF_SESSION, H5_CHECKPOINT]),
    Example("keras/keras_mnist_advanced.py", skip=KERAS_GENERATORS),
    Example("keras/keras_imagenet_resnet50.py", skip=KERAS_GENERATORS),
    Example("tensorflow/tensorflow_mnist.py", skip=TF1),
    Example("tensorflow/tensorflow_mnist_estimator.py", skip=TF1),
    Example("tensorflow/tensorflow_keras_mnist.py", skip=TF1),
    Example("tensorflow/tensorflow_synthetic_benchmark.py", skip=TF1),
    Example("tensorflow/tensorflow_word2vec.py", skip=TF1),
    Example("tensorflow/tensorflow_mnist_eager.py", skip=TF1),
    Example("elastic/pytorch/pytorch_mnist_elastic.py", launch="elastic", args="--epochs 2 --data-dir {data}",
            data="mnist_idx"),
    Example("elastic/pytorch/pytorch_synthetic_benchmark_elastic.py", launch="elastic",
            args=SYNTHETIC.format(model="resnet18")),
    Example("elastic/pytorch/pytorch_imagenet_resnet50_elastic.py", launch="elastic",
            args="--train-dir {data}/train --val-dir {data}/validation --batch-size 8 --val-batch-size 8 "
                 "--epochs 1 --warmup-epochs 0", data="imagefolder", timeout=900),
    Example("elastic/tensorflow2/tensorflow2_mnist_elastic.py", launch="elastic", data="keras_npz",
            edits=[lr_attribute("opt.lr.assign(", "opt.learning_rate.assign(")]),
    Example("elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py", launch="elastic", data="keras_npz",
            edits=[no_run_tf_function(" " * 20), H5_CHECKPOINT,
                   lr_attribute("state.model.optimizer.lr,", "state.model.optimizer.learning_rate,")],
            shorten=[steps("epochs=24-state.epoch", "epochs=4-state.epoch")]),
    Example("elastic/tensorflow2/tensorflow2_synthetic_benchmark_elastic.py", launch="elastic",
            args=SYNTHETIC.format(model="ResNet50"),
            edits=[lr_attribute("opt.lr.assign(", "opt.learning_rate.assign(")]),
    Example("elastic/tensorflow/tensorflow_keras_mnist_elastic.py", launch="elastic",
            args="--epochs 2 --batches-per-epoch 20", data="keras_npz",
            edits=[TF_SESSION, lr_attribute("model.optimizer.lr,", "model.optimizer.learning_rate,"), H5_CHECKPOINT]),
    Example("adasum/adasum_small_model.py", args="--op Adasum",
            metric=("steps to converge (100: not within 50)", r"<stdout>:\S+ Adasum \S+ \d+ (\d+)")),
    Example("spark/pytorch/pytorch_spark_mnist.py", launch="python",
            args="--num-proc 2 --data-dir {data} --work-dir {work}", data="libsvm", timeout=1800),
    Example("spark/keras/keras_spark_mnist.py", launch="python",
            args="--num-proc 2 --data-dir {data} --work-dir {work}", data="libsvm", timeout=1800),
    Example("spark/pytorch/pytorch_lightning_spark_mnist.py", launch="python",
            args="--num-proc 2 --data-dir {data} --work-dir {work}", data="libsvm",
            edits=LIGHTNING_SPARK_EDITS, timeout=1800),
    Example("spark/pytorch/pytorch_lightning_spark_mnist_legacy.py", launch="python",
            args="--num-proc 2 --epochs 4 --data-dir {data} --work-dir {work}", data="libsvm", timeout=1200),
    Example("spark/keras/keras_spark_rossmann_estimator.py",
            skip="needs Kaggle's Rossmann store-sales CSV files (seven tables, joined by the example's "
                 "feature engineering); none is generated here"),
    Example("spark/keras/keras_spark_rossmann_run.py",
            skip="needs Kaggle's Rossmann CSV files and Petastorm's `make_batch_reader`"),
    Example("spark/keras/keras_spark3_rossmann.py",
            skip="needs Kaggle's Rossmann CSV files, Petastorm and GPU resources (Spark 3 GPU scheduling)"),
    Example("spark/tensorflow2/tensorflow2_mnist_data_service.py",
            skip="needs `horovod.tensorflow.data.compute_service`, which this project does not provide"),
    Example("ray/tensorflow2_mnist_ray.py", launch="python", args="--address auto", data="keras_npz",
            ray=({"num_cpus": 32}, {"num_cpus": 32}), timeout=900,
            edits=[no_run_tf_function(" " * 8), H5_CHECKPOINT,
                   ("num_slots=4, use_gpu=False, cpus_per_slot=8",
                    "num_workers_per_host=4, use_gpu=False, cpus_per_worker=8",
                    "not a framework: Horovod's RayExecutor renamed `num_slots`/`cpus_per_slot` to "
                    "`num_workers_per_host`/`cpus_per_worker` before 0.28.1, whose RayExecutor refuses "
                    "the old names too")]),
    Example("ray/pytorch_ray_elastic.py", launch="python", args="--epochs 1 --data-dir {data}", data="mnist_idx",
            ray=({"num_cpus": 4, "num_gpus": 2},), timeout=900),
    Example("ray/basic_ray_elastic.py",
            skip="imports `horovod.ray.elastic.TestDiscovery`, upstream's test discovery that hides and "
                 "brings back Ray nodes at random, which this project does not provide; it also asks for "
                 "GPUs and 2 to 5 hosts"),
]

SITECUSTOMIZE = '''"""Accept generated MNIST files under $KERAS_HOME in place of Keras' hashed download."""
import importlib.abc, importlib.machinery, os, sys

_HOME = os.path.realpath(os.environ.get("KERAS_HOME", "")) if os.environ.get("KERAS_HOME") else None
_TARGETS = {"keras.src.utils.file_utils", "tf_keras.src.utils.data_utils"}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name.rpartition(".")[2], path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            original = module.validate_file

            def validate_file(fpath, *args, **kwargs):
                if os.path.realpath(str(fpath)).startswith(_HOME + os.sep):
                    return True  # a generated stand-in for the download
                return original(fpath, *args, **kwargs)

            module.validate_file = validate_file

        spec.loader.exec_module = exec_module
        return spec


if _HOME:
    sys.meta_path.insert(0, _Finder())
'''

METRICS = [  # (label, pattern): the last match of the first pattern found is the result
    ("test accuracy", r"Test accuracy:? \(?([0-9.]+)"),
    ("test accuracy", r"Test set: Average loss: [0-9.]+, Accuracy: ([0-9.]+%)"),
    ("img/sec", r"Total img/sec on \d+ \w+\(s\): ([0-9.]+ \+-[0-9.]+)"),
    ("val accuracy", r"val_accuracy: ([0-9.]+)"),
    ("val accuracy", r"Validate Epoch .*accuracy=([0-9.]+)"),
    ("train accuracy", r"\baccuracy: ([0-9.]+)"),
    ("loss", r"[Ll]oss: ([0-9.]+)"),
]


# ---------------------------------------------------------------------------------------- data

def mnist_like(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as MNIST: 8x8 images scaled to 24x24 in a 28x28 frame, 0-255 (uint8),
    each also shifted by 2 pixels up, down, left and right: 8985 images, shuffled."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    imgs = np.pad(np.kron(x.reshape(-1, 8, 8) / 16.0, np.ones((3, 3))), ((0, 0), (2, 2), (2, 2)))
    shifted = [np.roll(imgs, s, axis=a) for s, a in ((0, 1), (2, 1), (-2, 1), (2, 2), (-2, 2))]
    pixels = np.round(np.concatenate(shifted) * 255).astype(np.uint8)
    labels = np.tile(y, 5).astype(np.uint8)
    order = np.random.default_rng(seed).permutation(len(labels))
    return pixels[order], labels[order]


def split(n_test: int = 1000) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    x, y = mnist_like()
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def write_mnist_libsvm(path: Path) -> int:
    """MNIST-shaped rows as LIBSVM lines (label, then 1-based index:value of nonzero pixels), bz2,
    as the LIBSVM site's ``mnist.bz2``."""
    x, y = mnist_like()
    rows = x.reshape(len(x), -1)
    lines = []
    for label, row in zip(y, rows):
        nz = np.nonzero(row)[0]
        lines.append(f"{label} " + " ".join(f"{i + 1}:{row[i]}" for i in nz))
    path.write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))
    return len(lines)


def write_mnist_idx(root: Path) -> None:
    """The four IDX files of MNIST, unpacked and gzipped, where torchvision's ``MNIST(root)`` looks."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    (xtr, ytr), (xte, yte) = split()
    for name, arr in (("train-images-idx3-ubyte", xtr), ("train-labels-idx1-ubyte", ytr),
                      ("t10k-images-idx3-ubyte", xte), ("t10k-labels-idx1-ubyte", yte)):
        header = struct.pack(">HBB", 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
        data = header + arr.tobytes()
        (raw / name).write_bytes(data)
        (raw / f"{name}.gz").write_bytes(gzip.compress(data))


KERAS_NAMES = ["mnist.npz"] + [f"{name}-{rank}{ext}" for rank in range(8)  # up to 8 ranks (the Ray example)
                               for name, ext in (("mnist", ".npz"), ("MNIST-data", ""))]


def write_keras_mnist(keras_home: Path) -> None:
    """Keras' ``mnist.npz`` (x_train, y_train, x_test, y_test) under every name the examples pass."""
    folder = keras_home / "datasets"
    folder.mkdir(parents=True, exist_ok=True)
    (xtr, ytr), (xte, yte) = split()
    for name in KERAS_NAMES:
        with open(folder / name, "wb") as fh:
            np.savez(fh, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)


def write_imagefolder(root: Path, classes: int = 4, train: int = 8, val: int = 4) -> None:
    """``train/`` and ``validation/`` ImageFolder trees of JPEG files, one folder per class, each
    class a different colour (so that a model can learn it)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split_name, count in (("train", train), ("validation", val)):
        for c in range(classes):
            folder = root / split_name / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            base = np.zeros(3)
            base[c % 3] = 200
            for i in range(count):
                img = np.clip(base + rng.normal(0, 30, (96, 96, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(img).save(folder / f"img_{i}.JPEG", quality=90)


def prepare(kind: str, data: Path, keras_home: Path) -> None:
    marker = data / f".{kind or 'none'}"
    if marker.exists() or not kind:
        return
    data.mkdir(parents=True, exist_ok=True)
    if kind == "mnist_idx":
        write_mnist_idx(data)
    elif kind == "keras_npz":
        write_keras_mnist(keras_home)
    elif kind == "libsvm":
        write_mnist_libsvm(data / "mnist.bz2")
    elif kind == "imagefolder":
        write_imagefolder(data)
    else:
        raise ValueError(kind)
    marker.touch()


# ----------------------------------------------------------------------------------------- run

def apply_edits(text: str, edits: list[Edit]) -> str:
    for old, new, why in edits:
        if text.count(old) != 1:
            raise ValueError(f"the example changed: the edit for {why!r} no longer applies")
        text = text.replace(old, new)
    return text


class RayCluster:
    """A local Ray cluster (``ray.cluster_utils.Cluster``: a head and more nodes on this machine)
    held by a helper process in its own process group, stopped by that group's id (never ``ray
    stop``, which stops every cluster on the machine). Resources are logical: ``num_cpus=32`` on a
    2-core machine gives the 32 CPU slots an example asks for."""

    HELPER = """import json, sys, time
from ray.cluster_utils import Cluster
nodes = json.loads(sys.argv[1])
cluster = Cluster(initialize_head=True, head_node_args=dict(nodes[0], include_dashboard=False))
for args in nodes[1:]:
    cluster.add_node(**args)
cluster.wait_for_nodes()
print(cluster.address, flush=True)
time.sleep(1e6)
"""

    def __init__(self, nodes: tuple[dict[str, float], ...], work: Path, env: dict[str, str]) -> None:
        import json

        self.log = open(work / "ray.log", "w+")
        self.procs = [subprocess.Popen([sys.executable, "-c", self.HELPER, json.dumps(list(nodes))],
                                       stdout=subprocess.PIPE, stderr=self.log, env=env, text=True,
                                       cwd=work, start_new_session=True)]  # workers write in cwd
        line = self.procs[0].stdout.readline().strip() if self.procs[0].stdout else ""
        if not line:
            self.stop()
            raise RuntimeError(f"the Ray cluster did not start; see {work / 'ray.log'}")
        self.address = line

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                end_group(proc, 60)
        self.log.close()


def metric(out: str, own: tuple[str, str] | None = None) -> str:
    for label, pattern in ([own] if own else METRICS):
        found = re.findall(pattern, out)
        if found:
            return f"{label} {found[-1]}"
    return ""


def why_failed(out: str) -> str:
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(Error|Exception|error:)\b", ln) and "Traceback" not in ln:
            return re.sub(r"^\[\d+\]<std(err|out)>:", "", ln)[:200]
    return lines[-1][:200] if lines else "no output"


def run_one(ex: Example, examples: Path, out: Path, env: dict[str, str], np_: int,
            timeout: int | None) -> dict[str, str]:
    work = out / ex.path.replace("/", "__").removesuffix(".py")
    work.mkdir(parents=True, exist_ok=True)
    data = out / "data" / (ex.data or "none")
    keras_home = out / "data" / "keras"
    prepare(ex.data, data, keras_home)
    src = examples / ex.path
    script = work / src.name
    script.write_text(apply_edits(src.read_text(), ex.edits + ex.shorten))
    for sibling in src.parent.glob("*.py"):  # examples import their neighbours
        if sibling.name != src.name and not (work / sibling.name).exists():
            shutil.copy(sibling, work / sibling.name)
    args = shlex.split(ex.args.format(data=data, work=work))
    run_env = dict(env, KERAS_HOME=str(keras_home))
    if ex.launch == "horovodrun":
        cmd = ["horovodrun", "-np", str(np_), sys.executable, script.name, *args]
    elif ex.launch == "elastic":
        discover = work / "discover.sh"
        discover.write_text(f"#!/bin/sh\necho localhost:{np_}\n")
        discover.chmod(0o755)
        cmd = ["horovodrun", "-np", str(np_), "--min-np", str(np_), "--max-np", str(np_),
               "--host-discovery-script", str(discover), sys.executable, script.name, *args]
    else:
        cmd = [sys.executable, script.name, *args]
    shown = " ".join(shlex.quote(a) for a in cmd).replace(str(out), "$OUT").replace(sys.executable, "python")
    cluster = None
    start = time.monotonic()
    try:
        if ex.ray:
            cluster = RayCluster(ex.ray, work, run_env)
            run_env["RAY_ADDRESS"] = cluster.address
        rc, output = run_launcher(cmd, work, run_env, timeout or ex.timeout)
        status = "passed" if rc == 0 else f"timeout ({timeout or ex.timeout} s)" if rc is None else f"failed ({rc})"
    except RuntimeError as exc:
        output, status = str(exc), "failed (cluster)"
    finally:
        if cluster is not None:
            cluster.stop()
    seconds = time.monotonic() - start
    (work / "output.log").write_text(output)
    return {"example": ex.path, "command": shown, "status": status, "metric": metric(output, ex.metric),
            "time": f"{seconds:.0f} s", "edits": "; ".join(why for _, _, why in ex.edits + ex.shorten) or "none",
            "why": "" if status == "passed" else why_failed(output), "log": str(work / "output.log")}


def end_group(proc: subprocess.Popen[Any], grace: float) -> None:
    """SIGTERM to the process group ``proc`` leads, SIGKILL after ``grace`` seconds."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_launcher(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int) -> tuple[int | None, str]:
    """Runs the launcher in its own process group; past the timeout it gets SIGTERM (horovodrun
    then ends its ranks), then the group SIGKILL. Returns (exit code or None, output)."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
            end_group(proc, 30)
        out.seek(0)
        return rc, out.read()


def table(rows: list[dict[str, str]]) -> str:
    lines = ["| example | command | status | accuracy / metric | time | edits |", "|---|---|---|---|---|---|"]
    for r in rows:
        status = r["status"] if not r.get("why") else f"{r['status']}: {r['why']}"
        lines.append(f"| `{r['example']}` | `{r['command']}` | {status.replace('|', '/')} | {r['metric']} | "
                     f"{r['time']} | {r['edits']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default=upstream_tests.PINNED_REF, help="upstream tag or commit")
    parser.add_argument("--source", help="a .tar.gz, URL or unpacked checkout instead of GitHub")
    parser.add_argument("--cache", type=Path, default=None, help="cache folder (shared with upstream_tests.py)")
    parser.add_argument("--out", type=Path, default=None, help="work folders, logs and results.md")
    parser.add_argument("--np", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--timeout", type=int, default=None, help="seconds per example (default its own)")
    parser.add_argument("--list", action="store_true", help="list the examples and exit")
    parser.add_argument("examples", nargs="*", help="paths under examples/ (default: all that apply)")
    args = parser.parse_args(argv)

    known = {ex.path: ex for ex in EXAMPLES}
    if args.list:
        for ex in EXAMPLES:
            print(f"{ex.path}: {'not run: ' + ex.skip if ex.skip else ex.launch}")
        return 0
    unknown = [p for p in args.examples if p not in known]
    if unknown:
        print(f"unknown examples: {', '.join(unknown)} (see --list)", file=sys.stderr)
        return 2
    examples = upstream_tests.fetch(args.ref, args.source, args.cache or upstream_tests.default_cache(),
                                    "examples")
    out = (args.out or Path(tempfile.mkdtemp(prefix="upstream-examples-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    harness = out / "harness"
    harness.mkdir(exist_ok=True)
    (harness / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
                   p for p in (str(harness), os.environ.get("PYTHONPATH")) if p))
    chosen = [known[p] for p in args.examples] if args.examples else EXAMPLES
    rows = []
    for ex in chosen:
        if ex.skip:
            rows.append({"example": ex.path, "command": "", "status": "not run", "metric": "", "time": "",
                         "edits": "", "why": ex.skip})
            continue
        if not (examples / ex.path).is_file():
            rows.append({"example": ex.path, "command": "", "status": "missing", "metric": "", "time": "",
                         "edits": "", "why": f"not in upstream's examples at {args.ref}"})
            continue
        row = run_one(ex, examples, out, env, args.np, args.timeout)
        print(f"{row['status']:>16}  {row['time']:>7}  {ex.path}  {row['metric']}  {row['why']}", flush=True)
        rows.append(row)
    text = table(rows)
    (out / "results.md").write_text(text)
    print(text + f"\nlogs and results.md in {out}")
    ran = [r for r in rows if r["status"] != "not run"]
    return 0 if all(r["status"] == "passed" for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
