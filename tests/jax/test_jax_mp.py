"""horovod.jax on real ranks (mpirun), np=3: every collective eagerly and inside ``jax.jit``,
their gradients, the optax DistributedOptimizer in a jitted step against one process on the whole
batch, a rank-dependent program under jit, JaxState; the MNIST example trains at np=2.

One launch (shared with tests/keras' JAX-backend body) runs every check and returns the list of
failures (JAX's import is slow). The checks hold nothing that depends on the world size being
even or odd (the engine under them is checked at np=2 and 3 in tests/multiprocess and tests/torch):
np=3 alone, since the checks at np=2 cost another launch (60 s at load 25).
"""

from __future__ import annotations

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch, run_as_main

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]
pytest.importorskip("jax")
pytest.importorskip("optax")


def _close(got, want, tol=1e-5):
    import numpy as np

    got, want = np.asarray(got), np.asarray(want)
    return got.shape == want.shape and np.allclose(got, want, rtol=tol, atol=tol)


def _collectives(bad):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import horovod.jax as hvd

    r, n = hvd.rank(), hvd.size()
    jit = jax.jit
    x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3) + r
    allx = [np.arange(6, dtype=np.float32).reshape(2, 3) + k for k in range(n)]
    for op, want in [(hvd.Sum, sum(allx)), (hvd.Average, sum(allx) / n), (hvd.Min, np.min(allx, 0)),
                     (hvd.Max, np.max(allx, 0)), (hvd.Product, np.prod(allx, 0))]:
        for mode, f in [("eager", lambda v, op=op: hvd.allreduce(v, op=op)),
                        ("jit", jit(lambda v, op=op: hvd.allreduce(v, op=op)))]:
            got = f(x)
            if not isinstance(got, jax.Array) or not _close(got, want):
                bad.append(f"rank {r}: allreduce {op} {mode} -> {got}, want {want}")
    got = jit(lambda v: hvd.allreduce(v, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25))(x)
    if not _close(got, sum(allx) * 0.5):
        bad.append(f"rank {r}: scaled allreduce -> {got}")
    got = jit(lambda v: hvd.allreduce(v, compression=hvd.Compression.fp16))(x)
    if got.dtype != jnp.float32 or not _close(got, sum(allx) / n, 1e-2):
        bad.append(f"rank {r}: fp16 allreduce -> {got.dtype} {got}")
    ints = jnp.full((4,), r + 1, jnp.int32)
    got = jit(lambda v: hvd.allreduce(v, op=hvd.Sum, name="ints"))(ints)
    if got.dtype != jnp.int32 or not _close(got, np.full(4, sum(range(1, n + 1)))):
        bad.append(f"rank {r}: int32 allreduce -> {got}")
    for mode, f in [("eager", hvd.grouped_allreduce), ("jit", jit(hvd.grouped_allreduce))]:
        got = f([x, x[0] * 2, jnp.ones((), jnp.float32) * r])
        want = [sum(allx) / n, sum(allx)[0] * 2 / n, np.float32(sum(range(n)) / n)]
        if len(got) != 3 or not all(_close(g, w) for g, w in zip(got, want)):
            bad.append(f"rank {r}: grouped_allreduce {mode} -> {got}")
    # allgather: different first dimensions eagerly, equal ones under jit
    v = jnp.full((r + 1, 2), float(r))
    want = np.concatenate([np.full((k + 1, 2), float(k)) for k in range(n)])
    if not _close(hvd.allgather(v), want):
        bad.append(f"rank {r}: eager allgather -> {hvd.allgather(v)}")
    got = jit(hvd.allgather)(jnp.full((2, 2), float(r)))
    if not _close(got, np.repeat(np.arange(n, dtype=np.float32), 2)[:, None] * np.ones((1, 2))):
        bad.append(f"rank {r}: jit allgather -> {got}")
    got = jit(hvd.grouped_allgather)([jnp.full((1,), float(r)), jnp.full((2, 1), 2.0 * r)])
    if not (_close(got[0], np.arange(n)) and _close(got[1], np.repeat(2.0 * np.arange(n), 2)[:, None])):
        bad.append(f"rank {r}: jit grouped_allgather -> {got}")
    try:
        jit(hvd.allgather)(jnp.zeros((r + 1, 2))).block_until_ready()
        bad.append(f"rank {r}: jit allgather with unequal dims did not raise")
    except jax.errors.JaxRuntimeError as exc:
        if "same first dimension" not in str(exc):
            bad.append(f"rank {r}: jit allgather unequal dims: {str(exc)[-300:]}")
    # broadcast
    for mode, f in [("eager", hvd.broadcast), ("jit", jit(hvd.broadcast, static_argnums=1))]:
        got = f(jnp.full((3,), float(r)), n - 1)
        if not _close(got, np.full(3, n - 1.0)):
            bad.append(f"rank {r}: broadcast {mode} -> {got}")
    # alltoall: splits eagerly, equal parts under jit
    t = jnp.arange(2 * n, dtype=jnp.float32) + 100 * r
    got = jit(hvd.alltoall)(t)
    want = np.concatenate([np.arange(2 * r, 2 * r + 2) + 100 * k for k in range(n)])
    if not _close(got, want):
        bad.append(f"rank {r}: jit alltoall -> {got}, want {want}")
    splits = np.array([1] * n)
    out, received = hvd.alltoall(jnp.arange(n, dtype=jnp.float32) + 10 * r, splits=splits)
    if not (_close(out, np.array([r + 10.0 * k for k in range(n)])) and _close(received, np.ones(n))):
        bad.append(f"rank {r}: alltoall with splits -> {out}, {received}")
    # reducescatter: uneven rows
    rows = 2 * n + 1
    m = jnp.ones((rows, 2), jnp.float32) * (r + 1)
    mine = rows // n + (1 if r < rows % n else 0)
    for mode, f in [("eager", lambda v: hvd.reducescatter(v, op=hvd.Sum)),
                    ("jit", jit(lambda v: hvd.reducescatter(v, op=hvd.Sum)))]:
        got = f(m)
        if not _close(got, np.full((mine, 2), sum(range(1, n + 1)))):
            bad.append(f"rank {r}: reducescatter {mode} -> {got.shape} {got}")
    got = jit(hvd.grouped_reducescatter)([m, m * 2])
    if not (_close(got[0], np.full((mine, 2), sum(range(1, n + 1)) / n))
            and _close(got[1], np.full((mine, 2), 2 * sum(range(1, n + 1)) / n))):
        bad.append(f"rank {r}: grouped_reducescatter -> {got}")
    # async handles, objects, barrier, join
    hs = [hvd.allreduce_async(jnp.full((k + 1,), float(r)), op=hvd.Sum, name=f"async.{k}") for k in range(4)]
    for k, h in enumerate(hs):
        got = hvd.synchronize(h)
        if not isinstance(got, jax.Array) or not _close(got, np.full(k + 1, sum(range(n)))):
            bad.append(f"rank {r}: async allreduce {k} -> {got}")
    if hvd.broadcast_object({"r": r}, root_rank=0) != {"r": 0}:
        bad.append(f"rank {r}: broadcast_object")
    if hvd.allgather_object(r * 10) != [k * 10 for k in range(n)]:
        bad.append(f"rank {r}: allgather_object")
    hvd.barrier()
    if hvd.join() not in range(n):
        bad.append(f"rank {r}: join")
    tree = {"w": jnp.full((2, 2), float(r)), "b": [jnp.full((3,), r, jnp.int32)]}
    got = jit(hvd.broadcast_parameters, static_argnums=1)(tree, 1)
    if not (_close(got["w"], np.ones((2, 2))) and _close(got["b"][0], np.ones(3))):
        bad.append(f"rank {r}: broadcast_parameters -> {got}")


def _gradients(bad):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import horovod.jax as hvd

    r, n = hvd.rank(), hvd.size()
    x = jnp.arange(3, dtype=jnp.float32) + r
    w = jnp.array([1.0, 2.0, 3.0]) * (r + 1)  # a rank-dependent upstream gradient
    cases = [
        # (name, loss, expected gradient): torch's conventions
        ("allreduce Sum", lambda v: (hvd.allreduce(v, op=hvd.Sum) * w).sum(),
         sum(np.array([1.0, 2.0, 3.0]) * (k + 1) for k in range(n))),
        ("allreduce Average", lambda v: (hvd.allreduce(v) * w).sum(),
         sum(np.array([1.0, 2.0, 3.0]) * (k + 1) for k in range(n)) / n),
        ("grouped_allreduce", lambda v: (hvd.grouped_allreduce([v, 2 * v], op=hvd.Sum)[1] * w).sum(),
         2 * sum(np.array([1.0, 2.0, 3.0]) * (k + 1) for k in range(n))),
        ("allgather", lambda v: (hvd.allgather(v) * jnp.tile(w, n)).sum(),
         sum(np.array([1.0, 2.0, 3.0]) * (k + 1) for k in range(n)) / n),
        ("grouped_allgather", lambda v: (hvd.grouped_allgather([v])[0] * jnp.tile(w, n)).sum(),
         sum(np.array([1.0, 2.0, 3.0]) * (k + 1) for k in range(n)) / n),
        ("broadcast", lambda v: (hvd.broadcast(v, 0) * w).sum(),
         sum(np.array([1.0, 2.0, 3.0]) * (k + 1) for k in range(n)) / n if r == 0 else np.zeros(3)),
    ]
    for name, loss, want in cases:
        for mode, g in [("eager", jax.grad(loss)), ("jit", jax.jit(jax.grad(loss)))]:
            got = g(x)
            if not _close(got, want):
                bad.append(f"rank {r}: grad of {name} ({mode}) -> {got}, want {want}")
    # reducescatter (Sum): the gradient is the allgather of the incoming gradient, times size
    m = jnp.ones((n, 2), jnp.float32)
    got = jax.jit(jax.grad(lambda v: (hvd.reducescatter(v, op=hvd.Sum) * (r + 1)).sum()))(m)
    want = np.repeat(np.arange(1, n + 1, dtype=np.float32), 2).reshape(n, 2) * n
    if not _close(got, want):
        bad.append(f"rank {r}: grad of reducescatter -> {got}, want {want}")
    t = jnp.arange(n, dtype=jnp.float32)
    got = jax.grad(lambda v: (hvd.alltoall(v) * (r + 1)).sum())(t)
    if not _close(got, np.arange(1, n + 1, dtype=np.float32)):
        bad.append(f"rank {r}: grad of alltoall -> {got}")


def _optimizer(bad):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import horovod.jax as hvd

    r, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(6 * n, 4)).astype(np.float32)
    ys = rng.normal(size=(6 * n, 1)).astype(np.float32)
    init = {"w": jnp.asarray(rng.normal(size=(4, 1)), jnp.float32), "b": jnp.zeros((1,), jnp.float32)}

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    def train(tx, params, batches, jitted):
        state = tx.init(params)

        def step(p, s, x, y):
            g = jax.grad(loss)(p, x, y)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        step = jax.jit(step) if jitted else step
        for x, y in batches:
            params, state = step(params, state, x, y)
        return params

    shard = slice(6 * r, 6 * r + 6)
    mine = [(xs[shard][i::2], ys[shard][i::2]) for i in range(2)]  # 2 steps of 3 rows per rank
    whole = [(np.concatenate([xs[6 * k:6 * k + 6][i::2] for k in range(n)]),
              np.concatenate([ys[6 * k:6 * k + 6][i::2] for k in range(n)])) for i in range(2)]
    ref = train(optax.sgd(0.1), init, whole, False)
    params = hvd.broadcast_parameters(init, 0)
    for jitted in (False, True):
        got = train(hvd.DistributedOptimizer(optax.sgd(0.1)), params, mine, jitted)
        every = hvd.allgather_object(jax.tree_util.tree_map(np.asarray, got))
        if not all(np.array_equal(e["w"], every[0]["w"]) for e in every):
            bad.append(f"rank {r}: weights differ between ranks (jit={jitted})")
        if not (_close(got["w"], ref["w"]) and _close(got["b"], ref["b"])):
            bad.append(f"rank {r}: DistributedOptimizer (jit={jitted}) -> {got}, one process: {ref}")
    # backward_passes_per_step=2: two local passes, one reduced update = one step on the union
    tx = hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=2)
    got = train(tx, params, mine, True)
    ref1 = train(optax.sgd(0.1), init, [(np.concatenate([w[0] for w in whole]),
                                         np.concatenate([w[1] for w in whole]))], False)
    if not _close(got["w"], ref1["w"]):
        bad.append(f"rank {r}: backward_passes_per_step=2 -> {got['w'].ravel()}, want {ref1['w'].ravel()}")
    got = train(hvd.DistributedOptimizer(optax.sgd(0.1), compression=hvd.Compression.fp16), params, mine, True)
    if not _close(got["w"], ref["w"], 1e-2):
        bad.append(f"rank {r}: fp16 DistributedOptimizer -> {got['w'].ravel()}")


def _mismatch_and_state(bad):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import horovod.jax as hvd

    r, _n = hvd.rank(), hvd.size()

    @jax.jit
    def differs(v):
        return hvd.allreduce(v, name="differs")

    try:
        differs(jnp.ones(3 + r)).block_until_ready()  # a shape that differs per rank
        bad.append(f"rank {r}: a rank-dependent program under jit did not raise")
    except jax.errors.JaxRuntimeError as exc:
        cause = hvd.last_error()
        if not isinstance(cause, hvd.HorovodInternalError) or "differs" not in str(exc):
            bad.append(f"rank {r}: mismatch under jit raised {type(cause).__name__}: {str(exc)[-400:]}")
    got = jax.jit(hvd.allreduce)(jnp.ones(2))  # the engine still works
    if not _close(got, np.ones(2)):
        bad.append(f"rank {r}: allreduce after a mismatch -> {got}")
    # JaxState: commit keeps references, restore returns them, sync takes rank 0's
    params = {"w": jnp.full((2,), float(r))}
    state = hvd.elastic.JaxState(params=params, epoch=r, history=[r])
    state.sync()
    if not (_close(state.params["w"], np.zeros(2)) and state.epoch == 0 and state.history == [0]):
        bad.append(f"rank {r}: JaxState.sync -> {state.params}, {state.epoch}, {state.history}")
    state.commit()
    state.params = {"w": jnp.full((2,), 9.0)}
    state.epoch = 5
    state.history.append(1)
    state.restore()
    if not (_close(state.params["w"], np.zeros(2)) and state.epoch == 0 and state.history == [0]):
        bad.append(f"rank {r}: JaxState.restore -> {state.params}, {state.epoch}, {state.history}")


def _all_checks():
    import horovod.jax as hvd

    hvd.init()
    bad: list[str] = []
    for part in (_collectives, _gradients, _optimizer, _mismatch_and_state):
        try:
            part(bad)
        except Exception:  # noqa: BLE001 - report and go on with the next part
            import traceback

            bad.append(f"rank {hvd.rank()}: {part.__name__} raised {traceback.format_exc()[-700:]}")
            hvd.barrier()
    return bad


# A part of the np=3 launch that the JAX bodies share (tests/keras on the JAX backend too:
# tests/_shared_launch.py); among the last bodies, since it ends with errors on purpose.
_LAUNCH = joint_launch("jax", 3, {"all": _all_checks}, timeout=240, env={"JAX_PLATFORMS": "cpu"}, late=True)


def test_jax_bindings_on_real_ranks():
    results = _LAUNCH.results("all")
    problems = [p for rank_bad in results for p in rank_bad]
    assert not problems, "\n".join(problems)


def _mnist_example() -> str:
    """examples/jax/jax_mnist.py as ``__main__`` in this rank (3 epochs): what it printed."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return run_as_main(os.path.join(root, "examples", "jax", "jax_mnist.py"), "--epochs", "3")


# The JAX launch at np=2 that tests/keras/test_keras_without_tensorflow_mp.py shares (its body late).
_NP2 = joint_launch("jax", 2, {"mnist": _mnist_example}, timeout=240, env={"JAX_PLATFORMS": "cpu"})


@JOINT_TIMEOUT
def test_jax_mnist_example_trains_on_two_ranks():
    import re

    out = "".join(_NP2.results("mnist"))
    losses = [float(v) for v in re.findall(r"Epoch \d+: average training loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0], out[-3000:]
    acc = re.search(r"Final test accuracy: ([0-9.]+)%", out)
    assert acc and float(acc.group(1)) > 85.0, out[-3000:]
