"""Synthetic training benchmark (images/s) for Horovod with TensorFlow 2, in the style of upstream's
``tensorflow2_synthetic_benchmark.py``: a Keras application model on random data, gradients
averaged by ``hvd.DistributedGradientTape`` inside a ``tf.function``.

    mpirun -np 2 python examples/tensorflow2/tensorflow2_synthetic_benchmark.py --model ResNet50
    mpirun -np 2 python examples/tensorflow2/tensorflow2_synthetic_benchmark.py --model MobileNetV2 \\
        --image-size 64 --batch-size 16        # small enough for 2 CPU cores
"""

import argparse
import timeit

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

parser = argparse.ArgumentParser(description="TensorFlow Synthetic Benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--model", type=str, default="ResNet50", help="model to benchmark")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--image-size", type=int, default=224, help="input image height and width")
parser.add_argument("--num-warmup-batches", type=int, default=2, help="number of warm-up batches")
parser.add_argument("--num-batches-per-iter", type=int, default=5, help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=5, help="number of benchmark iterations")
parser.add_argument("--eager", action="store_true", default=False, help="run eagerly (no tf.function)")
args = parser.parse_args()

# Horovod: initialize Horovod.
hvd.init()

# Horovod: pin GPU to be used to process local rank (one GPU per process)
gpus = tf.config.experimental.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

# Set up standard model.
model = getattr(tf.keras.applications, args.model)(weights=None,
                                                   input_shape=(args.image_size, args.image_size, 3))
opt = tf.optimizers.SGD(0.01)

data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999, dtype=tf.int64)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy()
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none


def benchmark_step(first_batch):
    # Horovod: use DistributedGradientTape
    with tf.GradientTape() as tape:
        probs = model(data, training=True)
        loss = loss_fn(target, probs)

    # Horovod: add Horovod Distributed GradientTape.
    tape = hvd.DistributedGradientTape(tape, compression=compression)

    gradients = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(gradients, model.trainable_variables))

    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    # This is necessary to ensure consistent initialization of all workers when
    # training is started with random weights or restored from a checkpoint.
    #
    # Note: broadcast should be done after the first gradient step to ensure optimizer
    # initialization.
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables() if callable(opt.variables) else opt.variables, root_rank=0)


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end="\n" if nl else "", flush=True)


log(f"Model: {args.model}")
log(f"Batch size: {args.batch_size}")
device = "GPU" if gpus else "CPU"
log(f"Number of {device}s: {hvd.size()}")

step = benchmark_step if args.eager else tf.function(benchmark_step)

with tf.device(device):
    # Warm-up
    log("Running warmup...")
    step(first_batch=True)
    timeit.timeit(lambda: step(first_batch=False), number=args.num_warmup_batches)

    # Benchmark
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        time = timeit.timeit(lambda: step(first_batch=False), number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)

    # Results
    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} "
        f"+-{hvd.size() * img_sec_conf:.1f}")
