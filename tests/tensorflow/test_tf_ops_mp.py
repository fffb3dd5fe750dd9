"""horovod.tensorflow ops on real ranks (np=2 and np=3): eager, tf.function, TF1 sessions, gradients.

One launch per world size runs every case of both bodies (``_ops_body``, ``_reused_outputs_body``)
with the other TensorFlow modules' bodies (tests/_shared_launch.py, ``joint_launch``); each rank
body collects failures instead of stopping at the first, so a run reports each broken (mode, op,
dtype) combination with its rank.
"""

from __future__ import annotations

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch, own_init

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _ops_body():
    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []

    def check(case, got, want, atol=1e-5):
        got = np.asarray(got)
        want = np.asarray(want)
        if got.shape != want.shape or not np.allclose(got, want, atol=atol):
            bad.append(f"rank {r}: {case} -> {got.tolist()}, expected {want.tolist()}")

    # ---------------------------------------------------------------- eager
    for dt in (tf.float32, tf.float64, tf.int32, tf.float16):
        x = tf.cast(tf.reshape(tf.range(6), [2, 3]) + r, dt)
        allx = [np.arange(6).reshape(2, 3) + k for k in range(n)]
        check(f"eager allreduce Sum {dt.name}", hvd.allreduce(x, op=hvd.Sum), sum(allx))
        avg = sum(allx) / n
        check(f"eager allreduce Average {dt.name}", hvd.allreduce(x),
              np.trunc(avg) if dt.is_integer else avg, atol=1e-2)
        check(f"eager allreduce Max {dt.name}", hvd.allreduce(x, op=hvd.Max), np.max(allx, 0))
    check("eager pre/postscale", hvd.allreduce(tf.ones([3]) * (r + 1), op=hvd.Sum, prescale_factor=2.0,
                                               postscale_factor=0.5, name="scaled"),
          np.full(3, sum(k + 1 for k in range(n))))
    outs = hvd.grouped_allreduce([tf.fill([2], float(r)), tf.fill([3], r), tf.fill([1, 2], float(r))],
                                 op=hvd.Sum)
    check("eager grouped_allreduce mixed dtypes [0]", outs[0], np.full(2, sum(range(n))))
    check("eager grouped_allreduce mixed dtypes [1]", outs[1], np.full(3, sum(range(n))))
    if outs[1].dtype != tf.int32:
        bad.append(f"rank {r}: grouped_allreduce changed int32 to {outs[1].dtype}")
    g = hvd.allgather(tf.fill([r + 1, 2], r))
    check("eager allgather uneven", g, np.concatenate([np.full([k + 1, 2], k) for k in range(n)]))
    gs = hvd.grouped_allgather([tf.fill([r + 1], float(r)), tf.fill([1], r)])
    check("eager grouped_allgather[1]", gs[1], np.arange(n))
    root = n - 1
    check("eager broadcast", hvd.broadcast(tf.fill([2], float(r)), root), np.full(2, float(root)))
    v = tf.Variable(tf.fill([3], float(r)))
    w = tf.Variable(tf.fill([2], r))
    hvd.broadcast_variables([v, w], root_rank=root)
    check("eager broadcast_variables float", v, np.full(3, float(root)))
    check("eager broadcast_variables int", w, np.full(2, root))
    v2 = tf.Variable(tf.fill([2], float(r)))
    check("eager broadcast_", hvd.broadcast_(v2, 0), np.zeros(2))
    splits = [k + 1 for k in range(n)]
    data = tf.fill([sum(splits)], r)
    out, recv = hvd.alltoall(data, splits=splits)
    check("eager alltoall", out, np.concatenate([np.full(r + 1, k) for k in range(n)]))
    check("eager alltoall received splits", recv, np.full(n, r + 1))
    rows = 2 * n - 1
    rs = hvd.reducescatter(tf.ones([rows, 2]) * (r + 1), op=hvd.Sum)
    mine = rows // n + (1 if r < rows % n else 0)
    check("eager reducescatter uneven", rs, np.full([mine, 2], sum(k + 1 for k in range(n))))
    grs = hvd.grouped_reducescatter([tf.ones([n, 1]), tf.ones([2 * n])], op=hvd.Average)
    check("eager grouped_reducescatter[1]", grs[1], np.ones(2))
    sl = tf.IndexedSlices(tf.fill([1, 2], float(r + 1)), tf.constant([r]), dense_shape=tf.constant([n, 2]))
    red = hvd.allreduce(sl)
    check("eager IndexedSlices Average values", red.values,
          np.stack([np.full(2, (k + 1) / n) for k in range(n)]))
    check("eager IndexedSlices indices", red.indices, np.arange(n))
    check("eager IndexedSlices dense", tf.convert_to_tensor(red),
          np.stack([np.full(2, (k + 1) / n) for k in range(n)]))
    if hvd.broadcast_object({"r": r}, root_rank=root) != {"r": root}:
        bad.append(f"rank {r}: broadcast_object")
    if hvd.allgather_object(r * 10) != [k * 10 for k in range(n)]:
        bad.append(f"rank {r}: allgather_object")
    check("size_op", hvd.size_op(), n)
    check("rank_op", hvd.rank_op(), r)

    # ---------------------------------------------------------------- tf.function
    @tf.function
    def fn(x):
        a = hvd.allreduce(x, op=hvd.Sum)
        b = hvd.allgather(x)
        c = hvd.broadcast(x, 0)
        d = hvd.grouped_allreduce([x, 2 * x])
        e = hvd.reducescatter(tf.tile(x[None, :], [n, 1]), op=hvd.Sum)
        return a, b, c, d, e

    a, b, c, d, e = fn(tf.fill([2], float(r)))
    check("tf.function allreduce", a, np.full(2, sum(range(n))))
    check("tf.function allgather", b, np.concatenate([np.full(2, float(k)) for k in range(n)]))
    check("tf.function broadcast", c, np.zeros(2))
    check("tf.function grouped[1]", d[1], np.full(2, 2 * sum(range(n)) / n))
    check("tf.function reducescatter", e, np.full([1, 2], sum(range(n))))
    for _ in range(3):  # retrace-free repeat uses the same node names (response cache)
        a, *_ = fn(tf.fill([2], float(r)))
    check("tf.function repeated", a, np.full(2, sum(range(n))))

    # ---------------------------------------------------------------- gradients (eager)
    x = tf.constant([1.0, 2.0]) * (r + 1)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y_sum = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum) * tf.constant([1.0, 3.0]))
        y_gather = tf.reduce_sum(hvd.allgather(x) * (r + 1))
        y_bcast = tf.reduce_sum(hvd.broadcast(x, 0) * (r + 1))
    check("grad allreduce Sum", tape.gradient(y_sum, x), np.array([1.0, 3.0]) * n)
    check("grad allgather", tape.gradient(y_gather, x), np.full(2, sum(k + 1 for k in range(n)) / n))
    want_b = np.full(2, sum(k + 1 for k in range(n)) / n) if r == 0 else np.zeros(2)
    check("grad broadcast", tape.gradient(y_bcast, x), want_b)
    with tf.GradientTape() as tape:
        xs = tf.cast(tf.range(n), tf.float32) + 10 * r
        tape.watch(xs)
        out = hvd.alltoall(xs)
        loss = tf.reduce_sum(out * tf.cast(tf.range(n) + 1, tf.float32))
    check("grad alltoall", tape.gradient(loss, xs), np.full(n, r + 1.0))

    # ---------------------------------------------------------------- TF1 graph, many independent ops
    g1 = tf.Graph()
    with g1.as_default():
        ph = tf.compat.v1.placeholder(tf.float32, [3])
        reds = [hvd.allreduce(ph * (i + 1), op=hvd.Sum) for i in range(8)]
        gat = hvd.allgather(tf.reshape(ph, [1, 3]))
        # 9 independent blocking ops in one run: more than the 2 cores' default pool would hold.
        # First in a session with a ConfigProto of its own (inter-op count 0, as upstream's
        # examples make them: its pool is sized from TF_NUM_INTEROP_THREADS), then in one without.
        cfg = tf.compat.v1.ConfigProto()
        cfg.gpu_options.allow_growth = True
        runs = []
        for config in (cfg, None):
            with tf.compat.v1.Session(config=config) as sess:
                runs.append(sess.run(reds + [gat], feed_dict={ph: np.full(3, float(r))}))
    for how, vals in zip(("ConfigProto", "default"), runs, strict=True):
        for i in range(8):
            check(f"tf1 {how} session allreduce {i}", vals[i], np.full(3, (i + 1) * sum(range(n))))
        check(f"tf1 {how} session allgather", vals[8], np.stack([np.full(3, float(k)) for k in range(n)]))
    return bad


@pytest.mark.parametrize("np_", [2, 3])
def test_tf_ops_every_mode(np_):
    failures = [msg for per_rank in _LAUNCH[np_].results("ops") for msg in per_rank]
    assert not failures, "\n".join(failures)


def _process_set_body():
    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd

    ps = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[ps])
    r = hvd.rank()
    bad = []
    if ps.included():
        got = hvd.allreduce(tf.fill([2], float(r)), op=hvd.Sum, process_set=ps).numpy()
        if not np.allclose(got, 2.0):
            bad.append(f"rank {r}: allreduce on set [0, 2] -> {got}")
        got = hvd.allgather(tf.fill([1], r), process_set=ps).numpy()
        if got.tolist() != [0, 2]:
            bad.append(f"rank {r}: allgather on set [0, 2] -> {got}")
        got = hvd.broadcast(tf.fill([1], r), 2, process_set=ps).numpy()
        if got.tolist() != [2]:
            bad.append(f"rank {r}: broadcast root 2 on set -> {got}")
    else:
        try:
            hvd.allreduce(tf.ones([1]), process_set=ps)
            bad.append(f"rank {r}: non-member allreduce did not raise")
        except tf.errors.InvalidArgumentError as e:
            if "not a member" not in str(e):
                bad.append(f"rank {r}: non-member error text: {e}")
    # A tape on the set: members average among themselves, the non-member keeps its gradient.
    w = tf.Variable([1.0])
    with tf.GradientTape() as tape:
        loss = w * float(r + 1)
    grad = hvd.DistributedGradientTape(tape, process_set=ps).gradient(loss, [w])[0].numpy()
    want = (1 + 3) / 2 if r in (0, 2) else 2.0
    if not np.allclose(grad, want):
        bad.append(f"rank {r}: tape on process set -> {grad}, expected {want}")
    hvd.allreduce(tf.ones([1]), name="done")  # no rank leaves (and shuts down) before the others finish
    return bad


def test_tf_process_sets_np3():
    failures = [msg for per_rank in _SETS.results("process_sets") for msg in per_rank]
    assert not failures, "\n".join(failures)


def _reused_outputs_body():
    # Outputs of graph-mode allreduces come from pooled buffers (one packed buffer for a grouped
    # op). Results a caller still holds must never be overwritten by later steps.
    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    shapes = [(300, 7), (1000,), (3,), (64, 64), (5, 5, 3)]  # byte sizes aligned to 64 and not
    bad = []

    @tf.function
    def step(k):
        xs = [tf.fill(s, k * 10.0 + r) for s in shapes]
        xs.append(tf.cast(tf.fill([4096], k + r), tf.float16))
        grouped = hvd.grouped_allreduce(xs[:-1], op=hvd.Average)
        single = hvd.allreduce(xs[-1], op=hvd.Sum)
        return grouped + [single]

    held = []
    for k in range(5):
        held.append((k, step(tf.constant(float(k)))))
        if k % 2:
            del held[0]  # some results freed, some kept: the pool must tell them apart
    for k, outs in held:
        want_avg = k * 10.0 + (n - 1) / 2
        for s, o in zip(shapes, outs[:-1]):
            if o.shape != s or not np.allclose(o.numpy(), want_avg):
                bad.append(f"rank {r}: step {k} grouped {s} -> {np.unique(o.numpy())[:4]}, want {want_avg}")
        want_sum = sum(k + q for q in range(n))
        if outs[-1].dtype != tf.float16 or not np.allclose(outs[-1].numpy(), want_sum):
            bad.append(f"rank {r}: step {k} float16 sum -> {np.unique(outs[-1].numpy())[:4]}, want {want_sum}")
    return bad


@pytest.mark.parametrize("np_", [2, 3])
def test_tf_pooled_outputs_held_across_steps_are_not_overwritten(np_):
    failures = [msg for per_rank in _LAUNCH[np_].results("pooled") for msg in per_rank]
    assert not failures, "\n".join(failures)


# One launch per world size for both bodies, shared with the other TensorFlow modules' bodies
# (TensorFlow's start-up dominates their time); the process sets at np=3 too, late, between
# shutdowns of their own (own_init).
_LAUNCH = {n: joint_launch("tensorflow", n, {"ops": _ops_body, "pooled": _reused_outputs_body}, timeout=420)
           for n in (2, 3)}
_SETS = joint_launch("tensorflow", 3, {"process_sets": own_init(_process_set_body)}, timeout=180, late=True)
