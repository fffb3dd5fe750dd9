"""Synthetic Keras training throughput: Horovod against tf.distribute.MultiWorkerMirroredStrategy,
same model, same processes, alternating (machine noise hits both alike).

    mpirun -np 2 python benchmarks/tf_keras_synthetic.py

Every rank is one MWMS worker (TF_CONFIG on localhost; rank 0 picks the ports and broadcasts them
through Horovod) and one Horovod rank. Rank 0 prints images/s (all workers together) per framework
and the ratio.

MWMS runs under Keras 2 (tf_keras; this script sets TF_USE_LEGACY_KERAS=1 unless --keras 3): with
Keras 3.15, ``model.fit`` under MultiWorkerMirroredStrategy fails before the first step
(``Trainer._maybe_symbolic_build`` calls ``strategy.reduce("MEAN", <PerReplica batch>)``, which the
collective strategy cannot convert: "Attempt to convert a value (PerReplica...) ... to a Tensor").
With ``--keras 3`` only Horovod is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--batch-size", type=int, default=32, help="per worker")
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--steps", type=int, default=20, help="steps per timed epoch")
parser.add_argument("--rounds", type=int, default=3, help="alternating timed epochs per framework")
parser.add_argument("--keras", choices=["2", "3"], default="2")
parser.add_argument("--json", default=None)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def main() -> None:
    args = parser.parse_args()
    if args.keras == "2":
        os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported
    import horovod.tensorflow.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    from horovod.common.objects import broadcast_object

    ports = broadcast_object(_free_ports(size) if rank == 0 else None, root_rank=0)
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": rank}})
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy() if args.keras == "2" else None
    s = args.image_size

    def make_model():
        return tf.keras.Sequential([
            tf.keras.Input((s, s, 3)),
            tf.keras.layers.Conv2D(32, 3, activation="relu"), tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Conv2D(64, 3, activation="relu"), tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(), tf.keras.layers.Dense(256, activation="relu"),
            tf.keras.layers.Dense(10),
        ])

    x = np.random.RandomState(rank).rand(args.batch_size, s, s, 3).astype(np.float32)
    y = np.random.RandomState(rank).randint(0, 10, args.batch_size).astype(np.int64)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    # MWMS takes the global batch and splits it over the workers.
    mwms_data = tf.data.Dataset.from_tensors((np.concatenate([x] * size), np.concatenate([y] * size)))
    mwms_data = mwms_data.repeat().with_options(opts)
    hvd_data = tf.data.Dataset.from_tensors((x, y)).repeat()

    if strategy is not None:
        with strategy.scope():
            mwms_model = make_model()
            mwms_model.compile(optimizer=tf.keras.optimizers.SGD(0.01), loss=loss, jit_compile=False)
    hvd_model = make_model()
    hvd_model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)), loss=loss)

    class Timer(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self.t0)

    timers = {"horovod": Timer()}
    runs = {
        "horovod": lambda epochs: hvd_model.fit(
            hvd_data, steps_per_epoch=args.steps, epochs=epochs, verbose=0,
            callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), timers["horovod"]]),
    }
    if strategy is not None:
        timers["mwms"] = Timer()
        runs["mwms"] = lambda epochs: mwms_model.fit(mwms_data, steps_per_epoch=args.steps, epochs=epochs,
                                                     verbose=0, callbacks=[timers["mwms"]])
    for name, run in runs.items():  # warm-up: tracing, first negotiation, gRPC setup
        run(1)
        timers[name].times.clear()
    import horovod.tensorflow as hvd_tf
    from horovod.common.collectives import barrier

    for _ in range(args.rounds):
        for run in runs.values():
            barrier()  # every rank starts the epoch together (else one times its wait for the other)
            run(1)
    # An epoch of the job lasts as long as its slowest rank's.
    per_rank = hvd_tf.allgather_object({n: t.times for n, t in timers.items()})
    epochs = {n: [max(r[n][i] for r in per_rank) for i in range(len(per_rank[0][n]))] for n in timers}
    if rank == 0:
        ips = {n: args.steps * args.batch_size * size / statistics.median(t) for n, t in epochs.items()}
        print(f"keras={tf.keras.__name__} np={size} batch/worker={args.batch_size} image={s}x{s} "
              f"steps/epoch={args.steps} "
              f"rounds={args.rounds}")
        for n, v in ips.items():
            print(f"  {n:8s} {v:9.1f} images/s (median epoch {statistics.median(epochs[n]):.2f} s)")
        if "mwms" in ips:
            print(f"  ratio horovod / mwms = {ips['horovod'] / ips['mwms']:.2f}")
        else:
            print("  mwms not run: Keras 3's fit fails under MultiWorkerMirroredStrategy (see --help)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"np": size, "images_per_s": ips}, f, indent=1)


if __name__ == "__main__":
    main()
