"""The autotuner's pure parts: Gaussian process and Bayesian optimiser on known functions, knob
encoding, and the parameter manager's steps, samples, warm-up, CSV log and final choice (with a
fake clock, fake responses and a broadcast that is the identity)."""

from __future__ import annotations

import csv
import math
from types import SimpleNamespace

import numpy as np
import pytest

from horovod.common.autotune import CSV_HEADER, KNOBS, BayesianOptimizer, GaussianProcess, ParameterManager
from horovod.common.autotune.bayes import normal_cdf
from horovod.common.autotune.manager import from_config
from horovod.common.config import EngineConfig
from horovod.common.engine.tunables import Tunables
from horovod.common.types import Request, RequestType, Response


def test_normal_cdf_matches_erf():
    z = np.linspace(-5, 5, 101)
    want = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in z])
    np.testing.assert_allclose(normal_cdf(z), want, atol=2e-7)


def test_gp_interpolates_with_little_noise():
    x = np.array([[0.1], [0.5], [0.9]])
    y = np.array([1.0, 3.0, 2.0])
    gp = GaussianProcess(length_scale=0.2, noise=1e-6)
    gp.fit(x, y)
    mu, sd = gp.predict(x)
    np.testing.assert_allclose(mu * y.std() + y.mean(), y, atol=1e-3)
    assert (sd < 1e-2).all()
    _, far = gp.predict(np.array([[0.3]]))
    assert far[0] > sd.max()


def _run_bo(seed: int, samples: int = 20) -> tuple[np.ndarray, float]:
    center = np.array([0.7, 0.2, 1.0])

    def f(x: np.ndarray) -> float:  # maximum 10 at center (last dim binary)
        x = x.copy()
        x[2] = round(x[2])
        return 10.0 - 20.0 * float(((x - center) ** 2).sum())

    bo = BayesianOptimizer(3, initial=[[0.5, 0.5, 0.0]], noise=0.05, seed=seed)
    for _ in range(samples):
        x = bo.suggest()
        bo.add(x, f(x))
    return bo.best()


def test_bayesian_optimizer_finds_the_optimum_of_a_known_function():
    x, y = _run_bo(0)
    assert y > 9.5, (x, y)
    assert round(x[2]) == 1


def test_bayesian_optimizer_is_deterministic_with_a_seed():
    a, b = _run_bo(3, 10), _run_bo(3, 10)
    np.testing.assert_array_equal(a[0], b[0])
    assert a[1] == b[1]


def test_knob_encoding_round_trips():
    by = {k.name: k for k in KNOBS}
    assert by["fusion_threshold"].decode(by["fusion_threshold"].encode(64 << 20)) == 64 << 20
    assert by["chunk_bytes"].decode(by["chunk_bytes"].encode(2 << 20)) == 2 << 20
    assert by["max_tensor_bytes"].decode(by["max_tensor_bytes"].encode(16 << 10)) == 16 << 10
    assert by["max_tensor_bytes"].env == "HOROVOD_FUSION_MAX_TENSOR_BYTES"
    assert abs(by["cycle_time_ms"].decode(by["cycle_time_ms"].encode(5.0)) - 5.0) < 0.01
    assert by["cache_enabled"].decode(0.6) is True and by["cache_enabled"].decode(0.4) is False
    assert by["fusion_threshold"].encode(0) == 0.0  # below the range: clipped


def _resp(name: str, n: int = 1000) -> Response:
    return Response(Request(name=name, kind=RequestType.ALLREDUCE, dtype="float32", shapes=[(n,)]))


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _manager(tmp_path, score_of, **kw):
    t = Tunables()
    clock = _Clock()
    changes = []
    m = ParameterManager(t, 0, lambda msg: msg, ["fusion_threshold", "chunk_bytes", "cache_enabled"],
                         log_path=str(tmp_path / "tune.csv"), clock=clock,
                         on_change=lambda old, new: changes.append((old, new)), **kw)

    def step():
        # One training step of 4 tensors; its duration depends on the parameters now in force.
        clock.t += 1.0 / score_of(t)
        m.observe([_resp(f"g{i}") for i in range(4)])

    return m, t, step, changes


def test_manager_warms_up_samples_logs_and_keeps_the_best(tmp_path):
    def score_of(t):  # bytes/us peaks at a 4 MiB chunk and with the cache on
        return 1.0 / (1.0 + abs(math.log2(t.chunk_bytes / (4 << 20)))) + (0.2 if t.cache_enabled else 0.0)

    m, t, step, changes = _manager(tmp_path, score_of, warmup_samples=2, steps_per_sample=3, max_samples=12)
    for _ in range(400):
        step()
    assert not m.active
    phases = [h["phase"] for h in m.history]
    assert phases[:2] == ["warmup", "warmup"] and phases.count("sample") == 12 and phases[-1] == "best"
    best = m.history[-1]
    samples = [h for h in m.history if h["phase"] == "sample"]
    assert any(all(h[k] == best[k] for k in ("fusion_threshold", "chunk_bytes", "cache_enabled")) for h in samples)
    assert best["score"] >= sorted(h["score"] for h in samples)[-3], "kept a point far from the best measured"
    assert best["score"] > samples[0]["score"], "did not improve on the defaults"
    assert {k: getattr(t, k) for k in ("fusion_threshold", "chunk_bytes", "cache_enabled")} == \
        {k: best[k] for k in ("fusion_threshold", "chunk_bytes", "cache_enabled")}
    assert changes, "the manager never changed a parameter"
    rows = list(csv.reader(open(tmp_path / "tune.csv")))
    assert rows[0] == CSV_HEADER and len(rows) == 1 + 12 + 1
    assert float(rows[-1][6]) == pytest.approx(best["score"], rel=1e-3)
    # 4 float32 tensors of 1000 elements per step: bytes per microsecond of the fake clock.
    first = m.history[0]
    assert first["score"] == pytest.approx(3 * 16000 / 3e6 * score_of(Tunables()), rel=0.4)


def test_steps_are_counted_by_repeated_names(tmp_path):
    m, t, step, _ = _manager(tmp_path, lambda t: 1.0, warmup_samples=0, steps_per_sample=2, max_samples=50)
    m.observe([_resp("a"), _resp("b")])
    m.observe([_resp("a")])  # step 1 ends
    assert m.history == []
    m.observe([_resp("b"), _resp("a")])  # step 2 ends: the first sample
    assert len(m.history) == 1


def test_every_step_counts_when_a_sample_ends_inside_a_round(tmp_path):
    m, t, step, _ = _manager(tmp_path, lambda t: 1.0, warmup_samples=0, steps_per_sample=1, max_samples=50)
    for _ in range(6):  # each round holds a whole step: the repeat of "a" ends the previous one
        m.observe([_resp("a"), _resp("b")])
    assert len(m.history) == 5


def test_explicit_settings_and_one_host_keep_knobs_fixed():
    cfg = EngineConfig.from_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_CYCLE_TIME": "3"})
    m = from_config(cfg, Tunables.from_config(cfg), 1, lambda x: x, {"HOROVOD_CYCLE_TIME": "3"}, False)
    assert [k.name for k in m.knobs] == ["fusion_threshold", "chunk_bytes", "max_tensor_bytes", "cache_enabled"]
    m2 = from_config(cfg, Tunables.from_config(cfg), 1, lambda x: x, {}, True)
    assert "hierarchical_allreduce" in [k.name for k in m2.knobs]
    nothing = from_config(cfg, SimpleNamespace(), 1, lambda x: x, {k.env: "1" for k in KNOBS}, True)
    assert not nothing.active


def test_best_estimate_is_not_fooled_by_one_lucky_measurement():
    bo = BayesianOptimizer(1, noise=0.8)
    xs = np.linspace(0, 1, 11)
    for x in xs:
        bo.add([x], 1.0 - (x - 0.7) ** 2)  # true optimum at 0.7
    bo.add([0.05], 1.6)  # one outlier far from it
    assert bo.best()[0][0] == 0.05
    assert abs(bo.best_estimate()[0][0] - 0.7) <= 0.1
