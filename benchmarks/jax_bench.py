"""horovod.jax and Keras 3 backends, in one run.

    python benchmarks/jax_bench.py [--nps 2,3] [--reps 15] [--keras-steps 30]

1. Gradient sync: the ResNet-50 gradient set (``shapes.resnet50()``, 161 float32 arrays, 25.6 M values)
   averaged (a) through ``horovod.numpy.grouped_allreduce`` on NumPy arrays and (b) through
   ``horovod.jax.allreduce_tree`` (what ``DistributedOptimizer`` calls) inside a ``jax.jit`` step on
   ``jax.Array``s, interleaved repetition by repetition in one mpirun per world size. Reported:
   median seconds and the ratio jax/numpy (goal <= 1.10); also (c) the same jitted step with its
   argument donated (``donate_argnums``; the step's output is the next repetition's input).
2. Keras ``fit``: the same model and data (an MLP on 20k x 256 synthetic rows, batch 256, SGD,
   ``hvd.DistributedOptimizer``) on 2 ranks with KERAS_BACKEND=tensorflow, torch and jax; reported:
   the median time per train step after warm-up, and its ratio to the TensorFlow backend.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def gradsync(reps: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, HERE)
    from shapes import resnet50

    import horovod.jax as hvd
    import horovod.numpy as hnp

    hvd.init()
    rng = np.random.default_rng(hvd.rank())
    arrays = [rng.standard_normal(s).astype(np.float32) for s in resnet50()]
    tree = [jnp.asarray(a) for a in arrays]
    step = jax.jit(lambda g: hvd.allreduce_tree(g, name="grads"))
    jax.block_until_ready(step(tree))
    # the same step with its argument donated: XLA may reduce in the argument's memory
    donated = jax.jit(lambda g: hvd.allreduce_tree(g, name="grads.donated"), donate_argnums=0)
    box = [donated([jnp.asarray(a) for a in arrays])]
    hnp.grouped_allreduce(arrays, name="np")
    want = hnp.grouped_allreduce(arrays, name="check")
    got = step(tree)
    assert all(np.allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want))
    times: dict[str, list[float]] = {"numpy": [], "jax-jit": [], "jax-jit-donated": []}
    for _ in range(reps):
        hnp.barrier()
        t = time.perf_counter()
        hnp.grouped_allreduce(arrays, name="np")
        times["numpy"].append(time.perf_counter() - t)
        hnp.barrier()
        t = time.perf_counter()
        jax.block_until_ready(step(tree))
        times["jax-jit"].append(time.perf_counter() - t)
        hnp.barrier()
        t = time.perf_counter()
        box[0] = jax.block_until_ready(donated(box[0]))
        times["jax-jit-donated"].append(time.perf_counter() - t)
    if hvd.rank() == 0:
        print(json.dumps({k: statistics.median(v) for k, v in times.items()}), flush=True)


def keras_fit(steps: int) -> None:
    import numpy as np

    import horovod.keras as hvd

    hvd.init()
    import keras

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((256 * (steps + 5), 256)).astype("float32")
    y = rng.integers(0, 10, len(x))
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stamps: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):  # noqa: ANN001, ANN201
            stamps.append(time.perf_counter())

    model.fit(x, y, batch_size=256, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Clock()])
    per_step = statistics.median(b - a for a, b in zip(stamps[5:], stamps[6:]))
    if hvd.rank() == 0:
        print(json.dumps({"step_s": per_step}), flush=True)


def _mpirun(np_: int, args: list[str], env: dict[str, str]) -> dict[str, float]:
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np_), "-x", "PYTHONPATH",
           "-x", "KERAS_BACKEND", "-x", "JAX_PLATFORMS", sys.executable, __file__] + args
    full = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.environ.get("PYTHONPATH", ROOT), **env}
    out = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nps", default="2,3")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--keras-steps", type=int, default=30)
    parser.add_argument("--backends", default="tensorflow,torch,jax")
    parser.add_argument("--part", choices=["gradsync", "keras"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "gradsync":
        return gradsync(args.reps)
    if args.part == "keras":
        return keras_fit(args.keras_steps)
    print(f"## horovod.jax gradient sync: ResNet-50 set (161 arrays), median of {args.reps}")
    print("| np | horovod.numpy (s) | horovod.jax in jit (s) | ratio | jit, argument donated (s) | ratio |\n"
          "|---|---|---|---|---|---|")
    for np_ in [int(v) for v in args.nps.split(",")]:
        r = _mpirun(np_, ["--part", "gradsync", "--reps", str(args.reps)], {})
        print(f"| {np_} | {r['numpy']:.4f} | {r['jax-jit']:.4f} | {r['jax-jit'] / r['numpy']:.2f}x "
              f"| {r['jax-jit-donated']:.4f} | {r['jax-jit-donated'] / r['numpy']:.2f}x |", flush=True)
    print(f"\n## Keras 3 fit step on 2 ranks (MLP 256-512-512-10, batch 256), median of {args.keras_steps} steps")
    print("| backend | s/step | vs tensorflow |\n|---|---|---|")
    base = None
    for backend in args.backends.split(","):
        r = _mpirun(2, ["--part", "keras", "--keras-steps", str(args.keras_steps)], {"KERAS_BACKEND": backend})
        base = base or r["step_s"]
        print(f"| {backend} | {r['step_s']:.4f} | {r['step_s'] / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
